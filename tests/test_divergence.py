"""Teacher-forced KL to the SFT model, restoration and collateral (eval.divergence; issue 51, item 1)."""

import pytest
import torch
from fixtures import ANSWERABLE_UNITS, save_planted_llama
from fixtures import test_records as make_records

from rolemrc.core.chat import tokenize_replies
from rolemrc.core.records import prompt_turns
from rolemrc.core.tiny import build_model
from rolemrc.eval.divergence import collateral, continuations, kl_grid, perplexity_change, restoration
from rolemrc.intervene import Restraint, applied

NEUTRAL = ["the keeper of the lighthouse watched the storm", "a baker kneads dough before dawn and sings",
           "the river floods"]


def peaked(arch, tokenizer, seed):
    """A tiny random model whose output head is scaled up, so its distributions are far from uniform."""
    model = build_model(arch, tokenizer, seed=seed, hidden=64, layers=2, intermediate=96)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)
    return model


@pytest.fixture(scope="module")
def pair(tokenizer):
    """Two tiny Llamas of one shape (SFT, DPO) with different random weights, six cases of several dimensions."""
    sft, dpo = peaked("llama", tokenizer, 0), peaked("llama", tokenizer, 1)
    cases = make_records(6)
    texts = [f"{c['reference']} {' '.join(t['content'] for t in c['question'][-1:])[:40]}" for c in cases]
    return sft, dpo, cases, texts


def by_hand(sft, dpo, tokenizer, case, text, restraint=None):
    """KL(cell || SFT) of one case, unbatched: the mean over its reply tokens of sum_v p (log p - log q)."""
    (ids,), start = tokenize_replies(tokenizer, prompt_turns(case), [text])
    ids = torch.tensor([ids])
    with torch.no_grad():
        q = sft(input_ids=ids).logits[0, start - 1:-1].double().log_softmax(-1)
        if restraint is None:
            p = dpo(input_ids=ids).logits[0, start - 1:-1].double().log_softmax(-1)
        else:
            with applied(dpo, restraint):
                p = dpo(input_ids=ids).logits[0, start - 1:-1].double().log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_batched_kl_equals_the_unbatched_sum_over_the_vocabulary(pair, tokenizer):
    sft, dpo, cases, texts = pair
    halved = Restraint("half", "mlp.act", {0: list(range(0, 96, 3)), 1: [5, 7, 40]}, factor=0.5)
    result = kl_grid(sft, dpo, tokenizer, cases, texts, [halved, None], batch_size=4, progress=False)
    assert result.kl.shape == (2, 6) and result.dpo.shape == (6,)
    expected_dpo = torch.tensor([by_hand(sft, dpo, tokenizer, c, t) for c, t in zip(cases, texts)], dtype=torch.float64)
    expected_cell = torch.tensor([by_hand(sft, dpo, tokenizer, c, t, halved) for c, t in zip(cases, texts)],
                                 dtype=torch.float64)
    assert expected_dpo.min() > 0.01   # two random models: far apart
    torch.testing.assert_close(result.dpo, expected_dpo, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(result.kl[1], expected_dpo, rtol=1e-5, atol=1e-7)   # None: the DPO model
    torch.testing.assert_close(result.kl[0], expected_cell, rtol=1e-5, atol=1e-7)
    assert (result.kl[0] - result.dpo).abs().max() > 1e-3   # the restraint moves it, well above rounding
    replies = [tokenize_replies(tokenizer, prompt_turns(c), [t]) for c, t in zip(cases, texts)]
    assert result.tokens.tolist() == [len(ids) - start for (ids,), start in replies]


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_padding_and_batch_size_change_nothing(tokenizer, arch):
    sft, dpo = peaked(arch, tokenizer, 0), peaked(arch, tokenizer, 1)
    cases = make_records(5, seed=3)
    texts = ["a reference answer", "no", "the keeper of the lighthouse watched storms roll over grey water", "i", "ok"]
    cell = Restraint("zero", "mlp.act", {1: [1, 2, 3, 50]}, factor=0.0)
    runs = [kl_grid(sft, dpo, tokenizer, cases, texts, [cell], batch_size=b, neutral=NEUTRAL, progress=False)
            for b in (1, 2, 5)]
    for other in runs[1:]:
        for name in ("kl", "dpo", "neutral", "neutral_dpo"):
            torch.testing.assert_close(getattr(other, name), getattr(runs[0], name), rtol=1e-5, atol=1e-7)


def test_an_identity_restraint_restores_nothing_exactly(pair, tokenizer):
    sft, dpo, cases, texts = pair
    identity = Restraint("one", "mlp.act", {0: list(range(96)), 1: list(range(96))}, factor=1.0)
    result = kl_grid(sft, dpo, tokenizer, cases, texts, [identity], batch_size=3, neutral=NEUTRAL, progress=False)
    assert torch.equal(result.kl[0], result.dpo)   # x * 1 == x: the same logits
    everything = torch.ones(len(cases), dtype=torch.bool)
    assert restoration(result, everything).value.tolist() == [0.0]
    assert perplexity_change(result).tolist() == [0.0]


@pytest.fixture(scope="module")
def planted(tmp_path_factory, tokenizer):
    """The planted Llama (its units U refuse) as DPO and the same model without them as SFT."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("planted")
    dirs = save_planted_llama(root / "dpo", tokenizer), save_planted_llama(root / "sft", tokenizer, units_on=False)
    return [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in dirs[::-1]]


def test_undoing_the_planted_units_restores_everything_and_random_units_nothing(planted, tokenizer):
    sft, dpo = planted
    cases = make_records(8)
    texts = ["cannot answer cannot answer", "keeper keeper keeper"] * 4
    undo = Restraint("undo", "mlp.act", {1: ANSWERABLE_UNITS}, factor=0.0)
    control = Restraint("control", "mlp.act", {1: [0, 1, 2, 4]}, factor=0.0)
    result = kl_grid(sft, dpo, tokenizer, cases, texts, [undo, control, None], batch_size=3, neutral=NEUTRAL,
                     progress=False)
    assert result.dpo.min() > 0.1   # the planted units change every case's distribution
    everything = torch.ones(len(cases), dtype=torch.bool)
    undone = restoration(result, everything)
    torch.testing.assert_close(undone.value, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(undone.per_case.mean(1), undone.value)   # the per-case shares average to the ratio
    dimension = result.dimensions[0][0]
    side = collateral(result, dimension)
    assert side and dimension not in side
    for name, value in side.items():   # every case is planted: the other dimensions are restored as fully
        others = result.mask(name) & ~result.mask(dimension)
        torch.testing.assert_close(value.value, restoration(result, others).value)
        assert value.value[0] == pytest.approx(1.0, abs=1e-6)
    with torch.no_grad():   # the undone model's perplexity is the SFT model's
        nll = [float(-sft(input_ids=torch.tensor([ids])).logits[0, :-1].double().log_softmax(-1)
                     .gather(1, torch.tensor(ids[1:])[:, None]).mean()) for ids in tokenizer(NEUTRAL)["input_ids"]]
    sft_ppl = torch.tensor(nll, dtype=torch.float64).mean().exp()
    change = perplexity_change(result)
    assert change[0] == pytest.approx(float(sft_ppl - result.neutral_dpo.mean().exp()), rel=1e-5)
    assert abs(change[0]) > 1 and change[1] == 0 and change[2] == 0


def test_continuations_are_references_or_a_models_greedy_replies(model_dirs, tokenizer):
    from rolemrc.core.errors import InputError
    from rolemrc.core.modeling import load_model
    from rolemrc.eval.generate import GenerateConfig, generate

    cases = make_records(3)
    assert continuations(cases, "reference") == ["a reference answer"] * 3
    sft, tok = load_model(model_dirs["llama"], device="cpu")
    config = GenerateConfig(model=str(model_dirs["llama"]), max_new_tokens=5, progress=False)
    replies = continuations(cases, "sft", sft=sft, tokenizer=tok, config=config)
    assert replies == [r["response"] for r in generate(cases, config)]
    with pytest.raises(InputError, match="continuation dpo: pass the loaded dpo model"):
        continuations(cases, "dpo", sft=sft, tokenizer=tok)
    with pytest.raises(InputError, match="one of sft, dpo, reference"):
        continuations(cases, "judge")


def test_sweep_measure_kl_restores_the_planted_units_and_not_their_controls(tokenizer, tmp_path):
    import json

    from fixtures import PLANTED_WIDTH, write_diff_file
    from typer.testing import CliRunner

    from rolemrc.cli import app
    from rolemrc.core.io import write_jsonl
    from rolemrc.core.taxonomy import dimensions_for_task

    save_planted_llama(tmp_path / "dpo", tokenizer)
    save_planted_llama(tmp_path / "sft", tokenizer, units_on=False)
    delta = torch.zeros(2, PLANTED_WIDTH)
    delta[1, ANSWERABLE_UNITS] = 1.0   # the diff ranks the planted units first
    write_diff_file(tmp_path / "diff", delta, torch.full_like(delta, 0.5))
    records = make_records(54)   # every multi_turn case of them (12: enough for Holm p < 0.05) and 4 others
    write_jsonl(tmp_path / "test.jsonl", [r for r in records if "multi_turn" in dimensions_for_task(r["task"])]
                + [r for r in records if "multi_turn" not in dimensions_for_task(r["task"])][:4])
    (tmp_path / "neutral.txt").write_text("\n".join(NEUTRAL) + "\n")
    args = ["sweep", "run", "--measure", "kl", "--model", str(tmp_path / "dpo"), "--base", str(tmp_path / "sft"),
            "--diff", str(tmp_path / "diff"), "--data", str(tmp_path / "test.jsonl"), "--neutral",
            str(tmp_path / "neutral.txt"), "--dimension", "multi_turn", "--method", "frequency", "--top-k", "4",
            "--factors", "0,1", "--controls", "2", "--max-new-tokens", "4", "--out", str(tmp_path / "sweep")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    sweep = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    undo, identity = sorted(sweep["cells"], key=lambda c: c["factor"])
    own = undo["scores"]["restoration:multi_turn"]
    assert own["mean"] == pytest.approx(1.0, abs=1e-6) and own["controls_mean"] == 0   # other units write nothing
    assert own["vs_controls"]["p_holm"] < 0.05 and own["vs_baseline"]["p_holm"] < 0.05
    assert all(e["vs_baseline"]["diff"] == 0 for e in identity["scores"].values())   # x1: exactly the DPO model
    assert sweep["baseline"]["restoration:multi_turn"] == 0 and sweep["kl_to_base"]["multi_turn"] > 0.1
    assert undo["scores"]["neutral_ppl"]["n"] == len(NEUTRAL)
    assert sweep["headline"].startswith("1 of 2 cells beat both") and "multi_turn top-4 x0" in sweep["headline"]
    markdown = (tmp_path / "sweep" / "sweep.md").read_text()
    assert "KL(DPO ‖ base)" in markdown and "restoration:multi_turn" in markdown
    again = CliRunner().invoke(app, args)   # a rerun measures nothing again: every cell is in the store
    assert again.exit_code == 0 and json.loads((tmp_path / "sweep" / "sweep.json").read_text()) == sweep
    bad = CliRunner().invoke(app, [*args[:6], *args[8:]])   # no --base
    assert bad.exit_code == 2 and "error: --measure kl needs --base" in bad.output


def test_sweep_kl_inputs_are_refused_before_any_model_loads(model_dirs, tmp_path):
    from typer.testing import CliRunner

    from rolemrc.cli import app

    (tmp_path / "binary.txt").write_bytes(bytes(range(256)))
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "records.jsonl").write_text('{"id": "a", "question": "hi"}\n{"id": "b", "question": "ho"}\n')
    model = str(model_dirs["llama"])
    common = ["sweep", "run", "--model", model, "--diff", str(tmp_path / "diff"), "--data", str(tmp_path / "t.jsonl"),
              "--out", str(tmp_path / "out"), "--dimension", "role_style", "--method", "frequency"]
    for extra, says in ((["--measure", "kl", "--base", model, "--neutral", str(tmp_path / "binary.txt")], "binary"),
                        (["--measure", "kl", "--base", model, "--neutral", str(tmp_path / "blank.txt")], "no text in it"),
                        (["--measure", "kl", "--base", model, "--neutral", str(tmp_path / "records.jsonl")], "records"),
                        (["--measure", "kl", "--base", str(tmp_path / "nowhere")], "no such directory"),
                        (["--measure", "kl", "--base", model, "--base-url", "http://127.0.0.1:9/v1"], "in this process"),
                        (["--base", model], "--base and --neutral are --measure kl's")):
        result = CliRunner().invoke(app, [*common, *extra])
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert result.exit_code == 2 and len(errors) == 1 and says in errors[0], (extra, result.output)
        assert not (tmp_path / "out").exists()


def test_a_case_longer_than_the_context_keeps_its_last_tokens(tokenizer, caplog):
    sft = build_model("llama", tokenizer, seed=0, hidden=64, layers=2, intermediate=96, max_positions=32)
    dpo = build_model("llama", tokenizer, seed=1, hidden=64, layers=2, intermediate=96, max_positions=32)
    case = make_records(1)[0]
    (ids,), start = tokenize_replies(tokenizer, prompt_turns(case), ["the keeper"])
    assert len(ids) > 32 and len(ids) - start < 16
    result = kl_grid(sft, dpo, tokenizer, [case], ["the keeper"], [None], progress=False)
    assert "1 of 1 cases are longer than the model's 32 positions" in caplog.text
    kept = torch.tensor([ids[-32:]])
    first = start - (len(ids) - 32)
    with torch.no_grad():
        q, p = (m(input_ids=kept).logits[0, first - 1:-1].double().log_softmax(-1) for m in (sft, dpo))
    assert result.tokens.tolist() == [len(ids) - start]
    assert float(result.dpo[0]) == pytest.approx(float((p.exp() * (p - q)).sum(-1).mean()), rel=1e-5)
