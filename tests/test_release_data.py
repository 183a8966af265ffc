"""The real RoleMRC release: its task histogram, and record files without `id` or with other field names
(`conversations`/`prompt`/`messages` for the turns, `chosen`/`answer`/`target` for the gold reply)."""

import json

import pytest
from train_fixtures import sft_records
from typer.testing import CliRunner

from rolemrc.cli import app
from rolemrc.core.io import read_jsonl
from rolemrc.core.records import RecordError, normalize_record, prompt_turns, read_records
from rolemrc.core.taxonomy import TASK_COUNTS
from rolemrc.eval.dataset import DatasetDrift, check_dataset
from rolemrc.train.data import DataReport, load_examples, pair_example, sft_example

# The histogram of the release's roleMRC_test.jsonl, as NeMo-Gym's RoleMRC server pins it (written out here,
# not read from TASK_COUNTS, so a swapped row fails).
RELEASE_HISTOGRAM = {
    "role_related_mrc_answer_with_narration-special-content": 58,
    "role_related_mrc_answer_no_narration-special-content": 58,
    "role_related_mrc_answer_with_narration-refused": 22,
    "role_related_mrc_answer_with_narration-special-format": 20,
    "role_related_mrc_answer_no_narration-refused": 20,
    "role_related_mrc_answer_no_narration-special-format": 22,
    **{f"role_{rel}_mrc_{act}_{narr}_narration": 100
       for rel in ("related", "unrelated") for act in ("answer", "refused") for narr in ("with", "no")},
    **{f"role_related_mrc_refused_{narr}_narration-2ndrefused": 100 for narr in ("with", "no")},
    **{f"role_unrelated_mrc_refused_{narr}_narration-2ndanswer": 100 for narr in ("with", "no")},
}
QUESTION = [{"role": "System", "content": "You are the keeper of the lighthouse"},
            {"role": "User", "content": "why do the storms roll over grey water?"}]
RELEASE_FIELDS = {"turns": "question", "reference": "reference", "id": "line number"}


def write_lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def release_file(tmp_path):
    """1,400 test rows in the release's own format: capitalised roles, no `id`."""
    rows = [{"question": QUESTION, "reference": "because the wind turns", "task": task}
            for task, n in RELEASE_HISTOGRAM.items() for _ in range(n)]
    return write_lines(tmp_path / "roleMRC_test.jsonl", rows)


def test_histogram_is_the_release_one():
    assert len(RELEASE_HISTOGRAM) == 18 and sum(RELEASE_HISTOGRAM.values()) == 1400
    assert TASK_COUNTS == RELEASE_HISTOGRAM


def test_release_file_passes_the_dataset_check(release_file, tmp_path):
    records, fields = read_records(release_file)
    assert len(records) == 1400 and fields == RELEASE_FIELDS
    assert check_dataset(records, "rolemrc")["drift"] == {}
    swapped = [{**r, "task": r["task"].replace("-refused", "-special-format")} if r["task"].endswith("-refused")
               else r for r in records]   # the old table's mistake, in reverse
    with pytest.raises(DatasetDrift, match=r"no_narration-special-format: expected 22, found 42"):
        check_dataset(swapped, "rolemrc")


def test_cli_accepts_the_release_file(release_file, model_dirs, tmp_path):
    """`eval run --dataset rolemrc` gets past the histogram check to the model (a missing one here, to stay
    fast); the same file with one row short stops at the check. Generation itself: the next tests."""
    base = ["eval", "run", "--out", str(tmp_path / "run"), "--model", str(tmp_path / "no-model"), "--dataset", "rolemrc"]
    result = CliRunner().invoke(app, [*base, "--data", str(release_file)])
    assert result.exit_code == 2 and "no-model: no such directory" in result.output, result.output
    assert "fields used: turns=question, reference=reference, id=line number" in result.output
    short = write_lines(tmp_path / "short.jsonl", read_jsonl(release_file)[1:])
    result = CliRunner().invoke(app, [*base, "--data", str(short)])
    assert result.exit_code == 2 and "with_narration-special-content: expected 58, found 57" in result.output


@pytest.mark.parametrize("record, kind, turns, reference, fields", [
    ({"question": QUESTION, "reference": "r", "task": "t"}, "test", QUESTION, "r", RELEASE_FIELDS),
    ({"id": 7, "messages": [*QUESTION, {"role": "Assistant", "content": "a"}]}, "test", QUESTION, "a",
     {"turns": "messages", "reference": "last assistant turn of messages", "id": "id"}),
    ({"conversations": QUESTION, "answer": "a"}, "test", QUESTION, "a",
     {"turns": "conversations", "reference": "answer", "id": "line number"}),
    ({"prompt": "why?", "target": "a"}, "test", [{"role": "user", "content": "why?"}], "a",
     {"turns": "prompt", "reference": "target", "id": "line number"}),
    ({"prompt": QUESTION, "chosen": "a", "rejected": "b"}, "test", QUESTION, "a",
     {"turns": "prompt", "reference": "chosen", "id": "line number"}),
    ({"question": "why?", "chosen": [{"role": "Assistant", "content": "a"}], "rejected": "b"}, "pair",
     [{"role": "user", "content": "why?"}], "a", {"turns": "question", "reference": "chosen", "id": "line number"}),
    ({"messages": QUESTION, "answer": "a"}, "sft", [*QUESTION, {"role": "assistant", "content": "a"}], None,
     {"turns": "messages", "reference": "answer", "id": "line number"}),
])
def test_aliases_give_canonical_records(record, kind, turns, reference, fields):
    canonical, used = normalize_record(record, 17, kind)
    name = {"test": "question", "pair": "prompt", "sft": "conversations"}[kind]
    assert canonical[name] == [{"role": t["role"].lower(), "content": t["content"]} for t in turns]
    assert canonical.get({"test": "reference", "pair": "chosen"}.get(kind, "")) == reference
    assert used.as_dict() == fields and canonical["fields"] == fields
    assert canonical["id"] == record.get("id", "line-17")
    assert normalize_record(canonical, 17, kind)[0] == canonical   # canonical records pass through unchanged


def test_prompt_turns_reads_every_alias():
    reply = {"role": "assistant", "content": "a"}
    lowered = [{"role": t["role"].lower(), "content": t["content"]} for t in QUESTION]
    for field in ("question", "prompt", "conversations", "messages"):
        assert prompt_turns({field: [*QUESTION, reply]}) == lowered
    assert prompt_turns({"prompt": "why?"}) == [{"role": "user", "content": "why?"}]
    with pytest.raises(RecordError, match="no 'question', 'prompt', 'conversations' or 'messages' field"):
        prompt_turns({"text": "x"})
    with pytest.raises(RecordError, match="messages has no turn before its last assistant turn"):
        prompt_turns({"messages": [reply]})


def test_bad_records_name_file_and_line(tmp_path, model_dirs):
    path = write_lines(tmp_path / "t.jsonl", [{"question": QUESTION, "reference": "r"}, {"answer": "no turns"}])
    with pytest.raises(RecordError, match=r"t.jsonl:2: no 'question'"):
        read_records(path)
    result = CliRunner().invoke(app, ["eval", "generate", "--data", str(path), "--out", str(tmp_path / "o.jsonl"),
                                      "--model", str(model_dirs["llama"])])
    assert result.exit_code == 2 and "t.jsonl:2: no 'question'" in result.output


def test_eval_run_on_messages_dump_records_the_fields(tmp_path, model_dirs):
    rows = [{"messages": [*QUESTION, {"role": "assistant", "content": f"answer {k}"}], "task": task}
            for k, task in enumerate(list(RELEASE_HISTOGRAM)[:4])]
    data = tmp_path / "dump.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[2:]) + "\n")
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["eval", "run", "--data", str(data), "--out", str(out), "--model", str(model_dirs["llama"]),
                                      "--max-new-tokens", "2", "--metrics", "bleu", "--rounds", "20",
                                      "--dataset", "rolemrc", "--allow-drift"])
    assert result.exit_code == 0, result.output
    expected = {"turns": "messages", "reference": "last assistant turn of messages", "id": "line number"}
    assert "fields used: turns=messages, reference=last assistant turn of messages, id=line number" in result.output
    assert json.loads((out / "report.json").read_text())["fields"] == expected
    responses = read_jsonl(out / "responses.jsonl")
    assert [r["id"] for r in responses] == ["line-1", "line-2", "line-4", "line-5"]   # line 3 is blank
    assert [r["reference"] for r in responses] == [f"answer {k}" for k in range(4)]
    assert all(r["question"][-1]["role"] == "user" for r in responses)


def test_eval_run_limit_uses_the_first_cases_and_says_so(tmp_path, model_dirs):
    rows = [{"messages": [*QUESTION, {"role": "assistant", "content": f"answer {k}"}], "task": task}
            for k, task in enumerate(list(RELEASE_HISTOGRAM)[:4])]
    data = tmp_path / "dump.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["eval", "run", "--data", str(data), "--out", str(out), "--model", str(model_dirs["llama"]),
                                      "--max-new-tokens", "2", "--metrics", "bleu", "--rounds", "20", "--limit", "3"])
    assert result.exit_code == 0, result.output
    assert [r["reference"] for r in read_jsonl(out / "responses.jsonl")] == [f"answer {k}" for k in range(3)]
    assert json.loads((out / "report.json").read_text())["limit"] == 3
    assert "3 items (`--limit 3`: the first of the data, a quick run)" in (out / "report.md").read_text()


def test_train_reads_aliases_and_reports_the_fields(tmp_path, capsys):
    sft = write_lines(tmp_path / "sft.jsonl", [{"messages": r["conversations"]} for r in sft_records(3)]
                      + [{"prompt": "why?", "answer": "because"}])
    report = DataReport()
    examples = load_examples([sft], sft_example, report)
    assert len(examples) == 4 and examples[-1] == {"messages": [{"role": "user", "content": "why?"},
                                                                {"role": "assistant", "content": "because"}]}
    assert report.as_dict()["fields"] == {str(sft): {"turns": "messages|prompt", "reference": "absent|answer",
                                                     "id": "line number"}}
    assert f"note: {sft}: fields used: turns=messages|prompt, reference=absent|answer" in capsys.readouterr().err
    pairs = write_lines(tmp_path / "pairs.jsonl", [{"id": "p", "prompt": "why?", "target": "because", "rejected": "no"},
                                                   {"question": QUESTION, "answer": "yes", "rejected": "no"}])
    report = DataReport()
    examples = load_examples([pairs], pair_example, report)
    assert [e["chosen"][0]["content"] for e in examples] == ["because", "yes"]
    assert examples[0]["prompt"] == [{"role": "user", "content": "why?"}]
    assert report.as_dict()["fields"][str(pairs)] == {"turns": "prompt|question", "reference": "target|answer",
                                                     "id": "id|line number"}
    assert f"note: {pairs}: fields used: turns=prompt|question" in capsys.readouterr().err
    canonical_pairs = write_lines(tmp_path / "canon.jsonl", [{"id": "p", "prompt": QUESTION, "chosen": "a", "rejected": "b"}])
    load_examples([canonical_pairs], pair_example, DataReport())
    assert "note:" not in capsys.readouterr().err   # canonical files need no note
