"""Unit tier for the host-flags helper: atomics and futexes across two processes, the
slot protocol's ownership rules, garbage in a slot, and a two-thread stress in C
(natively and for aarch64 under qemu-user)."""

import multiprocessing as mp
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from async_handoff._hostflags import ffi, lib
from async_handoff.hostflags import HostFlags
from ofl.testing import wait_until

HERE = Path(__file__).parent
CSRC = HERE.parent / "src" / "async_handoff" / "csrc"


@pytest.fixture
def flags():
    f = HostFlags.create(f"hf-test-{os.getpid()}-{time.monotonic_ns()}", 3, 256)
    yield f
    f.close(unlink=True)


def _waiter(path, result):
    f = HostFlags.open(path)
    word = ffi.cast("uint32_t *", ffi.cast("uint8_t *", f.base) + lib.HF_STATUS_OFFSET)
    rc = lib.hf_wait_change(word, 0, lib.HF_NAP, 0, int((time.monotonic() + 60) * 1e9))
    result.put((rc, lib.hf_load32(word)))


def test_futex_wake_across_processes(flags):
    result = mp.Queue()
    child = mp.get_context("fork").Process(target=_waiter, args=(flags.path, result))
    child.start()
    word = ffi.cast("uint32_t *", ffi.cast("uint8_t *", flags.base) + lib.HF_STATUS_OFFSET)
    # The child is asleep in the futex once a wake on the shared word finds it (a wake that
    # cannot reach another process, a private futex, never does). Woken with the word
    # unchanged, it sleeps again.
    wait_until(lambda: lib.hf_futex_wake(word, 1), lambda n: n == 1,
               "a wake reaching the child asleep in the futex", 30)
    lib.hf_store32(word, 42)
    lib.hf_futex_wake(word, 1)
    rc, seen = result.get(timeout=30)
    child.join(30)
    # it returned only once the word changed: it waited for the store
    assert rc == lib.HF_OK and seen == 42 and child.exitcode == 0


def test_atomics_and_timeouts():
    cell = ffi.new("uint64_t *")
    assert lib.hf_cas64(cell, 0, 9) and lib.hf_load64(cell) == 9
    assert not lib.hf_cas64(cell, 0, 10) and lib.hf_load64(cell) == 9
    word = ffi.new("uint32_t *")
    t = time.monotonic()
    assert lib.hf_wait_change(word, 0, lib.HF_NAP, 1000, int((t + 0.05) * 1e9)) == lib.HF_ETIMEDOUT
    assert lib.hf_wait_change(word, 0, lib.HF_SPIN, 0, int((t + 0.1) * 1e9)) == lib.HF_ETIMEDOUT
    assert 0.09 < time.monotonic() - t < 2


def test_round_trip_and_ownership(flags):
    gen, _ = flags.new_generation()
    t = flags.submit(b"ask")
    assert flags.poll(t)[0] == lib.HF_PENDING
    rc, slot, seq, req = flags.take(gen, lib.HF_NAP, 0, time.monotonic() + 1)
    assert (rc, slot, seq, req) == (lib.HF_OK, t.slot, t.seq, b"ask")
    assert flags.take(gen + 1, lib.HF_NAP, 0, time.monotonic() + 0.01)[0] == lib.HF_EGEN
    assert flags.complete(slot, seq, b"answer", lib.HF_ROUND_OK) == lib.HF_OK
    assert flags.poll(t) == (lib.HF_OK, b"answer", lib.HF_ROUND_OK)
    assert flags.poll(t)[0] == lib.HF_ESTALE  # taken once, never twice


def test_late_reply_never_reaches_the_next_round(flags):
    gen, _ = flags.new_generation()
    first = flags.submit(b"round n")
    _, slot, seq, _ = flags.take(gen, lib.HF_NAP, 0, time.monotonic() + 1)
    assert flags.reclaim(first)            # the engine gives up on round n
    second = flags.submit(b"round n+1")    # ... and reuses the slot
    assert second.slot == slot and second.seq != seq
    assert flags.complete(slot, seq, b"late answer to n", lib.HF_ROUND_OK) == lib.HF_ESTALE
    assert flags.poll(second)[0] == lib.HF_PENDING
    assert flags.poll(first)[0] == lib.HF_ESTALE


def test_new_generation_reclaims_and_hides_old_rounds(flags):
    gen, _ = flags.new_generation()
    t = flags.submit(b"old")
    gen2, reclaimed = flags.new_generation()
    assert reclaimed == 1 and gen2 == gen + 1
    assert flags.take(gen, lib.HF_NAP, 0, time.monotonic() + 0.01)[0] == lib.HF_EGEN
    assert flags.take(gen2, lib.HF_NAP, 0, time.monotonic() + 0.01)[0] == lib.HF_ETIMEDOUT
    assert flags.poll(t)[0] == lib.HF_ESTALE


def test_full_and_too_big(flags):
    flags.new_generation()
    tickets = [flags.submit(b"x") for _ in range(3)]
    assert all(not isinstance(t, int) for t in tickets)
    assert flags.submit(b"x") == lib.HF_EFULL
    assert flags.submit(b"y" * 257) == lib.HF_ETOOBIG


def test_garbage_in_slots_is_never_a_reply(flags):
    gen, _ = flags.new_generation()
    rng = np.random.default_rng(0)
    ctl = np.frombuffer(flags.region.view, np.uint8)[4096:4096 + 3 * 64]
    for trial in range(300):
        t = flags.submit(b"real %d" % trial)
        if isinstance(t, int):  # every slot wedged by garbage: reclaim them all
            flags.new_generation()
            gen += 1
            continue
        ctl[rng.integers(0, ctl.size, 8)] = rng.integers(0, 256, 8, dtype=np.uint8)
        rc, reply, status = flags.poll(t)
        assert rc != lib.HF_OK or reply == b"", "garbage turned into a reply"
        rc, slot, seq, req = flags.take(gen, lib.HF_NAP, 0, time.monotonic() + 0.001)
        if rc == lib.HF_OK:
            flags.complete(slot, seq, req, lib.HF_ROUND_OK)
        rc, reply, status = flags.poll(t)
        assert rc != lib.HF_OK or reply in (b"real %d" % trial, b"")


def build(tmp_path, compiler, extra=()):
    exe = tmp_path / f"t-{Path(compiler).name}"
    res = subprocess.run([compiler, "-O2", "-Wall", "-Werror", "-std=gnu11", "-pthread", *extra,
                          f"-I{CSRC}", str(HERE / "csrc" / "test_hostflags.c"),
                          str(CSRC / "hostflags.c"), "-o", str(exe)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return exe


def need(tool):
    path = shutil.which(tool)
    if not path:
        pytest.fail(f"{tool} is missing: tools/setup.sh installs it (gcc-aarch64-linux-gnu, qemu-user)")
    return path


def test_two_thread_stress_native(tmp_path):
    res = subprocess.run([str(build(tmp_path, need("cc")))], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr


def test_two_thread_stress_aarch64(tmp_path):
    exe = build(tmp_path, need("aarch64-linux-gnu-gcc"), ["-static"])
    res = subprocess.run([need("qemu-aarch64"), str(exe), "20000"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr
