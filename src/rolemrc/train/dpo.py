"""Direct preference optimisation with trl's DPOTrainer against a frozen reference."""

from __future__ import annotations

from transformers import TrainerCallback

from rolemrc.core.extras import require
from rolemrc.train.config import DPOTrainConfig
from rolemrc.train.data import DataReport, fingerprints, jsonl_files, load_examples, pair_example
from rolemrc.train.runner import TrainResult, build_arguments, lora_config, prepare, source_model, start_model, train_and_save


def dpo_trainer(config: DPOTrainConfig, *, callbacks: tuple[TrainerCallback, ...] = ()):
    """(trainer, data report). The data and arguments are checked before the model loads. The reference is a
    frozen copy of `config.model`; with LoRA it is the same weights with the adapter disabled."""
    require("train", what="DPO training")
    from datasets import Dataset
    from trl import DPOTrainer

    files = jsonl_files(config.data)
    report = DataReport()
    pairs = load_examples(files, pair_example, report)
    report.check(config.max_bad_share, "preference")
    args = build_arguments(config)
    model, tokenizer = start_model(config)
    reference = None
    if not config.lora:
        reference, _ = start_model(config)
        reference.eval().requires_grad_(False)
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=Dataset.from_list(pairs),
                         processing_class=tokenizer, peft_config=lora_config(config))
    prepare(trainer, config, callbacks)
    return trainer, report


def train_dpo(config: DPOTrainConfig, *, callbacks: tuple[TrainerCallback, ...] = ()) -> TrainResult:
    """Preference-tune the SFT model `config.model` on the pairs in `config.data`, save to `config.out`."""
    trainer, report = dpo_trainer(config, callbacks=callbacks)
    return train_and_save(trainer, config, stage="dpo", report=report,
                          manifest={"base_model": source_model(config.model),
                                    "data": fingerprints(jsonl_files(config.data))})
