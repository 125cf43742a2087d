"""Fault drills against real worker processes: stalled, killed mid-round, restarted (state
lost), idle timeout, identity mismatch, capacity exceeded, garbage. Decoding output never
changes; every failure is counted."""

import json
import os
import socket
import threading
import time

import pytest

pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from ofl import Connection  # noqa: E402
from ofl.errors import RemoteError  # noqa: E402
from ofl.testing import stop_process, wait_until  # noqa: E402
from remote_drafter.decode_loop import plain_decode, speculative_decode
from remote_drafter.engine import protocol as P
from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.identity import Manifest, expectation
from remote_drafter.engine.transport import RemoteTransport, worker_stats  # noqa: E402
from remote_drafter.models import registry  # noqa: E402
from remote_drafter.models.llama import random_llama
from remote_drafter.testing import HIDDEN_LAYERS, WorkerProcess
from remote_drafter.vllm.client_factory import CapacityModeError, make_client

PROMPTS = {1: [1, 2, 3, 4, 5], 2: [9, 8, 7], 3: [4, 4, 2, 8, 1, 7]}
NEW = 20


@pytest.fixture(scope="module")
def reference(target):
    return {rid: plain_decode(target, p, NEW) for rid, p in PROMPTS.items()}


@pytest.fixture
def worker(models):
    w = WorkerProcess(models["dspark"], models["target"])
    yield w
    w.stop()


def remote_client(models, address, deadline_s=2.0, expect=None, depth="8:5"):
    return DrafterClient(RemoteTransport(address, "tcp", expect or expectation(models["target"], None),
                                         retry_s=0.05), depth, deadline_s=deadline_s)


def decode(target, client, on_round=None):
    return speculative_decode(target, client, PROMPTS, NEW, hidden_layers=HIDDEN_LAYERS, on_round=on_round)


def test_stalled_worker_costs_only_its_deadline(models, target, reference, worker):
    client = remote_client(models, worker.address, deadline_s=0.3)
    steps = []

    def on_round(drafts):
        steps.append(len(drafts))
        if len(steps) == 2:
            stop_process(worker.proc.pid)
        if len(steps) == 4:
            os.kill(worker.proc.pid, 18)  # SIGCONT
            # drafting resumes once the link is back: the decode's last steps are not a race
            wait_until(lambda: client.transport.conn.connected, what="the link back after the stall")

    t0 = time.monotonic()
    result = decode(target, client, on_round)
    assert result.tokens == reference
    c = client.counters()
    assert c["rounds_failed"] >= 1 and c["steps_without_drafts"] >= 1 and steps[2] == 0
    assert steps[-1] > 0  # drafting resumed after the stall (requests re-opened)
    # Step 3 ran while the worker was stopped (it resumes only at step 4): the stalled round
    # gave up at its deadline, or decoding could not have gone on. The time is for reading.
    print(f"decode with a stalled worker: {time.monotonic() - t0:.1f} s, {len(steps)} steps")


def unread_bytes(port: int) -> int:
    """Bytes sent to 127.0.0.1:`port` that the process serving it has not read yet."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(int(r[4].split(":")[1], 16) for r in rows
               if int(r[1].split(":")[1], 16) == port and r[3] == "01")  # 01: established


def test_worker_killed_mid_round_then_restarted(models, target, reference, worker):
    client = remote_client(models, worker.address, deadline_s=5.0)
    port = int(worker.address.rsplit(":", 1)[1])
    steps, killed = [], []

    def kill_with_a_round_in_flight():
        # once the next round's request waits at the stopped worker: it dies with it
        killed.append(wait_until(lambda: unread_bytes(port), bool,
                                 "the next round's request at the stopped worker", 30))
        worker.kill()

    killer = threading.Thread(target=kill_with_a_round_in_flight, daemon=True)

    def on_round(drafts):
        steps.append(len(drafts))
        if len(steps) == 2:
            stop_process(worker.proc.pid)
            killer.start()
        if len(steps) == 3:
            killer.join(30)
            worker.restart()
            wait_until(lambda: client.transport.conn.connected, what="the link to the restarted worker")

    result = decode(target, client, on_round)
    assert killed, "the worker was not killed with a round in flight"
    assert result.tokens == reference
    c = client.counters()
    assert steps[2] == 0 and c["rounds_failed"] >= 1
    assert steps[-1] > 0 and c["drafts"] > 0


def test_state_lost_behind_the_clients_back_is_reopened_transparently(models, target, reference):
    """Idle timeout on the worker (state gone, connection intact): the worker answers
    'unknown request' and the client re-opens within the same step: no step loses drafts."""
    w = WorkerProcess(models["dspark"], models["target"], "tcp", 0, "--idle-timeout-s", "0.2")
    try:
        client = remote_client(models, w.address, deadline_s=5.0)
        steps = []

        def on_round(drafts):
            steps.append(len(drafts))
            if len(steps) == 2:  # the client waits until the worker has dropped every request
                wait_until(lambda: worker_stats(w.address), lambda s: s["open_requests"] == 0,
                           "the idle timeout releasing every request", 30, 0.05)

        result = decode(target, client, on_round)
        assert result.tokens == reference
        c = client.counters()
        assert c["reopens"] >= len(PROMPTS) and c["rounds_failed"] == 0
        assert c["steps_without_drafts"] == 0
        assert min(steps) > 0
    finally:
        w.stop()


def test_a_slow_link_costs_only_the_deadline(models, target, reference):
    """An injected round delay far above the deadline: every round fails closed, on time."""
    w = WorkerProcess("lm", models["target"], "tcp", 0, "--inject-delay-ms", "5000")
    try:
        client = remote_client(models, w.address, deadline_s=0.1)
        client.add_request(1, [1, 2, 3], None)
        client.worker_info(10.0)  # connected first: only the round is timed
        t0 = time.monotonic()
        assert client.propose() == {}
        took = time.monotonic() - t0
        print(f"a round against a 5 s link under a 0.1 s deadline: {took:.3f} s")
        # bounded by its deadline, not the link: far below the delay however loaded the machine
        assert took < 2.5, took
        assert client.counters()["rounds_failed"] == 1
    finally:
        w.kill()  # it holds the late round: nothing graceful to wait for


def test_identity_mismatch_is_refused(models, target, reference, worker, tmp_path):
    random_llama(target.config, seed=7).save(str(tmp_path / "other"))
    wrong_target = expectation(str(tmp_path / "other"), None)
    client = remote_client(models, worker.address, expect=wrong_target)
    assert decode(target, client).tokens == reference
    assert client.counters()["drafts"] == 0 and client.counters()["rounds_failed"] > 0
    with pytest.raises(Exception, match="identity mismatch: target"):
        client.transport.info(1.0)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({**Manifest().to_json(), "markov": "0" * 64}))
    wrong_markov = expectation(models["target"], str(manifest))
    with pytest.raises(Exception, match="identity mismatch: markov"):
        RemoteTransport(worker.address, "tcp", wrong_markov).info(1.0)


def test_capacity_exceeded_is_refused_clearly(models, target, reference):
    w = WorkerProcess(models["dspark"], models["target"], "tcp", 0, "--max-requests", "2",
                      "--max-requests-per-client", "2")  # one client may fill the worker
    try:
        client = remote_client(models, w.address)
        result = decode(target, client)
        assert result.tokens == reference
        c = client.counters()
        assert c["capacity_refusals"] > 0 and c["drafts"] > 0 and c["rounds_failed"] == 0
    finally:
        w.stop()


def test_garbage_is_refused_and_the_worker_keeps_serving(models, target, reference, worker):
    with Connection(worker.address, backend="tcp") as raw:
        fingerprint = Manifest.from_json(raw.peer_metadata["remote_drafter"]["manifest"]).fingerprint
        for junk, why in [(b"\x00" * 7, "shorter than its header"), (os.urandom(200), "bad magic"),
                          (P.encode_request([P.Entry(1, P.OP_OPEN, [1, 2])], bytes(16)), "identity mismatch")]:
            with pytest.raises(RemoteError, match=why):
                raw.request(junk, deadline_s=2)
        stats = P.parse_stats_reply(raw.request(P.encode_request([], fingerprint, kind=P.KIND_STATS)))
        assert stats["rounds_refused"] == 3
    with socket.create_connection(tuple(worker.address.rsplit(":", 1)[0:1]) + (int(worker.address.rsplit(":", 1)[1]),)) as s:
        s.sendall(os.urandom(4096))  # not even an ofl frame
    assert decode(target, remote_client(models, worker.address)).tokens == reference


def test_capacity_mode_never_creates_a_local_drafter(models, target, reference, monkeypatch):
    monkeypatch.setenv("REMOTE_DRAFTER_CAPACITY_MODE", "1")
    monkeypatch.delenv("REMOTE_DRAFTER_ADDRESS", raising=False)
    monkeypatch.setenv("REMOTE_DRAFTER_DRAFTER", models["dspark"])
    with pytest.raises(CapacityModeError, match="never creates a local drafter"):
        make_client(models["target"])

    def forbidden(*a, **k):
        raise AssertionError("a local drafter was created in capacity mode")
    monkeypatch.setattr(registry, "load_drafter", forbidden)
    with socket.socket() as s:  # a port with nobody listening: the host is gone
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("REMOTE_DRAFTER_ADDRESS", f"127.0.0.1:{port}")
    client = make_client(models["target"], deadline_s=0.5)
    assert decode(target, client).tokens == reference  # target-only decoding
    assert client.counters()["drafts"] == 0 and client.counters()["steps_without_drafts"] > 0
    w = WorkerProcess(models["dspark"], models["target"], "tcp", port)  # the host is back
    try:
        wait_until(lambda: client.transport.conn.connected, what="the background reconnect")
        assert decode(target, client).tokens == reference
        assert client.counters()["drafts"] > 0
    finally:
        w.stop()
