"""`probe collect --preset rolemrc-code` against the RoleMRC authors' analysis recomputed here, independently of
rolemrc's counting: TransformerLens runs each prompt as their interpret.py does, and their visualize.py's top-20%
membership is written out in numpy."""

import json
from collections import defaultdict

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.probe import ProbeCounts
from rolemrc.probe.collect import CollectConfig
from rolemrc.probe.counts import top_k_size

# interpret.py's task_to_dim in rolemrc's spelling of the dimensions: the 8 base tasks, then the variants' suffixes
AUTHORS_BASE = {
    "role_related_mrc_answer_with_narration": ["knowledge_boundary", "role_style"],
    "role_related_mrc_answer_no_narration": ["knowledge_boundary"],
    "role_unrelated_mrc_refused_with_narration": ["knowledge_boundary"],
    "role_unrelated_mrc_refused_no_narration": ["knowledge_boundary", "role_style"],
    "role_related_mrc_refused_with_narration": ["knowledge_boundary"],
    "role_unrelated_mrc_answer_with_narration": ["knowledge_boundary"],
    "role_related_mrc_refused_no_narration": ["role_style"],
    "role_unrelated_mrc_answer_no_narration": ["role_style"],
}
AUTHORS_VARIANTS = {"special-content": ["nested"], "special-format": ["nested"], "2ndrefused": ["multi_turn"],
                    "2ndanswer": ["multi_turn"], "refused": ["prioritized"]}
TL_HOOKS = {"rolemrc-code": "hook_mlp_out", "rolemrc-code-qwen": "hook_attn_out"}


def authors_dimensions(task: str) -> list[str]:
    base, _, variant = task.partition("-")
    return AUTHORS_VARIANTS[variant] if variant else AUTHORS_BASE[base]


def authors_counts(model_dir, records, hook: str) -> dict[str, np.ndarray]:
    """Their pipeline on a TransformerLens model of `model_dir` (TransformerBridge: TransformerLens 4 has no
    HookedTransformer; it runs the HF modules unchanged, so no folding to turn off): the chat template without a
    generation prompt, `run_with_cache` on the string (TransformerLens tokenises it, with a BOS token first but on
    Qwen2), `tensor[-1][-1]` of every block's hook, then per dimension and layer the top int(width * 0.2) values by
    argsort and a count of the kept, non-zero values per unit."""
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = TransformerBridge.boot_transformers(str(model_dir), hf_model=hf_model, tokenizer=tokenizer, device="cpu")
    names = [f"blocks.{i}.{hook}" for i in range(hf_model.config.num_hidden_layers)]
    activations = defaultdict(list)  # dimension -> per case [layers, width]
    for row in records:
        question = [{"role": turn["role"].lower(), "content": turn["content"]} for turn in row["question"]]
        inputs = tokenizer.apply_chat_template(question, tokenize=False)
        with torch.inference_mode():
            _, cache = model.run_with_cache(inputs, names_filter=names)
        last = np.stack([cache[name][-1][-1].numpy() for name in names])
        for dimension in authors_dimensions(row["task"]):
            activations[dimension].append(last)
    counts = {}
    for dimension, rows in activations.items():
        matrix = np.stack(rows, axis=1)  # [layers, cases, width]
        k = max(1, int(matrix.shape[2] * (20 / 100)))
        top = np.argsort(matrix, axis=2)[:, :, ::-1][:, :, :k]
        mask = np.zeros_like(matrix, dtype=bool)
        np.put_along_axis(mask, top, True, axis=2)
        counts[dimension] = np.count_nonzero(np.where(mask, matrix, 0), axis=1)
    return counts


def run_cli(*args: str) -> dict:
    result = CliRunner().invoke(app, ["probe", "collect", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def data_file(records, tmp_path_factory):
    path = tmp_path_factory.mktemp("preset") / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(("arch", "preset"), [("llama", "rolemrc-code"), ("qwen2", "rolemrc-code-qwen")])
def test_preset_counts_equal_the_authors_pipeline_on_transformer_lens(model_dirs, records, data_file, tmp_path,
                                                                      arch, preset):
    out = tmp_path / "probe.safetensors"
    report = run_cli("--model", str(model_dirs[arch]), "--data", str(data_file), "--out", str(out),
                     "--preset", preset, "--batch-size", "4", "--top-cases", "0")
    probe = ProbeCounts.load(out)
    assert report["preset"] == probe.meta["preset"] == preset and probe.meta["preset_overrides"] == ""
    assert report["k"] == int(64 * 0.2) == 12  # rounded down, as theirs (rolemrc's default rounds up: 13)
    expected = authors_counts(model_dirs[arch], records, TL_HOOKS[preset])
    assert sorted(expected) == sorted(probe.dimensions)
    gaps = {d: int(np.abs(probe.count[d].numpy() - expected[d]).max()) for d in expected}
    assert gaps == dict.fromkeys(expected, 0), gaps
    assert all(probe.cases[d] == len([r for r in records if d in authors_dimensions(r["task"])]) for d in expected)


def test_options_given_beside_a_preset_override_it_and_the_file_names_them(model_dirs, data_file, tmp_path):
    out = tmp_path / "probe.safetensors"
    report = run_cli("--model", str(model_dirs["llama"]), "--data", str(data_file), "--out", str(out),
                     "--preset", "rolemrc-code", "--hook", "mlp.act", "--top-fraction", "0.2", "--limit", "6")
    meta = ProbeCounts.load(out).meta
    assert (report["hook"], report["k"], report["preset_overrides"]) == ("mlp.act", int(96 * 0.2), "hook")
    assert [meta[key] for key in ("top_rounding", "generation_prompt", "prepend_bos", "tokens", "rank")] == [
        "down", "false", "true", "last", "signed"]


def test_a_preset_in_the_library_and_an_unknown_one():
    config = CollectConfig.from_preset("rolemrc-code-qwen", tokens="all")
    assert (config.hook, config.top_rounding, config.generation_prompt, config.prepend_bos) == ("attn.out", "down",
                                                                                               False, False)
    assert config.preset_overrides() == ["tokens"] and CollectConfig().preset_overrides() == []
    with pytest.raises(ValueError, match="unknown preset 'rolemrc'; choose from rolemrc-code, rolemrc-code-qwen"):
        CollectConfig.from_preset("rolemrc")
    result = CliRunner().invoke(app, ["probe", "collect", "--model", "m", "--data", "d", "--out", "o",
                                      "--preset", "rolemrc"])
    assert result.exit_code == 2 and "error:" in result.output and "rolemrc-code" in result.output


@pytest.mark.parametrize(("width", "down", "up"), [(64, 12, 13), (3584, 716, 717), (4096, 819, 820), (5, 1, 1)])
def test_top_rounding_up_and_down(width, down, up):
    assert (top_k_size(0.2, width, "down"), top_k_size(0.2, width)) == (down, up)
