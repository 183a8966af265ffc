"""Issue 44's "one request can stall or exhaust the server", black-box over real HTTP: each oversized or quadratic
request of `rolemrc bench attacks` is answered with a 4xx naming its field, fast, with the server's RSS up < 50 MB,
while a concurrent stream keeps its pace; one key flooding the queue leaves room for another key. One server for the
module (the bench's own: keys KEY1 and KEY2, inline restraints, the experiment `attacks`); the bench reports the real
times, these bounds leave room for a loaded CI machine."""

import pytest

from rolemrc.bench.attacks import KEYS, RssSampler, Stream, attack_once, attacks, start_target

ANSWER_S = 1.0        # the target is 100 ms; `rolemrc bench attacks` measures it
RSS_MB = 50
MAX_QUEUE = 128       # the flood sends this many from KEY1: over max_queue_per_key (64 by default)
CLIENT_TIMEOUT_S = 10
REQUEST_TIMEOUT_S = 15   # the server's: the slow reader is cut off a second after it


@pytest.fixture(scope="module")
def attacked(model_dirs, tmp_path_factory):
    """(run, baseline): `run(name)` sends the named attack while the stream runs and returns its answers."""
    target = start_target(model_dirs["llama"], tmp_path_factory.mktemp("attacks"), MAX_QUEUE, REQUEST_TIMEOUT_S)
    chosen = attacks("tiny", 512, MAX_QUEUE, CLIENT_TIMEOUT_S, target.base_url,   # the fixture models' window: 512
                     request_timeout=REQUEST_TIMEOUT_S)
    try:
        with RssSampler(lambda: target.pid, 4096) as sampler, Stream(target.base_url, "tiny", KEYS[1]) as stream:
            stream.wait_for(20)
            start = stream.tokens[-1][1]
            stream.wait_for(len(stream.tokens) + 100)
            baseline = stream.gaps(start, stream.tokens[-1][1])
            yield (lambda name: attack_once(name, chosen[name], target, stream, sampler)), baseline
    finally:
        target.server.proc.kill()
        target.server.wait(30)


def stalled(answer, baseline) -> bool:
    """The stream's longest gap over the attack's window is past 1 s and 3x its baseline's."""
    return answer["stream_gap_max_ms"] >= max(1000, 3 * baseline["stream_gap_max_ms"])


def run_steady(run, baseline, attack):
    """`run(attack)`, sent once more if the stream stalled or the answer took ANSWER_S: a stall or a slow answer the
    attack causes recurs, one from a loaded machine (the other xdist workers, this process's own client) does not.
    The second answer is the one checked."""
    answers = run(attack)
    first = answers[attack]
    return run(attack) if stalled(first, baseline) or first.get("seconds", 0) >= ANSWER_S else answers


def check_cost(answer, baseline):
    """Answered within ANSWER_S, RSS up < RSS_MB, the stream kept its pace (see `stalled`)."""
    assert answer["seconds"] < ANSWER_S, answer
    assert answer["rss_growth_mb"] is not None and answer["rss_growth_mb"] < RSS_MB, answer
    assert not stalled(answer, baseline), (answer, baseline)
    assert not answer.get("server_restarted") and not answer.get("rss_cap_hit"), answer


def refused(answer, statuses, param=None, code=None):
    assert answer["status"] in statuses, answer
    assert param is None or answer["param"] == param, answer
    assert code is None or answer["code"] == code, answer


def test_no_max_tokens_with_ignore_eos_ends_at_default_max_tokens(attacked):
    run, baseline = attacked
    answer = run_steady(run, baseline, "no_max_tokens")["no_max_tokens"]
    assert answer["status"] == 200 and answer["finished"] and answer["tokens"] == 128, answer   # default_max_tokens
    assert not stalled(answer, baseline), (answer, baseline)


def test_echo_with_logprobs_at_the_context_window_stays_small(attacked):
    run, baseline = attacked
    answer = run_steady(run, baseline, "echo_logprobs_at_window")["echo_logprobs_at_window"]
    assert answer["status"] == 200, answer
    check_cost(answer, baseline)


def test_one_key_flooding_the_queue_leaves_room_for_another_key(attacked):
    run, _ = attacked
    answer = run("key_flood")["key_flood"]
    assert answer["status"] == 200, answer   # KEY2's request got in
    assert answer["flood"].get("429 key_queue_full", 0) >= MAX_QUEUE - 64 - 1, answer   # max_queue_per_key: 64
    assert "429 queue_full" not in answer["flood"], answer


@pytest.mark.parametrize(("attack", "statuses", "param", "code"), [
    ("chunked_body", {413}, None, "body_too_large"),
    ("long_stops", {400}, "stop", None),
    ("metadata", {400, 413}, "metadata", None),
    ("prompts_times_n", {400}, None, "too_many_choices"),   # last but one: before the limits it exhausts the server
])
def test_an_oversized_request_is_refused_naming_its_field_at_little_cost(attacked, attack, statuses, param, code):
    run, baseline = attacked
    answer = run_steady(run, baseline, attack)[attack]
    refused(answer, statuses, param, code)
    check_cost(answer, baseline)


def test_a_megabyte_of_duplicate_inline_units_is_refused_and_health_answers_meanwhile(attacked):
    run, baseline = attacked
    answers = run_steady(run, baseline, "inline_units")
    refused(answers["inline_units"], {400, 422}, param="restraint")
    check_cost(answers["inline_units"], baseline)
    health = answers["health_during_inline_units"]
    assert health["status"] == 200 and health["seconds"] < ANSWER_S, health


def test_what_a_request_holds_is_released_whatever_the_client_does(attacked):
    """Issue 53's attacks: streams abandoned before their first byte leave the same key served (no slot, share or
    claim leaked); a prompt at the window is served and one past it refused with the limit; a flood of registrations
    stops at the server's limit; a reader that never reads is cut off about a second past the deadline."""
    run, _ = attacked
    abandoned = run("abandoned_streams")["abandoned_streams"]
    assert abandoned["status"] == "served" and abandoned["rss_growth_mb"] < RSS_MB, abandoned
    prompt = run("long_prompt")["long_prompt"]
    assert prompt["status"] == 200 and prompt["over_the_window"]["code"] == "context_length_exceeded", prompt
    flood = run("registration_flood")["registration_flood"]
    assert flood["registrations"] == {"201": 256, "422 too_many_restraints": 44}, flood
    reader = run("slow_reader")["slow_reader"]
    assert reader["status"] == "cut off" and reader["probes"] == ["200"] * 3, reader
    assert reader["rss_growth_mb"] < RSS_MB, reader
