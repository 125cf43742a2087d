"""Shared-memory files: those of processes that died without closing them (kill -9, a
crash) are removed by the next process that creates one, while the files of live creators
stay, whichever PID namespace they run in; a file the tmpfs has no room for is refused whole
when it is made, not met as SIGBUS at a later touch. Unit tier: real processes, SIGKILLed
once their file exists; a 1 MiB tmpfs for a container's small /dev/shm (root)."""

import errno
import fcntl
import os
import subprocess
import sys

import pytest

from ofl import Region
from ofl.region import SHM_DIR, SHM_PREFIX, create_shm, remove_orphans
from ofl.testing import small_shm

CREATE_AND_WAIT = """
import os, sys
from ofl.region import create_shm
name = f"{sys.argv[1]}{os.getpid()}-{sys.argv[2]}"
create_shm(name, 4096)
print(name, flush=True)
sys.stdin.read()
"""


def killed_creator(prefix: str, tag: str) -> tuple[str, int]:
    """(path, pid) of a file whose creator was SIGKILLed after creating it."""
    child = subprocess.Popen([sys.executable, "-c", CREATE_AND_WAIT, prefix, tag],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    name = child.stdout.readline().strip()  # created: the event the kill waits for
    child.kill()
    child.wait()
    return os.path.join(SHM_DIR, name), child.pid


def test_a_killed_creators_file_goes_and_live_creators_files_stay():
    prefix = f"ofl-orphan-test-{os.getpid()}-"
    orphan, dead_pid = killed_creator(prefix, "orphan")
    live_fd, live = create_shm(f"{prefix}{os.getpid()}-live", 4096)
    # a live creator in another PID namespace: its pid means nothing here, its lock holds
    elsewhere_fd, elsewhere = create_shm(f"{prefix}{dead_pid}-elsewhere", 4096)
    starting = os.path.join(SHM_DIR, f"{prefix}{dead_pid}-starting")  # not yet locked and sized
    open(starting, "w").close()
    paths = (orphan, live, elsewhere, starting)
    try:
        assert os.path.getsize(orphan) == 4096
        assert remove_orphans(prefix) == (1, 4096)
        assert [os.path.exists(p) for p in paths] == [False, True, True, True]
        assert remove_orphans(prefix) == (0, 0)
        os.close(elsewhere_fd)  # that creator gone too
        os.close(live_fd)  # closed, but its pid (this process) lives: kept
        assert remove_orphans(prefix) == (1, 4096)
        assert [os.path.exists(p) for p in paths] == [False, True, False, True]
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)


def test_an_allocated_region_holds_its_file_until_closed_and_removes_it():
    region = Region.allocate("r", 10_000)
    fd = os.open(region.path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            raise AssertionError("an allocated region's file is not held")
        except BlockingIOError:
            pass
        assert os.path.basename(region.path).startswith(f"{SHM_PREFIX}{os.getpid()}-")
        region.close()
        assert not os.path.exists(region.path)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with the close
    finally:
        os.close(fd)


@pytest.fixture
def shm_1m(tmp_path):
    with small_shm(tmp_path) as folder:  # SHM_DIR on a 1 MiB tmpfs
        yield folder


def test_a_file_the_tmpfs_has_no_room_for_is_refused_when_made(shm_1m):
    with pytest.raises(OSError) as refused:
        create_shm(f"{SHM_PREFIX}{os.getpid()}-big", 4 << 20)
    assert refused.value.errno == errno.ENOSPC
    assert f"{shm_1m} cannot hold" in str(refused.value) and "4.0 MiB" in str(refused.value)
    assert os.listdir(shm_1m) == []  # nothing half made is left
    fd, path = create_shm(f"{SHM_PREFIX}{os.getpid()}-fits", 768 << 10)  # allocated: the room is taken
    try:
        with pytest.raises(OSError) as refused:
            Region.allocate("r", 512 << 10)
        assert refused.value.errno == errno.ENOSPC
        assert os.listdir(shm_1m) == [os.path.basename(path)]
    finally:
        os.close(fd)
        os.unlink(path)
