"""Lifetime device locks (remote_drafter.worker.device_lock), shared by the one-card worker and
drafter-tp2's ranks: a held device refuses a second worker naming the holder, a dead
holder's lock is cleared, the lock is free again (with no record) once the worker stops.
CPU tier: REMOTE_DRAFTER_DEVICE_LOCK=1 locks CPU 'devices' as auto locks GPUs; the same
path on a real GPU (UUID key) runs in packages/drafter-tp2-nvlink/benchmarks/gpu.sh."""

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from remote_drafter.worker.device_lock import DeviceBusy, DeviceLock, device_key, worker_lock
from remote_drafter.worker.server import spawn_worker


@pytest.fixture
def lock_dir(tmp_path, monkeypatch):
    folder = str(tmp_path / "locks")
    monkeypatch.setenv("REMOTE_DRAFTER_LOCK_DIR", folder)
    monkeypatch.setenv("REMOTE_DRAFTER_DEVICE_LOCK", "1")
    return folder


def worker_args(models, device="cpu:0"):
    return ["--drafter", models["dspark"], "--target", models["target"], "--device", device,
            "--listen", "127.0.0.1:0"]


def test_a_locked_device_refuses_a_second_one_card_worker_until_the_first_stops(models, lock_dir):
    first, _ = spawn_worker(worker_args(models), env=dict(os.environ))
    try:
        second = subprocess.run([sys.executable, "-m", "remote_drafter.cli", "worker",
                                 *worker_args(models)], capture_output=True, text=True, timeout=90)
        assert second.returncode == 2, second
        assert f"device {device_key('cpu:0')} is in use" in second.stderr, second.stderr
        assert f"locked by pid {first.pid}" in second.stderr, second.stderr
        other, _ = spawn_worker(worker_args(models, "cpu:1"), env=dict(os.environ))  # another device is free
        other.terminate()
        assert other.wait(timeout=30) == 0
    finally:
        first.terminate()
        first.wait(timeout=30)
    assert first.returncode == 0
    lock = DeviceLock(device_key("cpu:0"), lock_dir).acquire()  # released, no record left
    assert lock.cleared is None
    lock.release()


def test_auto_locks_gpus_only_and_bad_modes_are_refused(lock_dir, monkeypatch):
    monkeypatch.setenv("REMOTE_DRAFTER_DEVICE_LOCK", "auto")
    assert worker_lock("cpu") is None
    monkeypatch.setenv("REMOTE_DRAFTER_DEVICE_LOCK", "0")
    assert worker_lock("cpu") is None
    monkeypatch.setenv("REMOTE_DRAFTER_DEVICE_LOCK", "yes")
    with pytest.raises(ValueError, match="expected 'auto' or '0' or '1'"):
        worker_lock("cpu")
    monkeypatch.setenv("REMOTE_DRAFTER_DEVICE_LOCK", "1")
    held = worker_lock("cpu:3")
    try:
        with pytest.raises(DeviceBusy):
            worker_lock("cpu:3")
    finally:
        held.release()


def test_a_dead_holders_lock_is_cleared(lock_dir):
    key = device_key("cpu:7")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from remote_drafter.worker.device_lock import DeviceLock; "
        f"DeviceLock({key!r}, {lock_dir!r}).acquire(); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DeviceBusy, match=f"locked by pid {holder.pid}"):
            DeviceLock(key, lock_dir).acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = DeviceLock(key, lock_dir).acquire()  # the kernel dropped the dead holder's flock
    try:
        assert lock.cleared is not None and lock.cleared["pid"] == holder.pid
        with pytest.raises(DeviceBusy):  # and now it is this process's, exclusively
            DeviceLock(key, lock_dir).acquire()
    finally:
        lock.release()


def test_locks_of_one_process_exclude_each_other_and_name_the_holder(lock_dir):
    a = DeviceLock("GPU-1234", lock_dir).acquire()
    try:
        with pytest.raises(DeviceBusy) as refused:
            DeviceLock("GPU-1234", lock_dir).acquire()
        assert "device GPU-1234 is in use" in str(refused.value)
        DeviceLock("GPU-5678", lock_dir).acquire().release()  # another card is free
    finally:
        a.release()
    started = time.monotonic()
    DeviceLock("GPU-1234", lock_dir).acquire().release()
    assert time.monotonic() - started < 1
