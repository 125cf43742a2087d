"""Fault drills on CPU: a rank killed or hung mid-serve stops the whole pair (rank 0 stops
serving and says why; clients fail closed and decoding stays exact); the supervisor
restarts the pair within its bound, then gives up with a clear message."""

import os
import signal
import subprocess
import threading
import time

import pytest

from drafter_tp2.launcher import free_master
from drafter_tp2.testing import RankPair, drafter_tp2, tp2_env, worker_args
from remote_drafter.decode_loop import plain_decode, speculative_decode
from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.identity import expectation
from remote_drafter.engine.transport import RemoteTransport
from remote_drafter.models.llama import LlamaLM
from remote_drafter.testing import HIDDEN_LAYERS

PROMPTS = {1: [1, 2, 3, 4, 5], 2: [9, 8, 7]}
NEW = 10


@pytest.fixture(scope="module")
def target(models):
    return LlamaLM.load(models["target"])


def decode_and_break(models, target, address, breaker):
    client = DrafterClient(RemoteTransport(address, "tcp", expectation(models["target"], None),
                                           retry_s=0.05), "8:5", deadline_s=1.0)
    rounds = []

    def on_round(drafts):
        rounds.append(len(drafts))
        if len(rounds) == 3:
            breaker()
    result = speculative_decode(target, client, PROMPTS, NEW, hidden_layers=HIDDEN_LAYERS,
                                on_round=on_round)
    assert result.tokens == {rid: plain_decode(target, p, NEW) for rid, p in PROMPTS.items()}
    return rounds, client.counters()


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_rank_1_killed_or_hung_mid_serve_stops_rank_0(models, target, lock_dir, fault):
    pair = RankPair(worker_args(models), free_master("127.0.0.1:0"))
    try:
        address = pair.ready()
        broke_at, stopped_at, ended = [], [], threading.Event()

        def watch():
            pair.procs[0].wait()
            stopped_at.append(time.monotonic())
            ended.set()

        def breaker():
            broke_at.append(time.monotonic())
            os.kill(pair.procs[1].pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            threading.Thread(target=watch, daemon=True).start()
        rounds, counters = decode_and_break(models, target, address, breaker)
        assert rounds[:2] == [2, 2] and 0 in rounds[3:], rounds  # drafts, then none: fail closed
        assert ended.wait(30), "rank 0 kept serving after rank 1's fault"
        took = stopped_at[0] - broke_at[0]
        code0, err0 = pair.procs[0].returncode, pair.stderr(0)
    finally:
        pair.kill()
    print(f"{fault}: rank 0 stopped {took:.2f} s after the fault")
    assert code0 == 3, err0
    assert "drafter-tp2 rank 0: stopped serving:" in err0 and "failed" in err0, err0
    assert "clients get no drafts" in err0
    why = err0.split("stopped serving:", 1)[1].splitlines()[0]
    # What stopped it says how it was found: a hang by the pair's 3 s deadline (tp2_env's
    # DRAFTER_TP2_TIMEOUT_S); a death by the closed link, or, where gloo had a send pending to
    # the dead rank, by that same deadline (gloo does not always fail a pending send when the
    # link closes)
    if fault == "hang":
        assert "Timed out waiting 3000ms" in why, why
    else:
        assert "Timed out waiting 3000ms for send" in why or "Timed out" not in why, why
    assert counters["rounds_failed"] + counters["entries_failed"] > 0, counters


def test_rank_0_killed_stops_rank_1(models, lock_dir):
    pair = RankPair(worker_args(models), free_master("127.0.0.1:0"))
    try:
        pair.ready()
        pair.procs[0].kill()
        code1 = pair.procs[1].wait(timeout=15)
        err1 = pair.stderr(1)
    finally:
        pair.kill()
    assert code1 == 3 and "drafter-tp2 rank 1: stopped: following rank 0 failed" in err1, err1


def read_ready(proc) -> list[int]:
    line = proc.stdout.readline()
    assert " on " in line, line
    return [int(p) for p in line.split("rank pids ", 1)[1].split(")", 1)[0].split(",")]


def test_the_supervisor_restarts_within_its_bound_then_gives_up(models, lock_dir):
    sup = drafter_tp2("supervise", "--restarts", "1", "--window-s", "120", "--backoff-s", "0.2",
                      "--", *worker_args(models), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      env=tp2_env())
    try:
        first = read_ready(sup)
        os.kill(first[1], signal.SIGKILL)
        second = read_ready(sup)  # restarted: a fresh pair
        assert set(second).isdisjoint(first)
        os.kill(second[1], signal.SIGKILL)
        code = sup.wait(timeout=60)
        err = sup.stderr.read()
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
    assert code == 1, err
    assert "rank 1 ended (signal 9); the pair stopped serving" in err
    assert "restart 1 of 1 within 120 s" in err
    assert "gave up: the pair stopped 2 times within 120 s (bound: 1 restarts)" in err, err
    assert "roll back to the one-card worker" in err


def test_the_supervisor_does_not_restart_a_refusal(models, lock_dir):
    sup = drafter_tp2("supervise", "--restarts", "5", "--", *worker_args(models, "cpu:0,cpu:0"),
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=tp2_env())
    out, err = sup.communicate(timeout=90)
    assert sup.returncode == 2, err
    assert err.count("refusing to serve: the same device twice") == 2  # both ranks, one start
    assert "refused to start (its reason is above); not restarting" in err
