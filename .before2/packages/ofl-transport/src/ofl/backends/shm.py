"""shm backend: the client maps the server's file-backed regions read-only; a read is a copy.

Messages still travel over the bootstrap socket. The server proves it is on the same host
by its boot id, so a misconfigured remote endpoint fails at connect, not with wrong bytes.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from ..errors import BackendUnavailable, ProtocolError
from ..gather import gather_into
from ..region import Region
from . import tcp


def boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


class ServerBackend(tcp.ServerBackend):
    reads_over_channel = False

    def publish(self, region: Region) -> dict:
        if not region.path:
            raise BackendUnavailable(
                f"shm backend needs a file-backed region; {region.name!r} wraps plain memory "
                "(use Region.allocate or Region.from_file)")
        return {"path": region.path, "file_offset": region.file_offset}

    def accept(self, hello: dict, server) -> tuple[None, dict]:
        return None, {"boot_id": boot_id()}


class ClientBackend(tcp.ClientBackend):
    def __init__(self):
        self.maps: dict[int, np.ndarray] = {}
        self._mmaps: list[mmap.mmap] = []

    def setup(self, conn, reply: dict) -> None:
        if reply.get("boot_id") != boot_id():
            raise BackendUnavailable("shm backend needs the server on this host "
                                     "(its boot id differs); use tcp or verbs across hosts")
        for desc in conn.regions.values():
            path, offset = desc.extras.get("path"), desc.extras.get("file_offset")
            if not isinstance(path, str) or not isinstance(offset, int) or offset < 0:
                raise ProtocolError(f"region {desc.name!r}: bad shm descriptor {desc.extras!r}")
            self.maps[desc.index] = self._map(path, offset, desc.length)

    def _map(self, path: str, offset: int, length: int) -> np.ndarray:
        if length == 0:
            return np.empty(0, np.uint8)
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        fd = os.open(path, os.O_RDONLY)
        try:
            if os.fstat(fd).st_size < offset + length:
                raise ProtocolError(f"{path} is shorter than its descriptor says")
            mm = mmap.mmap(fd, offset - start + length, offset=start, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self._mmaps.append(mm)
        return np.frombuffer(mm, np.uint8, count=length, offset=offset - start)

    def read(self, conn, desc, offsets, lengths, dest, deadline) -> None:
        conn.check_alive()  # the mapping outlives a dead server: do not read from it silently
        gather_into(self.maps[desc.index], offsets, lengths, dest)

    def close(self) -> None:
        self.maps.clear()
        for mm in self._mmaps:
            try:
                mm.close()
            except BufferError:
                pass  # a caller kept a view; the mapping goes with it
        self._mmaps.clear()
