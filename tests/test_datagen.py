"""datagen with the offline template backend: sources, retrieval, synthesis, export, resume."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest
from datagen_fixtures import read_outputs, small_pool

from rolemrc.core.io import JsonlError, read_jsonl, write_jsonl
from rolemrc.core.records import normalize_turns, prompt_turns
from rolemrc.core.taxonomy import TASK_COUNTS, TASKS
from rolemrc.datagen.config import DatagenConfig
from rolemrc.datagen.pipeline import ResumeMismatch, allocate, run
from rolemrc.datagen.profiles import COMPONENTS, ProfileError, validate_profile
from rolemrc.datagen.replies import ReplySpec, Rule, check_reply
from rolemrc.datagen.retrieval import extremes
from rolemrc.datagen.sources import load_personas, load_triplets


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    return small_pool(tmp_path_factory.mktemp("pool") / "mrc.jsonl")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, pool):
    out = tmp_path_factory.mktemp("dg") / "run"
    result = run(DatagenConfig(out=out, size="tiny", mrc=pool, progress=False))
    return out, result


# --- bundled data and loaders ---------------------------------------------------------------

def test_bundled_sample_sizes_and_variety():
    personas, triplets = load_personas(), load_triplets()
    assert len(personas) >= 200 and len({p["persona"] for p in personas}) == len(personas)
    assert len(triplets) >= 300
    unanswerable = sum(t["answer"] is None for t in triplets)
    assert unanswerable / len(triplets) >= 0.2
    assert len({t["domain"] for t in triplets}) >= 30
    assert len({t["question"] for t in triplets}) == len(triplets)
    for t in triplets:
        if t["answer"] is not None:  # an answerable question's answer is grounded in its passages
            words = {w.strip(".,'").lower() for w in " ".join(t["passages"]).split()}
            answer_words = [w.strip(".,'").lower() for w in t["answer"].split()]
            assert sum(w in words for w in answer_words) >= len(answer_words) / 2, t["id"]


def test_personahub_and_msmarco_loaders(tmp_path):
    hub = tmp_path / "hub.jsonl"
    write_jsonl(hub, [{"persona": "A weaver  who dyes silk."}, {"persona": "A pilot."}])
    assert load_personas(hub) == [{"id": "p1", "persona": "A weaver who dyes silk."}, {"id": "p2", "persona": "A pilot."}]
    rows = [{"query_id": 7, "query": "what is x", "passages": {"is_selected": [1, 0], "passage_text": ["x is y.", "z"]},
             "answers": ["y"]},
            {"query_id": 8, "query": "what is q", "passages": {"is_selected": [0], "passage_text": ["w"]},
             "answers": ["No Answer Present."]}]
    marco = tmp_path / "marco.jsonl"
    write_jsonl(marco, rows)
    expected = [{"id": "7", "passages": ["x is y.", "z"], "question": "what is x", "answer": "y"},
                {"id": "8", "passages": ["w"], "question": "what is q", "answer": None}]
    assert load_triplets(marco) == expected
    import pandas as pd

    pd.DataFrame(rows).to_parquet(tmp_path / "marco.parquet")
    assert load_triplets(tmp_path / "marco.parquet") == expected


def test_bad_sources_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"persona": "ok"}\n{"name": "no persona"}\n')
    with pytest.raises(JsonlError, match=r"bad.jsonl:2: .*persona"):
        load_personas(bad)
    bad.write_text('{"passages": ["p"], "question": "q", "answer": ""}\n')
    with pytest.raises(JsonlError, match=r"bad.jsonl:1: .*answer"):
        load_triplets(bad)
    bad.write_text('{"passages": "not a list", "question": "q", "answer": null}\n')
    with pytest.raises(JsonlError, match="passages"):
        load_triplets(bad)


# --- retrieval -----------------------------------------------------------------------------

def _unit(rng, n, d=32):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_flat_extremes_match_numpy():
    rng = np.random.default_rng(0)
    q, k = _unit(rng, 50), _unit(rng, 500)
    ex = extremes(q, k, "flat")
    scores = q @ k.T
    np.testing.assert_array_equal(ex.top, scores.argmax(1))
    np.testing.assert_array_equal(ex.bottom, scores.argmin(1))
    np.testing.assert_allclose(ex.bottom_score, scores.min(1), rtol=1e-5, atol=1e-5)


def test_ivf_extremes_are_close_to_exact():
    rng = np.random.default_rng(1)
    q, k = _unit(rng, 40), _unit(rng, 2000)
    scores = q @ k.T
    ex = extremes(q, k, "ivf", nlist=16, nprobe=16)  # probing every list is exact
    np.testing.assert_array_equal(ex.top, scores.argmax(1))
    np.testing.assert_array_equal(ex.bottom, scores.argmin(1))
    approx = extremes(q, k, "ivf", nlist=16, nprobe=2)
    assert np.all(approx.top_score <= scores.max(1) + 1e-5) and np.all(approx.bottom_score >= scores.min(1) - 1e-5)


# --- replies ---------------------------------------------------------------------------------

PROFILE = {"id": "x", "name": "Ana", "persona": "A baker.", "components": dict.fromkeys(COMPONENTS, "c"), "text": "t"}


@pytest.mark.parametrize("text,spec_kw,reason", [
    ("", {}, "empty reply"),
    ("(smiles) Hello.", {"narration": False}, "narration where none is allowed"),
    ("(smiles) Hello.", {"narration": True}, None),
    ("Hello.", {"narration": True}, "narration missing"),
    ("Hello there.", {"narration": True, "rule": Rule("max_words", "max 4", 4)}, None),
    ("User: hi", {}, "speaks for another role"),
    ("I have no idea.", {"intent": "answer", "answer": "forty two loaves"}, "answer missing"),
    ("It was forty two loaves.", {"intent": "answer", "answer": "forty two loaves"}, None),
    ("(smiles) It was forty two loaves.", {"intent": "answer", "answer": "forty two loaves", "narration": True}, None),
    ("The answer is (forty two loaves)", {"intent": "answer", "answer": "forty two loaves", "narration": True},
     "answer missing"),                                                      # narrated, not said
    ("I will never forget my end.\nI love it.\nI will never forget my end.", {}, "repeats itself"),
    ("12 people controlled 1000 games.", {"intent": "insist_refuse"}, "refusal missing"),   # an invented answer
    ("(shakes head) The page won't tell us that.", {"intent": "insist_refuse", "narration": True}, None),
    ("Sorry, that is beyond me.", {"intent": "refuse_outside"}, None),
    ("I should not say, but closely spaced contours show steep ground.",                   # declines in word only
     {"intent": "refuse_directive", "question": "What do closely spaced contours show?", "answer": "steep ground"},
     "answers when it should decline"),
    ("The ground here is not mine to read, sorry.",                                     # one of two answer words
     {"intent": "refuse_directive", "question": "What do closely spaced contours show?", "answer": "steep ground"}, None),
    ("I am not allowed to talk about contours, sorry.",                                   # the question's words
     {"intent": "refuse_directive", "question": "What do closely spaced contours show?", "answer": "closely spaced contours"},
     None),
    ("Geography is outside my trade, sorry.",                                             # the topic's words
     {"intent": "refuse_outside", "question": "What do contours show?", "answer": "geography", "topic": "geography"}, None),
    ("Quiet, please.", {"rule": Rule("upper", "caps")}, "breaks rule upper"),
    ("QUIET, PLEASE.", {"rule": Rule("upper", "caps")}, None),
    ("one, two", {"rule": Rule("no_commas", "no commas")}, "breaks rule no_commas"),
    ("a b c d e", {"rule": Rule("max_words", "max 4", 4)}, "breaks rule max_words"),
    ("Bye. Stay curious!", {"rule": Rule("signoff", "end", "Stay curious!")}, None),
    ("Hello \U0001F31F", {"rule": Rule("emoji_start", "emoji")}, "breaks rule emoji_start"),
    ("How about this? I am writing this. How about this? I am writing this. I am writing this.", {}, "repeats itself"),
    ("You may describe your future.\nYou may describe your future.\nYou may describe your future.", {},
     "repeats itself"),
    (" ".join(["the sea the salt the wind"] * 8), {}, "repeats itself"),
    ("Good day. Good day. Good day. Fine bread today.", {}, None),          # short sentences may recur
    ("Sure. Write only the reply itself: the loaves are ready.", {}, "echoes the instructions"),
    ("I am Ana. Stay in character as described below.", {}, "echoes the instructions"),
])
def test_check_reply(text, spec_kw, reason):
    kw = {"intent": "chat", "narration": False, **spec_kw}
    assert check_reply(ReplySpec(profile=PROFILE, **kw), text) == reason


def test_allocate_keeps_published_proportions():
    counts = allocate(1400, TASK_COUNTS, cap=10_000)
    assert counts == TASK_COUNTS
    small = allocate(144, TASK_COUNTS, cap=12)
    assert sum(small.values()) == 144 and min(small.values()) >= 1 and max(small.values()) <= 12


# --- the template pipeline -------------------------------------------------------------------

def test_outputs_have_design_shapes(tiny_run):
    out, result = tiny_run
    profiles = read_jsonl(out / "profiles.jsonl")
    assert profiles and all(set(p["components"]) == set(COMPONENTS) and p["text"] for p in profiles)
    sft, pairs, test = (read_jsonl(out / f"{n}.jsonl") for n in ("sft", "pairs", "test"))
    assert len(sft) > 50 and len(pairs) > 40
    for r in sft:
        turns = normalize_turns(r["conversations"])
        assert turns[0]["role"] == "system" and turns[-1]["role"] == "assistant"
    for r in pairs:
        assert prompt_turns(r)[-1]["role"] == "user" and r["chosen"] != r["rejected"]
    assert {r["task"] for r in test} == set(TASKS)  # all 18 names, exactly
    for r in test:
        assert prompt_turns(r)[-1]["role"] == "user" and r["reference"]
    ids = [r["id"] for f in (sft, pairs, test) for r in f]
    assert len({r["id"] for r in sft}) == len(sft) and len({r["id"] for r in test}) == len(test)
    assert ids
    test_profiles = {r["id"].split("/")[0] for r in test}
    train_profiles = {r["id"].split("/")[0] for r in sft}
    assert not test_profiles & train_profiles  # held out by profile
    assert result["stats"]["dropped"] == {"profiles": {}, "synthesis": {}}


def test_replies_follow_their_task(tiny_run):
    out, _ = tiny_run
    sft = read_jsonl(out / "sft.jsonl")
    by_task = Counter(r["task"] for r in sft)
    assert any(t.startswith("free_chat") for t in by_task) and any(t.startswith("on_scene") for t in by_task)
    for r in sft:
        replies = [t["content"] for t in r["conversations"] if t["role"] == "assistant"]
        if "no_narration" in r["task"]:
            assert not any("(" in x for x in replies), r["id"]
        elif "with_narration" in r["task"] and not r["task"].endswith("special-format"):   # word limits drop it
            assert all("(" in x for x in replies), r["id"]
    pairs = read_jsonl(out / "pairs.jsonl")
    for p in pairs:
        if p["task"].startswith("role_related_mrc_refused"):
            assert p["rejected"] == "No Answer Present."
    test = read_jsonl(out / "test.jsonl")
    for r in test:
        if r["task"].endswith("-2ndanswer") or r["task"].endswith("-2ndrefused"):
            assert len([t for t in r["question"] if t["role"] == "user"]) == 2


def test_stats_table(tiny_run):
    out, _result = tiny_run
    stats = json.loads((out / "stats.json").read_text())
    assert stats["table"]["sft"]["all"]["count"] == len(read_jsonl(out / "sft.jsonl"))
    assert sum(stats["test_tasks"].values()) == len(read_jsonl(out / "test.jsonl"))
    md = (out / "stats.md").read_text()
    assert "| sft | single-turn MRC |" in md and "words/reply" in md


def test_rerun_and_torn_journal_resume_give_identical_files(tiny_run, tmp_path, pool):
    out, _ = tiny_run
    expected = read_outputs(out)
    # same settings in a fresh directory: identical bytes (deterministic)
    fresh = tmp_path / "fresh"
    run(DatagenConfig(out=fresh, size="tiny", mrc=pool, progress=False))
    assert read_outputs(fresh) == expected
    # simulate a kill: drop the outputs, keep half the synthesis journal plus a torn line
    journal = fresh / "work" / "items.jsonl"
    lines = journal.read_bytes().splitlines(keepends=True)
    journal.write_bytes(b"".join(lines[: len(lines) // 2]) + lines[len(lines) // 2][:40])
    for name in expected:
        (fresh / name).unlink()
    run(DatagenConfig(out=fresh, size="tiny", mrc=pool, progress=False))
    assert read_outputs(fresh) == expected
    assert len(journal.read_bytes().splitlines()) == len(lines)  # no duplicates in the journal


def test_resume_refuses_other_settings(tiny_run, tmp_path, pool):
    out, _ = tiny_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    with pytest.raises(ResumeMismatch, match="seed"):
        run(DatagenConfig(out=copy, size="tiny", seed=1, mrc=pool, progress=False))


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="--size"):
        DatagenConfig(size="huge")
    with pytest.raises(ValueError, match="base-url"):
        DatagenConfig(backend=__import__("rolemrc.datagen.config", fromlist=["BackendConfig"]).BackendConfig(name="openai"))


GOOD_PROFILE = {
    "name_and_description": "Aino, a falconer from Kuopio who trains goshawks.",
    "abilities_and_skills": "Reads the weather from the wind; fits jesses and hoods.",
    "speech_style": "Short sentences, dry humour.",
    "personality": "Patient, stubborn, kind to animals.",
    "background": "Grew up on a farm; apprenticed to an old falconer.",
    "knowledge_boundaries": "Knows birds of prey, not city life or computers.",
    "speech_examples": "Hold still. The bird feels your fear.",
}


@pytest.mark.parametrize(("change", "reason"), [
    ({"background": "N/A"}, "placeholder component background"),
    ({"speech_style": "Speech_style"}, "placeholder component speech_style"),
    ({"personality": "Personality characteristics:"}, "placeholder component personality"),
    ({"background": "Aino", "personality": "Aino"}, "components repeat each other"),
    (dict.fromkeys(("background", "personality", "speech_style"), "A falconer."), "components repeat each other"),
])
def test_profiles_that_say_nothing_are_refused(change, reason):
    """The shape a JSON Schema guarantees is not enough: placeholders and repeated components are refused
    with a reason that the stats count."""
    assert validate_profile("Aino", GOOD_PROFILE) == ("Aino", GOOD_PROFILE)
    assert validate_profile("Aino", {**GOOD_PROFILE, "name_and_description": "Aino"})[0] == "Aino"  # once is fine
    with pytest.raises(ProfileError, match=reason):
        validate_profile("Aino", {**GOOD_PROFILE, **change})
