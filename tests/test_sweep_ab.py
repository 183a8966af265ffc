"""From the offline sweep to a served A/B experiment: `rolemrc ab create --from-sweep` registers the chosen cells'
restraints on a running server (POST /v1/restraints, kept across restarts) and creates the experiment, whose arms
answer as the sweep's cells did; `rolemrc ab bake` makes each cell a checkpoint of its own, served as a model."""

import json

import httpx
import openai
import pytest
from fixtures import write_sweep_inputs
from typer.testing import CliRunner

from rolemrc.ab.from_sweep import arm_name, choose_cells
from rolemrc.cli import app
from rolemrc.core.errors import InputError
from rolemrc.core.io import read_jsonl
from rolemrc.serve.launch import running_server
from rolemrc.sweep import SweepConfig, run_sweep


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, tokenizer):
    """A finished sweep on a peaked small Llama: factors 0 and 0.5 at top-8, one control each."""
    root = tmp_path_factory.mktemp("sweep-ab")
    write_sweep_inputs(root, tokenizer, 6)
    config = SweepConfig(model=str(root / "model"), diff=str(root / "diff"), data=str(root / "test.jsonl"),
                         out=str(root / "sweep"), dimensions=["multi_turn"], method="frequency", factors=[0.0, 0.5],
                         top_k=[8], controls=1,
                         max_new_tokens=6, batch_size=8)
    return root, run_sweep(config, metrics=("rouge",), progress=False)


def bake_args(root, out) -> list[str]:
    return ["ab", "bake", "--from-sweep", str(root / "sweep"), "--cells", "best:2", "--model", str(root / "model"),
            "--out", str(out), "--no-progress"]


@pytest.fixture(scope="module")
def baked(sweep, tmp_path_factory):
    """(the folder, the CLI's result) of `ab bake` of the sweep's best 2 cells, run once for the module: the bake's
    own checks are test_ab_bake_writes_each_cell_as_a_checkpoint_of_its_own's, its arms are served in
    test_ab_create_from_sweep_serves_the_cells_as_arms's restart."""
    root, _ = sweep
    out = tmp_path_factory.mktemp("baked") / "arms"
    return out, CliRunner().invoke(app, bake_args(root, out))


def cell(label_factor: float, lo: float, beats: bool) -> dict:
    family = {"diff": 1.0, "lo": lo, "hi": 2.0, "p_holm": 0.001 if beats else 0.5}
    return {"id": f"selected-{int(label_factor * 10):012d}", "dimension": "multi_turn", "budget": {"top_k": 8},
            "factor": label_factor,
            "units": 8, "scores": {"judge:multi_turn": {"vs_baseline": family, "vs_controls": family}}}


def test_cells_are_chosen_best_first_or_by_name():
    cells = [cell(0.9, -0.5, False), cell(0.5, 0.1, True), cell(0.0, 0.3, True), cell(0.99, 0.2, False)]
    assert [c["factor"] for c in choose_cells(cells, "best:3")] == [0.0, 0.5, 0.99]
    assert choose_cells(cells, "multi_turn top-8 x0.9, " + cells[3]["id"]) == [cells[0], cells[3]]
    for bad, match in (("best:0", "best:N"), ("nope", "no cell \\['nope'\\]"), ("", "no cell")):
        with pytest.raises(InputError, match=match):
            choose_cells(cells, bad)


def test_ab_create_from_sweep_serves_the_cells_as_arms(sweep, baked, tmp_path):
    """Two server processes on one A/B log. The first takes client specs: `ab create --from-sweep` registers the
    cells' restraints and creates the experiment, each arm answering as its cell did; it serves no baked checkpoint,
    so `ab create --baked` there is one error line naming the serve.yaml entry to add. The restart registers the
    restraints again from the database, so the experiment is still served; it takes no client specs (`ab create
    --from-sweep` is refused, naming allow_inline_restraints) and serves the `ab bake` checkpoints as models too:
    `ab create --baked` makes each arm its checkpoint, which answers as the sweep's cell did, registering nothing.
    (On vLLM: tests/test_serve_vllm_baked.py.)"""
    root, summary = sweep
    out, _ = baked
    names = {arm_name(c) for c in summary["cells"]}
    served = {"models": {"m": {"path": str(root / "model")}}, "allow_inline_restraints": True, "db": "ab.sqlite",
              "allow_no_auth": True}
    args = ["ab", "create", "--from-sweep", str(root / "sweep"), "--cells", "best:2", "--id", "from-sweep"]
    create_baked = ["ab", "create", "--from-sweep", str(root / "sweep"), "--cells", "best:2", "--baked", str(out),
                    "--id", "baked"]
    with running_server(served, workdir=tmp_path) as server:
        result = CliRunner().invoke(app, [*args, "--base-url", server.base_url + "/v1"])
        assert result.exit_code == 0, result.output
        created = json.loads(result.output)
        arms = created["experiment"]["arms"]
        assert [a["name"] for a in arms] == ["baseline", *(e["arm"] for e in created["cells"])]
        assert {e["arm"] for e in created["cells"]} == names   # best:2 of 2 cells
        assert len(arms) == 3 and {a["model"] for a in arms} == {"m"} and arms[0].get("restraint") is None
        assert created["experiment"]["reveal_arm"] is True
        assert "multi_turn top-8 x0" in created["experiment"]["description"]
        listed = httpx.get(server.base_url + "/v1/restraints").json()["data"]
        assert {r["name"]: (r["units"], r["models"]) for r in listed} == {a["name"]: (8, ["m"]) for a in arms[1:]}

        # each arm answers as the sweep's cell did (greedy, same length)
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        for entry in created["cells"]:
            for row in read_jsonl(root / "sweep" / "cells" / f"{entry['cell']}.jsonl")[:3]:
                reply = client.chat.completions.create(model=f"m+{entry['arm']}", messages=row["question"], max_tokens=6,
                                                       temperature=0)
                assert reply.choices[0].message.content.strip() == row["response"]

        # registering is idempotent for the same units, refused for others under the same name
        spec = listed[0]["spec"]
        again = httpx.post(server.base_url + "/v1/restraints", json={"name": listed[0]["name"], "spec": spec})
        assert again.status_code == 200
        other = httpx.post(server.base_url + "/v1/restraints",
                           json={"name": listed[0]["name"], "spec": {**spec, "factor": 0.25}})
        assert other.status_code == 409 and other.json()["error"]["code"] == "restraint_exists"
        taken = CliRunner().invoke(app, [*args, "--base-url", server.base_url + "/v1"])
        assert taken.exit_code != 0 and "HTTP 409" in taken.output and "exists" in taken.output
        blind = CliRunner().invoke(app, [*args[:-1], "blind", "--no-reveal-arm", "--base-url", server.base_url + "/v1"])
        assert blind.exit_code == 0, blind.output   # the same restraints again: registered already
        assert json.loads(blind.output)["experiment"]["reveal_arm"] is False
        hidden = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "the keeper"}],
                                                max_tokens=4, user="u1", extra_body={"experiment": "blind"})
        assert hidden.model_extra["arm"] is None and hidden.model == "m"

        # the baked arms are not served here: one error line naming the serve.yaml entry that would serve one
        missing = CliRunner().invoke(app, [*create_baked, "--base-url", server.base_url + "/v1"])
    errors = [line for line in missing.output.splitlines() if line.startswith("error:")]
    assert missing.exit_code == 2 and len(errors) == 1 and "serves no model" in errors[0], missing.output
    assert str(out / sorted(names)[0]) in missing.output or str(out / sorted(names)[1]) in missing.output

    # a restart registers them again from the database, so the experiment's arms are still served; it also serves
    # each baked checkpoint as a model (the transformers engine, here) and takes no client specs
    restarted = {"models": {"m": {"path": str(root / "model")}} | {name: {"path": str(out / name)} for name in names},
                 "db": "ab.sqlite", "allow_no_auth": True}
    with running_server(restarted, workdir=tmp_path) as server:
        listed = httpx.get(server.base_url + "/v1/restraints").json()["data"]
        assert {r["name"] for r in listed} == {a["name"] for a in arms[1:]}
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="from-sweep", messages=[{"role": "user", "content": "the keeper"}],
                                               max_tokens=4, user="u1", extra_body={"experiment": "from-sweep"})
        assert reply.model_extra["arm"] in {a["name"] for a in arms}

        result = CliRunner().invoke(app, [*create_baked, "--base-url", server.base_url + "/v1"])
        assert result.exit_code == 0, result.output
        created = json.loads(result.output)
        baked_arms = created["experiment"]["arms"]
        assert baked_arms[0]["model"] == "m" and {a["name"]: a["model"] for a in baked_arms[1:]} == {n: n for n in names}
        assert not any(a.get("restraint") for a in baked_arms)
        assert httpx.get(server.base_url + "/v1/restraints").json()["data"] == listed   # nothing registered
        for entry in created["cells"]:
            for row in read_jsonl(root / "sweep" / "cells" / f"{entry['cell']}.jsonl")[:3]:
                reply = client.chat.completions.create(model=entry["arm"], messages=row["question"], max_tokens=6,
                                                       temperature=0)
                assert reply.choices[0].message.content.strip() == row["response"]

        # without client specs, registration is refused (the baseline named: the baked arms are models here too)
        refused = CliRunner().invoke(app, ["ab", "create", "--from-sweep", str(root / "sweep"), "--model", "m",
                                           "--base-url", server.base_url + "/v1"])
    assert refused.exit_code != 0 and "allow_inline_restraints" in refused.output


def test_ab_create_without_a_finished_sweep_is_refused(tmp_path):
    """A folder holding something else than a sweep (here a serve config) is one error. (A server without client
    specs refusing registration: test_ab_create_from_sweep_serves_the_cells_as_arms.)"""
    (tmp_path / "serve.yaml").write_text("models: {m: model}\n")
    missing = CliRunner().invoke(app, ["ab", "create", "--from-sweep", str(tmp_path), "--base-url", "http://127.0.0.1:9/v1"])
    assert missing.exit_code != 0 and "no finished sweep" in missing.output


def test_ab_report_by_kl_scores_every_arm_on_every_logged_reference(tmp_path, tokenizer):
    """`ab report --measure kl` on a request log: the planted DPO model served as the control, an arm zeroing its 4
    planted units (the SFT model there: restoration 1) and one zeroing 4 other units (0). Each arm is scored on
    every request with a reference, whichever arm answered it, paired over users; a request without a reference
    is left out."""
    from fixtures import ANSWERABLE_UNITS, answerable_records, save_planted_llama

    from rolemrc.intervene.spec import Restraint
    from rolemrc.serve.store import Store

    sft = save_planted_llama(tmp_path / "sft", tokenizer, units_on=False, noise=1e-3)
    dpo = save_planted_llama(tmp_path / "dpo", tokenizer, noise=1e-3)
    db = str(tmp_path / "ab.sqlite")
    store = Store.open(db)
    for name, units in (("planted", ANSWERABLE_UNITS), ("other", [0, 1, 2, 4])):
        store.add_restraint(name, Restraint(name=name, hook="mlp.act", factor=0.0, units={1: units}).to_dict(), 0.0)
    store.add_experiment("kl", "by KL", [{"name": "dpo", "model": "m", "weight": 1},
                                         {"name": "planted", "model": "m", "weight": 1, "restraint": "planted"},
                                         {"name": "other", "model": "m", "weight": 1, "restraint": "other"}], 0.0)
    records = answerable_records(12, "h")
    for k, r in enumerate(records):
        store.log_request([{"id": f"r{k:03d}", "experiment": "kl", "arm": ("dpo", "planted", "other")[k % 3],
                            "user": f"u{k % 6}", "model": "m", "endpoint": "chat", "messages": r["question"],
                            "response": "cannot answer", "finish_reason": "stop", "latency_s": 0.1, "prompt_tokens": 5,
                            "completion_tokens": 2, "metadata": {"task": r["task"], "reference": r["reference"]}
                            if k else {"task": r["task"]}, "started": float(k), "finished": float(k) + 0.1}])
    store.close()
    out = tmp_path / "report"
    args = ["ab", "report", "kl", "--db", db, "--metrics", "", "--measure", "kl", "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--model", str(dpo), "--base", str(sft), "--rounds", "500"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["kl"]["cases"] == 11 and report["kl"]["users"] == 6   # r000 has no reference
    arms = report["arms"]
    assert arms["planted"]["restoration"]["mean"] == pytest.approx(1, abs=0.02) and arms["planted"]["restoration"]["lo"] > 0.9
    assert abs(arms["other"]["restoration"]["mean"]) < 0.05 and arms["dpo"]["restoration"]["mean"] == 0
    assert arms["planted"]["kl_per_token"]["mean"] < 1e-3 < arms["dpo"]["kl_per_token"]["mean"]
    test = report["tests"]["planted vs dpo"]["restoration"]
    assert test["n"] == 6 and test["p"] < 0.05 and test["test"] == "sign-flip"
    assert "restoration (of KL to SFT)" in (out / "chart.html").read_text()
    refused = CliRunner().invoke(app, [*args, "--model", str(dpo)])
    assert refused.exit_code == 2 and "--measure kl needs --model" in refused.output


def test_ab_report_by_kl_refuses_arms_it_cannot_compare(tmp_path):
    """--measure kl needs an unrestrained first arm, one served model and every restraint in the log: each is one
    InputError naming the arm, before any model loads."""
    from rolemrc.ab.divergence import arm_restraints
    from rolemrc.serve.store import Store

    store = Store.open(str(tmp_path / "ab.sqlite"))
    arms = lambda *a: {"arms": [dict(zip(("name", "model", "restraint"), x)) for x in a]}  # noqa: E731
    for exp, match in ((arms(("a", "m", "r")), "first, which must be the unrestrained model; 'a' serves restraint 'r'"),
                       (arms(("a", "m", None), ("b", "m2", None)), "the arms serve \\['m', 'm2'\\]"),
                       (arms(("a", "m", None), ("b", "m+gone", None)), "arm 'b' serves restraint 'gone', which the request")):
        with pytest.raises(InputError, match=match):
            arm_restraints(store, exp)
    store.close()


def test_ab_bake_writes_each_cell_as_a_checkpoint_of_its_own(sweep, baked):
    """`ab bake` writes each chosen cell's restraint baked into a checkpoint and models.yaml, prints its serve.yaml
    entries, keeps what it baked already and refuses to write over a model directory. (`ab create --baked` and the
    arms served: test_ab_create_from_sweep_serves_the_cells_as_arms.)"""
    import yaml

    root, summary = sweep
    out, result = baked
    assert result.exit_code == 0, result.output
    manifest = yaml.safe_load((out / "models.yaml").read_text())
    names = {arm_name(c) for c in summary["cells"]}
    assert set(manifest["arms"]) == set(manifest["serve"]["models"]) == names and manifest["dtype"] == "float32"
    assert all((out / name / "config.json").is_file() for name in names)
    assert yaml.safe_load(result.output)["models"] == manifest["serve"]["models"]   # printed as serve.yaml entries
    assert "memory_utilization: 0.3" in result.output   # 0.9 of a GPU over the model and 2 arms
    bake = bake_args(root, out)
    weights = {name: (out / name / "model.safetensors").stat().st_mtime_ns for name in names}
    assert CliRunner().invoke(app, bake).exit_code == 0   # baked already: kept
    assert weights == {name: (out / name / "model.safetensors").stat().st_mtime_ns for name in names}
    taken = CliRunner().invoke(app, [*bake[:-2], str(root / "model"), "--no-progress"])
    assert taken.exit_code == 2 and "is a Hugging Face model directory; `ab bake` writes a new folder" in taken.output
