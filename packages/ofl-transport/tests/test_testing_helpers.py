"""The shared test helpers' own contracts (CPU only, any machine)."""

import os
import signal
import subprocess
import time

import pytest

from ofl.testing import link_delay, sh


@pytest.mark.parametrize("seconds", [0.0, 0.0004, 0.003])
def test_a_simulated_link_delay_never_ends_early(seconds):
    for _ in range(20):
        started = time.perf_counter()
        link_delay(seconds)
        took = time.perf_counter() - started
        assert took >= seconds, f"{seconds * 1e3:g} ms delay ended after {took * 1e3:.3f} ms"
        # late only by a preemption at worst: a bug sleeping ms as s would be seconds late
        assert took < seconds + 0.25, took


def test_sh_waits_for_its_command_alone_not_for_a_process_holding_its_output():
    """A command that leaves a process behind holding its stdout: sh returns at the command's
    exit with what it wrote (a pipe would stay open until the other process ended)."""
    done = sh("sh", "-c", "sleep 1000 & echo $!; echo to stderr >&2", timeout=60)
    left = int(done.stdout)
    try:
        assert done.returncode == 0 and done.stderr == "to stderr\n"
        os.kill(left, 0)  # still running, its stdout still open: sh did not wait for it
    finally:
        os.kill(left, signal.SIGKILL)


def test_sh_raises_on_failure_with_the_commands_output():
    with pytest.raises(subprocess.CalledProcessError) as failed:
        sh("sh", "-c", "echo why >&2; exit 3")
    assert failed.value.returncode == 3 and failed.value.stderr == "why\n"
    assert sh("sh", "-c", "exit 3", check=False).returncode == 3
