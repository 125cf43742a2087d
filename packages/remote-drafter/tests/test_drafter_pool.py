"""A pool of drafter workers (REMOTE_DRAFTER_STANDBYS): the primary frozen (sync), killed or
frozen (through the proxy) in the middle of decoding (set off by a round it answered), rounds move to a standby, its requests
re-open there and drafting resumes; output identical to target-only decoding at
temperature 0, sync and through the proxy. A standby with other identities is never used."""

import os
import signal

import pytest

pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from ofl.testing import stop_process, wait_until  # noqa: E402
from remote_drafter.decode_loop import plain_decode, speculative_decode  # noqa: E402
from remote_drafter.engine.client import DrafterClient  # noqa: E402
from remote_drafter.engine.identity import expectation  # noqa: E402
from remote_drafter.engine.transport import AsyncTransport, RemoteTransport  # noqa: E402
from remote_drafter.models.llama import random_llama  # noqa: E402
from remote_drafter.testing import HIDDEN_LAYERS, TINY, WorkerProcess  # noqa: E402
from remote_drafter.vllm.client_factory import make_client  # noqa: E402

PROMPTS = {1: [1, 2, 3, 4, 5], 2: [4, 4, 2, 8, 1, 7]}
NEW = 16
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # three processes share the machine's cores


@pytest.fixture(scope="module")
def reference(target):
    return {rid: plain_decode(target, p, NEW) for rid, p in PROMPTS.items()}


@pytest.fixture
def pool(models):
    workers = [WorkerProcess(models["dspark"], models["target"], env=ONE_THREAD) for _ in range(2)]
    yield workers
    for w in workers:
        w.proc.send_signal(signal.SIGCONT)  # a frozen one must be able to die
        w.stop()


def drill(target, client, transport, primary, fault):
    """Decode; after the third round (answered by the primary) `fault` hits it, and the
    next round waits until the transport has moved to the standby (the event the failover
    is); returns the result and drafts per round."""
    drafts = []

    def on_round(got):
        drafts.append(len(got))
        if len(drafts) == 3:
            fault(primary.proc.pid)
        if len(drafts) == 4 and not isinstance(transport, AsyncTransport):
            wait_until(lambda: transport.failovers, what="rounds moved to the standby", timeout_s=30)
    mode = "async" if isinstance(transport, AsyncTransport) else "sync"
    return speculative_decode(target, client, PROMPTS, NEW, hidden_layers=HIDDEN_LAYERS,
                              on_round=on_round, mode=mode), drafts


def kill(pid):
    os.kill(pid, signal.SIGKILL)


def test_a_frozen_primary_moves_rounds_to_the_standby(models, target, reference, pool):
    transport = RemoteTransport(pool[0].address, "tcp", expectation(models["target"], None),
                                retry_s=0.05, standbys=(pool[1].address,))
    client = DrafterClient(transport, "8:5", deadline_s=0.5)
    try:
        result, drafts = drill(target, client, transport, pool[0], stop_process)
        assert result.tokens == reference  # target-only decoding's output, whatever happened
        assert transport.failovers == 1 and transport.pool()[1]["current"], transport.pool()
        assert transport.pool()[0]["last_error"], transport.pool()
        c = client.counters()
        assert c["worker_failovers"] == 1, c
        assert c["rounds_failed"] >= 1 and c["reopens"] + c["rounds_failed"] >= 1, c
        assert drafts[:3] == [len(PROMPTS)] * 3 and drafts[3] == 0 and drafts[-1] > 0, drafts  # resumed there
    finally:
        client.close()


@pytest.mark.parametrize("fault", [kill, stop_process], ids=["killed", "frozen"])
def test_through_the_proxy_the_pool_serves_after_the_primary_fails(models, target, reference, pool, fault):
    from async_handoff import HandoffConfig
    # the proxy beats only between rounds: a heartbeat timeout well past the frozen round's
    # deadline, so the watchdog never takes the proxy's wait on it for a stuck proxy
    config = HandoffConfig(round_deadline_ms=2000, max_wait_ms=2000, heartbeat_timeout_ms=2000,
                           startup_timeout_s=30)
    transport = AsyncTransport(pool[0].address, "tcp", expectation(models["target"], None), config,
                               standbys=(pool[1].address,))
    client = DrafterClient(transport, "8:5", deadline_s=2)
    try:
        result, drafts = drill(target, client, transport, pool[0], fault)
        assert result.tokens == reference
        # the proxy reached the standby and the requests re-opened there, while the engine's
        # own link (limits only) may still be waiting on a frozen primary
        assert drafts[-1] > 0, drafts
        assert transport.handoff.counters()["respawns"] == 0  # the proxy moved on, it did not die
    finally:
        client.close()


def test_a_standby_with_other_identities_is_never_used(models, target, reference, monkeypatch, tmp_path):
    random_llama(TINY, seed=7).save(str(tmp_path / "other"))  # another target: other identities
    wrong = WorkerProcess("lm", str(tmp_path / "other"), env=ONE_THREAD)
    good = WorkerProcess(models["dspark"], models["target"], env=ONE_THREAD)
    monkeypatch.setenv("REMOTE_DRAFTER_ADDRESS", "127.0.0.1:1")  # nobody: the primary is down
    monkeypatch.setenv("REMOTE_DRAFTER_STANDBYS", f"{wrong.address},{good.address}")
    client = make_client(models["target"], deadline_s=0.5)
    try:
        wait_until(lambda: client.transport.failovers, what="rounds on a standby", timeout_s=30)
        pool = client.transport.pool()
        assert pool[2]["current"] and "rejected" in pool[1]["last_error"], pool
        result = speculative_decode(target, client, PROMPTS, NEW, hidden_layers=HIDDEN_LAYERS)
        assert result.tokens == reference and client.counters()["drafts"] > 0
    finally:
        client.close()
        wrong.stop()
        good.stop()
