"""The canary's and status's view of the async proxy (unit tier): its counters read from
where each engine rank serves them, and judged over the canary — rounds answered, none
failed or bad, no watchdog fire or respawn, still enabled; DEGRADED otherwise."""

import socket

import pytest

from async_handoff.exposition import serve
from dsv41_stack.cli import report_canary
from dsv41_stack.config import StackConfig
from dsv41_stack.deployment import (
    Deployment,
    drafts_made,
    engram_degraded,
    handoff_degraded,
    handoff_moved,
)
from longctx_bench.launch import free_port

LISTEN = "127.0.0.1:9496"
CLEAN = {"rounds_ok": 10.0, "rounds_failed": 0.0, "rounds_bad": 0.0, "rounds_timed_out": 0.0,
         "watchdog_fires": 0.0, "respawns": 0.0, "enabled": 1.0}


def moved_by(**changes) -> tuple[dict, dict]:
    after = {**CLEAN, **{k: CLEAN[k] + v for k, v in changes.items()}}
    return handoff_moved(CLEAN, after), after


@pytest.mark.parametrize("changes, degraded", [
    ({"rounds_ok": 5}, []),
    ({"rounds_ok": 5, "rounds_timed_out": 2}, []),  # abandoned at a request's end: not a failure
    ({}, []),  # no round answered: drafts_made's "no drafts made"
    ({"rounds_ok": 5, "rounds_failed": 1}, ["async proxy rounds failed +1"]),
    ({"rounds_ok": 5, "rounds_bad": 2}, ["async proxy rounds bad +2"]),
    ({"rounds_ok": 5, "watchdog_fires": 1, "respawns": 1},
     ["async proxy watchdog fires +1", "async proxy respawns +1"]),
    ({"rounds_ok": 5, "enabled": -1}, ["async proxy disabled"]),
])
def test_the_proxy_counters_judged_over_the_canary(changes, degraded):
    moved, after = moved_by(**changes)
    assert handoff_degraded(moved, after, LISTEN) == degraded


def test_drafts_through_the_async_proxy_are_proven_by_answered_rounds_not_vllms_counter():
    """A failed round leaves placeholders that vLLM counts as drafts: under the async
    handoff only rounds answered prove drafting; synchronous rounds count vLLM's drafts."""
    placeholders_only = {"num_drafts": 40.0}
    assert not drafts_made(placeholders_only, handoff_moved(CLEAN, CLEAN), asynchronous=True)
    assert not drafts_made(placeholders_only, None, asynchronous=True)  # unreadable: unproven
    assert drafts_made(placeholders_only, moved_by(rounds_ok=3)[0], asynchronous=True)
    assert drafts_made(placeholders_only, None, asynchronous=False)
    assert not drafts_made({}, None, asynchronous=False)


def test_unserved_or_unreadable_counters_are_degraded():
    assert handoff_degraded(None, None, "") == [
        "async proxy counters not served: set ASYNC_HANDOFF_METRICS_LISTEN"]
    assert handoff_moved(None, CLEAN) is None
    assert handoff_degraded(None, CLEAN, LISTEN) == [f"async proxy counters unreadable at {LISTEN}"]


def exposition(counters: dict) -> str:
    kinds = {"enabled": "gauge"}
    return "".join(f"# TYPE async_handoff_{k}{'' if k in kinds else '_total'} {kinds.get(k, 'counter')}\n"
                   f"async_handoff_{k}{'' if k in kinds else '_total'} {v}\n" for k, v in counters.items())


def test_each_rank_is_read_where_it_serves():
    """One host: rank 0 at the address; two hosts: rank r at the port + r (its own host)."""
    port = free_port(span=2)  # rank r's counters at port + r
    servers = [serve(lambda r=r: exposition({**CLEAN, "rounds_ok": 100.0 + r}), f"127.0.0.1:{port + r}")
               for r in (0, 1)]
    base = {"ASYNC_HANDOFF_METRICS_LISTEN": f"127.0.0.1:{port}", "VLLM_DSPARK_REMOTE_ASYNC": "1",
            "REMOTE_DRAFTER_ADDRESS": "127.0.0.1:1", "STACK_NUM_SPEC_TOKENS": "3"}
    try:
        one = Deployment(StackConfig(base))
        assert one.async_on() and one.handoff_counters() == {**CLEAN, "rounds_ok": 100.0}
        two = Deployment(StackConfig({**base, "STACK_TP": "2", "STACK_ENGINE_NODES": "2",
                                      "STACK_ENGINE_MASTER": "127.0.0.1:29501"}))
        assert two.handoff_counters(1)["rounds_ok"] == 101.0
        assert two.handoff_listen(1) == f"127.0.0.1:{port + 1}"
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
    assert one.handoff_counters() is None  # nothing answers: None (the canary: unreadable)
    assert not Deployment(StackConfig({**base, "VLLM_DSPARK_REMOTE_ASYNC": "0"})).async_on()


def test_engram_counters_unreadable_or_moved_are_degraded():
    engram = "127.0.0.1:9490"
    assert engram_degraded("", None, None) == []  # not served: not checked (and not claimed)
    assert engram_degraded(engram, None, {}) == engram_degraded(engram, {}, None) == [
        f"Engram counters unreadable at {engram}"]
    assert engram_degraded(engram, {}, {"rows_remote": 900.0}) == []  # a counter appears when first counted
    assert engram_degraded(engram, {"fallbacks": 2.0}, {"fallbacks": 5.0, "remote_failures": 1.0}) == [
        "Engram fallbacks +3", "Engram remote_failures +1"]
    with socket.socket() as s:  # a port nothing serves: unreadable, so the canary cannot say "no fallback"
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"
    assert Deployment(StackConfig({"ENGRAM_METRICS_LISTEN": nobody})).engram_counters() is None


def test_the_canary_report_names_the_proxy(capsys):
    result = {"ok": True, "recorded": False, "fingerprint": "a" * 64, "reference": "a" * 64,
              "degraded": [], "handoff": moved_by(rounds_ok=7)[0], "checked": ["drafts made"]}
    assert report_canary(result) == 0
    assert "canary: ok, counters fresh (drafts made)" in capsys.readouterr().out
    assert report_canary(result) == 0
    assert "canary: async proxy ok: 7 rounds answered, 0 failed, 0 watchdog fires, 0 respawns" \
        in capsys.readouterr().out
    result.update(ok=False, degraded=["async proxy watchdog fires +1"])
    assert report_canary(result) == 1
    assert "canary: DEGRADED: async proxy watchdog fires +1" in capsys.readouterr().out


def test_prompts_answered_with_errors_or_nothing_are_not_a_fingerprint(capsys):
    from longctx_bench.runner import EMPTY_DIGEST, fingerprint_errors
    good = "ab" * 32
    got = {"p1": good, "p2": 'HTTP 500: {"error": "EngineCore encountered an issue"}',
           "p3": EMPTY_DIGEST, "all": "cd" * 32}
    assert fingerprint_errors(got) == {"p2": got["p2"], "p3": "no output"}
    assert fingerprint_errors({"p1": good, "all": good}) == {}
    result = {"ok": False, "recorded": False, "fingerprint": "cd" * 32, "degraded": [],
              "handoff": None, "errors": fingerprint_errors(got)}
    assert report_canary(result) == 1
    out = capsys.readouterr().out
    assert "canary: FAILED, 2 prompts not answered (nothing recorded); 'p2': HTTP 500" in out
    assert "recorded the reference" not in out and "counters fresh" not in out
