"""The probe's choices, as `Literal` types (torch-free: the CLI's help lists them)."""

from __future__ import annotations

from typing import Literal, get_args

Backend = Literal["torch", "nnsight", "transformer-lens"]  # collector backends (probe/backends.py)
Tokens = Literal["last", "all"]  # the last prompt token, or every prompt token (each one observation)
Rank = Literal["signed", "abs"]  # rank units by signed value or by magnitude
Rounding = Literal["up", "down"]  # top_fraction x width to a unit count: ceil, or floor (the RoleMRC code's int())
Direction = Literal["both", "up", "down"]  # units that moved: |delta| > 0, delta > 0 (more active under B), delta < 0
DIRECTIONS: tuple[str, ...] = get_args(Direction)
TOKEN_METHODS = {"last": "frequency", "all": "frequency-all"}  # a diff's token policy -> its frequency selector
DEFAULT_RESAMPLES = 5  # Poisson bootstrap replicates a probe or an attribution counts by default (probe/resample.py)
