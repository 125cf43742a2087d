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
from ofl.errors import ConnectionLost, DeadlineExceeded


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
    deadline = time.monotonic() + seconds
    with pytest.raises(DeadlineExceeded, match=f"0 of {wire.HEADER_SIZE} bytes"):
        b.recv_header(deadline=deadline)
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
