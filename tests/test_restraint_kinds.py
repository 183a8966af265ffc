"""Restraint kinds beyond scaling: patch, direction and revert as data (typed, digested, YAML), as runtime hooks, as
exact bakes and LoRA adapters where those exist (to 1e-5 relative on float32 logits), and their refusals."""

import json

import pytest
import torch
from test_intervene_lora import TEXTS, load, logits, peft
from transformers import AutoModelForCausalLM

from rolemrc.core.hooks import site
from rolemrc.core.modeling import dir_fingerprint
from rolemrc.intervene import Restraint, RestraintError, applied, bake, check, export_lora


def relative(a, b):
    return float((a - b).abs().max() / b.abs().max())


def vector(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).tolist()


def width_of(path, hook):
    config = json.loads((path / "config.json").read_text())
    hidden = config.get("hidden_size") or config["n_embd"]
    return config.get("intermediate_size") or config.get("n_inner") or 4 * hidden if hook.startswith("mlp.a") or \
        hook == "mlp.post" else hidden


def kinds(path, hook):
    n = width_of(path, hook)
    return [Restraint(name="p", hook=hook, kind="patch", units={0: [5, 1], 1: [2]}, values={0: [0.5, -1.25], 1: [2.0]}),
            Restraint(name="d", hook=hook, kind="direction", directions={0: vector(n), 1: vector(n, 1)})]


def test_each_kind_round_trips_through_yaml_and_json_with_its_own_digest(tmp_path):
    r = Restraint(name="p", hook="mlp.act", kind="patch", units={0: [7, 3]}, values={0: [1.0, -2.0]})
    assert r.units == {0: [3, 7]} and r.values == {0: [-2.0, 1.0]}   # values follow their units when sorted
    d = Restraint(name="d", hook="mlp.out", kind="direction", directions={1: [3.0, 4.0]})
    assert d.directions == {1: [0.6, 0.8]} and d.sites == [1]
    v = Restraint(name="v", hook="mlp.act", kind="revert", alpha=0.5, scope="units", units={0: [1]},
                  reference={"name": "runs/sft", "fingerprint": "abc"})
    for x in (r, d, v, Restraint(name="s", hook="mlp.act", factor=0.5, units={0: [1]})):
        for suffix in (".yaml", ".json"):
            assert Restraint.load(x.save(tmp_path / f"{x.name}{suffix}")).to_dict() == x.to_dict()
    assert "restraint: patch" in (tmp_path / "p.yaml").read_text()
    assert "restraint" not in Restraint.load(tmp_path / "s.yaml").to_dict()   # a scale's spec is as it always was
    digests = {x.digest for x in (r, d, v)} | {Restraint(name="x", hook="mlp.act", kind="patch", units={0: [7, 3]},
                                                         values={0: [1.0, -2.5]}).digest}
    assert len(digests) == 4
    assert Restraint(name="other-name", hook="mlp.act", kind="patch", units={0: [3, 7]},
                     values={0: [-2.0, 1.0]}).digest == r.digest


@pytest.mark.parametrize(("fields", "message"), [
    ({"kind": "steer", "units": {0: [1]}}, "unknown restraint kind 'steer'"),
    ({"kind": "revert", "alpha": 1.5, "scope": "model", "reference": {"name": "sft"}}, r"alpha must lie in \[0, 1\]"),
    ({"kind": "revert", "alpha": 0.5, "scope": "model"}, "needs the reference checkpoint"),
    ({"kind": "revert", "alpha": 0.5, "scope": "rows", "reference": {"name": "sft"}}, "scope is one of model"),
    ({"kind": "revert", "alpha": 0.5, "scope": "layers", "reference": {"name": "sft"}}, "needs 'layers'"),
    ({"kind": "patch", "units": {0: [1, 2]}, "values": {0: [1.0]}}, "1 values for 2 units"),
    ({"kind": "patch", "units": {0: [1]}, "values": {0: [float("nan")]}}, "must be finite"),
    ({"kind": "direction", "directions": {0: [0.0, 0.0]}}, "nonzero vector"),
    ({"kind": "direction", "directions": {0: [1.0]}, "units": {0: [1]}}, "not 'units'"),
    ({"units": {0: [1]}, "values": {0: [1.0]}}, "'values' belong to a patch"),
])
def test_bad_kind_fields_are_refused(fields, message):
    with pytest.raises(RestraintError, match=message):
        Restraint(name="x", hook="mlp.act", **fields)


def test_a_direction_of_another_width_is_refused(model_dirs):
    r = Restraint(name="d", hook="mlp.act", kind="direction", directions={0: [1.0, 0.0, 2.0]})
    with pytest.raises(RestraintError, match="the direction of layer 0 has 3 entries, but mlp.act has width 96"), \
            applied(load(model_dirs["llama"]), r):
        pass


def test_the_hooks_do_what_each_kind_says(model_dirs):
    model = load(model_dirs["llama"])
    patch, direction = kinds(model_dirs["llama"], "mlp.act")
    seen = {}
    batch = torch.tensor([[5, 6, 7, 8]])
    for r in (patch, direction):
        with applied(model, r), torch.no_grad():   # the capture runs after the restraint's rewrite
            handle = site(model, "mlp.act", 0).capture(lambda t, r=r: seen.__setitem__(r.name, t.detach().clone()))
            model(batch)
            handle.remove()
    assert seen["p"][..., [1, 5]].eq(torch.tensor([-1.25, 0.5])).all()
    d = torch.tensor(direction.directions[0])
    assert float((seen["d"] @ d).abs().max()) < 1e-5 and float(seen["d"].abs().max()) > 1e-2


@pytest.mark.parametrize(("arch", "hook"), [("llama", "mlp.post"), ("llama", "mlp.out"), ("llama", "attn.out"),
                                            ("gpt2", "mlp.act"), ("gpt2", "attn.out"), ("qwen2", "mlp.post")])
def test_bakes_and_direction_lora_equal_the_hooks(model_dirs, tokenizer, tmp_path, arch, hook):
    """patch bakes into the projection's bias (Llama gains mlp_bias or attention_bias), direction orthogonalises it;
    each equals its hook to 1e-5 relative in float32, and a direction's rank-1 LoRA under real PEFT does too."""
    plain = logits(load(model_dirs[arch]), tokenizer)
    for r in kinds(model_dirs[arch], hook):
        model = load(model_dirs[arch])
        with applied(model, r):
            hooked = logits(model, tokenizer)
        assert relative(hooked, plain) > 1e-4, r.kind   # the restraint does something
        if r.kind == "patch" and arch == "qwen2":
            with pytest.raises(RestraintError, match="Qwen2ForCausalLM has none of and whose config cannot add one"):
                bake(model_dirs[arch], r, tmp_path / f"baked-{r.kind}")
            continue
        report = bake(model_dirs[arch], r, tmp_path / f"baked-{r.kind}")
        assert not report.numerical_noop and report.restraint == r.to_dict()
        baked = logits(load(tmp_path / f"baked-{r.kind}"), tokenizer)
        assert relative(baked, hooked) <= 1e-5, (r.kind, relative(baked, hooked))
        if r.kind == "direction" and not (arch == "gpt2" and hook == "attn.out"):   # GPT-2's c_proj has a bias
            lora = export_lora(model_dirs[arch], r, tmp_path / "lora")
            assert lora.max_units == 1 and lora.rank == 8
            assert relative(logits(peft(load(model_dirs[arch]), tmp_path / "lora"), tokenizer), hooked) <= 1e-5
    if arch == "llama":
        flags = json.loads((tmp_path / "baked-patch" / "config.json").read_text())
        assert flags["mlp_bias" if hook.startswith("mlp") else "attention_bias"] is True


def test_a_gated_mlp_act_folds_only_a_scale(model_dirs, tmp_path):
    for r in kinds(model_dirs["llama"], "mlp.act"):
        with pytest.raises(RestraintError, match=f"a {r.kind} at mlp.act cannot be folded .* restrain mlp.post"):
            bake(model_dirs["llama"], r, tmp_path / "x")
    with pytest.raises(RestraintError, match="a direction at mlp.act cannot be folded"):
        export_lora(model_dirs["llama"], r, tmp_path / "lora")


def test_lora_refuses_what_it_cannot_hold(model_dirs):
    patch, _ = kinds(model_dirs["llama"], "mlp.post")
    with pytest.raises(RestraintError, match="is a patch, which adds a constant per unit .a bias.: a LoRA adapter cannot"):
        export_lora(model_dirs["llama"], patch, "/nonexistent")
    revert = Restraint(name="v", hook="mlp.act", kind="revert", alpha=0.5, scope="model",
                       reference={"name": str(model_dirs["qwen2"])})
    with pytest.raises(RestraintError, match="model.embed_tokens.weight .Embedding. differs from the reference"):
        export_lora(model_dirs["llama"], revert, "/nonexistent")   # a revert exports where it is low-rank (test_revert_lora)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, model_dirs, tokenizer):
    """A fake SFT -> DPO pair: the llama fixture as SFT, the same model with every weight moved as DPO."""
    dpo = tmp_path_factory.mktemp("dpo")
    model = load(model_dirs["llama"])
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    model.save_pretrained(dpo)
    tokenizer.save_pretrained(dpo)
    return model_dirs["llama"], dpo


def revert(sft, **fields):
    return Restraint(name="v", hook="mlp.act", kind="revert", reference={"name": str(sft)}, **fields)


def test_revert_moves_weights_toward_the_reference_over_its_scope(pair, tokenizer, tmp_path):
    sft, dpo = pair
    full = bake(dpo, revert(sft, alpha=1.0, scope="model"), tmp_path / "full")
    torch.testing.assert_close(logits(load(tmp_path / "full"), tokenizer), logits(load(sft), tokenizer), rtol=0, atol=1e-5)
    assert full.size["reverted_share"] == pytest.approx(1.0)
    none = bake(dpo, revert(sft, alpha=0.0, scope="model"), tmp_path / "none")
    assert none.numerical_noop and none.size["reverted_share"] == 0.0
    half = bake(dpo, revert(sft, alpha=0.5, scope="layers", layers=[1]), tmp_path / "layer")
    assert 0 < half.size["reverted_share"] < 0.5
    units = bake(dpo, revert(sft, alpha=1.0, scope="units", units={0: [3, 4]}), tmp_path / "units")
    a, b, c = (load(p) for p in (sft, dpo, tmp_path / "units"))
    mlp = {name: dict(m.model.layers[0].mlp.named_parameters()) for name, m in (("sft", a), ("dpo", b), ("units", c))}
    for proj, index in (("gate_proj.weight", (slice(None, None), [3, 4])), ("down_proj.weight", (slice(None), [3, 4]))):
        if proj.startswith("gate"):
            index = ([3, 4], slice(None))
        torch.testing.assert_close(mlp["units"][proj][index], mlp["sft"][proj][index], rtol=0, atol=0)
    kept = torch.ones(96, dtype=torch.bool)
    kept[[3, 4]] = False
    torch.testing.assert_close(mlp["units"]["up_proj.weight"][kept], mlp["dpo"]["up_proj.weight"][kept], rtol=0, atol=0)
    assert 0 < units.size["reverted_share"] < half.size["reverted_share"]
    report = check(dpo, revert(sft, alpha=1.0, scope="model"), prompts=TEXTS)
    assert report.kind == "revert" and not report.numerical_noop and report.hook_vs_original_max_abs > 1e-3


def test_a_revert_toward_a_missing_or_other_reference_is_refused_before_loading(pair, tmp_path):
    sft, dpo = pair
    with pytest.raises(RestraintError, match="reverts toward /no/such/sft, which cannot be found"):
        bake(dpo, revert("/no/such/sft", alpha=0.5, scope="model"), tmp_path / "x")
    other = Restraint(name="v", hook="mlp.act", kind="revert", alpha=0.5, scope="model",
                      reference={"name": str(sft), "fingerprint": "0" * 16})
    with pytest.raises(RestraintError, match=f"{dir_fingerprint(sft)}: not the checkpoint the spec was made against"):
        bake(dpo, other, tmp_path / "x")
    with pytest.raises(RestraintError, match="is a revert: it is baked into weights"), \
            applied(AutoModelForCausalLM.from_pretrained(dpo), revert(sft, alpha=0.5, scope="model")):
        pass


@pytest.mark.parametrize("kind", ["patch", "direction"])
def test_check_reports_each_hooked_kind(model_dirs, kind):
    r = {x.kind: x for x in kinds(model_dirs["llama"], "mlp.post")}[kind]
    report = check(model_dirs["llama"], r, prompts=TEXTS)
    assert report.kind == kind and report.factor_at_dtype is None and not report.numerical_noop
    assert report.weight_elements_changed > 0 and report.verdict.startswith("effective")


@pytest.fixture
def moments_diff(tmp_path):
    """A selector test diff (3 layers x 4 units) with distinct SFT means and the models of both sides recorded."""
    from test_selectors import write_diff

    from rolemrc.probe.diff import load_diff

    diff = load_diff(write_diff(tmp_path / "d"))
    diff.mean_a["multi_turn"] = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10
    diff.meta |= {"a_model": "runs/sft", "a_model_fingerprint": "sft-fp", "b_model": "runs/dpo",
                  "b_model_fingerprint": "dpo-fp"}
    return diff


def test_select_makes_patches_and_unit_reverts_of_its_units(moments_diff):
    from rolemrc.intervene import select

    common = {"method": "standardized", "top_k": 3}
    scale = select(moments_diff, "multi_turn", factor=0.0, **common)
    patch = select(moments_diff, "multi_turn", kind="patch", **common)
    assert patch.units == scale.units == {0: [2], 1: [0], 2: [1]}
    assert patch.values == {0: [pytest.approx(0.2)], 1: [pytest.approx(0.4)], 2: [pytest.approx(0.9)]}   # SFT means
    assert patch.reference["fingerprint"] == "sft-fp" and patch.model["fingerprint"] == "dpo-fp"
    revert = select(moments_diff, "multi_turn", kind="revert", alpha=0.5, **common)
    assert revert.scope == "units" and revert.units == scale.units and revert.reference["name"] == "runs/sft"
    other = type(moments_diff)(**{**moments_diff.__dict__, "meta": {**moments_diff.meta, "b_model_fingerprint": "x"}})
    with pytest.raises(RestraintError, match="a diff whose B side is the model with fingerprint x, but the units were "
                                             "selected on runs/dpo"):
        select(moments_diff, "multi_turn", kind="patch", means=other, **common)
    for bad, message in (({"kind": "patch", "factor": 0.5}, "a patch takes no --factor"),
                         ({"kind": "revert"}, "--alpha belongs to a revert, which needs it"),
                         ({"kind": "scale", "factor": 0.5, "alpha": 0.5}, "--alpha belongs to a revert, not a scale"),
                         ({"kind": "direction"}, "select makes a restraint of kind scale | patch | revert")):
        with pytest.raises(RestraintError, match=message):
            select(moments_diff, "multi_turn", **common, **bad)


def test_directions_come_from_the_difference_of_means(moments_diff):
    from rolemrc.intervene.kinds import direction_restraint

    r = direction_restraint(moments_diff, "multi_turn", top_layers=2)
    delta = moments_diff.mean_b["multi_turn"].double() - moments_diff.mean_a["multi_turn"].double()
    longest = sorted(delta.norm(dim=1).argsort(descending=True)[:2].tolist())
    assert r.kind == "direction" and r.sites == longest
    for layer in longest:
        torch.testing.assert_close(torch.tensor(r.directions[layer], dtype=torch.float64), delta[layer] / delta[layer].norm())


def test_the_cli_writes_directions_and_reverts_and_refuses_bad_alpha(tmp_path, pair):
    from test_selectors import write_diff
    from typer.testing import CliRunner

    from rolemrc.cli import app

    sft, _ = pair
    run = CliRunner().invoke
    res = run(app, ["intervene", "direction", "--diff", str(write_diff(tmp_path / "d")), "--dimension", "multi_turn",
                    "--top-layers", "1", "--out", str(tmp_path / "d.yaml")])
    assert res.exit_code == 0, res.output
    assert Restraint.load(tmp_path / "d.yaml").kind == "direction"
    res = run(app, ["intervene", "revert", "--reference", str(sft), "--alpha", "0.25", "--scope", "layers",
                    "--layers", "1", "--out", str(tmp_path / "v.yaml")])
    assert res.exit_code == 0, res.output
    v = Restraint.load(tmp_path / "v.yaml")
    assert (v.kind, v.alpha, v.layers, v.reference["fingerprint"]) == ("revert", 0.25, [1], dir_fingerprint(sft))
    res = run(app, ["intervene", "revert", "--reference", str(sft), "--alpha", "2", "--scope", "model",
                    "--out", str(tmp_path / "w.yaml")])
    assert res.exit_code == 2 and "error: alpha must lie in [0, 1]" in res.output and not (tmp_path / "w.yaml").exists()


STYLE = "role_related_mrc_refused_no_narration"   # role_style alone
PAIRS = [{"id": f"p{i}", "prompt": [{"role": "user", "content": prompt}], "chosen": chosen, "rejected": rejected,
          "task": task} for i, (prompt, chosen, rejected, task) in enumerate([
              ("who keeps the lighthouse", "the keeper watched storms roll over grey water", "no", STYLE),
              ("sing to the ovens", "a baker in the old quarter kneads dough", "i cannot answer that", STYLE),
              ("answer questions on history", "rivers and mountains and trains", "sorry traveller", STYLE),
              ("what lies outside", "i cannot answer that because it lies outside", "libraries",
               "role_related_mrc_answer_no_narration"),
          ])]


def reply_mean(model, tokenizer, pair, side, hook):
    """[layers, width]: the hook point's activation of one pair's side, unbatched, averaged over its reply's tokens."""
    from rolemrc.core.chat import tokenize_replies
    from rolemrc.core.hooks import num_layers

    (ids,), start = tokenize_replies(tokenizer, pair["prompt"], [pair[side]])
    start = min(start, tokenize_replies(tokenizer, pair["prompt"], [pair["chosen"], pair["rejected"]])[1])
    seen = {}
    handles = [site(model, hook, i).capture(lambda t, i=i: seen.__setitem__(i, t[0, start:].double().mean(0)))
               for i in range(num_layers(model))]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in handles:
        h.remove()
    return torch.stack([seen[i] for i in sorted(seen)])


def test_a_pair_direction_is_the_normalised_mean_difference_over_the_replies(model_dirs, tokenizer, tmp_path):
    """chosen - rejected over each reply's tokens, batched and padded, equals the unbatched hand computation; the
    layers are the longest ones; --dimension keeps its pairs alone."""
    from rolemrc.core.io import write_jsonl
    from rolemrc.intervene.kinds import pair_direction_restraint

    write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    r = pair_direction_restraint(model_dirs["llama"], tmp_path / "pairs.jsonl", dimension="role_style", top_layers=1,
                                 hook="mlp.post", batch_size=2, dtype="float32", device="cpu", progress=False)
    model = load(model_dirs["llama"])
    kept = [p for p in PAIRS if p["task"] == STYLE]
    delta = sum(reply_mean(model, tokenizer, p, "chosen", "mlp.post") - reply_mean(model, tokenizer, p, "rejected",
                                                                                   "mlp.post") for p in kept) / len(kept)
    longest = int(delta.norm(dim=1).argmax())
    assert r.kind == "direction" and r.hook == "mlp.post" and r.sites == [longest]
    torch.testing.assert_close(torch.tensor(r.directions[longest], dtype=torch.float64),
                               delta[longest] / delta[longest].norm(), rtol=0, atol=1e-5)
    assert r.source["pairs_used"] == 3 and r.source["contrast"] == "chosen-rejected"
    assert r.model["fingerprint"] == dir_fingerprint(model_dirs["llama"]) and r.model["width"] == 96


def test_the_cli_writes_a_pair_direction_and_refuses_the_wrong_inputs(model_dirs, tmp_path):
    from typer.testing import CliRunner

    from rolemrc.cli import app
    from rolemrc.core.io import write_jsonl

    write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    run = CliRunner().invoke
    base = ["intervene", "direction", "--contrast", "chosen-rejected", "--model", str(model_dirs["llama"]),
            "--pairs", str(tmp_path / "pairs.jsonl")]
    res = run(app, [*base, "--hook", "mlp.out", "--top-layers", "2", "--out", str(tmp_path / "d.yaml")])
    assert res.exit_code == 0, res.output
    d = Restraint.load(tmp_path / "d.yaml")
    assert (d.kind, d.hook, d.sites, d.name) == ("direction", "mlp.out", [0, 1], "pairs-chosen-rejected-direction")
    for extra, message in ((["--diff", str(tmp_path)], "not its: --diff"),
                           (["--dimension", "multi_turn"], "pairs.jsonl: no pair of 'multi_turn'")):
        res = run(app, [*base, *extra, "--out", str(tmp_path / "x.yaml")])
        errors = [line for line in res.output.splitlines() if line.startswith("error:")]
        assert res.exit_code == 2 and len(errors) == 1 and message in errors[0], res.output
        assert not (tmp_path / "x.yaml").exists()
    res = run(app, ["intervene", "direction", "--model", str(model_dirs["llama"]), "--out", str(tmp_path / "x.yaml")])
    assert res.exit_code == 2 and "error: --contrast dpo-sft reads --diff, --dimension; missing: --diff, --dimension; " \
                                  "not its: --model" in res.output


def refuse_loading(monkeypatch):
    """Any model load fails the test: what is refused must be refused before a model loads."""
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("a model loaded"))


def one_error(args, out):
    """Exit 2, one `error:` line (returned), no traceback, nothing at `out`."""
    from typer.testing import CliRunner

    from rolemrc.cli import app

    res = CliRunner().invoke(app, args)
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert res.exit_code == 2 and len(errors) == 1 and "Traceback" not in res.output, res.output
    assert not out.exists(), out
    return errors[0]


@pytest.mark.parametrize("command", ["bake", "check", "lora"])
def test_a_direction_of_another_width_is_refused_from_config_json_before_loading(model_dirs, tmp_path, monkeypatch,
                                                                                   command):
    """mlp.post is intermediate_size (96) wide, mlp.out hidden_size (64): a 64-wide direction at mlp.post, or a unit
    past the width, is one error naming the model's config.json, read before the model loads."""
    refuse_loading(monkeypatch)
    model = model_dirs["llama"]
    out = tmp_path / "out"
    for r, says in ((Restraint(name="d", hook="mlp.post", kind="direction", directions={0: vector(64)}),
                     "the direction of layer 0 has 64 entries, but mlp.post has width 96"),
                    (Restraint(name="s", hook="mlp.out", factor=0.0, units={1: [70]}),
                     "unit 70 in layer 1 out of range (mlp.out has width 64)")):
        spec = r.save(tmp_path / f"{r.name}.yaml")
        args = {"bake": ["--out", str(out)], "lora": ["--out", str(out)], "check": []}[command]
        error = one_error(["intervene", command, "--model", str(model), "--restraint", str(spec), *args], out)
        assert says in error and f"{model}/config.json" in error, error


def means_diffs(tmp_path):
    """Two diffs of the sweep fixture's shape (mlp.act, 2 x 96) with moments: the selection's, B side the model
    "dpo-fp", and one whose B side is another model."""
    from fixtures import write_diff_file

    from rolemrc.probe.diff import load_diff

    delta = torch.linspace(-1, 1, 192).reshape(2, 96)
    paths = []
    for name, fingerprint in (("diff", "dpo-fp"), ("other", "other-fp")):
        diff = load_diff(write_diff_file(tmp_path / name, delta, torch.full_like(delta, 0.5)))
        diff.meta |= {"a_model": "runs/sft", "a_model_fingerprint": "sft-fp", "b_model": f"runs/{name}",
                      "b_model_fingerprint": fingerprint}
        diff.save(tmp_path / name)
        paths.append(tmp_path / name)
    return paths


def test_patch_means_of_another_model_are_refused_before_anything_loads(model_dirs, tmp_path, monkeypatch):
    """`select --kind patch --means` and `sweep run --kind patch --means` with a diff whose B side is another model
    than the one the units come from: one error naming that diff, nothing loaded or written."""
    from rolemrc.core.io import write_jsonl

    refuse_loading(monkeypatch)
    diff, other = means_diffs(tmp_path)
    common = ["--diff", str(diff), "--dimension", "multi_turn", "--method", "standardized", "--kind", "patch",
              "--means", str(other)]
    says = f"{other}/diff.safetensors: a diff whose B side is the model with fingerprint other-fp, but the units were " \
           "selected on runs/diff (dpo-fp)"
    assert says in one_error(["intervene", "select", *common, "--top-k", "4", "--out", str(tmp_path / "p.yaml")],
                             tmp_path / "p.yaml")
    write_jsonl(tmp_path / "test.jsonl", [{"id": "a", "question": "hello", "task": STYLE}])
    assert says in one_error(["sweep", "run", "--model", str(model_dirs["llama"]), "--data", str(tmp_path / "test.jsonl"),
                              *common, "--top-k", "4", "--out", str(tmp_path / "sweep")], tmp_path / "sweep")
