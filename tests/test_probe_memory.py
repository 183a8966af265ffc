"""`probe attribute --batch-size auto`: on the CPU 4 pairs per batch, and every batch size gives the same file bit for
bit (a pair's score does not depend on its batch); on CUDA the batch comes from the free memory and the cost model,
which for two Llama-3.1-8B-shape bf16 models at 528 tokens on an 80 GiB card gives the 2 pairs measured to fit."""

import json

import pytest
import torch
from fixtures import test_records as records_of
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.io import write_jsonl
from rolemrc.core.tiny import build_model
from rolemrc.probe import attribute
from rolemrc.probe.memory import CPU_BATCH, GIB, pair_bytes, pairs_that_fit


@pytest.fixture(scope="module")
def models(tokenizer):
    sft = build_model("llama", tokenizer, seed=0, hidden=64, layers=3, intermediate=96)
    dpo = build_model("llama", tokenizer, seed=1, hidden=64, layers=3, intermediate=96)
    return sft, dpo


@pytest.fixture(scope="module")
def pairs():
    return [{"id": r["id"], "prompt": r["question"], "chosen": r["reference"], "rejected": "No." * (i % 5 + 1),
             "task": r["task"]} for i, r in enumerate(records_of(11))]


def test_auto_batches_give_the_plain_numbers_bit_for_bit(models, tokenizer, pairs):
    kw = {"tokenizers": (tokenizer, tokenizer), "progress": False}
    auto = attribute(models, pairs, **kw)
    assert auto.meta["batch_size"] == str(CPU_BATCH) and auto.meta["peak_memory_gib"] == ""
    for size in (1, 3):
        plain = attribute(models, pairs, batch_size=size, **kw)
        assert plain.meta["batch_size"] == str(size)
        assert all(torch.equal(auto.sums[d], plain.sums[d]) for d in auto.sums)


def test_the_cost_model_fits_two_8b_models_on_an_80gb_card():
    """Two Llama-3.1-8B-shape bf16 models (weights ~30 GiB of an H100's ~79 GiB): at 528 tokens the cost model
    allows 2 pairs per batch, what peaked at 42 GiB there, where 4 ran out of memory."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    cost = pair_bytes(model, "mlp.act", 528)
    assert 14 * GIB < cost < 15 * GIB
    assert pairs_that_fit(79 * GIB - 30 * GIB, cost) == 2
    assert pairs_that_fit(GIB, cost) == 1   # never below one pair


def test_cli_batch_size_takes_auto_or_a_number(tmp_path, pairs, model_dirs):
    write_jsonl(tmp_path / "pairs.jsonl", pairs)
    model = str(model_dirs["llama"])
    base = ["probe", "attribute", "--model", model, "--model", model, "--pairs", str(tmp_path / "pairs.jsonl")]
    result = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "a.safetensors")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["batch_size"] == str(CPU_BATCH)
    result = CliRunner().invoke(app, [*base, "--batch-size", "many", "--out", str(tmp_path / "b.safetensors")])
    assert result.exit_code == 2 and "error: batch size must be auto or a whole number >= 1, got 'many'" in result.output
