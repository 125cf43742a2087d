"""Registered memory: a named, contiguous byte buffer a server publishes or a client reads into.

A Region wraps any buffer (numpy array, bytearray, mmap) as a flat uint8 view with a stable
address. File-backed regions (Region.allocate, Region.from_file) can also be mapped by a
same-host peer, which is what the shm backend needs.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import secrets
from dataclasses import dataclass, field

import numpy as np

from .errors import OutOfRange

SHM_DIR = "/dev/shm"
SHM_PREFIX = "ofl-"  # Region.allocate's files: ofl-{pid}-{random}


@dataclass(frozen=True)
class RegionDescriptor:
    """What a peer learns about a published region during the handshake."""

    name: str
    length: int
    index: int
    # Backend extras: shm {"path", "file_offset"}, verbs {"addr", "rkey"}.
    extras: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"name": self.name, "length": self.length, "index": self.index,
                "extras": self.extras}

    @classmethod
    def from_json(cls, obj: dict) -> RegionDescriptor:
        from .errors import ProtocolError

        try:
            name, length, index = obj["name"], obj["length"], obj["index"]
            extras = obj.get("extras", {})
        except (KeyError, TypeError) as exc:
            raise ProtocolError(f"bad region descriptor {obj!r}") from exc
        if not (isinstance(name, str) and isinstance(length, int) and isinstance(index, int)
                and isinstance(extras, dict) and length >= 0 and index >= 0):
            raise ProtocolError(f"bad region descriptor {obj!r}")
        return cls(name, length, index, extras)


MADV_HUGEPAGE = 14


def _libc_call(name: str, address: int, length: int, *extra: int) -> str:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(ctypes.c_void_p(address), ctypes.c_size_t(length), *extra) == 0:
        return "ok"
    return os.strerror(ctypes.get_errno())


def create_shm(name: str, size: int) -> tuple[int, str]:
    """Create SHM_DIR/name of `size` bytes; returns its descriptor and path. The descriptor
    holds a shared lock on the file until it is closed or this process ends, however it ends
    (the kernel drops it then): remove_orphans leaves a file while its lock is held. The
    bytes are allocated now: a tmpfs without room for them (a container's small /dev/shm)
    fails here with ENOSPC and a message, where a sparse file would kill the process with
    SIGBUS at its first touch of a page past the room."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.posix_fallocate(fd, 0, size)  # after the lock: a file with bytes has been held
    except BaseException as exc:
        os.close(fd)
        os.unlink(path)
        if not (isinstance(exc, OSError) and exc.errno == errno.ENOSPC):
            raise
        free = os.statvfs(SHM_DIR)
        raise OSError(exc.errno, f"{SHM_DIR} cannot hold {name} ({size / 2**20:.1f} MiB; "
                      f"{free.f_bavail * free.f_frsize / 2**20:.1f} MiB free there): "
                      f"{os.strerror(exc.errno)}") from None
    return fd, path


def remove_orphans(prefix: str) -> tuple[int, int]:
    """Unlink the files SHM_DIR/{prefix}{pid}-... whose creator died without closing them
    (kill -9, a crash: each restart would leave another); returns (files, bytes). A file goes
    only when both say its creator is gone: no process holds its lock, which is right across
    PID namespaces sharing this /dev/shm and after a pid is reused, and no process of that
    pid is seen here, which keeps the files of creators that hold no lock."""
    removed = size = 0
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return 0, 0
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone meanwhile, or another user's
            continue
        try:
            n = os.fstat(fd).st_size
            if n:  # (an empty file is being created: its creator locks it before sizing it)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while a holder lives
                os.unlink(path)
                removed, size = removed + 1, size + n
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed, size


class Region:
    """A named flat byte buffer. Keep it alive as long as any peer may read it."""

    def __init__(self, name: str, buffer, *, path: str | None = None, file_offset: int = 0,
                 _owned: tuple = ()):
        view = memoryview(buffer)
        if not view.contiguous:
            raise ValueError(f"region {name!r}: buffer must be contiguous")
        self.name = name
        self.view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self.array = np.frombuffer(self.view, dtype=np.uint8) if len(self.view) else np.empty(0, np.uint8)
        self.path = path
        self.file_offset = file_offset
        self._owned = _owned
        self._unlink = False
        self._held: int | None = None  # an allocated file's locked descriptor (create_shm)

    @property
    def length(self) -> int:
        return len(self.view)

    @property
    def address(self) -> int:
        return int(self.array.ctypes.data) if self.length else 0

    @property
    def writable(self) -> bool:
        return not self.view.readonly

    def check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.length:
            raise OutOfRange(f"region {self.name!r}: [{offset}, {offset + length}) is outside "
                             f"[0, {self.length})")

    @classmethod
    def from_buffer(cls, name: str, buffer) -> Region:
        """Wrap memory the caller owns (numpy array, bytearray, mmap)."""
        return cls(name, buffer)

    @classmethod
    def allocate(cls, name: str, length: int) -> Region:
        """Page-aligned shared memory under /dev/shm, usable by every backend; unlinked on close."""
        remove_orphans(SHM_PREFIX)
        fd, path = create_shm(f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}", max(length, 1))
        try:
            mm = mmap.mmap(fd, max(length, 1))
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        region = cls(name, memoryview(mm)[:length], path=path, _owned=(mm,))
        region._unlink, region._held = True, fd
        return region

    @classmethod
    def from_file(cls, name: str, path: str, *, offset: int = 0, length: int | None = None,
                  writable: bool = False) -> Region:
        """Map (part of) a file, e.g. an Engram shard; the page cache holds it, not the heap."""
        size = os.path.getsize(path)
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise OutOfRange(f"{path}: [{offset}, {offset + length}) is outside the file ({size} B)")
        page = mmap.ALLOCATIONGRANULARITY
        start = offset - offset % page
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, length + offset - start, offset=start,
                           access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        view = memoryview(mm)[offset - start:offset - start + length]
        return cls(name, view, path=os.path.abspath(path), file_offset=offset, _owned=(mm,))

    def lock(self) -> str:
        """mlock the region so it never pages out; "ok" or the reason it failed (callers
        report it: locking is best effort where RLIMIT_MEMLOCK forbids it)."""
        return _libc_call("mlock", self.address, self.length)

    def advise_hugepages(self) -> str:
        """madvise(MADV_HUGEPAGE); "ok" or the reason it failed."""
        return _libc_call("madvise", self.address, self.length, MADV_HUGEPAGE)

    def close(self) -> None:
        """Release the mapping (and the /dev/shm file of an allocated region)."""
        self.array = np.empty(0, np.uint8)
        try:
            self.view.release()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when it does
        for owned in self._owned:
            try:
                owned.close()
            except BufferError:
                pass  # a peer view still exists; the mapping goes when it does
        if self._unlink and self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        if self._held is not None:
            os.close(self._held)
            self._held = None
        self._owned = ()

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Region({self.name!r}, {self.length} B{', ' + self.path if self.path else ''})"
