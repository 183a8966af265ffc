"""rolemrc.train: the embedded base model, SFT and DPO.

    from rolemrc.train import SFTTrainConfig, make_config, train_sft
    result = train_sft(make_config(SFTTrainConfig, profile="tiny", model="runs/base", data=["sft.jsonl"], out="runs/sft"))

Heavy imports (torch, transformers, trl) happen on first use, so `rolemrc --help` stays fast.
"""

from rolemrc.train.config import BaseTrainConfig, DPOTrainConfig, SFTTrainConfig, TrainConfig, TrainConfigError, make_config

_LAZY = {"train_base": "rolemrc.train.embedded", "train_sft": "rolemrc.train.sft", "train_dpo": "rolemrc.train.dpo",
         "TrainResult": "rolemrc.train.runner", "DataError": "rolemrc.train.data"}

__all__ = ["BaseTrainConfig", "DPOTrainConfig", "SFTTrainConfig", "TrainConfig", "TrainConfigError", "make_config", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rolemrc.train' has no attribute {name!r}")
