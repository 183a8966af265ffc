"""Pages that agree with the code: docs/ARCHITECTURE.md stays a contract of at most 350 lines; docs/gpu.md's parameter
counts are the `bench generate` shapes' own; docs/eval.md's task table is `core/taxonomy.py`; docs/troubleshooting.md
and docs/calibration.md quote messages the code prints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SRC = ROOT / "src" / "rolemrc"


def source_text() -> str:
    return "\n".join(p.read_text() for p in SRC.rglob("*.py"))


def test_architecture_is_a_contract_of_at_most_350_lines():
    lines = (DOCS / "ARCHITECTURE.md").read_text().splitlines()
    assert len(lines) <= 350, f"docs/ARCHITECTURE.md has {len(lines)} lines; the contract is <= 350"


def parameters(shape: dict, **changes) -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**shape, **changes})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_gpu_page_counts_the_bench_shapes_parameters():
    from rolemrc.bench.generate import SHAPES

    page = (DOCS / "gpu.md").read_text()
    rows = {m[1]: int(m[2].replace(",", "")) for m in re.finditer(r"^\| ([^|]+?) \|(?:[^|]*\|){5} ([\d,]+) \|", page, re.M)}
    assert rows["`llama-8b` of `bench generate` (Llama-3.1-8B)"] == parameters(SHAPES["llama-8b"]) == 8_030_261_248
    assert rows["`llama-1b` of `bench generate` (Llama-3.2-1B)"] == parameters(SHAPES["llama-1b"]) == 1_235_814_400
    assert rows["the H100 runs' 8B shape"] == parameters(SHAPES["llama-8b"], vocab_size=32000)
    assert "bench probe` has no 8B size" in " ".join(page.split())


def test_the_eval_page_task_table_is_the_taxonomy():
    from rolemrc.core.taxonomy import TASK_COUNTS, judge_aspects_for_task

    page = (DOCS / "eval.md").read_text()
    rows = re.findall(r"^\| `([a-z_0-9-]+)` \| (\d+) \| ([^|]+) \|$", page, re.M)
    assert [r[0] for r in rows] == list(TASK_COUNTS)
    for task, count, aspects in rows:
        assert int(count) == TASK_COUNTS[task]
        assert aspects.strip() == ", ".join(a.dimension + (f" ({a.detail})" if a.detail else "")
                                            for a in judge_aspects_for_task(task))


# what docs/troubleshooting.md quotes, as the source writes it (each a piece of one f-string)
QUOTED = [
    "a gated repository you have no access to: accept its terms on the hub and log in (hf auth login)",
    "not found on the hub (or private: log in with hf auth login)",
    "HF_HUB_OFFLINE is set: download it where the hub is reachable (hf download ID) or ",
    "units and direction entries; this server's limit is ",
    'code="restraint_too_large"',
    "units in one layer; this server's LoRA rank ",
    "holds {max_rank}; {rank_fix(units)}",
    "raise max_lora_rank (at most {VLLM_RANKS[-1]} on vLLM) or {baked}",
    "serve it baked, a checkpoint per A/B arm (`rolemrc ab bake`, then `ab create --baked`)",
    "vLLM's LoRA rank (max_lora_rank) goes to {VLLM_RANKS[-1]} at most, so {baked}",
    "fits none of the served models ({why})",
    'code="restraint_needs_bake"',
    "serve the cells baked, a checkpoint each: `rolemrc ab bake --from-sweep {sweep} --cells {cells} --model ",
    "<the served model's checkpoint> --out arms`, add the entries it prints (arms/{MODELS_FILE}) to ",
    "serve.yaml and restart the server, then `rolemrc ab create --from-sweep {sweep} --cells {cells} --baked ",
    "this model takes {self.context_window} ",
    "exceeds the ",
    'code="context_length_exceeded"',
    "leaves no room for a prompt in ",
    "the KV cache could not grow to admit this request (out of memory); ",
    "BERTScore's default encoder (or give --bertscore-model DIR, or leave bertscore ",
    "out: --metrics bleu,rouge,meteor)",
    "the calibration found no recipe to use ({self.status}: {self.why}); name --method ",
    "the calibration found no selector that undoes a planted change ",
]


@pytest.mark.parametrize("quoted", QUOTED)
def test_troubleshooting_quotes_the_code(quoted):
    assert quoted in source_text()


def test_vllm_rank_limit_and_inline_limit_are_the_pages():
    from rolemrc.intervene.lora import VLLM_RANKS
    from rolemrc.serve.config import ServeConfig

    page = (DOCS / "troubleshooting.md").read_text()
    flat = " ".join(page.split())
    assert max(VLLM_RANKS) == 512 and "over 512 units in one layer" in flat
    assert ServeConfig.__dataclass_fields__["max_inline_units"].default == 4096 and "4096 by default" in flat


def test_the_calibration_page_says_what_to_do_for_each_status():
    from rolemrc.intervene.recommendation import STATUSES

    page = (DOCS / "calibration.md").read_text()
    section = page.split("### `found`, `unstable`, `none`: what to do next", 1)[1].split("\n## ", 1)[0]
    for status in STATUSES:
        assert f"**`{status}`.**" in section
