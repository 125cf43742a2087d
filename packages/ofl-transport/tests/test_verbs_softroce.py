"""Soft-RoCE tier: the verbs backend for real (rxe0 inside a QEMU guest), correctness only.

Runs where OFL_TEST_RDMA_DEVICE names a verbs device: tools/softroce/verbs-tests.sh boots the
guest and runs `pytest -m softroce` there (tools/test does this in CI). Elsewhere skipped."""

import os
import signal

import numpy as np
import pytest

from ofl import Connection, ConnectionLost, DeadlineExceeded, OutOfRange, Region, Server
from ofl.probe import PROBE_REGION, pattern
from ofl.testing import stop_process

DEVICE = os.environ.get("OFL_TEST_RDMA_DEVICE")
pytestmark = [
    pytest.mark.softroce,
    pytest.mark.skipif(not DEVICE, reason="needs a verbs device: runs in the soft-RoCE tier "
                       "(tools/softroce/verbs-tests.sh, called by tools/test)"),
]
ROW = 264


@pytest.fixture(autouse=True)
def verbs_env(monkeypatch):
    monkeypatch.setenv("OFL_IB_DEVICE", DEVICE or "")
    monkeypatch.setenv("OFL_GID_INDEX", os.environ.get("OFL_TEST_RDMA_GID_INDEX", ""))
    monkeypatch.setenv("OFL_MAX_MESSAGE_BYTES", str(1 << 20))


@pytest.fixture
def verbs_server():
    from ofl.testing import ServeProcess

    os.environ["OFL_IB_DEVICE"] = DEVICE or ""
    srv = ServeProcess("verbs", size=4 << 20)
    yield srv
    srv.stop()


def test_gather_rows_are_exact(verbs_server):
    with Connection(verbs_server.address, backend="verbs") as conn:
        rng = np.random.default_rng(7)
        for tokens in (1, 64, 200):  # 200 tokens = 4,800 rows: many chained batches
            offsets = rng.integers(0, verbs_server.size - ROW, 24 * tokens).astype(np.uint64)
            dest = Region.from_buffer("rows", np.zeros(24 * tokens * ROW, np.uint8))
            conn.gather(PROBE_REGION, offsets, ROW, into=dest)
            want = np.concatenate([pattern(int(o), ROW) for o in offsets])
            assert np.array_equal(dest.array, want)


def test_variable_lengths_large_read_and_messages(verbs_server):
    with Connection(verbs_server.address, backend="verbs") as conn:
        offsets = np.array([3, 70_000, verbs_server.size - 5], np.uint64)
        lengths = np.array([1000, 65_536, 5], np.uint32)
        dest = Region.allocate("dest", 1 << 20)
        conn.gather(PROBE_REGION, offsets, lengths, into=dest)
        want = np.concatenate([pattern(int(o), int(n)) for o, n in zip(offsets, lengths)])
        assert np.array_equal(dest.array[:len(want)], want)
        conn.read(PROBE_REGION, 12345, 1 << 20, dest)
        assert np.array_equal(dest.array, pattern(12345, 1 << 20))
        for size in (0, 1, 4096, 1 << 20):
            payload = os.urandom(size)
            assert conn.request(payload) == payload
        with pytest.raises(OutOfRange):
            conn.read(PROBE_REGION, verbs_server.size - 10, 11, dest)
        with pytest.raises(Exception, match="registered memory"):
            conn.read(PROBE_REGION, 0, 8, np.zeros(8, np.uint8))  # not a Region
        assert conn.request(b"still fine") == b"still fine"


def test_in_process_server_and_handler_errors():
    data = Region.allocate("d", 1 << 16)
    data.array[:] = np.arange(1 << 16) % 253

    def handler(b, peer):
        if b == b"boom":
            raise RuntimeError("bad")
        return b[::-1]

    with Server("verbs", handler=handler) as srv:
        srv.register(data)
        with Connection(srv.address, backend="verbs") as conn:
            from ofl import RemoteError

            with pytest.raises(RemoteError, match="bad"):
                conn.request(b"boom")
            assert conn.request(b"abc") == b"cba"
            out = Region.from_buffer("o", np.zeros(3 * 100, np.uint8))
            conn.gather("d", [0, 1000, 65_000], 100, into=out)
            assert np.array_equal(out.array, np.concatenate(
                [data.array[0:100], data.array[1000:1100], data.array[65000:65100]]))


def test_stall_fires_deadline_and_kill_is_an_error(verbs_server):
    conn = Connection(verbs_server.address, backend="verbs")
    assert conn.request(b"a") == b"a"
    stop_process(verbs_server.proc.pid)  # returns once every thread is stopped
    try:
        with pytest.raises(DeadlineExceeded):
            conn.request(b"b", deadline_s=0.5)
    finally:
        os.kill(verbs_server.proc.pid, signal.SIGCONT)
    assert conn.request(b"c") == b"c"  # reconnected: a fresh queue pair
    verbs_server.kill()
    with pytest.raises((ConnectionLost, DeadlineExceeded)):
        conn.request(b"d", deadline_s=3)
    conn.close()
