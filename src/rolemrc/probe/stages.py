"""The paired probe as two cached stages (`core.stages.StageCache`): SFT and DPO probed together on the same cases,
then diffed. The demo and the calibration both run it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rolemrc.core.stages import StageCache
from rolemrc.probe.options import DEFAULT_RESAMPLES, Tokens


def paired_diff_stages(cache: StageCache, models: Sequence[Path], data: Path, *, paired: Path, diff_dir: Path,
                       names: tuple[str, str], hook: str, tokens: Tokens = "last", figures: bool = True) -> dict:
    """Probe `models` together on `data` into the paired file `paired` (one pass over the same cases), then diff it
    into `diff_dir` (exact McNemar per unit at tokens=last, the paired t-test at all; heatmaps unless not `figures`),
    with DEFAULT_RESAMPLES replicates of the cases (the diff's `stability`, `intervene.stability`).
    `names`: the cache's names of the two stages; each reruns only when its inputs change. Returns the diff's summary."""
    from rolemrc.probe.collect import collect_paired
    from rolemrc.probe.diff import diff
    from rolemrc.probe.report import write_diff

    def probe() -> dict:
        result = collect_paired(list(models), data, hook=hook, tokens=tokens)
        counts = result.counts[0]
        return {"out": str(result.save(paired)), "models": result.models, "cases": counts.cases,
                "empty_dimensions": counts.empty_dimensions}

    # the token policy is part of the key where it is not the default, so the demo's key (tokens=last) stands; the
    # resamples are, so a probe cached before they were counted runs again
    policy = {} if tokens == "last" else {"tokens": tokens}
    key = {"models": list(models), "data": data, "hook": hook, **policy, "resamples": DEFAULT_RESAMPLES}
    cache.run(names[0], key, probe, [paired])
    return cache.run(names[1], {"paired": paired}, lambda: write_diff(diff(paired), diff_dir, figures=figures),
                     [diff_dir / "diff.safetensors"])
