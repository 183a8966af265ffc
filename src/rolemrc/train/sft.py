"""Supervised fine-tuning with trl's SFTTrainer, loss on assistant turns only (masks: train.masks)."""

from __future__ import annotations

from transformers import TrainerCallback

from rolemrc.core.extras import require
from rolemrc.train.config import SFTTrainConfig
from rolemrc.train.data import DataError, DataReport, fingerprints, jsonl_files, parse_mix
from rolemrc.train.masks import tokenize_with_assistant_mask
from rolemrc.train.runner import TrainResult, build_arguments, lora_config, prepare, source_model, start_model, train_and_save


def sft_trainer(config: SFTTrainConfig, *, callbacks: tuple[TrainerCallback, ...] = ()):
    """(trainer, data report, mixture) ready to train; the data and arguments are checked before the model loads."""
    require("train", what="SFT training")
    from datasets import Dataset
    from trl import SFTTrainer

    from rolemrc.train.data import sft_examples

    report = DataReport()
    examples, mixture = sft_examples(config.data, config.mix, config.seed, report)
    report.check(config.max_bad_share, "SFT")
    args = build_arguments(config)
    model, tokenizer = start_model(config)
    if args.assistant_only_loss:  # masks from the model's own template; trl's would need {% generation %} markers
        examples = [tokenize_with_assistant_mask(tokenizer, example["messages"]) for example in examples]
        args.assistant_only_loss = False
        if not any(any(e["assistant_masks"][: args.max_length]) for e in examples):
            raise DataError(f"every SFT example's assistant turns lie beyond max_length={args.max_length} tokens "
                            "(trl would drop them all); raise max_length")
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(examples),
                         processing_class=tokenizer, peft_config=lora_config(config))
    prepare(trainer, config, callbacks)
    return trainer, report, mixture


def train_sft(config: SFTTrainConfig, *, callbacks: tuple[TrainerCallback, ...] = ()) -> TrainResult:
    """Fine-tune `config.model` on `config.data` (plus `config.mix`), save to `config.out`."""
    trainer, report, mixture = sft_trainer(config, callbacks=callbacks)
    files = jsonl_files(config.data) + [parse_mix(spec)[0] for spec in config.mix]
    return train_and_save(trainer, config, stage="sft", report=report,
                          manifest={"base_model": source_model(config.model), "data": fingerprints(files),
                                    "mixture": mixture})
