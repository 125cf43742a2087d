"""A hostile or broken peer against a real `ofl serve` process (loopback; the other
addresses of 127.0.0.0/8 stand for other hosts): admission before a slot is spent, closed
by default, the key proof both ways (and an impostor server), handshake, idle and frame
deadlines, memory the peer cannot reserve, and one counted log line - never a traceback -
for each kind of bad input. Every wait is on an observed event (a frame, an EOF, a drained
socket, a counter) with a bound."""

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from ofl import AuthenticationFailed, Connection, Server, admission, wire
from ofl.backends import tcp
from ofl.errors import ConfigurationError
from ofl.probe import PROBE_REGION, pattern
from ofl.testing import ServeProcess, closes, rss_bytes, threads, wait_until

KEY = "0123456789abcdef" * 4
MiB = 1 << 20


def hello(**fields) -> bytes:
    body = wire.encode_json({"backend": "tcp", "identity": "hostile", **fields})
    return wire.pack_header(wire.Kind.HELLO, 1, len(body)) + body


def peer(address: str, source: str = "127.0.0.1") -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0))


def next_frame(sock: socket.socket) -> tuple[wire.Header | None, bytes]:
    """The next frame the server sends, or (None, b"") when it closed (or reset) first."""
    try:
        raw = _exactly(sock, wire.HEADER_SIZE)
        header = wire.unpack_header(raw, 1 << 30)
        return header, _exactly(sock, header.length)
    except (ConnectionError, EOFError):
        return None, b""


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset, as a crashed peer does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.fixture
def server_log(tmp_path):
    path = tmp_path / "server.log"
    with open(path, "w") as f:
        yield f, path


def lines(path, text: str) -> list[str]:
    return [line for line in path.read_text().splitlines() if text in line]


def test_idle_peers_that_said_hello_cannot_lock_out_the_engine(server_log):
    """64 sockets that send HELLO and go quiet held every slot ("server full" for everyone
    after). Now one address holds at most OFL_MAX_CONNECTIONS_PER_PEER (8): the other 56
    are refused with the reason, and the engine's client is served."""
    log, path = server_log
    srv = ServeProcess("tcp", stderr=log)
    try:
        base = threads(srv.proc.pid)
        held, refusals = [], []
        for _ in range(64):
            s = peer(srv.address, "127.0.0.2")
            s.sendall(hello())
            header, body = next_frame(s)
            if header.kind == wire.Kind.HELLO_OK:
                held.append(s)
            else:
                refusals.append(wire.error_text(body))
        assert len(held) == 8 and len(refusals) == 56
        assert "127.0.0.2 already holds 8 connections" in refusals[0]
        assert threads(srv.proc.pid) == base + 8  # one thread per held connection, no more
        with Connection(srv.address, backend="tcp") as engine:
            assert engine.request(b"served") == b"served"
    finally:
        srv.stop()
    said = lines(path, "peer_limit_refusals")
    assert 1 <= len(said) <= 10  # refusals are logged, rate-limited (56 happened)
    assert "ofl server" in said[0] and "127.0.0.2:" in said[0]


def test_peers_outside_the_allow_list_are_dropped_before_they_take_a_slot(server_log):
    log, path = server_log
    srv = ServeProcess("tcp", env={"OFL_ALLOW": "127.0.0.1, 10.0.0.0/8"}, stderr=log)
    try:
        base = threads(srv.proc.pid)
        outsider = peer(srv.address, "127.0.0.3")
        header, body = next_frame(outsider)  # told why, before it says anything
        assert header.kind == wire.Kind.ERROR
        assert "127.0.0.3 is not among the peers this server admits (OFL_ALLOW)" in \
            wire.error_text(body)
        for _ in range(64):  # HELLO and go quiet, as a flood would: each closed at accept
            s = peer(srv.address, "127.0.0.3")
            s.sendall(hello())
            assert closes(s)
        assert threads(srv.proc.pid) == base
        with Connection(srv.address, backend="tcp") as engine:
            assert engine.request(b"served") == b"served"
    finally:
        srv.stop()
    assert 1 <= len(lines(path, "peers_refused")) <= 10


def test_a_key_is_proved_both_ways_and_an_impostor_server_is_refused(server_log):
    """Keyless peers on both sides talk as before. A keyed client refuses a server that asks
    no proof (it knows no key) or proves the wrong key, before it proves anything itself; a
    keyed server refuses a missing or wrong proof with a reason the client raises, and
    reclaims silent sockets at the handshake deadline."""
    log, path = server_log
    plain = ServeProcess("tcp")
    try:
        with Connection(plain.address, backend="tcp") as keyless:
            assert keyless.request(b"no key on either side") == b"no key on either side"
        with pytest.raises(AuthenticationFailed, match="asked for no key proof: it holds no shared key"):
            Connection(plain.address, backend="tcp", key=KEY)
    finally:
        plain.stop()
    srv = ServeProcess("tcp", env={"OFL_AUTH_KEY": KEY, "OFL_HANDSHAKE_TIMEOUT_MS": "300"},
                       stderr=log)
    try:
        base = threads(srv.proc.pid)
        with Connection(srv.address, backend="tcp", key=KEY) as good:
            assert good.request(b"proved") == b"proved"
        with pytest.raises(AuthenticationFailed, match="could not prove the shared key"):
            Connection(srv.address, backend="tcp", key="f" * 64)  # to it, an impostor
        with pytest.raises(AuthenticationFailed, match="set OFL_AUTH_KEY on the client"):
            Connection(srv.address, backend="tcp", key="")  # = a client from before keys
        nonce = admission.new_nonce()
        forger = peer(srv.address, "127.0.0.6")  # answers the challenge without the key
        forger.sendall(hello(auth=admission.AUTH_SCHEME, nonce=nonce.hex()))
        header, body = next_frame(forger)
        challenge = wire.decode_json(body, "CHALLENGE")
        assert header.kind == wire.Kind.CHALLENGE and admission.proof_matches(
            KEY.encode(), nonce, challenge["proof"], admission.SERVER_PROOF_LABEL)
        replayed = wire.encode_json({"proof": challenge["proof"]})  # the server's own proof back
        forger.sendall(wire.pack_header(wire.Kind.PROOF, 0, len(replayed)) + replayed)
        assert "differs from the server's" in wire.error_text(next_frame(forger)[1])
        silent = [peer(srv.address, "127.0.0.4") for _ in range(8)]
        stalled = peer(srv.address, "127.0.0.5")
        stalled.sendall(hello(auth=admission.AUTH_SCHEME, nonce=nonce.hex()))  # never proves
        assert next_frame(stalled)[0].kind == wire.Kind.CHALLENGE
        t = time.monotonic()
        with Connection(srv.address, backend="tcp", key=KEY) as engine:  # served meanwhile
            assert engine.request(b"still served") == b"still served"
        assert all(closes(s) for s in [*silent, stalled])
        assert time.monotonic() - t < 1.5  # reclaimed at 0.3 s (was 3 s, and never after HELLO)
        wait_until(lambda: threads(srv.proc.pid), lambda n: n == base, "the server's threads back to their base")
    finally:
        srv.stop()
    text = path.read_text()
    assert KEY not in text
    assert lines(path, "handshake_timeouts") and lines(path, "auth_failures")


def test_idle_links_are_closed_while_a_pinging_client_stays(server_log):
    """After its handshake a link that carries no frame for the idle deadline is closed (a
    peer cannot hold a slot by saying nothing); the engine's client pings a quiet link and
    keeps it, and a client that does not ping notices the close before it sends, and
    reconnects without losing its call."""
    log, path = server_log
    # long enough that a stalled ping thread on a loaded machine does not lose the engine its link
    srv = ServeProcess("tcp", env={"OFL_IDLE_TIMEOUT_MS": "3000"}, stderr=log)
    try:
        with Connection(srv.address, backend="tcp") as engine, \
                Connection(srv.address, backend="tcp", keepalive=False) as quiet:
            idle = peer(srv.address, "127.0.0.7")
            idle.sendall(hello())
            assert next_frame(idle)[0].kind == wire.Kind.HELLO_OK
            assert closes(idle)  # its slot is back
            wait_until(lambda: engine.stats["pings"], lambda n: n >= 2, "the engine's pings")
            wait_until(lambda: alive(quiet), lambda up: not up, "the quiet link closed")
            assert engine.request(b"kept") == b"kept" and engine.stats["reconnects"] == 0
            assert quiet.request(b"re-opened") == b"re-opened"
            assert quiet.stats["links_reopened"] == 1 and quiet.stats["failures"] == 0
    finally:
        srv.stop()
    assert lines(path, "idle_closes")


def alive(conn: Connection) -> bool:
    try:
        conn.check_alive()
        return True
    except OSError:
        return False


def test_a_server_other_hosts_can_reach_needs_an_allow_list_a_key_or_insecure(monkeypatch):
    for name in ("OFL_ALLOW", "OFL_AUTH_KEY", "OFL_AUTH_KEY_FILE", "OFL_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigurationError, match="neither an allow-list .OFL_ALLOW. nor a shared key"):
        Server("tcp", "0.0.0.0", 0)
    run = subprocess.run([sys.executable, "-m", "ofl.cli", "serve", "--listen", "0.0.0.0:0",
                          "--size", "1MiB"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "OFL_INSECURE=1" in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    for kwargs, exposure in (({"allow": "10.0.0.2"}, "allow-list"), ({"key": KEY}, "key"),
                             ({"insecure": True}, "insecure")):
        with Server("tcp", "0.0.0.0", 0, **kwargs) as srv:
            assert srv.admission_status()["exposure"] == exposure
    with Server("tcp", "127.0.0.1", 0) as srv:  # loopback: closed to other hosts already
        assert srv.admission_status() == {"exposure": "loopback", "allow": [], "key": False,
                                          "idle_timeout_s": 300.0}


def test_the_handler_is_told_the_peer_address_the_server_saw():
    """Quotas are kept per peer on what the server knows, never on what the peer writes."""
    seen = []
    with Server("tcp", handler=lambda b, who: seen.append(who) or b) as srv:
        s = peer("%s:%d" % srv.address, "127.0.0.9")
        s.sendall(hello())
        assert next_frame(s)[0].kind == wire.Kind.HELLO_OK
        s.sendall(wire.pack_header(wire.Kind.MESSAGE, 2, 2) + b"hi")
        assert next_frame(s) == (wire.Header(wire.Kind.MESSAGE_REPLY, 2, 2), b"hi")
    assert seen == ["127.0.0.9"]


def test_a_key_file_others_may_read_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("OFL_AUTH_KEY", raising=False)
    path = tmp_path / "ofl.key"
    path.write_text(KEY + "\n")
    path.chmod(0o644)
    monkeypatch.setenv("OFL_AUTH_KEY_FILE", str(path))
    with pytest.raises(ConfigurationError, match=f"may be read by others .mode 0644.: chmod 600 {path}"):
        admission.configured_key()
    path.chmod(0o600)
    assert admission.configured_key() == KEY.encode()
    monkeypatch.setenv("OFL_AUTH_KEY", KEY)
    with pytest.raises(ConfigurationError, match="set one"):
        admission.configured_key()
    monkeypatch.delenv("OFL_AUTH_KEY")
    path.unlink()
    with pytest.raises(ConfigurationError, match="No such file"):
        admission.configured_key()


def test_bad_input_is_one_counted_line_never_a_traceback(server_log):
    """Deep JSON, an oversized HELLO, peers that vanish mid-request or reset right after
    the handshake - each answered or dropped, logged as one line with its counter, and the
    server keeps serving."""
    log, path = server_log
    srv = ServeProcess("tcp", stderr=log)
    try:
        deep = b"[" * 30_000 + b"]" * 30_000  # fits the HELLO limit: refused for its depth
        s = peer(srv.address)
        s.sendall(wire.pack_header(wire.Kind.HELLO, 1, len(deep)) + deep)
        assert "nested 30000 deep" in wire.error_text(next_frame(s)[1])
        huge = b"[" * 100_000 + b"]" * 100_000  # 100,000 levels: over the limit
        s = peer(srv.address)
        s.sendall(wire.pack_header(wire.Kind.HELLO, 1, len(huge)) + huge)
        assert "HELLO of 200000 bytes exceeds the handshake limit" in wire.error_text(next_frame(s)[1])
        digits = b'{"backend":"tcp","identity":"h","n":' + b"9" * 5000 + b"}"  # int() refuses
        s = peer(srv.address)
        s.sendall(wire.pack_header(wire.Kind.HELLO, 1, len(digits)) + digits)
        assert "HELLO: payload is not JSON we take" in wire.error_text(next_frame(s)[1])
        s = peer(srv.address)  # declared 1 MiB + 1: refused for its size, not "got HELLO"
        s.sendall(wire.pack_header(wire.Kind.HELLO, 1, MiB + 1))
        assert "exceeds the handshake limit of 65536" in wire.error_text(next_frame(s)[1])
        for _ in range(20):  # the handshake race: reset the moment HELLO_OK is on its way
            s = peer(srv.address)
            s.sendall(hello())
            reset(s)
        for cut in (wire.pack_header(wire.Kind.MESSAGE, 2, 1000) + b"ten bytes.",
                    wire.pack_header(wire.Kind.READ, 3, 20) + b"\0" * 20):
            s = peer(srv.address)  # mid-request: a partial payload, or a read not waited for
            s.sendall(hello())
            next_frame(s)
            s.sendall(cut)
            reset(s)
        with Connection(srv.address, backend="tcp") as engine:
            assert engine.request(b"still up") == b"still up"
    finally:
        srv.stop()
    text = path.read_text()
    assert "Traceback" not in text, text
    assert all("(protocol_errors: " in line for line in lines(path, "exceeds the handshake"))
    assert lines(path, "nested 30000 deep")


def test_a_slow_sender_has_a_deadline_per_frame_not_per_byte(server_log):
    """One byte per 50 ms never let a per-byte timeout fire; the frame's total deadline
    (OFL_FRAME_TIMEOUT_MS, 0.3 s here) drops the sender, while an idle connection stays."""
    log, path = server_log
    srv = ServeProcess("tcp", env={"OFL_FRAME_TIMEOUT_MS": "300"}, stderr=log)
    try:
        idle, slow = peer(srv.address), peer(srv.address)
        for s in (idle, slow):
            s.sendall(hello())
            next_frame(s)
        slow.sendall(wire.pack_header(wire.Kind.MESSAGE, 5, 100))
        t, sent = time.monotonic(), 0
        try:
            while sent < 100:  # 5 s worth of bytes, were it never cut off
                slow.send(b"x")
                sent += 1
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sent < 100 and time.monotonic() - t < 2
        idle.sendall(wire.pack_header(wire.Kind.MESSAGE, 6, 4) + b"idle")
        assert next_frame(idle)[1] == b"idle"  # idle for as long: still served
    finally:
        srv.stop()
    assert lines(path, "frame_timeouts")


def test_declared_lengths_reserve_no_memory(server_log):
    """Headers declaring bodies that never come raised ofl's RSS by their declared size.
    Now a payload buffer grows with the bytes that arrived: 32 connections declaring 4 MiB
    each (128 MiB) and sending 100 KiB cost a few MiB."""
    log, _ = server_log
    srv = ServeProcess("tcp", env={"OFL_FRAME_TIMEOUT_MS": "60000"}, stderr=log)
    try:
        with Connection(srv.address, backend="tcp") as warm:  # first-use allocations
            warm.request(b"x" * MiB)
        before = rss_bytes(srv.proc.pid)
        conns = []
        for i in range(32):
            s = peer(srv.address, f"127.0.1.{i // 8 + 1}")
            s.sendall(hello())
            next_frame(s)
            s.sendall(wire.pack_header(wire.Kind.MESSAGE, 9, 4 * MiB) + b"\1" * (100 << 10))
            conns.append(s)
        wait_drained(srv.port, len(conns))
        grown = rss_bytes(srv.proc.pid) - before
        assert grown < 16 * MiB, f"RSS grew {grown / MiB:.1f} MiB holding 128 MiB of declared payloads"
    finally:
        srv.stop()


def test_a_read_is_capped_and_streamed_with_a_send_deadline(server_log):
    """An 816-byte READ of 65 ranges x 1 MiB was gathered into one 68 MB buffer, and a
    client that never read its reply held the thread forever. Now it is refused over
    OFL_MAX_READ_BYTES, a reply is copied in 256 KiB pieces, and a reader that stalls is
    dropped at the frame deadline."""
    log, path = server_log
    srv = ServeProcess("tcp", env={"OFL_FRAME_TIMEOUT_MS": "500"}, stderr=log)
    try:
        base = threads(srv.proc.pid)
        s = peer(srv.address)
        s.sendall(hello())
        next_frame(s)
        before = rss_bytes(srv.proc.pid)
        big = wire.ReadRequest(0, np.zeros(65, np.uint64), MiB)  # ranges may overlap
        payload = b"".join(bytes(p) for p in big.encode())
        assert len(payload) == 12 + 65 * 8  # a few hundred bytes ask for 65 MiB
        s.sendall(wire.pack_header(wire.Kind.READ, 4, len(payload)) + payload)
        header, body = next_frame(s)
        assert header.kind == wire.Kind.ERROR
        assert "exceeds this server's limit of 4194304 per request" in wire.error_text(body)
        rows = np.arange(65, dtype=np.uint64) * (64 << 10)
        many = wire.ReadRequest(0, rows, 60 << 10)  # 3.9 MB
        frame = b"".join(bytes(p) for p in many.encode())
        for rid in range(8):  # 31 MB asked for, and not read
            s.sendall(wire.pack_header(wire.Kind.READ, 10 + rid, len(frame)) + frame)
        client_port = s.getsockname()[1]
        wait_until(lambda: established(srv.port, client_port), lambda up: not up, "the slow sender dropped")  # at 0.5 s
        received = 0
        try:
            while chunk := s.recv(1 << 20):
                received += len(chunk)
        except ConnectionResetError:
            pass  # it closed with our further READs unread
        assert received < 8 * len(many.offsets) * (60 << 10)
        assert rss_bytes(srv.proc.pid) - before < 8 * MiB
        wait_until(lambda: threads(srv.proc.pid), lambda n: n == base, "the server's threads back to their base")
        with Connection(srv.address, backend="tcp") as engine:  # gathers split under the cap
            dest = np.zeros(65 * MiB, np.uint8)
            engine.gather(PROBE_REGION, np.zeros(65, np.uint64), MiB, dest)
            assert np.array_equal(dest[-MiB:], pattern(0, MiB))
    finally:
        srv.stop()
    assert lines(path, "send_timeouts")


def server_sockets(port: int) -> list[tuple[int, str, int]]:
    """(peer port, TCP state, unread bytes) of each socket of the server on `port`."""
    out = []
    with open("/proc/net/tcp") as f:
        for row in f.read().splitlines()[1:]:
            fields = row.split()
            local, remote = fields[1], fields[2]
            if int(local.split(":")[1], 16) == port:
                out.append((int(remote.split(":")[1], 16), fields[3], int(fields[4].split(":")[1], 16)))
    return out


def established(port: int, peer_port: int) -> bool:
    return any(p == peer_port and state == "01" for p, state, _ in server_sockets(port))


def wait_drained(port: int, connections: int, timeout_s: float = 10) -> None:
    """Until the server has read everything sent to it on `connections` sockets of `port`
    (their receive queues are empty): its buffers exist by then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        queues = [unread for _, state, unread in server_sockets(port) if state == "01"]
        if len(queues) >= connections and not any(queues):
            return
        time.sleep(0.01)
    raise AssertionError(f"the server did not read what {connections} peers sent")


class SessionRecorder(tcp.ServerBackend):
    """A backend whose accept creates a session (as verbs does: a queue pair); with
    `proceed` it first waits for the test's signal, so the peer can vanish before HELLO_OK."""

    def __init__(self, proceed: threading.Event | None):
        self.proceed, self.sessions = proceed, []

    def accept(self, hello, server):
        if self.proceed is not None:
            assert self.proceed.wait(5)
        self.sessions.append(session := Recorded())
        return session, {}


class Recorded:
    def __init__(self):
        self.started, self.closed = False, threading.Event()

    def start(self, server, peer) -> None:
        self.started = True

    def close(self) -> None:
        self.closed.set()


@pytest.mark.parametrize("reset_after_hello_ok", [False, True])
def test_every_session_a_handshake_created_is_closed(reset_after_hello_ok):
    """A peer that resets during the handshake (before HELLO_OK could be sent, or right
    after it: the log line no longer asks the socket for its peer) costs no traceback and
    leaks no session."""
    proceed = threading.Event()
    srv = Server("tcp", handler=lambda b, _peer: b)
    srv.backend = SessionRecorder(None if reset_after_hello_ok else proceed)
    with srv:
        s = peer("%s:%d" % srv.address)
        s.sendall(hello())
        if reset_after_hello_ok:
            assert next_frame(s)[0].kind == wire.Kind.HELLO_OK
        reset(s)
        proceed.set()
        wait_until(lambda: len(srv.backend.sessions), lambda n: n == 1, "the failed handshake's session closed")
        session = srv.backend.sessions[0]
        assert session.closed.wait(5)
        assert session.started is reset_after_hello_ok
        wait_until(lambda: srv.stats["connections_lost"], lambda n: n == 1, "the lost connection counted")
        assert srv.stats["internal_errors"] == 0


@pytest.mark.parametrize("variable, value, why", [
    ("OFL_AUTH_KEY", "short", "OFL_AUTH_KEY holds 5 characters; use at least 32"),
    ("OFL_ALLOW", "10.0.0.2,engine-host", "OFL_ALLOW: 'engine-host' is neither an address"),
])
def test_unusable_admission_settings_stop_the_server_with_the_reason(variable, value, why):
    run = subprocess.run([sys.executable, "-m", "ofl.cli", "serve", "--listen", "127.0.0.1:0",
                          "--size", "1MiB"],
                         env={**os.environ, variable: value}, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 1 and why in run.stderr and "Traceback" not in run.stderr


def test_decode_json_refuses_depth_and_size_without_recursion():
    for raw, why in ((b"[" * 100_000, "nested 100000 deep"),
                     (b'{"a":' * 40 + b"1" + b"}" * 40, "nested 40 deep"),
                     (json.dumps({"x": "[" * 100}).encode(), None),  # brackets in a string
                     (b" " * (wire.MAX_CONTROL_BYTES + 1), "exceed the limit")):
        if why is None:
            assert wire.decode_json(raw, "HELLO") == {"x": "[" * 100}
            continue
        with pytest.raises(wire.ProtocolError, match=why):
            wire.decode_json(raw, "HELLO")
