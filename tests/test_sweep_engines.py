"""The sweep's other engines, for real: a running `rolemrc serve` endpoint (each row's restraint sent inline) and
`--engine vllm` (a server of the sweep's own, restraints as LoRA adapters) give the in-process sweep's responses."""


from types import SimpleNamespace

import pytest
import torch
from fixtures import EAGER, save_peaked_llama, vllm_or_skip, write_diff_file
from fixtures import test_records as make_records

from rolemrc.core.errors import RolemrcError
from rolemrc.core.io import write_jsonl
from rolemrc.intervene.spec import Restraint, RestraintError
from rolemrc.serve.launch import running_server
from rolemrc.sweep.plan import SweepConfig, plan
from rolemrc.sweep.run import generate_cells
from rolemrc.sweep.sources import check_rank, engine_label, served_model, server_config


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("sweep-engines")
    save_peaked_llama(root / "model", tokenizer, max_positions=512)
    delta = torch.linspace(-1, 1, 2 * 96).reshape(2, 96)[:, torch.randperm(96, generator=torch.Generator().manual_seed(1))]
    write_diff_file(root / "diff", delta, torch.full_like(delta, 0.5))
    write_jsonl(root / "test.jsonl", make_records(6, seed=2))
    return root


def config(root, out, **kw) -> SweepConfig:
    return SweepConfig(model=str(root / "model"), diff=str(root / "diff"), data=str(root / "test.jsonl"), out=str(out),
                       dimensions=["multi_turn"], method="frequency", **{"factors": [0.0], "top_k": [8], "controls": 1, "max_new_tokens": 8,
                                                     "batch_size": 8, "cells_per_pass": 2, **kw})


def responses(root, out, **kw) -> list[list[str]]:
    """Each planned cell's responses, in plan order (cell ids name the engine, so they differ across engines)."""
    cells, store = generate_cells(config(root, out, **kw), progress=False)
    return [[r["response"].replace("\ufffd", "") for r in store.load(c)] for c in cells]


@pytest.fixture(scope="module")
def local(setup, tmp_path_factory):
    return responses(setup, tmp_path_factory.mktemp("local"))


def test_a_sweep_on_a_running_endpoint_equals_the_in_process_one(setup, local, tmp_path):
    model = {"path": str(setup / "model")}
    served = {"models": {"m": model, "n": model}, "allow_inline_restraints": True, "db": None}
    with running_server(served, workdir=tmp_path) as server:
        url = server.base_url + "/v1"
        with pytest.raises(RestraintError, match="serves \\['m', 'n'\\]; choose one with --served-model"):
            served_model(url, "none")
        remote = responses(setup, tmp_path / "out", base_url=url, served_model="n")
    assert remote == local
    assert remote[1] != remote[0]   # the restraint reached the server: zeroing 8 units moves the text


def test_engine_vllm_serves_every_cell_as_a_lora_adapter(setup, local, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLEMRC_VLLM_PYTHON", vllm_or_skip(module_level=False))
    assert responses(setup, tmp_path, engine="vllm", engine_options={"vllm_args": EAGER}) == local
    assert not list(tmp_path.glob("cells/*.tmp")) and list(tmp_path.glob("server-*.log"))


def test_the_vllm_server_is_sized_for_the_largest_cell(setup, tmp_path):
    cfg = config(setup, tmp_path, engine="vllm", top_k=[8, 40], cells_per_pass=3)
    cells = plan(cfg, width=96, settings={})
    served = server_config(cfg, cells)
    model = served["models"]["sweep"]
    widest = max(len(u) for c in cells[1:] for u in c.restraint.units.values())
    assert model["engine"] == "vllm" and model["max_lora_rank"] >= widest and model["max_inline_adapters"] == 3
    assert served["allow_inline_restraints"] and served["max_inline_units"] == 40
    options = {"vllm_args": ["--tensor-parallel-size", "2"], "memory_utilization": 0.5}
    tuned = config(setup, tmp_path, engine="vllm", top_k=[8, 40], cells_per_pass=3, engine_options=options)
    assert server_config(tuned, cells)["models"]["sweep"] == model | options
    assert engine_label(tuned) != engine_label(cfg)   # a vLLM flag may change the replies: cells are not shared
    for wrong, says in (({"max_lora_rank": 8}, "not a vllm engine option the sweep leaves to you"),
                        ({"tensor_parallel": 2}, "choose from .*vllm_args"), ("{}", "must be a JSON object"),
                        ({"memory_utilization": 1.5}, "memory_utilization is 1.5; it must be > 0 and <= 1"),
                        ({"vllm_args": "--enforce-eager"}, "vllm_args must be a list of strings")):
        with pytest.raises(RestraintError, match=says):
            config(setup, tmp_path, engine="vllm", engine_options=wrong)
    with pytest.raises(RestraintError, match="choose one"):
        config(setup, tmp_path, engine="vllm", base_url="http://x/v1")
    check_rank(cfg, cells)   # a cell wider than vLLM's largest LoRA rank is refused before any model loads
    wide = SimpleNamespace(id="c-wide", restraint=Restraint(name="wide", hook=cells[1].restraint.hook,
                                                            units={0: list(range(600))}, factor=0.0))
    with pytest.raises(RestraintError, match=r"cell c-wide restrains 600 units in one layer, .* vLLM accepts \(512\)"):
        check_rank(cfg, [*cells, wide])
    check_rank(config(setup, tmp_path), [*cells, wide])   # in process: hooks, no rank


def test_engine_and_judge_come_from_the_registries(setup, tmp_path):
    """Any serving engine that runs a local model may generate a sweep; a name outside serve's registry, or an engine
    that only proxies another server, is refused naming the choices, and so is a judge outside eval's registry."""
    from rolemrc.core.registry import UnknownNameError
    from rolemrc.eval.judges import JUDGES
    from rolemrc.serve.engines import ENGINES

    with pytest.raises(RestraintError, match="not a serving engine; choose from " + ", ".join(ENGINES)):
        config(setup, tmp_path, engine="tgi")
    with pytest.raises(RestraintError, match="'upstream' does not run a local model"):
        config(setup, tmp_path, engine="upstream")
    with pytest.raises(UnknownNameError, match=f"unknown judge 'gpt'; choose from {JUDGES.listing()}"):
        config(setup, tmp_path, judge="gpt")
    with pytest.raises(RolemrcError, match="needs a model and a base URL"):
        config(setup, tmp_path, judge="openai")


@pytest.mark.parametrize(("options", "says"), [("{'vllm_args': []}", "error: --engine-options is not JSON: "),
                                               ('{"python": "/x", "lora_rank": 8}', "error: --engine-options lora_rank: ")])
def test_engine_options_are_refused_in_one_line_before_the_model_loads(setup, tmp_path, options, says):
    from typer.testing import CliRunner

    from rolemrc.cli import app

    result = CliRunner().invoke(app, ["sweep", "run", "--model", str(setup / "model"), "--diff", str(setup / "diff"),
                                      "--data", str(setup / "test.jsonl"), "--out", str(tmp_path / "s"), "--dimension",
                                      "multi_turn", "--method", "frequency", "--engine", "vllm", "--engine-options",
                                      options])
    assert result.exit_code == 2 and result.output.startswith(says) and result.output.count("\n") == 1, result.output
    assert not (tmp_path / "s").exists()
