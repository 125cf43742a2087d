"""HostFlags: the shared-memory region of request/reply slots (protocol in csrc/hostflags.h).

Thin Python over the C helper: every state change is one C call (C11 atomics, futexes),
and the GIL is released while it waits.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from ofl import Region
from ofl.region import create_shm

from ._hostflags import ffi, lib

WAIT_MODES = {"spin": lib.HF_SPIN, "nap": lib.HF_NAP}
PROXY_STARTING, PROXY_READY, PROXY_FAILED = 0, 1, 2


class HostFlagsError(RuntimeError):
    pass


@dataclass(frozen=True)
class Ticket:
    """One submitted round: the slot and the round's unique sequence number."""

    slot: int
    seq: int
    submitted: float  # time.monotonic()
    flags: HostFlags


def region_size(nslots: int, slot_bytes: int) -> int:
    """Bytes of the region (header and slots) HostFlags.create makes in /dev/shm."""
    return lib.hf_region_size(nslots, slot_bytes)


class HostFlags:
    def __init__(self, region: Region, path: str, held: int | None = None):
        self.region, self.path = region, path
        self._held = held  # the creator's locked descriptor (create_shm)
        self.base = ffi.cast("void *", region.address)
        # The geometry is validated once and kept here, never re-read from shared memory.
        self.r = ffi.new("struct hf_region *")
        if lib.hf_attach(self.base, region.length, self.r) != lib.HF_OK:
            raise HostFlagsError(f"{path}: not a host-flags region (or another version)")
        self.nslots, self.slot_bytes = self.r.nslots, self.r.slot_bytes
        self._out = ffi.new("uint8_t[]", self.slot_bytes)
        self._slot, self._seq = ffi.new("uint32_t *"), ffi.new("uint64_t *")
        self._len, self._status = ffi.new("uint32_t *"), ffi.new("uint32_t *")

    @classmethod
    def create(cls, name: str, nslots: int, slot_bytes: int) -> HostFlags:
        size = region_size(nslots, slot_bytes)
        fd, path = create_shm(name, size)  # held until close: ofl's remove_orphans leaves it
        region = None
        try:
            region = Region.from_file(name, path, writable=True)
            if lib.hf_format(ffi.cast("void *", region.address), size, nslots, slot_bytes):
                raise HostFlagsError("cannot format the region")
            return cls(region, path, held=fd)
        except BaseException:
            if region is not None:
                region.close()
            os.close(fd)
            os.unlink(path)
            raise

    @classmethod
    def open(cls, path: str) -> HostFlags:
        return cls(Region.from_file(os.path.basename(path), path, writable=True), path)

    def lock(self) -> str:
        return self.region.lock()

    def info(self):
        out = ffi.new("struct hf_info *")
        lib.hf_get_info(self.r, out)
        return out

    # -- status text written by the proxy after its self-test ------------------------------
    def write_status(self, status: dict) -> None:
        raw = json.dumps(status).encode()[: lib.HF_STATUS_BYTES - 1] + b"\0"
        view = self.region.view[lib.HF_STATUS_OFFSET:lib.HF_STATUS_OFFSET + len(raw)]
        view[:] = raw

    def read_status(self) -> dict:
        raw = bytes(self.region.view[lib.HF_STATUS_OFFSET:lib.HF_STATUS_OFFSET + lib.HF_STATUS_BYTES])
        try:
            return json.loads(raw.split(b"\0", 1)[0] or b"{}")
        except ValueError:
            return {"error": "unreadable status"}

    def set_proxy(self, pid: int, state: int) -> None:
        lib.hf_set_proxy(self.r, pid, state)

    # -- engine side -----------------------------------------------------------------------
    def submit(self, payload: bytes) -> Ticket | int:
        """A Ticket, or the helper's error code (HF_EFULL, HF_ETOOBIG, HF_ESTALE)."""
        rc = lib.hf_submit(self.r, payload, len(payload), self._slot, self._seq)
        if rc != lib.HF_OK:
            return rc
        return Ticket(self._slot[0], self._seq[0], time.monotonic(), self)

    def poll(self, t: Ticket) -> tuple[int, bytes | None, int]:
        """(rc, reply, round status); rc HF_OK means the reply was taken and the slot freed."""
        rc = lib.hf_poll(self.r, t.slot, t.seq, self._out, self.slot_bytes, self._len,
                         self._status)
        if rc != lib.HF_OK:
            return rc, None, -1
        return rc, bytes(ffi.buffer(self._out, self._len[0])), self._status[0]

    def wait_reply(self, t: Ticket, mode: int, spin_ns: int, deadline: float) -> int:
        return lib.hf_wait_reply(self.r, t.slot, t.seq, mode, spin_ns, int(deadline * 1e9))

    def reclaim(self, t: Ticket) -> bool:
        return lib.hf_reclaim(self.r, t.slot, t.seq) == lib.HF_OK

    def new_generation(self) -> tuple[int, int]:
        reclaimed = ffi.new("uint32_t *")
        gen = lib.hf_new_generation(self.r, reclaimed)
        return gen, reclaimed[0]

    # -- proxy side ------------------------------------------------------------------------
    def take(self, generation: int, mode: int, spin_ns: int, deadline: float):
        """(rc, slot, seq, request bytes)."""
        rc = lib.hf_take(self.r, generation, mode, spin_ns, int(deadline * 1e9), self._slot,
                         self._seq, self._out, self.slot_bytes, self._len)
        if rc == lib.HF_OK:
            return rc, self._slot[0], self._seq[0], bytes(ffi.buffer(self._out, self._len[0]))
        return rc, self._slot[0], self._seq[0], None

    def complete(self, slot: int, seq: int, reply: bytes, status: int) -> int:
        return lib.hf_complete(self.r, slot, seq, reply, len(reply), status)

    def heartbeat(self) -> None:
        lib.hf_heartbeat(self.r)

    def close(self, unlink: bool = False) -> None:
        self.region.close()
        if self._held is not None:
            os.close(self._held)
            self._held = None
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
