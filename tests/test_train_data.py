"""Train data: record checks with counted skip reasons, the bad-share limit, mixing, the base corpus."""

import pytest
from fixtures import test_records as make_test_records
from train_fixtures import pair_records, profile_records, sft_records

from rolemrc.core.io import write_jsonl
from rolemrc.train.corpus import gather_corpus
from rolemrc.train.data import (
    BadRecord,
    DataError,
    DataReport,
    jsonl_files,
    load_examples,
    mix_in,
    pair_example,
    parse_mix,
    sft_example,
    sft_examples,
)

GOOD_PAIR = {"prompt": [{"role": "User", "content": "hi?"}], "chosen": "hello", "rejected": "go away"}


def test_release_format_roles_are_lower_cased():
    record = sft_records(1, capitalised=True)[0]
    roles = {t["role"] for t in sft_example(record)["messages"]}
    assert roles == {"system", "user", "assistant"}
    assert pair_example(GOOD_PAIR)["chosen"] == [{"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize("record, reason", [
    ({"conversations": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
     "empty or missing assistant reply"),
    ({"conversations": [{"role": "narrator", "content": "hi"}]}, "malformed turns"),
    ({"conversations": []}, "malformed turns"),
    ({"messages": []}, "malformed turns"),  # `messages` is an alias of `conversations` (core.records)
    ({"turns": [{"role": "user", "content": "hi"}]}, "no conversations field"),
])
def test_bad_sft_records(record, reason):
    with pytest.raises(BadRecord) as info:
        sft_example(record)
    assert info.value.reason == reason


@pytest.mark.parametrize("change, reason", [
    ({"chosen": None}, "missing chosen/rejected"),
    ({"rejected": ""}, "empty or missing rejected"),
    ({"rejected": "hello "}, "chosen equals rejected"),
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "prompt does not end with a user turn"),
])
def test_bad_pairs(change, reason):
    record = {**GOOD_PAIR, **change}
    with pytest.raises(BadRecord) as info:
        pair_example({k: v for k, v in record.items() if v is not None})
    assert info.value.reason == reason


def test_bad_records_are_counted_and_the_share_enforced(tmp_path):
    records = sft_records(8) + [{"conversations": [{"role": "user", "content": "x"}]}] * 2 + [{"id": "no-turns"}]
    write_jsonl(tmp_path / "sft.jsonl", records)
    report = DataReport()
    examples = load_examples(jsonl_files([tmp_path]), sft_example, report)
    assert len(examples) == 8 and report.total_skipped == 3
    assert report.as_dict()["reasons"] == {"no assistant turn": 2, "no conversations field": 1}
    assert "sft.jsonl:9" in report.summary()  # first offending line is named
    report.check(0.3, "SFT")  # 3/11 = 27%
    with pytest.raises(DataError, match=r"3 of 11 SFT records are bad \(27.3% > max_bad_share 10.0%\).*no assistant turn: 2"):
        report.check(0.1, "SFT")
    with pytest.raises(DataError, match="no usable SFT records"):
        DataReport().check(1.0, "SFT")


def test_missing_paths_are_clear(tmp_path):
    with pytest.raises(DataError, match="no such file or folder"):
        jsonl_files([tmp_path / "nope.jsonl"])
    with pytest.raises(DataError, match="is an empty folder"):
        jsonl_files([tmp_path])
    (tmp_path / "notes.txt").write_text("notes")
    with pytest.raises(DataError, match="holds no .jsonl files"):
        jsonl_files([tmp_path])


def test_mix_draws_a_share_of_the_main_size(tmp_path):
    main = [{"i": k} for k in range(10)]
    extra = [{"e": k} for k in range(3)]
    drawn = mix_in(main, extra, 0.5, seed=0)
    assert len(drawn) == 5 and {d["e"] for d in drawn} == {0, 1, 2}  # short extra is cycled through
    assert mix_in(main, extra, 0.5, seed=0) == drawn  # seeded
    write_jsonl(tmp_path / "main.jsonl", sft_records(10))
    write_jsonl(tmp_path / "extra.jsonl", sft_records(6, seed=9, capitalised=False))
    examples, mixture = sft_examples([str(tmp_path / "main.jsonl")], [f"{tmp_path / 'extra.jsonl'}:0.3"], 0, DataReport())
    assert len(examples) == 13 and mixture[str(tmp_path / "extra.jsonl")] == {"ratio": 0.3, "available": 6, "drawn": 3}


@pytest.mark.parametrize("spec", ["extra.jsonl", "extra.jsonl:zero", "extra.jsonl:-1", ":0.3"])
def test_bad_mix_specs(spec):
    with pytest.raises(DataError, match="PATH:RATIO"):
        parse_mix(spec)
    assert parse_mix("C:/data/x.jsonl:0.25")[1] == 0.25


def test_corpus_holds_out_test_records(tmp_path):
    write_jsonl(tmp_path / "sft.jsonl", sft_records(6))
    write_jsonl(tmp_path / "pairs.jsonl", [*pair_records(4), pair_records(1)[0]])
    write_jsonl(tmp_path / "test.jsonl", make_test_records(5))
    write_jsonl(tmp_path / "profiles.jsonl", profile_records(2))
    write_jsonl(tmp_path / "junk.jsonl", [{"what": 1}])
    report = DataReport()
    corpus = gather_corpus(jsonl_files([tmp_path]), report)
    assert len(corpus.chats) == 6 + 4  # the repeated pair is counted once
    assert len(corpus.plain) == 2
    test_text = make_test_records(5)[0]["question"][1]["content"]
    assert test_text in corpus.texts  # the tokenizer sees the test vocabulary ...
    assert all(test_text not in t["content"] for chat in corpus.chats for t in chat)  # ... but no test conversation
    assert report.as_dict()["reasons"] == {"unknown record kind": 1}


@pytest.mark.parametrize("stage", ["sft", "dpo"])
@pytest.mark.parametrize("content, message", [
    (None, "no such file or folder"),
    ('{"prompt": 1}\nnot json\n', r"bad.jsonl:2: invalid JSON"),
    ('{"id": 1}\n', r"no usable (SFT|preference) records"),
])
def test_data_is_checked_before_the_model_loads(tmp_path, stage, content, message):
    """The model directory does not exist: the data error must come first."""
    from rolemrc.core.errors import RolemrcError
    from rolemrc.train import DPOTrainConfig, SFTTrainConfig, make_config, train_dpo, train_sft

    data = tmp_path / "bad.jsonl"
    if content is not None:
        data.write_text(content)
    cls, train = {"sft": (SFTTrainConfig, train_sft), "dpo": (DPOTrainConfig, train_dpo)}[stage]
    config = make_config(cls, model=str(tmp_path / "no-model"), data=[str(data)], out=str(tmp_path / "o"))
    with pytest.raises(DataError, match=message) as caught:
        train(config)
    assert isinstance(caught.value, RolemrcError) and isinstance(caught.value, ValueError)
