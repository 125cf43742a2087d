"""A TCP socket that carries ofl frames, with a deadline on every blocking step.

Both sides use it: the server for its connection loop, the client for its calls. The socket
stays non-blocking: each send or receive is tried at once, and only one that would block
waits, in a poll bounded by the deadline. (A Python socket timeout costs a mode switch
(ioctl) each time it is set and a poll before every call, ready or not: calls that cost on a
host where system calls are dear, such as a gVisor sandbox.) Sends are
scatter-gather (`sendmsg` straight from registered memory); receives land directly in the
caller's buffer (`recv_into`), so a read is never copied through a Python bytes object.
A header's receive takes up to AHEAD_BYTES more into a small scratch buffer, so a small
frame (a reply, a control frame) that has fully arrived comes in one receive; the next read
copies those bytes out first.
A payload whose size only the peer's header vouches for grows as its bytes arrive, so a
declared length reserves no more memory than the peer has already sent in one payload. The
last payload's buffer is received into again once nothing holds it: memory already touched,
where a fresh buffer page-faults on each new page (most of what a large message costs beyond
the socket's own copy).
"""

from __future__ import annotations

import math
import select
import socket
import sys
import threading
import time
from collections.abc import Iterator

from . import wire
from .errors import ConnectionLost, DeadlineExceeded

IOV_MAX = 1024  # Linux limit of iovecs per sendmsg
AHEAD_BYTES = 4 << 10  # a header's receive takes up to this much more: a small frame whole
GROW_FROM = 64 << 10  # a payload buffer starts this large and doubles as bytes arrive
POLL_MAX_MS = 2**31 - 1  # the longest wait one poll takes


def _held_once() -> int:
    """What sys.getrefcount says of an object one local name holds (Pythons differ: some
    count the call's own reference, some borrow it). Whoever reuses a buffer only when
    nothing else holds it compares with this (here; remote-drafter's histories)."""
    alone = bytearray(1)
    return sys.getrefcount(alone)


HELD_ONCE = _held_once()


def set_socket_options(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 8 << 20)
        except OSError:
            pass  # the kernel caps it; the default still works


def accepted(listener: socket.socket, stopping: threading.Event) -> Iterator[tuple]:
    """(socket, peer address) of each connection, until `stopping` is set or the listener
    is shut down."""
    while not stopping.is_set():
        try:
            yield listener.accept()
        except OSError:
            return


def send_and_close(sock: socket.socket, data: bytes) -> None:
    """Tell a peer being refused why, in what its socket takes right now (an accept loop
    never waits on a peer), and close."""
    try:
        sock.setblocking(False)
        sock.send(data)
    except OSError:
        pass  # its buffer is full or it is gone: the close says enough
    sock.close()


class Channel:
    def __init__(self, sock: socket.socket, max_payload: int):
        self.sock = sock
        self.max_payload = max_payload
        self.largest = 0  # the largest payload received whole: a later one starts this large
        self._last: bytearray | None = None  # the last large payload's buffer, for the next one
        self._last_size = 0  # the most it held
        self._scratch = bytearray(wire.HEADER_SIZE + AHEAD_BYTES)  # what a header's receive lands in
        self._ahead = memoryview(b"")  # received past what was asked for: the next bytes of the stream
        set_socket_options(sock)
        sock.setblocking(False)
        self._readable, self._writable = select.poll(), select.poll()
        self._readable.register(sock, select.POLLIN)
        self._writable.register(sock, select.POLLOUT)

    # -- deadlines -----------------------------------------------------------------------
    @staticmethod
    def _check(deadline: float | None) -> None:
        if deadline is not None and deadline - time.monotonic() <= 0:
            raise DeadlineExceeded("deadline passed")

    @staticmethod
    def _ready(poller: select.poll, seconds: float | None) -> bool:
        """Whether the socket became ready within `seconds` (None: however long it takes; a
        poll takes whole milliseconds, rounded up, and at most 2**31 - 1 of them: the caller
        of a longer wait polls again)."""
        return bool(poller.poll(None if seconds is None else min(max(math.ceil(seconds * 1000), 0), POLL_MAX_MS)))

    def _wait(self, poller: select.poll, deadline: float | None) -> None:
        """Until the socket is ready for what would have blocked, or raise once the deadline
        has passed and a last look found it not ready (never before the deadline)."""
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if self._ready(poller, None if left is None else max(left, 0.0)):  # past it: one look
                return
            if left is not None and left <= 0:
                raise TimeoutError

    # -- send ----------------------------------------------------------------------------
    def send_frame(self, kind: wire.Kind, request_id: int, parts=(), deadline: float | None = None,
                   version: int = wire.PROTOCOL_VERSION) -> None:
        views = self._bytes_of(parts)
        length = sum(map(len, views))
        self._send([memoryview(wire.pack_header(kind, request_id, length, version)), *views], deadline)

    def send_all(self, parts: list, deadline: float | None) -> None:
        self._send(self._bytes_of(parts), deadline)

    @staticmethod
    def _bytes_of(parts) -> list[memoryview]:
        """Each part as a memoryview of its bytes, empty ones left out (made once a frame,
        not once to size the frame and again to send it: a round sends dozens of parts)."""
        return [view.cast("B") for view in map(memoryview, parts) if view.nbytes]

    def _send(self, pending: list[memoryview], deadline: float | None) -> None:
        try:
            while pending:
                self._check(deadline)  # a clock read, no system call
                try:
                    sent = self.sock.sendmsg(pending[:IOV_MAX])
                except BlockingIOError:
                    self._wait(self._writable, deadline)
                    continue
                while sent:
                    if sent >= len(pending[0]):
                        sent -= len(pending.pop(0))
                    else:
                        pending[0] = pending[0][sent:]
                        sent = 0
        except TimeoutError:
            raise DeadlineExceeded("deadline passed while sending") from None
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            if isinstance(exc, DeadlineExceeded):
                raise
            raise ConnectionLost(f"send failed: {exc}") from None

    # -- receive -------------------------------------------------------------------------
    def recv_into(self, view: memoryview, deadline: float | None) -> None:
        """Fill `view` completely or raise (bytes already received ahead count as
        arrived: the deadline is checked before them); nothing to fill is done at once."""
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if len(view):
            self._check(deadline)  # a clock read, no system call
        got = min(len(self._ahead), len(view))
        if got:
            view[:got] = self._ahead[:got]
            self._ahead = self._ahead[got:]
        while got < len(view):
            got += self._recv_some(view[got:], deadline, got, len(view))

    def _recv_some(self, view: memoryview, deadline: float | None, got: int, n: int) -> int:
        """One receive into `view` that gets at least a byte (waiting only when none has
        arrived), or raise; `got` of `n` bytes asked for have come (for the error)."""
        try:
            while True:
                self._check(deadline)  # a clock read, no system call
                try:
                    k = self.sock.recv_into(view, len(view))
                except BlockingIOError:
                    self._wait(self._readable, deadline)
                    continue
                if k == 0:
                    raise ConnectionLost(f"peer closed the connection ({got} of {n} bytes received)")
                return k
        except TimeoutError:
            raise DeadlineExceeded(f"deadline passed with {got} of {n} bytes received") from None
        except (ConnectionResetError, OSError) as exc:
            if isinstance(exc, ConnectionLost | DeadlineExceeded):
                raise
            raise ConnectionLost(f"receive failed: {exc}") from None

    def wait_readable(self, idle_s: float | None = None) -> bool:
        """Block until the peer sends a byte or closes (True: the next receive gets the byte,
        or raises ConnectionLost), or `idle_s` passes first (False; None waits for ever); True
        at once while bytes received ahead wait to be read. The frame's own deadline starts
        with its first byte."""
        if self._ahead:
            return True
        try:
            self._wait(self._readable, None if idle_s is None else time.monotonic() + idle_s)
            return True
        except TimeoutError:
            return False

    def recv_header(self, deadline: float | None) -> wire.Header:
        """The next frame's header. Its receive takes whatever else has arrived, up to
        AHEAD_BYTES, kept for what is received next: a small frame comes whole in one receive
        (each a system call, dear on a gVisor host)."""
        self._check(deadline)  # a clock read, no system call
        have = len(self._ahead)
        if have < wire.HEADER_SIZE:
            scratch = memoryview(self._scratch)
            scratch[:have] = bytes(self._ahead)  # a header's first bytes, received before
            self._ahead = scratch[:have]
            while have < wire.HEADER_SIZE:
                have += self._recv_some(scratch[have:], deadline, have, wire.HEADER_SIZE)
                self._ahead = scratch[:have]  # what has come, should the next receive fail
        raw = bytes(self._ahead[:wire.HEADER_SIZE])
        self._ahead = self._ahead[wire.HEADER_SIZE:]  # consumed, valid or not
        return wire.unpack_header(raw, self.max_payload)

    def recv_payload(self, header: wire.Header, deadline: float | None) -> bytearray:
        """The payload, in a buffer at most twice the bytes received so far at any moment
        (or as large as the largest payload this peer sent before, which rounds of one size
        then fill without growing). A large one lands in the last large one's buffer when its
        caller no longer holds it: a caller that keeps a payload (or a view of it) keeps it
        from being reused."""
        start = min(header.length, max(GROW_FROM, self.largest))
        large = header.length > GROW_FROM  # a small one is cheap: it leaves the large one be
        # one under about half the last's size (Python gives a bytearray's memory back below
        # half of what it holds, which may be an eighth over its size) would fault it in again
        # later: it takes a buffer of its own and leaves the large one be too
        buf = self._last if large and 16 * header.length > 9 * self._last_size else None
        if buf is not None and sys.getrefcount(buf) <= HELD_ONCE + 1:  # only `buf` and _last: let go of
            if len(buf) > start:
                del buf[start:]
            else:
                buf.extend(bytes(start - len(buf)))
        else:
            buf = bytearray(start)
        got = 0
        while True:
            self.recv_into(memoryview(buf)[got:], deadline)
            got = len(buf)
            if got == header.length:
                self.largest = max(self.largest, got)
                if buf is self._last:
                    self._last_size = max(self._last_size, got)
                elif large and 16 * got > 9 * self._last_size:
                    self._last, self._last_size = buf, got
                return buf
            buf.extend(bytes(min(got, header.length - got)))

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
