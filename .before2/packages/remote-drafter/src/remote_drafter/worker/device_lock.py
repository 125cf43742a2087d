"""Lifetime device locks, shared by every drafter worker on a host (the one-card
`remote-drafter worker` and each rank of drafter-tp2): an exclusive flock on
<lock dir>/dsv41-device-<key>.lock, keyed by the GPU's UUID (on CPU a stable per-index
key), taken before anything is loaded onto the device and held for the worker's life.

flock belongs to the open file: the kernel drops it when the holder dies, however it dies,
so a stale lock can never block; the file only keeps the last holder's pid, process start
time and command for the messages. The file is never unlinked (unlinking a lock file races
with a process that has it open). Released only after the rank's device work has finished.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import sys
import tempfile
import time

from remote_drafter import env

log = logging.getLogger("remote_drafter.worker.device_lock")


class DeviceBusy(RuntimeError):
    pass


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (with the pid: a process identity
    that survives pid reuse)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, ticks: int | None) -> bool:
    return ticks is not None and _start_ticks(pid) == ticks


class DeviceLock:
    def __init__(self, key: str, folder: str):
        self.key = key
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key)
        self.path = os.path.join(folder, f"dsv41-device-{safe}.lock")
        self.fd: int | None = None
        self.cleared: dict | None = None  # the dead holder whose record was replaced

    def acquire(self) -> DeviceLock:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read(fd)
            os.close(fd)
            who = (f"pid {holder.get('pid')} ({' '.join(holder.get('argv', []))[:120]}, since "
                   f"{holder.get('since', '?')})" if holder else "another process")
            raise DeviceBusy(f"device {self.key} is in use: {self.path} is locked by {who}; "
                             "one worker per device") from None
        previous = self._read(fd)
        if previous and not _alive(previous.get("pid", -1), previous.get("start_ticks")):
            self.cleared = previous
            log.warning("device %s: cleared the stale lock record of dead pid %s", self.key,
                        previous.get("pid"))
        record = {"pid": os.getpid(), "start_ticks": _start_ticks(os.getpid()), "key": self.key,
                  "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self.fd = fd
        return self

    @staticmethod
    def _read(fd: int) -> dict | None:
        try:
            data = os.pread(fd, 1 << 16, 0)
            return json.loads(data) if data else None
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        """Call after the device's work has finished (the caller synchronises first)."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # no record: the next holder has nothing stale to report
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def device_key(device: str) -> str:
    """The identity a lock and drafter-tp2's distinctness check use: the GPU's UUID (the
    same card under any index or CUDA_VISIBLE_DEVICES); on CPU a stable key per given
    index ('cpu:0' and 'cpu:1' stand for two devices in tests)."""
    import torch
    d = torch.device(device)
    if d.type == "cuda":
        return f"GPU-{torch.cuda.get_device_properties(d).uuid}"
    return f"{socket.gethostname()}-cpu{d.index or 0}"


def lock_dir() -> str:
    chosen = env.REMOTE_DRAFTER_LOCK_DIR.get() or os.environ.get("XDG_RUNTIME_DIR", "")
    if chosen:
        return chosen
    return "/run/lock" if os.access("/run/lock", os.W_OK) else tempfile.gettempdir()


def worker_lock(device: str) -> DeviceLock | None:
    """The one-card worker's lock on its device, as REMOTE_DRAFTER_DEVICE_LOCK says (auto:
    GPUs only), or None; raises DeviceBusy while another worker holds it."""
    import torch
    mode = env.REMOTE_DRAFTER_DEVICE_LOCK.get()
    if why := env.REMOTE_DRAFTER_DEVICE_LOCK.problem(mode):
        raise ValueError(why)
    if mode == "0" or (mode == "auto" and torch.device(device).type != "cuda"):
        return None
    return DeviceLock(device_key(device), lock_dir()).acquire()
