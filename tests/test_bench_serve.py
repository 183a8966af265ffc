"""`rolemrc bench serve --engine ...` at a tiny scale over real HTTP (the transformers engine only, so no vLLM is
needed): the report is complete and every rate positive; bad engines and model directories are input errors. And
`rolemrc bench attacks` on two attacks: a report per attack (tests/test_serve_attacks.py checks the answers)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from rolemrc.bench.cli import app
from rolemrc.core.errors import EXIT_INPUT

VARIANTS = {"unrestrained", "one_restraint", "mix_of_4"}


def test_http_bench_report():
    result = CliRunner().invoke(app, ["serve", "--engine", "transformers", "--concurrency", "1,2", "--tokens", "4",
                                      "--waves", "1", "--repeats", "1", "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["engines"] == ["transformers"] and out["vllm_version"] is None and out["dtype"] == "bfloat16"
    assert out["model"] == {"path": "random-init demo", "layers": 4, "hidden": 192, "intermediate": 512}
    assert out["restraints"]["count"] == 4 and out["restraints"]["units_per_layer"] == 51
    for c in ("1", "2"):
        run = out["results"]["transformers"][c]
        assert set(run["tokens_per_s"]) == VARIANTS and all(v > 0 for v in run["tokens_per_s"].values())
        assert run["restrained_vs_unrestrained"] > 0 and run["mix_vs_unrestrained"] > 0
    assert "vllm_vs_transformers" not in out
    assert set(out["meets_targets"]) == set(out["targets"]) and set(out["meets_targets"].values()) == {None}


def test_bad_engine_and_model_are_input_errors(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["serve", "--engine", "vllm,tgi"])
    assert result.exit_code == EXIT_INPUT and "unknown engine(s) ['tgi']; choose from vllm, transformers" in result.output
    result = runner.invoke(app, ["serve", "--engine", "transformers", "--dtype", "float64"])
    assert result.exit_code == EXIT_INPUT and "'--dtype': 'float64' is not one of 'auto', 'float32', 'bfloat16', 'float16'" in result.output
    result = runner.invoke(app, ["serve", "--engine", "transformers", "--model", str(tmp_path)])
    assert result.exit_code == EXIT_INPUT and "not a Hugging Face model directory" in result.output


def test_attacks_bench_report():
    result = CliRunner().invoke(app, ["attacks", "--only", "metadata,chunked_body", "--timeout", "10"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["benchmark"] == "attacks" and out["context_window"] == 512 and out["server_restarts"] == 0
    assert list(out["attacks"]) == ["chunked_body", "metadata"] and out["baseline"]["stream_gap_max_ms"] > 0
    for answer in out["attacks"].values():
        assert isinstance(answer["status"], int) and answer["seconds"] > 0 and answer["rss_growth_mb"] is not None
        assert answer["stream_gap_max_ms"] >= answer["stream_gap_p50_ms"] >= 0
    result = CliRunner().invoke(app, ["attacks", "--only", "metadata,slowloris"])
    assert result.exit_code == EXIT_INPUT and "unknown attack(s) ['slowloris']" in result.output
