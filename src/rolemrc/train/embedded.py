"""The embedded default: a tokenizer and a small Llama trained from scratch on RoleMRC-style data.

Conversations are rendered with the ChatML template and pretrained on in full (every token
has loss), so the model learns the turn format and to close its turns with `<|im_end|>`.
"""

from __future__ import annotations

import random

from transformers import TrainerCallback

from rolemrc.core.chat import render_chat
from rolemrc.core.extras import require
from rolemrc.train.config import BaseTrainConfig
from rolemrc.train.corpus import Corpus, gather_corpus
from rolemrc.train.data import DataError, DataReport, fingerprints, jsonl_files
from rolemrc.train.runner import TrainResult, build_arguments, prepare, resume_checkpoint, train_and_save


def documents(corpus: Corpus, tokenizer, seed: int) -> list[str]:
    """Rendered conversations and plain texts, shuffled, each ended by `<|endoftext|>`."""
    docs = [render_chat(tokenizer, turns, add_generation_prompt=False) for turns in corpus.chats]
    docs += corpus.plain
    random.Random(seed).shuffle(docs)
    return [doc + tokenizer.bos_token for doc in docs]


def pack(tokenizer, docs: list[str], block_size: int) -> list[list[int]]:
    """Concatenate the tokenised documents and cut them into full blocks of `block_size` ids."""
    ids = [i for ids in tokenizer(docs, add_special_tokens=False)["input_ids"] for i in ids]
    blocks = [ids[k:k + block_size] for k in range(0, len(ids) - block_size + 1, block_size)]
    if not blocks:
        raise DataError(f"the corpus has {len(ids)} tokens, fewer than one block of {block_size}; "
                        "add data or lower block_size")
    return blocks


def train_base(config: BaseTrainConfig, *, callbacks: tuple[TrainerCallback, ...] = ()) -> TrainResult:
    """Train the tokenizer (or reuse the checkpoint's when resuming), build the Llama, pretrain, save."""
    require("train", what="base-model training")
    from datasets import Dataset
    from transformers import AutoTokenizer, Trainer, default_data_collator

    from rolemrc.core.tiny import build_model, train_tokenizer

    files = jsonl_files(config.data)
    report = DataReport()
    corpus = gather_corpus(files, report)
    report.check(config.max_bad_share, "data")
    if not corpus.chats and not corpus.plain:
        raise DataError("no conversations, pairs, profiles or passages to pretrain on (test records are held out)")
    args = build_arguments(config)
    checkpoint = resume_checkpoint(config)
    if checkpoint:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    else:
        tokenizer = train_tokenizer(corpus.texts, vocab_size=config.vocab_size)
    blocks = pack(tokenizer, documents(corpus, tokenizer, config.seed), config.block_size)
    dataset = Dataset.from_dict({"input_ids": blocks, "labels": blocks})
    model = build_model("llama", tokenizer, seed=config.seed, hidden=config.hidden, layers=config.layers,
                        intermediate=config.intermediate, heads=config.heads, kv_heads=config.kv_heads,
                        max_positions=config.max_positions)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.train()
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator,
                      processing_class=tokenizer)
    prepare(trainer, config, callbacks)
    corpus_info = {"conversations": len(corpus.chats), "plain_texts": len(corpus.plain),
                   "blocks": len(blocks), "tokens": len(blocks) * config.block_size}
    architecture = {"arch": "llama", "vocab_size": len(tokenizer), "parameters": model.num_parameters()}
    return train_and_save(trainer, config, stage="base", report=report,
                          manifest={"base_model": None, "data": fingerprints(files), "corpus": corpus_info,
                                    "architecture": architecture})

