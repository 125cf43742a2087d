"""ofl.channel.Channel on a TCP loopback pair: the socket stays non-blocking, so a frame whose
bytes are already there costs no wait and no mode switch (each a system call, dear on a
gVisor host), and only a call that would block waits, in one poll bounded by its deadline."""

import select
import socket
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


def test_a_receive_that_would_block_waits_once_until_its_deadline(pair):
    a, b = pair
    with pytest.raises(DeadlineExceeded, match=f"0 of {wire.HEADER_SIZE} bytes"):
        b.recv_header(deadline=time.monotonic() + 0.05)
    assert CountingPoll.waits == 1
    with pytest.raises(DeadlineExceeded, match="deadline passed"):
        b.recv_header(deadline=time.monotonic() - 1)  # already passed: no receive tried
    assert not b.wait_readable(0.0)


def test_a_closed_peer_ends_the_wait_and_its_next_receive_is_a_lost_connection(pair):
    a, b = pair
    a.close()
    assert b.wait_readable(5.0)
    with pytest.raises(ConnectionLost, match="peer closed the connection"):
        b.recv_header(deadline=time.monotonic() + 5)
