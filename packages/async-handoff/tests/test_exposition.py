"""The Handoff's counters read from another process's point of view: served on
ASYNC_HANDOFF_METRICS_LISTEN, parsed back, moving with rounds and with a watchdog fire;
an address already taken costs the counters, never the rounds; the port is freed on close."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from test_handoff import ECHO, Worker, config, free_address, round_trip

from async_handoff import Handoff, HandoffConfig
from async_handoff.cli import main
from async_handoff.exposition import parse, read, serve
from ofl.testing import wait_until


def test_parse_keeps_the_counters_and_gauges_only():
    text = """# HELP async_handoff_rounds_ok_total rounds answered in time
# TYPE async_handoff_rounds_ok_total counter
async_handoff_rounds_ok_total 7.0
async_handoff_rounds_ok_created 1.7e+09
# TYPE async_handoff_watchdog_fires_total counter
async_handoff_watchdog_fires_total 1.0
# TYPE async_handoff_round_seconds histogram
async_handoff_round_seconds_bucket{le="0.001"} 3.0
async_handoff_round_seconds_count 7.0
# TYPE async_handoff_enabled gauge
async_handoff_enabled 1.0
# TYPE engram_client_fallbacks_total counter
engram_client_fallbacks_total 4.0
"""
    assert parse(text) == {"rounds_ok": 7.0, "watchdog_fires": 1.0, "enabled": 1.0}


def test_the_env_variable_reaches_the_config(monkeypatch):
    monkeypatch.setenv("ASYNC_HANDOFF_METRICS_LISTEN", "127.0.0.1:9496")
    assert HandoffConfig.from_env().metrics_listen == "127.0.0.1:9496"


def test_counters_served_move_with_rounds_and_a_watchdog_fire(capsys):
    worker, listen = Worker(), free_address()
    # deadlines no loaded machine reaches: only the SIGKILL below may fire the watchdog
    h = Handoff(config(metrics_listen=listen, round_deadline_ms=2000, heartbeat_timeout_ms=2000), ECHO,
                {"address": worker.address, "backend": "tcp"}).start()
    try:
        assert h.enabled, h.reason
        before = read(listen)
        assert before["rounds_ok"] == 0 and before["enabled"] == 1 and before["watchdog_fires"] == 0
        for i in range(20):
            assert round_trip(h, b"round %d" % i) is not None
        after = read(listen)
        assert after["rounds_ok"] == 20 and after["rounds_failed"] == 0
        assert after == {k: float(v) for k, v in parse(h.prometheus()).items()}
        pid = h.proc.pid
        os.kill(pid, signal.SIGKILL)  # the watchdog notices, respawns, and it shows outside
        wait_until(lambda: h.enabled and h.proc.pid != pid, what="a respawned proxy", timeout_s=15)
        fired = read(listen)
        assert fired["watchdog_fires"] == 1 and fired["respawns"] == 1
        assert main(["counters", "--listen", listen]) == 0  # the CLI prints the same
        assert json.loads(capsys.readouterr().out)["watchdog_fires"] == 1
    finally:
        h.close()
        worker.stop()
    with pytest.raises(OSError):  # closed: nothing answers ...
        read(listen, timeout_s=1)
    assert main(["counters", "--listen", listen]) == 1
    assert "nothing answers" in capsys.readouterr().err
    again = serve(lambda: "", listen)  # ... and the next engine's Handoff can take the port
    again.shutdown()
    again.server_close()


def test_a_taken_address_costs_the_counters_not_the_rounds(caplog):
    worker = Worker()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = "127.0.0.1:%d" % taken.getsockname()[1]
        h = Handoff(config(metrics_listen=listen), ECHO,
                    {"address": worker.address, "backend": "tcp"}).start()
        try:
            assert h.enabled and round_trip(h, b"abc") == b"cba"
            assert f"not served on {listen}" in caplog.text
        finally:
            h.close()
            worker.stop()


def test_the_reader_imports_no_torch():
    code = "import sys, async_handoff.exposition; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
