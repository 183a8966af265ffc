"""Convert a GGUF file (Llama or Qwen2 layout) into a plain float32 HF safetensors directory, and check it.

transformers dequantises the file; the weights are then copied with `strict=True` into a fresh model of the
same config (a GGUF-loaded model refuses `save_pretrained`), every GGUF tensor is matched to a weight by
name, and the written directory is reloaded and must give the same logits and token ids.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rolemrc.core.artifacts import expect
from rolemrc.core.errors import InputError
from rolemrc.core.version import __version__
from rolemrc.models.errors import ModelsError, UnsupportedGGUFError
from rolemrc.models.manifest import MANIFEST, read_manifest, write_manifest
from rolemrc.models.progress import step

# general.architecture -> what it covers. llama.cpp writes Mistral files with architecture "llama".
SUPPORTED_ARCHITECTURES = {"llama": "Llama and Mistral", "qwen2": "Qwen2"}
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SAMPLE_TEXT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"


@dataclass(frozen=True)
class GGUFInfo:
    """What the conversion needs to know about a GGUF file before loading it."""

    path: Path
    architecture: str
    quantisation: str             # the file type, e.g. "Q4_1"
    tensor_names: frozenset[str]
    tensor_types: dict[str, int]  # ggml type name -> tensor count


def read_info(path: Path) -> GGUFInfo:
    """Read a GGUF header; refuse files that are not GGUF or that the conversion does not handle."""
    import gguf

    try:
        expect(path, ("gguf", "binary"), "expected a GGUF file (e.g. from llama.cpp's convert_hf_to_gguf.py)")
    except InputError as exc:
        raise ModelsError(str(exc)) from None
    try:
        reader = gguf.GGUFReader(path)
        architecture = _field(reader, "general.architecture")
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise ModelsError(f"{path} is not a readable GGUF file ({exc})") from None
    if architecture not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
        raise UnsupportedGGUFError(f"{path}: architecture {architecture!r} is not supported; supported: {supported}")
    types = Counter(t.tensor_type.name for t in reader.tensors)
    if unsupported := sorted(set(types) - set(SUPPORTED_TYPES)):
        raise UnsupportedGGUFError(f"{path}: tensor type(s) {', '.join(unsupported)} not supported; "
                                   f"supported: {', '.join(SUPPORTED_TYPES)}")
    return GGUFInfo(path, architecture, _quantisation(reader, types), frozenset(t.name for t in reader.tensors),
                    dict(types))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _parsed_once():
    """Within the block, gguf parses a file once and builds a tensor-name map once per layout. transformers reads the
    GGUF anew for the config, the weights and the tokenizer (each parse ~4 CPU-s for SmolLM2's 49k-token vocabulary,
    field by field) and builds gguf's name map for each of the model's ~400 modules; a reader is read-only (a memmap)
    and a map depends only on its (architecture, layers), so sharing them changes nothing but the time."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def convert(path: Path, out: Path, *, source: dict[str, Any] | None = None, model: str | None = None,
            force: bool = False) -> dict[str, Any]:
    """Convert `path` into the HF directory `out` and return its manifest (`model`: the known model's name, if any)."""
    with _parsed_once():
        info = read_info(path)
        _check_out(out, force)
        digest = sha256(path)
        with step(f"dequantising {path.name} ({info.quantisation}, {len(info.tensor_names)} tensors)"):
            loaded, tokenizer, loading = _load(info)
            plain = _plain_copy(loaded)
    _account(info, plain, loading)
    partial = out.parent / f".{out.name}.partial"  # renamed to `out` once verified; removed on any failure
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with step(f"writing {out}"):
            plain.save_pretrained(partial)
            tokenizer.save_pretrained(partial)
        with step("verifying the written model"):
            _verify(partial, loaded, tokenizer)
        manifest = write_manifest(partial, _manifest(info, digest, plain, source or {"gguf": str(path.resolve())}, model))
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return manifest


def _field(reader, key: str) -> Any:
    """A scalar or string metadata value (KeyError when absent)."""
    field = reader.fields[key]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0].name == "STRING" else value[0].item()


def _quantisation(reader, types: Counter) -> str:
    """The file type as llama.cpp names it ("Q4_1"), else the most common tensor type."""
    import gguf

    try:
        name = gguf.LlamaFileType(_field(reader, "general.file_type")).name
    except (KeyError, ValueError):
        return types.most_common(1)[0][0] if types else "F32"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ModelsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ModelsError(f"{out} is not empty; pass --force to replace it")
        if read_manifest(out) is None:
            raise ModelsError(f"{out} holds no {MANIFEST}, so it is not a converted model; not replacing it")


def _load(info: GGUFInfo):
    """(dequantised model, tokenizer, loading info), read from a directory holding only the GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="rolemrc-gguf-") as stage:
        (Path(stage) / info.path.name).symlink_to(info.path.resolve())
        model, loading = AutoModelForCausalLM.from_pretrained(stage, gguf_file=info.path.name, dtype=torch.float32,
                                                              output_loading_info=True)
        try:
            tokenizer = AutoTokenizer.from_pretrained(stage, gguf_file=info.path.name)
        except ValueError as exc:
            raise UnsupportedGGUFError(f"{info.path}: its tokenizer cannot be converted ({exc})") from None
    return model.eval(), tokenizer, loading


def _plain_copy(loaded):
    """A fresh model of the same config (no quantization_config) holding the loaded weights."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    return plain.eval()


def _account(info: GGUFInfo, model, loading: dict) -> None:
    """Every GGUF tensor filled exactly one model weight, and every weight came from the file."""
    import gguf

    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == info.architecture)
    names = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    expected, seen = set(), set()
    for key, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:  # a tied weight, stored once in the file
            continue
        seen.add(tensor.data_ptr())
        base, _, suffix = key.rpartition(".")
        expected.add(f"{names.get_name(base) or base}.{suffix}")
    missing = sorted(expected - info.tensor_names) + sorted(loading.get("missing_keys", ()))
    unused = sorted(info.tensor_names - expected)
    if missing or unused:
        raise ModelsError(f"{info.path}: tensors do not match the {type(model).__name__} layout; "
                          f"weights not in the file: {missing[:8]}; file tensors not used: {unused[:8]}")


def _verify(directory: Path, reference, tokenizer) -> None:
    """The written model reloads tied as configured and gives the reference's logits and token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    reloaded_tokenizer = AutoTokenizer.from_pretrained(directory)
    if model.config.tie_word_embeddings and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise ModelsError(f"{directory}: tie_word_embeddings is set but lm_head is not tied after reload")
    ids = tokenizer(SAMPLE_TEXT, return_tensors="pt").input_ids
    if reloaded_tokenizer(SAMPLE_TEXT).input_ids != ids[0].tolist():
        raise ModelsError(f"{directory}: the written tokenizer encodes differently from the GGUF's")
    with torch.no_grad():
        diff = (model(ids).logits - reference(ids).logits).abs().max().item()
    if diff > 1e-5:
        raise ModelsError(f"{directory}: logits differ from the GGUF model's by up to {diff:.3g} after reload")


def _manifest(info: GGUFInfo, digest: str, model, source: dict[str, Any], name: str | None) -> dict[str, Any]:
    from importlib.metadata import version

    import transformers

    conversion = (f"{info.quantisation} dequantised to float32" if info.quantisation != "F32"
                  else "F32 (not quantised), stored as float32")
    config = model.config
    return {
        "model": name,
        "source": source,
        "gguf": {"file": info.path.name, "sha256": digest, "architecture": info.architecture,
                 "tensor_types": info.tensor_types},
        "conversion": conversion,
        "tensor_count": len(info.tensor_names),
        "parameters": sum(p.numel() for p in model.parameters()),
        "config": {"model_type": config.model_type, "num_hidden_layers": config.num_hidden_layers,
                   "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
                   "tie_word_embeddings": config.tie_word_embeddings},
        "rolemrc_version": __version__,
        "transformers_version": transformers.__version__,
        "gguf_version": version("gguf"),
    }
