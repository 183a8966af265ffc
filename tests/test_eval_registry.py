"""eval registries: a metric and a judge added by one decorated function each are scored, listed in the CLI
help and validated; an unknown name is a clear error, never a silent fallback to another judge."""

from __future__ import annotations

import importlib
import json
import re

import pytest
from typer.testing import CliRunner

from rolemrc.core.errors import EXIT_INPUT, InputError, RolemrcError
from rolemrc.core.io import write_jsonl
from rolemrc.core.registry import Registry, UnknownNameError
from rolemrc.core.taxonomy import judge_aspects_for_task
from rolemrc.eval import (
    JUDGES,
    METRICS,
    JudgeConfig,
    MetricConfig,
    Scores,
    Verdict,
    judge,
    metric,
    register_judge,
    score,
)
from rolemrc.eval.metrics import metric_scale, parse_metrics
from rolemrc.eval.report import table3


@pytest.fixture
def plugin():
    """Register `length_ratio` and `nonempty` as a contributor would; the CLIs are re-imported so their help
    reads the registries as they are, and everything is undone afterwards. Yields the `rolemrc` app."""

    @metric("length_ratio")
    def length_ratio(hyps: list[str], refs: list[str], config: MetricConfig) -> Scores:
        return Scores({"length_ratio": [len(h) / max(len(r), 1) for h, r in zip(hyps, refs)]},
                      "response characters per reference character")

    @register_judge("nonempty")
    def nonempty(calls, config: JudgeConfig, progress: bool) -> list[Verdict]:
        """1 when the response is not blank."""
        return [Verdict.make(item["id"], item["task"], aspect, int(bool(str(item["response"]).strip())))
                for item, aspect in calls]

    modules = [importlib.import_module(m) for m in ("rolemrc.eval.cli", "rolemrc.ab.cli", "rolemrc.cli")]
    try:
        yield [importlib.reload(m) for m in modules][-1].app
    finally:
        METRICS.unregister("length_ratio")
        JUDGES.unregister("nonempty")
        for m in modules:
            importlib.reload(m)


def test_registered_metric_and_judge_are_scored(plugin, records):
    items = [dict(r, response=r["reference"] if k % 2 else "") for k, r in enumerate(records)]
    assert "length_ratio" in MetricConfig().groups  # the default is every registered group
    run = score(items, judge="nonempty", metrics=("bleu", "length_ratio"), rounds=200)
    assert list(run.summary["metrics"]) == ["bleu", "length_ratio"]
    assert run.summary["metric_info"]["length_ratio"] == "response characters per reference character"
    assert run.summary["metrics"]["length_ratio"]["mean"] == pytest.approx(0.5)
    assert run.summary["judge"] == {"name": "nonempty", "doc": "1 when the response is not blank."}
    assert len(run.verdicts) == sum(len(judge_aspects_for_task(r["task"])) for r in records)
    assert {v["id"]: v["score"] for v in run.verdicts} == {r["id"]: k % 2 for k, r in enumerate(records)}


def test_cli_lists_validates_and_runs_registered_names(plugin, records, tmp_path):
    app, runner = plugin, CliRunner()
    for command in (["eval", "score"], ["eval", "run"], ["ab", "report"]):
        help_text = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "300"}).output
        help_text = " ".join(re.sub("[│╭╮╰╯─]", " ", help_text).split())  # unwrap
        assert "bleu, rouge, meteor, bertscore, length_ratio" in help_text and "<rules|openai|nonempty>" in help_text
    responses = tmp_path / "responses.jsonl"
    write_jsonl(responses, [dict(r, response=r["reference"]) for r in records[:6]])
    ok = runner.invoke(app, ["eval", "score", str(responses), "--out", str(tmp_path / "run"), "--judge", "nonempty",
                                      "--metrics", "length_ratio", "--rounds", "100"])
    assert ok.exit_code == 0, ok.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["judge"]["name"] == "nonempty" and report["metrics"]["length_ratio"]["mean"] == 1.0
    for option, value, message in (("--metrics", "bleu,bogus", "unknown metric 'bogus'; choose from bleu, rouge, "
                                                                "meteor, bertscore, length_ratio"),
                                   ("--judge", "bogus", "Invalid value for '--judge': 'bogus' is not one of 'rules', "
                                                        "'openai', 'nonempty'.")):
        bad = runner.invoke(app, ["eval", "score", str(responses), "--out", str(tmp_path / "bad"), option, value])
        assert bad.exit_code == EXIT_INPUT and f"error: {message}" in bad.output
        assert not (tmp_path / "bad").exists()
        bad = runner.invoke(app, ["ab", "report", "exp", "--db", str(tmp_path / "none.sqlite"), option, value])
        assert bad.exit_code == EXIT_INPUT and f"error: {message}" in bad.output


def test_unknown_names_are_errors_not_fallbacks(records):
    items = [dict(r, response="x") for r in records[:3]]
    with pytest.raises(UnknownNameError, match=r"unknown judge 'gpt4'; choose from rules, openai$"):
        JudgeConfig(name="gpt4")
    with pytest.raises(UnknownNameError, match="unknown judge 'gpt4'"):
        score(items, judge="gpt4", metrics=None)
    config = JudgeConfig()
    config.name = "gone"            # e.g. a judge unregistered after its config was built: no openai fallback
    with pytest.raises(UnknownNameError, match="unknown judge 'gone'"):
        judge(items, config)
    with pytest.raises(UnknownNameError, match="unknown metrics 'blue', 'rouge3'; choose from bleu, rouge, meteor"):
        MetricConfig(groups=("blue", "rouge3"))
    with pytest.raises(UnknownNameError, match="unknown metric 'blue'"):
        parse_metrics("bleu,blue")
    assert parse_metrics("none") == parse_metrics("") == () and parse_metrics(" bleu, rouge ") == ("bleu", "rouge")
    assert issubclass(UnknownNameError, RolemrcError) and issubclass(UnknownNameError, ValueError)
    with pytest.raises(InputError, match="the openai judge needs a model and a base URL"):
        JudgeConfig(name="openai")


def test_registry_register_get_unregister():
    things: Registry[int] = Registry("thing")
    things.register("one")(1)
    things.register("two")(2)
    assert things.names() == ("one", "two") and things.get("two") == 2 and "one" in things
    with pytest.raises(ValueError, match="thing 'one' is already registered"):
        things.register("one")(3)
    assert things.unregister("one") == 1 and things.names() == ("two",)
    with pytest.raises(UnknownNameError, match="unknown thing 'one'; choose from two"):
        things.get("one")


def test_metric_metadata_drives_the_display_scale():
    assert {n: (METRICS.get(n).scale, METRICS.get(n).higher_is_better) for n in METRICS.names()} == {
        "bleu": (1.0, True), "rouge": (100.0, True), "meteor": (100.0, True), "bertscore": (100.0, True)}
    assert (metric_scale("bleu"), metric_scale("rougeLsum"), metric_scale("unregistered")) == (1.0, 100.0, 100.0)

    @metric("chrf", scale=1.0)
    def chrf(hyps: list[str], refs: list[str], config: MetricConfig) -> Scores:
        return Scores({"chrf": [50.0] * len(hyps)}, "a score already on 0-100")

    try:
        stat = {"mean": 0.5, "lo": 0.25, "hi": 0.75}
        row = table3([("run", {"metrics": {"chrf": stat, "rouge1": stat}})]).splitlines()[2]
        assert row.startswith("| run | 0.5 [0.2, 0.8] | 50.0 [25.0, 75.0] |")
    finally:
        METRICS.unregister("chrf")
