"""`rolemrc ab create --from-sweep DIR`: chosen cells of a restraint sweep become the arms of an A/B experiment on a
running server. Each cell's restraint is registered there (POST /v1/restraints), or with `--baked` each cell is a
served model of its own (its checkpoint from `rolemrc ab bake`, listed in the server's config); then the experiment is
created (POST /v1/experiments) with the unrestrained model as its first arm, the one `ab report` tests the others
against."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

import httpx

from rolemrc.core.artifacts import check_format, expect
from rolemrc.core.errors import InputError, RolemrcError
from rolemrc.intervene.budget import Budget
from rolemrc.intervene.spec import Restraint
from rolemrc.sweep.report import beats_both, cell_label, rank_cells

MODELS_FILE = "models.yaml"   # in a folder `rolemrc ab bake` wrote: each arm's checkpoint and served model id


class ServerError(RolemrcError, RuntimeError):
    """The server refused a request (`code`: its error code, when it gave one)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


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


def _call(client: httpx.Client, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The server's JSON answer to a GET (or, with `body`, a POST) of `path`; a ServerError when it refuses."""
    try:
        response = client.get(path) if body is None else client.post(path, json=body)
    except httpx.HTTPError as exc:
        raise ServerError(f"{client.base_url}{path}: {exc}") from None
    if response.status_code not in (200, 201):
        try:
            error = response.json()["error"]
            message, code = error["message"], error.get("code")
        except (ValueError, KeyError, TypeError):
            message, code = response.text[:300], None
        raise ServerError(f"{response.request.url}: HTTP {response.status_code}: {message}", code)
    return response.json()


def load_baked(folder: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """(the models file, its contents) of a folder `rolemrc ab bake` wrote."""
    import yaml

    folder = expect(folder, "baked-arms", "--baked wants the folder `rolemrc ab bake` wrote")
    manifest = yaml.safe_load((folder / MODELS_FILE).read_text())
    check_format(folder / MODELS_FILE, manifest if isinstance(manifest, dict) else {}, "baked-arms")
    return folder / MODELS_FILE, manifest


def baked_models(folder: str | os.PathLike, chosen: list[dict], specs: dict[str, dict]) -> dict[str, dict]:
    """Arm name -> its entry in the models file of `folder` (the served model id, the checkpoint, its serve.yaml
    entry) for each chosen cell; an InputError naming the file for a cell baked there from no or another restraint."""
    path, manifest = load_baked(folder)
    arms = {}
    for cell in chosen:
        name = arm_name(cell)
        entry = manifest["arms"].get(name)
        if entry is None or entry["restraint"] != Restraint.from_dict(specs[cell["id"]]).digest:
            why = "has no arm" if entry is None else "baked another restraint as arm"
            raise InputError(f"{path} {why} {name!r} (cell {cell_label(cell)}); bake the cells again: "
                             f"rolemrc ab bake --cells {shlex.quote(manifest['cells'])} --out {path.parent} ...")
        arms[name] = {**entry, "serve": manifest["serve"]["models"].get(name)}
    return arms


def only_model(base_url: str, cards: list[dict], baked: set[str]) -> str:
    """The one unrestrained model the server lists besides the baked arms', or a ServerError naming them."""
    roots = [c["id"] for c in cards if not c.get("restraint") and c["id"] not in baked]
    if len(roots) != 1:
        raise ServerError(f"{base_url} serves {roots or 'no'} unrestrained models besides the arms; name the "
                          "baseline with --model")
    return roots[0]


def baked_arm(name: str, entry: dict, cards: list[dict], base_url: str, folder: str | os.PathLike) -> dict:
    """The arm serving the baked checkpoint `entry` as the model the server lists under its id, or a ServerError
    naming the serve.yaml entry that serves it."""
    model = entry["model"]
    if not any(c["id"] == model and not c.get("restraint") for c in cards):
        line = f"{model}: {json.dumps(entry['serve'] or {'path': entry['path']})}"
        raise ServerError(f"{base_url} serves no model {model!r} (arm {name!r}): add `{line}` to serve.yaml's models "
                          f"({Path(folder) / MODELS_FILE} lists every arm's entry) and restart the server")
    return {"name": name, "model": model}


def registered_arm(client: httpx.Client, name: str, spec: dict, model: str, fix: str) -> dict:
    """The arm serving `model` restrained by `spec`, registered on the server as `name`; a ServerError that names `fix`
    (the baked route) where the server cannot apply it at runtime."""
    try:
        card = _call(client, "restraints", {"name": name, "spec": spec})
    except ServerError as exc:
        if exc.code == "restraint_needs_bake":
            raise ServerError(f"{exc}; {fix}", exc.code) from None
        raise
    if model not in card["models"]:
        raise ServerError(f"restraint {name!r} fits {card['models']}, not {model!r} (the server's log says why; where "
                          f"{model!r} cannot apply it at runtime: {fix})")
    return {"name": name, "model": model, "restraint": name}


def bake_fix(folder: str | os.PathLike, which: str) -> str:
    """How to serve the cells as baked checkpoints instead (`rolemrc ab bake`)."""
    sweep, cells = shlex.quote(str(folder)), shlex.quote(which)
    return (f"serve the cells baked, a checkpoint each: `rolemrc ab bake --from-sweep {sweep} --cells {cells} --model "
            f"<the served model's checkpoint> --out arms`, add the entries it prints (arms/{MODELS_FILE}) to "
            f"serve.yaml and restart the server, then `rolemrc ab create --from-sweep {sweep} --cells {cells} --baked "
            "arms ...`")


def experiment_from_sweep(folder: str | os.PathLike, which: str, base_url: str, *, model: str | None = None,
                          baked: str | os.PathLike | None = None, exp_id: str | None = None,
                          description: str | None = None, api_key: str | None = None, reveal_arm: bool = True,
                          timeout: float = 120.0) -> dict[str, Any]:
    """Register the chosen cells' restraints on the server at `base_url` (OpenAI base, .../v1) and create the
    experiment: arm `baseline` (the model unrestrained), then one arm per cell. `baked`: a folder from `rolemrc ab
    bake`, whose checkpoints the server serves as models: each cell's arm is its model, nothing is registered.
    `model`: the served model id (default: the one unrestrained model the server lists, the baked arms' aside);
    `reveal_arm`: whether responses say which arm served them. Returns the experiment and what each arm's cell
    showed."""
    cells, specs = load_sweep(folder)
    chosen = choose_cells(cells, which)
    arms_baked = baked_models(baked, chosen, specs) if baked is not None else {}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    evidence = []
    with httpx.Client(base_url=base_url.rstrip("/") + "/", headers=headers, timeout=timeout) as client:
        cards = _call(client, "models")["data"]
        model = model or only_model(base_url, cards, {e["model"] for e in arms_baked.values()})
        arms = [{"name": "baseline", "model": model}]
        for cell in chosen:
            name = arm_name(cell)
            arms.append(baked_arm(name, arms_baked[name], cards, base_url, baked) if baked is not None else
                        registered_arm(client, name, specs[cell["id"]], model, bake_fix(folder, which)))
            evidence.append({"arm": name, "cell": cell["id"], "label": cell_label(cell), "units": cell["units"],
                             "beats_both": beats_both(cell)})
        text = description or (f"restraint sweep {Path(folder).resolve()}: " + "; ".join(
            f"{e['arm']} = {e['label']} (beats baseline and controls on {', '.join(e['beats_both']) or 'nothing'})"
            for e in evidence))
        experiment = _call(client, "experiments", {"id": exp_id, "description": text[:4096], "arms": arms,
                                                   "reveal_arm": reveal_arm})
    return {"experiment": experiment, "cells": evidence}
