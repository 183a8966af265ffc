"""`rolemrc ab create --from-sweep DIR`: chosen cells of a restraint sweep become the arms of an A/B experiment on a
running server. Each cell's restraint is registered there (POST /v1/restraints), then the experiment is created
(POST /v1/experiments) with the unrestrained model as its first arm, the one `ab report` tests the others against."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx

from rolemrc.core.artifacts import check_format, expect
from rolemrc.core.errors import InputError, RolemrcError
from rolemrc.intervene.budget import Budget
from rolemrc.sweep.report import beats_both, cell_label, rank_cells


class ServerError(RolemrcError, RuntimeError):
    """The server refused a request."""


def choose_cells(cells: list[dict], which: str) -> list[dict]:
    """`best:N` (the top N of `rank_cells`) or comma-separated cell ids or labels ('multi_turn top-16 x0')."""
    if which.startswith("best:"):
        count = which.removeprefix("best:")
        if not count.isdigit() or int(count) < 1:
            raise InputError(f"--cells {which!r}: best:N with N >= 1")
        return rank_cells(cells)[: int(count)]
    named = {c["id"]: c for c in cells} | {cell_label(c): c for c in cells}
    wanted = [w.strip() for w in which.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in named]
    if unknown or not wanted:
        raise InputError(f"--cells: no cell {unknown or which!r} in the sweep; cells: {sorted(cell_label(c) for c in cells)}")
    return [named[w] for w in wanted]


def arm_name(cell: dict) -> str:
    """A name for the cell's restraint and arm, unique to the cell (its id's digest)."""
    return (f"{cell['dimension'].replace('_', '-')}-{Budget.of(cell['budget']).slug}-x{cell['factor']:g}-"
            f"{cell['id'].rsplit('-', 1)[1][:6]}")


def load_sweep(folder: str | os.PathLike) -> tuple[list[dict], dict[str, dict]]:
    """(sweep.json's cells, cell id -> restraint spec from plan.json)."""
    folder = expect(folder, ("sweep", "folder"), "--from-sweep wants a sweep folder (from `rolemrc sweep run`)")
    if not (folder / "sweep.json").is_file() or not (folder / "plan.json").is_file():
        raise InputError(f"--from-sweep {folder}: no finished sweep (sweep.json and plan.json) there")
    summary = json.loads((folder / "sweep.json").read_text())
    check_format(folder / "sweep.json", summary, "sweep")
    cells = summary["cells"]
    specs = {c["id"]: c["restraint"] for c in json.loads((folder / "plan.json").read_text())["cells"] if c["restraint"]}
    return cells, specs


def _post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    try:
        response = client.post(path, json=body)
    except httpx.HTTPError as exc:
        raise ServerError(f"{client.base_url}{path}: {exc}") from None
    if response.status_code not in (200, 201):
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:300]
        raise ServerError(f"{response.request.url}: HTTP {response.status_code}: {message}")
    return response.json()


def experiment_from_sweep(folder: str | os.PathLike, which: str, base_url: str, *, model: str | None = None,
                          exp_id: str | None = None, description: str | None = None, api_key: str | None = None,
                          reveal_arm: bool = True, timeout: float = 120.0) -> dict[str, Any]:
    """Register the chosen cells' restraints on the server at `base_url` (OpenAI base, .../v1) and create the
    experiment: arm `baseline` (the model unrestrained), then one arm per cell. `model`: the served model id
    (default: the one unrestrained model the server lists); `reveal_arm`: whether responses say which arm served
    them. Returns the experiment and what each arm's cell showed."""
    from rolemrc.sweep.sources import served_model

    cells, specs = load_sweep(folder)
    chosen = choose_cells(cells, which)
    model = model or served_model(base_url, api_key or "EMPTY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    arms = [{"name": "baseline", "model": model}]
    evidence = []
    with httpx.Client(base_url=base_url.rstrip("/") + "/", headers=headers, timeout=timeout) as client:
        for cell in chosen:
            name = arm_name(cell)
            card = _post(client, "restraints", {"name": name, "spec": specs[cell["id"]]})
            if model not in card["models"]:
                raise ServerError(f"restraint {name!r} fits {card['models']}, not {model!r}")
            arms.append({"name": name, "model": model, "restraint": name})
            evidence.append({"arm": name, "cell": cell["id"], "label": cell_label(cell), "units": cell["units"],
                             "beats_both": beats_both(cell)})
        text = description or (f"restraint sweep {Path(folder).resolve()}: " + "; ".join(
            f"{e['arm']} = {e['label']} (beats baseline and controls on {', '.join(e['beats_both']) or 'nothing'})"
            for e in evidence))
        experiment = _post(client, "experiments", {"id": exp_id, "description": text[:4096], "arms": arms,
                                                   "reveal_arm": reveal_arm})
    return {"experiment": experiment, "cells": evidence}
