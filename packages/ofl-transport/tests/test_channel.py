"""ofl.channel.Channel on a TCP loopback pair: the socket stays non-blocking, so a frame whose
bytes are already there costs no wait and no mode switch (each a system call, dear on a
gVisor host), and only a call that would block waits, in one poll bounded by its deadline."""

import select
import socket
import threading
import time

import numpy as np
import pytest

from ofl import channel as channel_module
from ofl import wire
from ofl.channel import Channel
from ofl.errors import ConnectionLost, DeadlineExceeded, ProtocolError


class CountingSocket(socket.socket):
    """A socket that counts its mode switches (each an ioctl) and its receives."""

    def __init__(self, sock: socket.socket):
        super().__init__(sock.family, sock.type, fileno=sock.detach())
        self.counts = {"settimeout": 0, "setblocking": 0, "recv_into": 0}

    def settimeout(self, value):
        self.counts["settimeout"] += 1
        super().settimeout(value)

    def setblocking(self, flag):
        self.counts["setblocking"] += 1
        super().setblocking(flag)

    def recv_into(self, *args):
        self.counts["recv_into"] += 1
        return super().recv_into(*args)


POLL = select.poll


class CountingPoll:
    """select.poll, its waits counted."""
    waits = 0

    def __init__(self):
        self._poll = POLL()

    def register(self, *args):
        self._poll.register(*args)

    def poll(self, timeout=None):
        CountingPoll.waits += 1
        return self._poll.poll(timeout)


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setattr(channel_module.select, "poll", CountingPoll)
    CountingPoll.waits = 0
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    a, b = Channel(CountingSocket(client), 1 << 30), Channel(CountingSocket(server), 1 << 30)
    yield a, b
    a.close()
    b.close()


def test_a_frame_already_there_arrives_with_no_wait_and_no_mode_switch(pair):
    a, b = pair
    payload = np.arange(24 << 10, dtype=np.uint32)  # 96 KiB: in the peer's socket buffer once sent
    a.send_frame(wire.Kind.MESSAGE, 7, [payload], deadline=time.monotonic() + 30)
    assert b.wait_readable(5.0) and CountingPoll.waits == 1  # the one wait: for the frame's first byte
    header = b.recv_header(deadline=time.monotonic() + 30)
    got = b.recv_payload(header, deadline=time.monotonic() + 30)
    assert header.request_id == 7 and bytes(got) == payload.tobytes()
    assert CountingPoll.waits == 1  # every byte was there: no receive waited
    for ch in (a, b):
        assert ch.sock.counts["settimeout"] == 0 and ch.sock.counts["setblocking"] == 1  # once, at the start


@pytest.mark.parametrize("seconds", [0.0009, 0.0029, 0.05])
def test_a_receive_that_would_block_waits_out_its_whole_deadline(pair, seconds):
    """Not a moment less (a poll takes whole milliseconds: rounded up, and polled again if it
    ends early), in a poll or two, not a loop of them."""
    a, b = pair
    for _ in range(5):  # a busy machine may pass a sub-millisecond deadline before the receive starts
        CountingPoll.waits = 0
        deadline = time.monotonic() + seconds
        with pytest.raises(DeadlineExceeded) as raised:
            b.recv_header(deadline=deadline)
        if str(raised.value) != "deadline passed":  # (the check at its start): then it waited
            break
    assert f"0 of {wire.HEADER_SIZE} bytes" in str(raised.value)
    assert time.monotonic() >= deadline and 1 <= CountingPoll.waits <= 3


def test_a_deadline_already_passed_tries_nothing_and_a_zero_idle_wait_looks_once(pair):
    a, b = pair
    with pytest.raises(DeadlineExceeded, match="deadline passed"):
        b.recv_header(deadline=time.monotonic() - 1)
    assert b.sock.counts["recv_into"] == 0 and CountingPoll.waits == 0
    assert not b.wait_readable(0.0) and CountingPoll.waits == 1  # one look, no wait
    a.send_frame(wire.Kind.PING, 1, deadline=time.monotonic() + 5)
    assert b.wait_readable(5.0) and b.wait_readable(0.0)  # once there, a look finds it
    b.recv_into(memoryview(bytearray(0)), deadline=time.monotonic() - 1)  # nothing to receive: done


def test_a_send_the_peer_is_slow_to_take_waits_and_arrives_whole(pair):
    """More parts than one sendmsg takes (IOV_MAX) and more bytes than the socket buffers hold:
    the send waits for the reader (a thread reading as it goes) and every byte arrives in order."""
    a, b = pair
    parts = [np.full(16 << 10, i % 251, np.uint8) for i in range(channel_module.IOV_MAX + 300)]  # 21 MiB
    received = bytearray(sum(len(p) for p in parts))
    reader = threading.Thread(target=b.recv_into, args=(memoryview(received), time.monotonic() + 60))
    reader.start()
    a.send_all(parts, time.monotonic() + 60)
    reader.join(60)
    assert not reader.is_alive() and received == b"".join(p.tobytes() for p in parts)


def test_a_closed_peer_ends_the_wait_and_its_next_receive_is_a_lost_connection(pair):
    a, b = pair
    a.close()
    assert b.wait_readable(5.0)
    with pytest.raises(ConnectionLost, match="peer closed the connection"):
        b.recv_header(deadline=time.monotonic() + 5)


def test_a_request_waits_for_its_reply_before_receiving(monkeypatch):
    """A reply takes the server's whole turn, so the client polls for it first, and a small
    reply's header and payload come in one receive: none is tried for nothing."""
    from ofl import client as client_module
    from ofl.client import Connection
    from ofl.server import Server

    made = []
    monkeypatch.setattr(client_module, "Channel",
                        lambda sock, **kw: made.append(Channel(CountingSocket(sock), **kw)) or made[-1])
    arrived, answer = threading.Event(), threading.Event()

    def handler(payload, _peer):
        arrived.set()
        answer.wait(30)  # the client is waiting for the reply by now (seen below)
        return bytes(payload)

    with Server("tcp", handler=handler) as srv, Connection(srv.address, backend="tcp") as conn:
        conn.ensure_connected()
        sock = made[-1].sock
        got = []
        caller = threading.Thread(target=lambda: got.append(conn.request(b"x" * 1000, deadline_s=30)))
        before = sock.counts["recv_into"]
        caller.start()
        assert arrived.wait(30)
        answer.set()
        caller.join(30)
        assert got == [b"x" * 1000]
        assert sock.counts["recv_into"] - before == 1  # the header and the payload at once


def test_frames_received_ahead_are_read_in_order(pair):
    """A header's receive takes what else has arrived (the rest of a small frame, the start of
    the next): every frame still reads whole and in order, whatever their sizes, and a frame
    that arrived whole needs no further receive or wait."""
    a, b = pair
    sizes = [0, 5, channel_module.AHEAD_BYTES - 30, channel_module.AHEAD_BYTES + 3000, 70_000, 1]
    sent = [np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(sizes)]
    for i, p in enumerate(sent):  # back to back, all in the receiver's buffer before it reads
        a.send_frame(wire.Kind.MESSAGE, i, [p], deadline=time.monotonic() + 30)
    deadline = time.monotonic() + 30
    assert b.wait_readable(5.0)
    receives = b.sock.counts["recv_into"]
    for i, p in enumerate(sent):
        header = b.recv_header(deadline)
        assert (header.request_id, header.length) == (i, len(p))
        assert bytes(b.recv_payload(header, deadline)) == p.tobytes()
        if i == 1:  # the first two frames, small, came in the first header's receive
            assert b.sock.counts["recv_into"] == receives + 1
    assert not b.wait_readable(0.0)  # nothing left over


def test_a_header_split_across_receives(pair):
    """A header whose bytes come in two pieces, the second after a wait, reads whole."""
    a, b = pair
    frame = wire.pack_header(wire.Kind.MESSAGE, 3, 4) + b"abcd"
    a.sock.sendall(frame[:10])
    assert b.wait_readable(5.0)
    done = []
    reader = threading.Thread(target=lambda: done.append(b.recv_header(time.monotonic() + 30)))
    reader.start()
    bound = time.monotonic() + 30
    while CountingPoll.waits < 2 and time.monotonic() < bound:  # the reader waits for the rest
        time.sleep(0.001)
    assert CountingPoll.waits == 2
    a.sock.sendall(frame[10:])
    reader.join(30)
    header = done[0]
    assert (header.request_id, header.length) == (3, 4)
    assert bytes(b.recv_payload(header, time.monotonic() + 30)) == b"abcd"


def test_bytes_received_ahead_land_in_a_caller_buffer(pair):
    """recv_into (a READ's rows into the caller's array) takes the bytes a header's receive
    took ahead first, then the socket's."""
    a, b = pair
    data = np.arange(10_000, dtype=np.uint8)
    a.send_frame(wire.Kind.READ_DATA, 1, [data], deadline=time.monotonic() + 30)
    assert b.wait_readable(5.0)
    header = b.recv_header(time.monotonic() + 30)
    dest = np.zeros(header.length, np.uint8)
    b.recv_into(memoryview(dest), time.monotonic() + 30)
    assert np.array_equal(dest, data)


def test_a_bad_header_is_consumed_and_a_passed_deadline_refused(pair):
    """A header that fails its checks is taken off the stream all the same, and a receive
    whose deadline has passed is refused even when its bytes were received ahead."""
    a, b = pair
    a.sock.sendall(b"JUNK" * 6 + wire.pack_header(wire.Kind.MESSAGE, 4, 2) + b"ok"
                   + wire.pack_header(wire.Kind.MESSAGE, 5, 0))
    assert b.wait_readable(5.0)
    with pytest.raises(ProtocolError, match="magic"):
        b.recv_header(time.monotonic() + 30)
    header = b.recv_header(time.monotonic() + 30)  # the next frame's, from the bytes taken ahead
    assert header.request_id == 4 and bytes(b.recv_payload(header, time.monotonic() + 30)) == b"ok"
    with pytest.raises(DeadlineExceeded):
        b.recv_header(time.monotonic() - 1)  # frame 5 is here, the deadline is not


def test_empty_parts_of_any_shape_are_left_out(pair):
    """A part with no bytes, whatever its shape, adds nothing to a frame and is not sent."""
    a, b = pair
    parts = [np.empty((0, 4), np.float32), b"ab", np.empty((3, 0), np.uint8), b""]
    a.send_frame(wire.Kind.MESSAGE, 2, parts, deadline=time.monotonic() + 30)
    a.send_all([np.empty((0, 4), np.float32)], deadline=time.monotonic() + 30)
    header = b.recv_header(time.monotonic() + 30)
    assert header.length == 2 and bytes(b.recv_payload(header, time.monotonic() + 30)) == b"ab"
