"""The shared test helpers' own contracts (CPU only, any machine)."""

import time

import pytest

from ofl.testing import link_delay


@pytest.mark.parametrize("seconds", [0.0, 0.0004, 0.003])
def test_a_simulated_link_delay_never_ends_early(seconds):
    for _ in range(20):
        started = time.perf_counter()
        link_delay(seconds)
        took = time.perf_counter() - started
        assert took >= seconds, f"{seconds * 1e3:g} ms delay ended after {took * 1e3:.3f} ms"
        # late only by a preemption at worst: a bug sleeping ms as s would be seconds late
        assert took < seconds + 0.25, took
