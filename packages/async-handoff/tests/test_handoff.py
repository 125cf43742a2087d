"""The proxy end to end over ofl (tcp, shm) against a test worker, and the fault drills:
kill -9, SIGSTOP, unreachable and late workers, garbage in slots, the region removed
underneath, the respawn bound, torch kept out; and a 10,000-round soak."""

import os
import signal
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from async_handoff import Handoff, HandoffConfig
from ofl import Server
from ofl.testing import wait_until

HERE = str(Path(__file__).parent)
ECHO = "async_handoff.adapters:OflMessageAdapter"


class Worker:
    """An ofl server answering each round with (round id, payload reversed), after a delay."""

    def __init__(self, backend="tcp", delay_s=0.0):
        self.delay_s = delay_s
        self.rounds = 0
        self.server = Server(backend, handler=self.handle, identity="test-worker").start()
        self.address = "%s:%d" % self.server.address
        self.backend = backend

    def handle(self, payload: bytes) -> bytes:
        self.rounds += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        return payload[::-1]

    def stop(self):
        self.server.stop()


def config(**kw) -> HandoffConfig:
    base = dict(mode="nap", round_deadline_ms=200, max_wait_ms=50, heartbeat_timeout_ms=400,
                respawn_max=3, respawn_window_s=60, startup_timeout_s=20,
                proxy_env={"PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")})
    base.update(kw)
    return HandoffConfig(**base)


def start(worker, adapter=ECHO, **kw) -> Handoff:
    h = Handoff(config(**kw), adapter, {"address": worker.address, "backend": worker.backend})
    h.start()
    return h


def round_trip(h, payload, timeout_s=5.0):
    t = h.submit(payload)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        reply = h.wait(t)
        if reply is not None or t is None:
            return reply
        if h.poll(t) is None and h.flags.poll(t)[0] != 1:  # no longer pending: gone
            return None
    return None


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_rounds_over_ofl(backend):
    worker = Worker(backend)
    h = start(worker)
    try:
        assert h.enabled, h.reason
        assert h.proxy_status["ok"] and h.proxy_status["torch_imported"] is False
        assert "test-worker" in h.proxy_status["peer"]
        for i in range(200):
            payload = struct.pack("<Q", i) + os.urandom(i % 50)
            assert round_trip(h, payload) == payload[::-1]
        assert h.counters()["rounds_ok"] == 200
        assert "async_handoff_rounds_ok_total 200.0" in h.prometheus()
    finally:
        h.close()
        worker.stop()


def test_engine_calls_are_bounded_and_never_block():
    worker = Worker(delay_s=0.5)
    h = start(worker, round_deadline_ms=2000, max_wait_ms=30)
    try:
        t = h.submit(b"slow")
        t0 = time.monotonic()
        assert h.poll(t) is None and time.monotonic() - t0 < 0.01  # poll never waits
        t0 = time.monotonic()
        assert h.wait(t, timeout_s=10) is None                      # wait is capped
        assert time.monotonic() - t0 < 0.2
    finally:
        h.close()
        worker.stop()


def test_late_worker_times_out_and_is_counted():
    worker = Worker(delay_s=0.4)
    h = start(worker, round_deadline_ms=150)
    try:
        t = h.submit(b"late")
        wait_until(lambda: h.poll(t) is None and h.counters()["rounds_timed_out"] >= 1, what="the round timed out")
        worker.delay_s = 0
        wait_until(lambda: round_trip(h, b"prompt"), lambda r: r == b"tpmorp", "a round through the new proxy")
    finally:
        h.close()
        worker.stop()


def test_kill_9_mid_round_respawns_and_never_answers_the_old_round():
    worker = Worker(delay_s=0.3)
    h = start(worker, round_deadline_ms=2000)
    try:
        old = h.submit(b"old round")
        wait_until(lambda: worker.rounds, lambda n: n == 1, "the round in flight at the worker", 5)
        first_pid, first_gen = h.proc.pid, h.generation
        os.kill(first_pid, signal.SIGKILL)
        wait_until(lambda: h.enabled and h.proc.pid != first_pid, what="a respawned proxy", timeout_s=15)
        assert h.generation == first_gen + 1
        c = h.counters()
        assert c["watchdog_fires"] == 1 and c["respawns"] == 1
        assert h.poll(old) is None  # the predecessor's round is gone, never answered
        worker.delay_s = 0
        assert round_trip(h, b"new round") == b"dnuor wen"
    finally:
        h.close()
        worker.stop()


def test_a_round_slower_than_the_heartbeat_but_within_its_deadline_keeps_its_proxy():
    """The proxy beats between rounds: a live round longer than the heartbeat timeout (a
    loaded machine) is answered, and the watchdog leaves the proxy alone."""
    worker = Worker(delay_s=0.6)
    h = start(worker, round_deadline_ms=2000, heartbeat_timeout_ms=300)
    try:
        pid = h.proc.pid
        assert round_trip(h, b"slow") == b"wols"
        assert h.proc.pid == pid and h.counters()["watchdog_fires"] == 0
    finally:
        h.close()
        worker.stop()


def test_stopped_proxy_is_killed_and_respawned():
    worker = Worker()
    h = start(worker, heartbeat_timeout_ms=300)
    try:
        assert round_trip(h, b"abc") == b"cba"
        pid = h.proc.pid
        os.kill(pid, signal.SIGSTOP)
        t = h.submit(b"while stuck")
        t0 = time.monotonic()
        assert h.wait(t) is None and time.monotonic() - t0 < 0.2
        wait_until(lambda: h.enabled and h.proc.pid != pid, what="a respawned proxy", timeout_s=15)
        assert h.counters()["watchdog_fires"] == 1
        assert round_trip(h, b"xyz") == b"zyx"
    finally:
        h.close()
        worker.stop()


def test_unreachable_worker_disables_after_bounded_respawns():
    worker = Worker()
    address = worker.address
    worker.stop()  # nothing listens there now
    h = Handoff(config(respawn_max=2, startup_timeout_s=10), ECHO,
                {"address": address, "backend": "tcp"})
    h.start()
    try:
        assert not h.enabled
        wait_until(lambda: h.reason, lambda r: r.startswith("respawn bound"), "the respawn bound", 30)
        time.sleep(0.5)
        assert h.counters()["respawns"] == 2  # no flapping past the bound
        assert h.submit(b"x") is None and h.counters()["disabled_skips"] == 1
    finally:
        h.close()


def test_crashing_proxy_hits_the_respawn_bound():
    worker = Worker()
    h = start(worker, adapter="handoff_test_adapters:CrashAdapter", respawn_max=2)
    try:
        for _ in range(20):
            h.wait(h.submit(b"boom"))
            if h.reason.startswith("respawn bound"):
                break
            wait_until(lambda: h.enabled, what="the proxy back", timeout_s=10)
        assert h.reason.startswith("respawn bound")
        assert h.counters()["respawns"] == 2 and h.counters()["watchdog_fires"] == 3
    finally:
        h.close()
        worker.stop()


def test_a_proxy_that_imports_torch_is_refused():
    pytest.importorskip("torch", reason="needs torch in this venv to try importing it (the "
                        "main .venv has it; the torch-free venv cannot stage this drill)")
    worker = Worker()
    h = start(worker, adapter="handoff_test_adapters:TorchAdapter", respawn_max=0)
    try:
        assert not h.enabled and "torch was imported" in h.proxy_status.get("error", "")
    finally:
        h.close()
        worker.stop()


def test_garbage_in_slots_never_becomes_a_reply():
    worker = Worker()
    h = start(worker)
    rng = np.random.default_rng(0)
    stop = threading.Event()

    def scribble():
        view = np.frombuffer(h.flags.region.view, np.uint8)
        while not stop.is_set():
            i = int(rng.integers(4096, len(view)))
            view[i] = rng.integers(0, 256)
            time.sleep(0.0005)

    t = threading.Thread(target=scribble)
    t.start()
    try:
        for i in range(500):
            payload = struct.pack("<Q", i) * 4
            reply = h.wait(h.submit(payload))
            assert reply is None or reply == payload[::-1], f"round {i} got another's reply"
    finally:
        stop.set()
        t.join()
        h.close()
        worker.stop()


def test_region_removed_underneath():
    worker = Worker()
    h = start(worker)
    try:
        assert round_trip(h, b"one") == b"eno"
        old_path, pid = h.flags.path, h.proc.pid
        os.unlink(old_path)
        assert round_trip(h, b"two") == b"owt"  # both sides keep their mapping
        os.kill(pid, signal.SIGKILL)  # a respawned proxy must open the region by name
        wait_until(lambda: h.enabled and h.proc.pid != pid, what="a respawned proxy", timeout_s=15)
        assert h.flags.path != old_path and os.path.exists(h.flags.path)
        assert round_trip(h, b"three") == b"eerht"
    finally:
        h.close()
        worker.stop()


def test_soak_10000_rounds():
    worker = Worker()
    h = start(worker)
    try:
        for i in range(10_000):
            payload = struct.pack("<Q", i)
            assert round_trip(h, payload) == payload[::-1]
        c = h.counters()
        assert c["rounds_ok"] == 10_000
        assert c["rounds_failed"] == c["rounds_timed_out"] == c["watchdog_fires"] == 0
    finally:
        h.close()
        worker.stop()


def test_selftest_cli(capsys):
    from async_handoff.cli import main

    assert main(["selftest", "--rounds", "300"]) == 0
    out = capsys.readouterr().out
    assert "300 rounds: 300 ok, 0 without a reply; watchdog fires 0" in out
    assert main(["env"]) == 0 and "VLLM_DSPARK_REMOTE_ASYNC" in capsys.readouterr().out


def test_dropped_tickets_do_not_wedge_the_slots():
    worker = Worker(delay_s=0.03)
    h = start(worker, round_deadline_ms=50, slots=4)
    try:
        given = 0
        for _ in range(40):  # submit every "step", poll once too early, drop the ticket
            t = h.submit(b"step")
            given += t is not None
            h.poll(t)
            time.sleep(0.01)
        assert given >= 30, f"only {given} of 40 rounds could be submitted"
        assert h.counters()["rounds_timed_out"] > 0
        worker.delay_s = 0
        assert round_trip(h, b"later") == b"retal"
    finally:
        h.close()
        worker.stop()


def test_garbage_in_the_header_never_crashes_the_engine():
    worker = Worker()
    h = start(worker)
    rng = np.random.default_rng(1)
    try:
        view = np.frombuffer(h.flags.region.view, np.uint8)
        for i in range(300):
            view[rng.integers(0, 64, 4)] = rng.integers(0, 256, 4, dtype=np.uint8)  # nslots, ...
            payload = struct.pack("<Q", i)
            reply = h.wait(h.submit(payload))
            assert reply is None or reply == payload[::-1]
    finally:
        h.close()
        worker.stop()
