"""Attribution patching over preference pairs (`probe attribute`): the scores equal a plain autograd computation on
each unpadded sequence; a DPO model built from the SFT one by changing known units of one layer scores those units
alone in that layer (every unit upstream and every unchanged one exactly 0) and its scores add up to the measured
margin to first order; shards merged (files here; processes under torchrun: tests/test_probe_distributed.py, in its
one torchrun launch) equal one pass bit for bit; bad input exits 2 with one line before a model loads."""

import json
import shutil

import pytest
import torch
from test_probe_merge import assert_same_file
from train_fixtures import pair_records
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.errors import InputError
from rolemrc.core.io import write_jsonl
from rolemrc.core.taxonomy import TASKS, dimensions_for_task
from rolemrc.core.tiny import build_model
from rolemrc.probe import attribute, collect, diff, load_attribution
from rolemrc.probe.attribution import SCORE_UNIT, bucket_length, build_pairs
from rolemrc.probe.cases import build_cases
from rolemrc.probe.diff import ProbeMismatchError
from rolemrc.probe.errors import ProbeError
from rolemrc.probe.merge import merge_any, merge_files
from rolemrc.probe.resample import resample_weights

LAYERS, CHANGED_LAYER, CHANGED = 3, 1, [5, 17, 40]
# where each tested hook point's tensor lives, written out plainly: (module path, its output or its input)
PER_RUN = ("batch_size", "peak_memory_gib")   # how one run went: a merge keeps them per file, in merged_from
PLAIN_SITES = {("llama", "mlp.act"): ("model.layers.{}.mlp.act_fn", "output"),
               ("qwen2", "mlp.post"): ("model.layers.{}.mlp.down_proj", "input"),
               ("gpt2", "attn.out"): ("transformer.h.{}.attn", "output")}


@pytest.fixture(scope="module")
def pairs():
    """Preference pairs over every task (so every dimension), with replies of varied length."""
    return [{**p, "task": TASKS[i % len(TASKS)]} for i, p in enumerate(pair_records(20))]


def tiny(arch, tokenizer, seed=0):
    return build_model(arch, tokenizer, seed=seed, hidden=64, layers=LAYERS, intermediate=96)


def changed(model, scale):
    """A copy of a Llama `model` whose units CHANGED of layer CHANGED_LAYER (their gate rows) are scaled."""
    other = type(model)(model.config).eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        other.model.layers[CHANGED_LAYER].mlp.gate_proj.weight[CHANGED] *= scale
    return other


@pytest.fixture(scope="module")
def sft(tokenizer):
    return tiny("llama", tokenizer)


@pytest.fixture(scope="module")
def dirs(sft, tokenizer, tmp_path_factory):
    """Saved models: sft, dpo (CHANGED scaled by 1.5), and a 2-layer model."""
    out = {}
    for name, model in (("sft", sft), ("dpo", changed(sft, 1.5)),
                        ("short", build_model("llama", tokenizer, hidden=64, layers=2, intermediate=96))):
        out[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(out[name])
        tokenizer.save_pretrained(out[name])
    return out


def plain_tokens(tokenizer, record):
    """(chosen ids, rejected ids, first reply token): the prompt rendered with the generation prompt is a prefix of
    each rendered conversation."""
    render = lambda turns, gen: tokenizer(tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=gen),  # noqa: E731
                                          add_special_tokens=False)["input_ids"]
    prompt = render(record["prompt"], True)
    seqs = [render(record["prompt"] + [{"role": "assistant", "content": record[side]}], False) for side in ("chosen", "rejected")]
    assert all(s[:len(prompt)] == prompt for s in seqs)
    return *seqs, len(prompt)


def module(model, path):
    for part in path.split("."):
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model


def plain_score(sft, dpo, arch, hook, ids, start, sign):
    """[layers, width]: per layer, sign * d(reply log-prob under dpo)/d(activation) . (a_dpo - a_sft), summed over the
    positions of one unpadded sequence, the activation made a leaf of its own layer's forward pass."""
    path, side = PLAIN_SITES[(arch, hook)]
    ids = torch.tensor([ids])
    return torch.stack([plain_layer_score(module(sft, path.format(i)), module(dpo, path.format(i)), side, sft, dpo, ids,
                                          start, sign) for i in range(LAYERS)])


def plain_layer_score(sft_site, dpo_site, side, sft, dpo, ids, start, sign):
    seen = {}

    def read(_m, args, out=None):
        first = args[0] if side == "input" else (out[0] if isinstance(out, tuple) else out)
        seen["sft"] = first.detach()

    def swap(_m, args, out=None):
        first = args[0] if side == "input" else (out[0] if isinstance(out, tuple) else out)
        seen["leaf"] = leaf = first.detach().requires_grad_()
        if side == "input":
            return (leaf, *args[1:])
        return (leaf, *out[1:]) if isinstance(out, tuple) else leaf

    register = "register_forward_pre_hook" if side == "input" else "register_forward_hook"
    handle = getattr(sft_site, register)(read)
    with torch.no_grad():
        sft(input_ids=ids)
    handle.remove()
    handle = getattr(dpo_site, register)(swap)
    logp = dpo(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
    handle.remove()
    (sign * logp[start - 1:].sum()).backward()
    leaf = seen["leaf"]
    return (leaf.grad[0].double() * (leaf[0].detach().double() - seen["sft"][0].double())).sum(0)


@pytest.mark.parametrize("arch,hook", list(PLAIN_SITES))
def test_scores_equal_a_plain_autograd_computation(tokenizer, pairs, arch, hook):
    sft, dpo = tiny(arch, tokenizer, seed=1), tiny(arch, tokenizer, seed=2)  # two unrelated models: every unit moves
    sample = pairs[:5]
    got = attribute([sft, dpo], sample, tokenizers=(tokenizer, tokenizer), hook=hook, batch_size=2, progress=False)
    want, count = {}, {}
    for record in sample:
        chosen, rejected, start = plain_tokens(tokenizer, record)
        score = plain_score(sft, dpo, arch, hook, chosen, start, 1.0) + plain_score(sft, dpo, arch, hook, rejected, start, -1.0)
        for d in dimensions_for_task(record["task"]):
            want[d] = want.get(d, 0) + score
            count[d] = count.get(d, 0) + 1
    assert {d: n for d, n in got.pairs.items() if n} == count
    for d, total in want.items():
        assert total.abs().max() > 1e-3  # the check has something to find
        torch.testing.assert_close(got.mean(d), total / count[d], rtol=1e-4, atol=1e-6)
    assert got.empty_dimensions == [d for d in got.dimensions if d not in want]
    with pytest.raises(ProbeError, match="has no pairs"):
        got.mean(got.empty_dimensions[0])


def test_changed_units_carry_the_score_and_unchanged_ones_score_exactly_zero(sft, tokenizer, pairs):
    kw = {"tokenizers": (tokenizer, tokenizer), "batch_size": 3, "progress": False}
    same = attribute([sft, sft], pairs, **kw)
    assert all((s == 0).all() for s in same.sums.values())
    for scale in (1.5, 1.01):
        got = attribute([sft, changed(sft, scale)], pairs, **kw)
        for score in got.scores.values():
            assert (score[:CHANGED_LAYER] == 0).all()  # upstream: activations identical, so exactly 0
            moved = score[CHANGED_LAYER].nonzero().flatten().tolist()
            assert moved == CHANGED and (score[CHANGED_LAYER + 1:] != 0).any()  # downstream moves too
    # first order: patching the whole changed layer from SFT to DPO gives the DPO model, so its scores add up to
    # DPO's margin over the pairs (zero under the SFT model), up to second-order terms in the change
    total = float(sum(got.sums.values())[CHANGED_LAYER].sum()) * SCORE_UNIT
    margin = measured_margin(sft, changed(sft, 1.01), tokenizer, pairs)
    assert abs(margin) > 1e-5 and abs(total - margin) < 0.02 * abs(margin)


def measured_margin(sft, dpo, tokenizer, pairs):
    """Sum over pairs, each counted once per dimension it has: [lp_dpo(c) - lp_sft(c)] - [lp_dpo(r) - lp_sft(r)],
    computed in float64 (in float32 the log-probs' rounding is as large as the margin of a small change)."""
    sft, dpo, total = changed(sft, 1.0).double(), dpo.double(), 0.0
    for record in pairs:
        chosen, rejected, start = plain_tokens(tokenizer, record)
        for sign, ids in ((1, chosen), (-1, rejected)):
            ids = torch.tensor([ids])
            with torch.no_grad():
                lp = [m(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])[start - 1:].sum()
                      for m in (dpo, sft)]
            total += sign * float(lp[0] - lp[1]) * len(dimensions_for_task(record["task"]))
    return total


def test_shards_merged_equal_one_pass_exactly(dirs, pairs, tmp_path):
    kw = {"batch_size": 3, "device": "cpu", "progress": False}
    whole = attribute([dirs["sft"], dirs["dpo"]], pairs, **kw).save(tmp_path / "whole.safetensors")
    parts = [attribute([dirs["sft"], dirs["dpo"]], part, **kw).save(tmp_path / f"part-{i}.safetensors")
             for i, part in enumerate([pairs[:7], pairs[7:9], pairs[9:]])]
    assert_same_file(merge_files(parts[::-1], tmp_path / "merged.safetensors"), whole, ignore={"merged_from", *PER_RUN})
    merged = load_attribution(tmp_path / "merged.safetensors")
    assert [p["pairs"] for p in json.loads(merged.meta["merged_from"])] == [11, 2, 7]
    with pytest.raises(ProbeError, match="share 2 case"):
        merge_any([parts[1], parts[1]])
    other_hook = attribute([dirs["sft"], dirs["dpo"]], pairs[:7], hook="mlp.out", **kw).save(tmp_path / "hook.safetensors")
    with pytest.raises(ProbeError, match="not comparable.*hook: 'mlp.act' vs 'mlp.out'"):
        merge_any([other_hook, parts[1]][::-1])
    swapped = attribute([dirs["dpo"], dirs["sft"]], pairs[:7], **kw).save(tmp_path / "swapped.safetensors")
    with pytest.raises(ProbeError, match="not comparable \\(models"):
        merge_any([swapped, parts[1]])
    probe = collect(dirs["sft"], pairs[:3], device="cpu", progress=False).save(tmp_path / "probe.safetensors")
    with pytest.raises(ProbeError, match="is an attribution file and .*probe.safetensors is not"):
        merge_any([parts[0], probe])
    res = CliRunner().invoke(app, ["probe", "diff", str(parts[0]), "--out", str(tmp_path / "d")])
    assert res.exit_code == 2 and f"{parts[0]} is an attribution file" in res.output


def test_a_replicate_is_the_attribution_of_its_resample_of_the_pairs(dirs, tokenizer, pairs, tmp_path):
    """Replicate r of an attribution equals the attribution of the pairs each repeated w[r, pair] times (the stored
    replicate of the file too); the pairs' weights come from their hashes alone."""
    kw = {"batch_size": 3, "device": "cpu", "progress": False}
    result = attribute([dirs["sft"], dirs["dpo"]], pairs, resamples=2, **kw)
    loaded = load_attribution(result.save(tmp_path / "resampled.safetensors"))
    assert loaded.meta["resamples"] == "2" and len(loaded.resamples) == 2
    weights = resample_weights(build_pairs(pairs, tokenizer).hashes, 2)
    for r in range(2):
        resampled = [p for p, w in zip(pairs, weights[r].tolist()) for _ in range(w)]
        once = attribute([dirs["sft"], dirs["dpo"]], resampled, resamples=0, **kw)
        for got in (result.resamples[r], loaded.resamples[r]):
            assert got.pairs == once.pairs
            assert all(torch.equal(got.sums[d], once.sums[d]) for d in once.dimensions)


def test_batches_pad_to_their_length_bucket():
    assert [bucket_length(n, None) for n in (1, 8, 9, 50, 64, 65, 300)] == [8, 8, 16, 56, 64, 80, 320]
    assert bucket_length(300, 310) == 310


def test_cli_attribute_and_merge(dirs, pairs, tmp_path):
    data = tmp_path / "pairs.jsonl"
    write_jsonl(data, pairs)
    args = ["probe", "attribute", "--model", str(dirs["sft"]), "--model", str(dirs["dpo"]), "--device", "cpu"]
    res = CliRunner().invoke(app, [*args, "--pairs", str(data), "--out", str(tmp_path / "a.safetensors")])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["hook"] == "mlp.act" and report["layers"] == LAYERS and report["width"] == 96
    assert sum(report["pairs"].values()) == sum(len(dimensions_for_task(p["task"])) for p in pairs)
    for top in report["top"].values():  # up to the changed layer, only the changed units score
        assert all(u["layer"] > CHANGED_LAYER or u["unit"] in CHANGED for u in top) and len(top) == 5
    attribution = load_attribution(tmp_path / "a.safetensors")
    assert attribution.meta["data_fingerprint"] != attribution.meta["pairs_fingerprint"]  # a file's own fingerprint
    halves = []
    for i, part in enumerate((pairs[:10], pairs[10:])):
        write_jsonl(tmp_path / f"p{i}.jsonl", part)
        halves.append(tmp_path / f"h{i}.safetensors")
        assert CliRunner().invoke(app, [*args, "--pairs", str(tmp_path / f"p{i}.jsonl"), "--out", str(halves[i])]).exit_code == 0
    res = CliRunner().invoke(app, ["probe", "merge", *map(str, halves), "--out", str(tmp_path / "m.safetensors")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["top"] == report["top"]
    assert_same_file(tmp_path / "m.safetensors", tmp_path / "a.safetensors",
                     ignore={"merged_from", "data_fingerprint", *PER_RUN})


@pytest.fixture
def no_model_loads(monkeypatch):
    import transformers

    def refuse(*_a, **_k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def test_cli_refuses_bad_input_before_loading_a_model(dirs, pairs, tmp_path, no_model_loads):
    good = tmp_path / "pairs.jsonl"
    write_jsonl(good, pairs[:2])
    no_rejected = tmp_path / "no-rejected.jsonl"
    write_jsonl(no_rejected, [pairs[0], {k: v for k, v in pairs[1].items() if k != "rejected"}])
    no_chosen = tmp_path / "no-chosen.jsonl"
    write_jsonl(no_chosen, [{"prompt": "hello?", "rejected": "no"}])
    wider = tmp_path / "wider"
    shutil.copytree(dirs["dpo"], wider)
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "vocab_size": 512, "intermediate_size": 128}))
    sft, dpo = dirs["sft"], dirs["dpo"]
    cases = {   # name: (models, other options, message)
        "missing sft": ([tmp_path / "nowhere", dpo], {}, "nowhere: no such directory"),
        "one model": ([sft], {}, "attribution compares exactly two models, the reference (SFT) first"),
        "three models": ([sft, dpo, dpo], {}, "got 3"),
        "missing pairs": ([sft, dpo], {"--pairs": tmp_path / "none.jsonl"}, "none.jsonl: no such file"),
        "no rejected": ([sft, dpo], {"--pairs": no_rejected},
                        f"{no_rejected}:2: a preference pair needs a non-empty 'rejected' reply"),
        "no chosen": ([sft, dpo], {"--pairs": no_chosen}, f"{no_chosen}:1: a preference pair needs a non-empty 'chosen' reply"),
        "bad hook": ([sft, dpo], {"--hook": "mlp.nothing"}, "error: Invalid value for '--hook': 'mlp.nothing' is not one of"),
        "other layers": ([sft, dirs["short"]], {}, "differ (layers: 3 vs 2); attribution compares"),
        "other vocabulary and width": ([sft, wider], {}, "differ (vocabulary: 400 vs 512; width: 96 vs 128)"),
        "bad batch": ([sft, dpo], {"--batch-size": 0}, "batch size must be auto or a whole number >= 1, got 0"),
        "bad limit": ([sft, dpo], {"--limit": 0}, "error: Invalid value for '--limit'"),
    }
    for name, (models, change, message) in cases.items():
        options = {"--pairs": good, "--out": tmp_path / "x.safetensors", **change}
        args = [*(x for m in models for x in ("--model", m)), *(x for kv in options.items() for x in kv)]
        res = CliRunner().invoke(app, ["probe", "attribute", *map(str, args)])
        assert res.exit_code == 2, (name, res.output)
        assert message in res.output and res.output.count("rror") == 1, (name, res.output)
    assert not (tmp_path / "x.safetensors").exists()


def test_other_tokenizers_are_refused(dirs, pairs, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(dirs["dpo"], other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    (other / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ProbeError, match="do not share a tokenizer \\(chat template differ\\); attribution compares"):
        attribute([dirs["sft"], other], pairs[:2], device="cpu", progress=False)


def test_max_length_keeps_the_prompts_last_tokens_in_collect_and_attribute(tokenizer, pairs):
    """`--max-length` means one thing: a long case keeps the prompt tokens nearest the reply. In attribution both
    replies stay whole (the prompt cut alike in both sequences), unless a reply alone exceeds the budget: then it keeps
    the prompt's last token and its own first tokens."""
    full = build_pairs(pairs[:1], tokenizer)
    (c,), (r,), (start,) = full.chosen, full.rejected, full.starts
    longest, reply = max(len(c), len(r)), max(len(c), len(r)) - start
    assert start > 3 and reply > 3
    cut = build_pairs(pairs[:1], tokenizer, max_length=longest - 2)
    assert (cut.chosen, cut.rejected, cut.starts, cut.truncated) == ([c[2:]], [r[2:]], [start - 2], 1)
    short = build_pairs(pairs[:1], tokenizer, max_length=3)
    assert (short.chosen, short.rejected, short.starts) == ([c[start - 1:start + 2]], [r[start - 1:start + 2]], [1])
    assert build_pairs(pairs[:1], tokenizer, max_length=longest).truncated == 0
    whole = build_cases(pairs[:1], tokenizer).input_ids[0]
    assert build_cases(pairs[:1], tokenizer, max_length=3).input_ids[0] == whole[-3:]


def test_limit_uses_the_first_cases_and_is_recorded(sft, tokenizer, pairs):
    kw = {"tokenizers": (tokenizer, tokenizer), "progress": False}
    limited = attribute([sft, sft], pairs, limit=3, **kw)
    assert len(limited.case_hashes) == 3
    assert limited.meta["limit"] == "3" and attribute([sft, sft], pairs[:3], **kw).meta["limit"] == ""
    probe = collect(sft, pairs, tokenizer=tokenizer, limit=5, progress=False)
    assert len(probe.case_hashes) == 5 and probe.meta["limit"] == "5"
    with pytest.raises(ProbeMismatchError, match="limit: '5' vs ''"):
        diff(probe, collect(sft, pairs[:5], tokenizer=tokenizer, progress=False))
    with pytest.raises(InputError, match="limit must be at least 1 case, got 0"):
        collect(sft, pairs, tokenizer=tokenizer, limit=0, progress=False)
