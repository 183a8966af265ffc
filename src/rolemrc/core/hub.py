"""Hugging Face hub ids (`org/name[@revision]`) resolved to a snapshot directory: the HF cache first, the hub only
when the model is not cached and `HF_HUB_OFFLINE` is not set."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from rolemrc.core.errors import InputError

SEGMENT = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?"   # the hub's rule for an org or repository name
HUB_ID = re.compile(rf"(?P<repo>{SEGMENT}/{SEGMENT})(?:@(?P<revision>[A-Za-z0-9][\w./-]*))?")
# What a snapshot needs for transformers to load it; the rest of a repository (original/ weights, GGUF, ONNX, ...) is
# left on the hub.
WANTED_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]


class HubModelError(InputError):
    """A hub id that cannot be resolved: malformed, not cached while offline, unknown, gated, or the hub unreachable."""


@dataclass(frozen=True)
class HubId:
    repo: str                  # org/name
    revision: str | None       # a branch, tag or commit; None: main

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(name: str) -> HubId:
    """`org/name[@revision]` as a HubId, else a HubModelError saying what a hub id looks like."""
    match = HUB_ID.fullmatch(name)
    if match is None or ".." in match["repo"] or "--" in match["repo"]:
        raise HubModelError(f"{name}: not a local directory, and not a hub id (org/name or org/name@revision, "
                            "letters, digits, '-', '_' and '.')")
    return HubId(match["repo"], match["revision"])


def looks_like_path(name: str) -> bool:
    """Whether a model name is meant as a path: it exists, starts with '.', '/' or '~', or has more than one '/'."""
    return Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") > 1


def offline() -> bool:
    """Whether HF_HUB_OFFLINE asks for the cache alone (read now, not when huggingface_hub was imported)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache() -> Path:
    """Where huggingface_hub keeps models: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub (read now)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_snapshot(hub_id: HubId) -> Path:
    """The snapshot directory of `hub_id`: from the HF cache if it is there, else downloaded (unless offline); a
    HubModelError naming the id and why otherwise."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache()
    fetch = {"repo_id": hub_id.repo, "revision": hub_id.revision, "cache_dir": cache}
    try:
        return Path(snapshot_download(**fetch, local_files_only=True))
    except LocalEntryNotFoundError:
        if offline():
            raise HubModelError(f"{hub_id}: not a local directory; as a hub id, not in the HF cache at {cache} and "
                                "HF_HUB_OFFLINE is set: download it where the hub is reachable (hf download ID) or "
                                "unset HF_HUB_OFFLINE") from None
    try:
        return Path(snapshot_download(**fetch, allow_patterns=WANTED_FILES))
    except GatedRepoError:
        why = "a gated repository you have no access to: accept its terms on the hub and log in (hf auth login)"
    except RepositoryNotFoundError:
        why = "not found on the hub (or private: log in with hf auth login)"
    except RevisionNotFoundError:
        why = f"the hub has no revision {hub_id.revision!r} of {hub_id.repo}"
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        why = f"not in the HF cache at {cache}, and the hub could not be reached ({type(exc).__name__})"
    raise HubModelError(f"{hub_id}: not a local directory; as a hub id, {why}") from None
