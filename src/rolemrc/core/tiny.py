"""Small models and byte-level BPE tokenizers built in-process (no hub, no downloads)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch

from rolemrc.core.chat import CHAT_SPECIAL_TOKENS, CHATML_TEMPLATE
from rolemrc.core.errors import InputError

ARCHITECTURES = ("llama", "qwen2", "mistral", "gpt2")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """Train a byte-level BPE tokenizer with ChatML special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHAT_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|pad|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_config(arch: str, vocab_size: int, *, hidden: int = 64, layers: int = 2, intermediate: int | None = None,
                heads: int = 4, kv_heads: int | None = None, max_positions: int = 512, **extra):
    """A small config of one of ARCHITECTURES; `intermediate` defaults to about 8/3 * hidden."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    intermediate = intermediate or (8 * hidden // 3 // 8) * 8
    kv_heads = kv_heads or heads
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=heads,
                          n_inner=intermediate, n_positions=max_positions, **extra)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}.get(arch)
    if cls is None:
        raise InputError(f"unknown architecture {arch!r}; choose one of {ARCHITECTURES}")
    return cls(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
               num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
               tie_word_embeddings=False, **extra)


def build_model(arch: str, tokenizer, *, seed: int = 0, **sizes):
    """A randomly initialised causal LM of `arch` sized by `sizes`, matching the tokenizer's ids."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, len(tokenizer), **sizes)
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


EXAMPLE_TEXTS = ("the keeper of the lighthouse watched the storm roll over the rocks",
                 "a baker kneads the dough at dawn and sings to the ovens",
                 "who keeps the lighthouse when the keeper sleeps", "the river floods every spring")


def example_models(out: str | os.PathLike, *, layers: int = 2) -> tuple[str, str]:
    """Two tiny Llamas of one shape with different random weights, saved with one tokenizer as `out`/sft and
    `out`/dpo: stand-ins for a user's checkpoints in the documentation's examples (seconds to build)."""
    tokenizer = train_tokenizer(list(EXAMPLE_TEXTS) * 8, vocab_size=300)
    paths = []
    for seed, name in enumerate(("sft", "dpo")):
        path = Path(out) / name
        build_model("llama", tokenizer, seed=seed, hidden=64, layers=layers, intermediate=96).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(str(path))
    return paths[0], paths[1]
