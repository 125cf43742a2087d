"""Loopback integration tier: a real `ofl serve` process per test, over tcp and shm,
with fault drills (kill -9 mid-read, stall, garbage, truncated frames, restart)."""

import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

from ofl import (
    BackendUnavailable,
    Connection,
    ConnectionLost,
    DeadlineExceeded,
    Links,
    OflError,
    OutOfRange,
    Region,
    RemoteError,
    Server,
    wire,
)
from ofl.probe import PROBE_REGION, pattern
from ofl.testing import stop_process, wait_until

ROW = 264


def expected_rows(offsets, length):
    return np.concatenate([pattern(int(o), length) for o in offsets])


def test_engram_shaped_gather_is_exact(served):
    with Connection(served.address, backend=served.backend) as conn:
        rng = np.random.default_rng(1)
        for tokens in (1, 64, 300):
            offsets = rng.integers(0, served.size - ROW, 24 * tokens).astype(np.uint64)
            dest = Region.from_buffer("rows", np.zeros(24 * tokens * ROW, np.uint8))
            conn.gather(PROBE_REGION, offsets, ROW, into=dest)
            assert np.array_equal(dest.array, expected_rows(offsets, ROW))


def test_variable_length_gather_and_offset_into(served):
    with Connection(served.address, backend=served.backend) as conn:
        offsets = np.array([0, 17, 5000, served.size - 3], np.uint64)
        lengths = np.array([1, 300, 4096, 3], np.uint32)
        dest = np.full(16 + int(lengths.sum()), 0xEE, np.uint8)
        conn.gather(PROBE_REGION, offsets, lengths, into=dest, into_offset=16)
        want = np.concatenate([pattern(int(o), int(n)) for o, n in zip(offsets, lengths)])
        assert np.array_equal(dest[16:], want)
        assert (dest[:16] == 0xEE).all()  # bytes before into_offset untouched


def test_large_read_is_exact(served):
    with Connection(served.address, backend=served.backend) as conn:
        dest = bytearray(served.size)
        conn.read(PROBE_REGION, 0, served.size, dest)
        assert np.array_equal(np.frombuffer(dest, np.uint8), pattern(0, served.size))


def test_messages_round_trip(served):
    with Connection(served.address, backend=served.backend) as conn:
        for size in (0, 1, 64, 1 << 20):
            payload = os.urandom(size)
            assert conn.request(payload) == payload
        with pytest.raises(ValueError, match="exceeds the limit"):
            conn.request(b"x" * (conn.max_message_bytes + 1))


def test_out_of_range_refused_before_sending(served):
    with Connection(served.address, backend=served.backend) as conn:
        dest = np.zeros(2 * ROW, np.uint8)
        for offsets in ([served.size - ROW + 1], [0, 2**64 - 8]):
            with pytest.raises(OutOfRange):
                conn.gather(PROBE_REGION, np.array(offsets, np.uint64), ROW, into=dest)
        with pytest.raises(OutOfRange, match="destination"):
            conn.read(PROBE_REGION, 0, 3 * ROW, dest)
        with pytest.raises(OflError, match="no region"):
            conn.read("nope", 0, 1, dest)
        assert conn.stats["out_of_range"] == 2
        conn.read(PROBE_REGION, 0, ROW, dest)  # the connection still works
        assert np.array_equal(dest[:ROW], pattern(0, ROW))


class RawPeer:
    """A hand-driven socket speaking (or breaking) the wire protocol."""

    def __init__(self, address):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=5)

    def send(self, kind, rid, payload=b"", version=wire.PROTOCOL_VERSION):
        self.sock.sendall(wire.pack_header(kind, rid, len(payload), version) + payload)

    def recv(self):
        raw = self._exact(wire.HEADER_SIZE)
        h = wire.unpack_header(raw, 1 << 30)
        return h, self._exact(h.length)

    def _exact(self, n):
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    def hello(self, backend):
        self.send(wire.Kind.HELLO, 1, wire.encode_json({"backend": backend, "identity": "raw"}))
        h, body = self.recv()
        assert h.kind == wire.Kind.HELLO_OK
        return wire.decode_json(body, "HELLO_OK")

    def closed_by_peer(self) -> bool:
        """Drain what the server sent (an error frame) and see the connection end."""
        self.sock.settimeout(5)
        try:
            while self.sock.recv(4096):
                pass
            return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False


def test_server_refuses_out_of_range_and_keeps_serving():
    srv = Server("tcp", handler=lambda b, _peer: b)
    region = Region.from_buffer("r", np.arange(4096, dtype=np.uint8))
    srv.register(region)
    with srv:
        peer = RawPeer("%s:%d" % srv.address)
        peer.hello("tcp")
        bad = wire.ReadRequest(0, np.array([4000], np.uint64), 200)
        peer.send(wire.Kind.READ, 5, b"".join(bytes(p) for p in bad.encode()))
        h, body = peer.recv()
        assert h.kind == wire.Kind.ERROR and h.request_id == 5
        assert "out of range" in wire.error_text(body)
        wrong_region = wire.ReadRequest(7, np.array([0], np.uint64), 8)
        peer.send(wire.Kind.READ, 6, b"".join(bytes(p) for p in wrong_region.encode()))
        h, body = peer.recv()
        assert h.kind == wire.Kind.ERROR and "no region" in wire.error_text(body)
        good = wire.ReadRequest(0, np.array([10], np.uint64), 8)
        peer.send(wire.Kind.READ, 7, b"".join(bytes(p) for p in good.encode()))
        h, body = peer.recv()
        assert h.kind == wire.Kind.READ_DATA and body == bytes(range(10, 18))
        assert srv.stats["out_of_range"] == 1


def test_version_mismatch_is_refused_with_reason(served):
    peer = RawPeer(served.address)
    peer.send(wire.Kind.HELLO, 1, wire.encode_json({"backend": served.backend}), version=2)
    h, body = peer.recv()
    assert h.kind == wire.Kind.ERROR
    assert "version mismatch" in wire.error_text(body)
    assert peer.closed_by_peer()


def test_client_reports_version_mismatch(monkeypatch):
    with Server("tcp") as srv:
        monkeypatch.setattr(wire, "PROTOCOL_VERSION", 2)
        with pytest.raises(wire.VersionMismatch, match="version mismatch"):
            Connection(srv.address, backend="tcp")


def test_backend_mismatch_is_refused(served):
    other = "shm" if served.backend == "tcp" else "tcp"
    with pytest.raises(RemoteError, match="backend mismatch"):
        Connection(served.address, backend=other)


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64,                      # not ofl at all
    wire.pack_header(wire.Kind.MESSAGE, 1, 1 << 40),             # absurd length
    b"\x00" * 24,                                                # zero magic
])
def test_garbage_drops_only_that_connection(served, garbage):
    with Connection(served.address, backend=served.backend) as good:
        assert good.request(b"before") == b"before"
        peer = RawPeer(served.address)
        peer.hello(served.backend)
        peer.sock.sendall(garbage)
        h, body = peer.recv()
        assert h.kind == wire.Kind.ERROR
        assert peer.closed_by_peer()
        assert good.request(b"after") == b"after"


def test_garbage_before_hello_and_truncated_frames(served):
    with Connection(served.address, backend=served.backend) as good:
        junk = RawPeer(served.address)
        junk.sock.sendall(os.urandom(100))
        assert junk.closed_by_peer()
        cut = RawPeer(served.address)
        cut.hello(served.backend)
        cut.sock.sendall(wire.pack_header(wire.Kind.MESSAGE, 2, 100) + b"only ten b")
        cut.sock.close()  # truncated mid-payload
        unknown = RawPeer(served.address)
        unknown.hello(served.backend)
        unknown.send(wire.Kind.HELLO_OK, 3, b"{}")  # a frame kind the server does not take
        h, body = unknown.recv()
        assert h.kind == wire.Kind.ERROR and h.request_id == 3
        unknown.send(wire.Kind.MESSAGE, 4, b"still here")
        assert unknown.recv()[1] == b"still here"
        assert good.request(b"ok") == b"ok"


def test_kill_9_mid_read_fails_before_deadline():
    from ofl.testing import ServeProcess

    srv = ServeProcess("tcp", size=64 << 20)
    try:
        conn = Connection(srv.address, backend="tcp", deadline_s=10)
        dest = bytearray(64 << 20)
        errors, done = [], threading.Event()

        reads = []

        def reader():
            try:
                while not done.is_set():
                    conn.read(PROBE_REGION, 0, 64 << 20, dest)
                    reads.append(1)
            except OflError as exc:
                errors.append(exc)

        t = threading.Thread(target=reader)
        t.start()
        wait_until(lambda: len(reads), what="the reader's first whole read", timeout_s=30)
        killed = time.monotonic()  # the reader is in its next read
        srv.proc.send_signal(signal.SIGKILL)
        t.join(timeout=10)
        done.set()
        assert not t.is_alive(), "a read hung after the server died"
        assert errors and isinstance(errors[0], ConnectionLost | DeadlineExceeded)
        assert time.monotonic() - killed < 10
        assert conn.stats["failures"] == 1
    finally:
        srv.kill()


def test_shm_read_notices_dead_server():
    from ofl.testing import ServeProcess

    srv = ServeProcess("shm")
    conn = Connection(srv.address, backend="shm")
    dest = np.zeros(ROW, np.uint8)
    conn.read(PROBE_REGION, 0, ROW, dest)
    srv.kill()
    with pytest.raises(ConnectionLost):
        conn.read(PROBE_REGION, 0, ROW, dest)  # retried once on a fresh connection: refused


def test_stalled_server_deadline_then_recovery(served):
    conn = Connection(served.address, backend=served.backend)
    assert conn.request(b"a") == b"a"
    stop_process(served.proc.pid)
    try:
        t = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            conn.request(b"b", deadline_s=0.3)
        assert 0.25 < time.monotonic() - t < 2
        if served.backend == "tcp":
            with pytest.raises(DeadlineExceeded):
                conn.read(PROBE_REGION, 0, ROW, np.zeros(ROW, np.uint8), deadline_s=0.3)
        assert conn.stats["deadlines"] >= 1
    finally:
        os.kill(served.proc.pid, signal.SIGCONT)
    assert conn.request(b"c") == b"c"  # reconnects on the next call
    assert conn.stats["reconnects"] >= 1
    conn.close()


def test_reconnect_after_server_restart(served):
    conn = Connection(served.address, backend=served.backend)
    dest = np.zeros(ROW, np.uint8)
    conn.read(PROBE_REGION, 100, ROW, dest)
    served.restart()
    conn.read(PROBE_REGION, 100, ROW, dest)  # the closed link noticed before sending: re-opened
    assert np.array_equal(dest, pattern(100, ROW))
    assert conn.stats["links_reopened"] == 1 and conn.stats["retries"] == 0
    served.restart()
    assert conn.request(b"x") == b"x"  # a message too: nothing had gone out on the dead link
    assert conn.stats["links_reopened"] == 2 and conn.stats["failures"] == 0
    conn.close()


def test_handler_errors_reach_the_caller_and_server_keeps_serving():
    def handler(payload, peer):
        if payload == b"boom":
            raise ValueError("bad round")
        return payload.upper()

    with Server("tcp", handler=handler) as srv, Connection(srv.address, backend="tcp") as conn:
        with pytest.raises(RemoteError, match="ValueError: bad round"):
            conn.request(b"boom")
        assert conn.request(b"fine") == b"FINE"
        assert srv.stats["handler_errors"] == 1


def test_a_message_sent_in_parts_arrives_whole_and_is_the_handlers_to_keep():
    kept = []

    def handler(payload, peer):
        kept.append(payload)
        return bytes(payload[::-1])

    parts = [b"head", np.arange(3, dtype=np.int32), memoryview(b""), bytearray(b"tail")]
    whole = b"head" + np.arange(3, dtype=np.int32).tobytes() + b"tail"
    with Server("tcp", handler=handler) as srv, Connection(srv.address, backend="tcp") as conn:
        assert conn.request(parts) == whole[::-1]
        assert conn.request(b"second") == b"dnoces"
        with pytest.raises(ValueError, match="exceeds the limit"):
            conn.request([b"x" * conn.max_message_bytes, b"y"])
    assert [bytes(p) for p in kept] == [whole, b"second"]  # the first buffer was not reused


def test_server_full_is_a_clear_refusal():
    with Server("tcp", max_connections=1) as srv:
        first = Connection(srv.address, backend="tcp")
        with pytest.raises(RemoteError, match="server full"):
            Connection(srv.address, backend="tcp")
        first.close()


def test_links_map_ranks_to_connections():
    with Server("tcp", handler=lambda b, _peer: b"A") as a, Server("tcp", handler=lambda b, _peer: b"B") as b:
        links = Links(["%s:%d" % a.address, "%s:%d" % b.address], backend="tcp")
        assert links.for_rank(0).request(b"") == b"A"
        assert links.for_rank(1).request(b"") == b"B"
        assert links.for_rank(1).link == "link1"
        with pytest.raises(OflError, match="rank 2 has no link"):
            links.for_rank(2)
        links.close()


def test_shm_needs_a_file_backed_region():
    srv = Server("shm")
    try:
        with pytest.raises(BackendUnavailable, match="file-backed"):
            srv.register(Region.from_buffer("plain", bytearray(10)))
    finally:
        srv.stop()


def test_shm_serves_a_file_region(tmp_path):
    path = tmp_path / "shard.bin"
    data = np.random.default_rng(3).integers(0, 256, 10_000, dtype=np.uint8)
    path.write_bytes(b"H" * 4096 + data.tobytes())
    region = Region.from_file("shard", str(path), offset=4096)
    with Server("shm") as srv:
        srv.register(region)
        with Connection(srv.address, backend="shm") as conn:
            out = np.zeros(2 * 100, np.uint8)
            conn.gather("shard", np.array([0, 9900], np.uint64), 100, out)
            assert np.array_equal(out, np.concatenate([data[:100], data[9900:]]))


def test_verbs_without_a_device_fails_loudly(monkeypatch):
    # This machine has no RDMA device (the soft-RoCE tier runs verbs for real).
    monkeypatch.setenv("OFL_IB_DEVICE", "")
    with pytest.raises(BackendUnavailable) as exc:
        Server("verbs")
    assert any(w in str(exc.value) for w in ("no RDMA device", "pyverbs", "not built"))
    with pytest.raises(BackendUnavailable, match="unknown backend"):
        Server("carrier-pigeon")


def test_peer_metadata_and_verification_on_every_connect():
    seen = []

    def verify(meta):
        seen.append(meta)
        if meta.get("tables") != "v1":
            raise ValueError(f"holds tables {meta.get('tables')!r}, expected 'v1'")

    srv = Server("tcp", handler=lambda b, _peer: b, metadata={"tables": "v1"}).start()
    host, port = srv.address
    conn = Connection((host, port), backend="tcp", verify_peer=verify)
    assert conn.peer_metadata == {"tables": "v1"} and conn.request(b"x") == b"x"
    srv.stop()
    other = Server("tcp", host, port, handler=lambda b, _peer: b, metadata={"tables": "v2"}).start()
    try:
        from ofl import PeerRejected

        with pytest.raises(PeerRejected, match="expected 'v1'"):
            conn.request(b"z")  # the old link found closed; the new server has other tables
        assert len(seen) == 2 and conn.stats["peers_rejected"] == 1
    finally:
        other.stop()


def test_retried_read_resolves_regions_on_the_new_connection():
    a = Region.from_buffer("a", np.full(4096, 0xAA, np.uint8))
    b = Region.from_buffer("b", np.full(1024, 0xBB, np.uint8))
    srv = Server("tcp")
    srv.register(a)
    srv.register(b)
    srv.start()
    host, port = srv.address
    conn = Connection((host, port), backend="tcp")
    dest = np.zeros(16, np.uint8)
    conn.read("a", 0, 16, dest)
    srv.stop()
    again = Server("tcp", host, port)  # restarted with the regions in the other order
    again.register(b)
    again.register(a)
    again.start()
    try:
        conn.read("a", 4000, 16, dest)  # on the re-opened link
        assert (dest == 0xAA).all() and conn.stats["links_reopened"] == 1
    finally:
        again.stop()
        conn.close()
