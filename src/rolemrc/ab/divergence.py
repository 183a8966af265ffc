"""`ab report --measure kl`: each arm's restraint scored on every logged request that carries a reference, by its
teacher-forced KL to the SFT model (`eval.divergence.kl_grid`), no generation. The KL does not depend on which arm
answered a request, so every arm is scored on every request: the arms are compared paired, request by request, and
still with the user as the unit (per-user means; CIs resample users; a sign-flip test over users).

Per arm: its mean KL per token to the SFT model, and its restoration, the share of the unrestrained arm's KL it
undoes, 1 − KL(arm‖SFT) / KL(control‖SFT) (1: the arm is the SFT model on these references; 0: the control; below 0:
further from the SFT model). The control is the experiment's first arm, which must be unrestrained (the DPO model
as served); every arm must serve the same model, whose weights are `model`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from rolemrc.core.errors import InputError
from rolemrc.core.stats import cluster_means, mean_ci, paired_test


def arm_restraints(store: Any, exp: dict[str, Any]) -> list[Any]:
    """Each arm's Restraint (None for an unrestrained arm; an arm names it as `restraint` or in a `model+restraint`
    id) from the specs registered in the store; the first arm must be unrestrained and every arm must serve one
    model."""
    from rolemrc.intervene.spec import Restraint

    named = [(a["name"], *a["model"].partition("+")[::2]) for a in exp["arms"]]   # (arm, model, restraint in its id)
    restraints = [a.get("restraint") or inline for a, (_, _, inline) in zip(exp["arms"], named)]
    if restraints[0]:
        raise InputError(f"--measure kl compares every arm with the first, which must be the unrestrained model; "
                         f"{named[0][0]!r} serves restraint {restraints[0]!r}")
    models = sorted({model for _, model, _ in named})
    if len(models) > 1:
        raise InputError(f"--measure kl scores every arm on one model's weights (--model); the arms serve {models} "
                         "(an arm baked by `rolemrc ab bake` is a model of its own: compare it by the judge)")
    out = []
    for (arm, _, _), name in zip(named, restraints):
        spec = store.restraint(name) if name else None
        if name and spec is None:
            raise InputError(f"arm {arm!r} serves restraint {name!r}, which the request log does not hold")
        out.append(Restraint.from_dict(spec) if spec else None)
    return out


def kl_report(store: Any, exp: dict[str, Any], cases: list[dict[str, Any]], *, model: str | Path, base: str | Path,
              batch_size: int = 8, rounds: int = 2000, progress: bool = True) -> dict[str, Any]:
    """Per arm: KL per token to the SFT model `base` and restoration, each per user with a 95% CI over users, and
    each arm's restoration against the control (paired over users), on `cases` (`ab.report.referenced_cases`: the
    logged requests with a reference, each with its `cluster`). Nothing when there are none."""
    from rolemrc.core.modeling import load_model
    from rolemrc.eval.divergence import kl_grid, restoration

    restraints = arm_restraints(store, exp)
    names = [a["name"] for a in exp["arms"]]
    if not cases:
        return {"cases": 0, "note": "no completed request carried metadata.reference, so nothing to score by KL"}
    dpo, tok = load_model(model)
    sft, _ = load_model(base)
    result = kl_grid(sft, dpo, tok, cases, [c["reference"] for c in cases], restraints, batch_size=batch_size,
                     progress=progress)
    clusters = [c["cluster"] for c in cases]
    shares = restoration(result, torch.ones(len(cases), dtype=torch.bool)).per_case.numpy()
    arms = {}
    for k, name in enumerate(names):
        kl_users, share_users = (cluster_means(v, clusters) for v in (result.kl[k].numpy(), shares[k]))
        arms[name] = {"restraint": exp["arms"][k].get("restraint"), "kl_per_token": mean_ci(kl_users, rounds=rounds),
                      "restoration": mean_ci(share_users, rounds=rounds)}
        if k:
            arms[name]["vs_control"] = paired_test(np.zeros_like(share_users), share_users, rounds=rounds) | {
                "unit": "user"}
    return {"cases": len(cases), "users": len(set(clusters)), "base": str(base), "model": str(model),
            "control_kl_per_token": float(result.dpo.mean()), "arms": arms}
