"""Where and at what precision a model loads: the closed choices of `--dtype`, `--device-map`, and the options every
command that loads a model declares (torch-free: the CLI's help lists them)."""

from __future__ import annotations

from typing import Literal, get_args

import typer

from rolemrc.core.errors import InputError

Dtype = Literal["auto", "float32", "bfloat16", "float16"]   # auto: the checkpoint's own (config.json's dtype)
DTYPES: tuple[str, ...] = get_args(Dtype)
DeviceMap = Literal["auto", "balanced", "balanced_low_0", "sequential"]   # transformers' placement strategies
DEVICE_MAPS: tuple[str, ...] = get_args(DeviceMap)

MODEL_HELP = "a local HF directory, a model pulled by `rolemrc models pull` (its name), or a hub id org/name[@revision]"
DTYPE_HELP = ("auto: the checkpoint's own dtype (config.json), on any device: a bf16 checkpoint runs in bf16 on the "
              "CPU too (slow there: pass float32)")
DEVICE_HELP = "cpu, cuda, cuda:1, ... (auto: cuda if available)"
DEVICE_MAP_HELP = ("spread the model's layers over the GPUs (then the CPU) with accelerate's big-model placement, "
                   "instead of --device")


def dtype_option(help: str = DTYPE_HELP) -> typer.models.OptionInfo:
    """The `--dtype` option: a choice of DTYPES, default auto."""
    return typer.Option("auto", "--dtype", help=help)


def device_option(help: str = DEVICE_HELP) -> typer.models.OptionInfo:
    """The `--device` option, default auto."""
    return typer.Option("auto", "--device", help=help)


def device_map_option(help: str = DEVICE_MAP_HELP) -> typer.models.OptionInfo:
    """The `--device-map` option: a choice of DEVICE_MAPS, default none (then --device)."""
    return typer.Option(None, "--device-map", help=help)


def check_dtype(dtype: str | None) -> None:
    """An InputError for a dtype name outside DTYPES (None: auto)."""
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")


def check_placement(device: str, device_map: str | None) -> None:
    """An InputError for an unknown device map, or one given with a device."""
    if device_map is not None:
        if device_map not in DEVICE_MAPS:
            raise InputError(f"unknown device map {device_map!r}; choose one of {', '.join(DEVICE_MAPS)}")
        if device != "auto":
            raise InputError(f"give a device ({device}) or a device map ({device_map}), not both")
