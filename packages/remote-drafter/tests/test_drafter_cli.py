"""The CLI end to end: init a drafter, print its identity, serve it, ask a worker for its
status, and run shadow parity against it (100% at greedy; refused for another drafter);
kernel back ends found by name in the entry-point group other packages register them in."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

import remote_drafter.cli  # noqa: E402
from remote_drafter.testing import WorkerProcess
from remote_drafter.worker.server import spawn_worker


def cli(*args, check=True):
    return subprocess.run([sys.executable, "-m", "remote_drafter.cli", *args], capture_output=True,
                          text=True, check=check)


def test_init_identity_status_shadow(models, tmp_path):
    out = str(tmp_path / "drafter")
    text = cli("init", "--target", models["target"], "--out", out, "--target-layers", "0,2,3",
               "--window", "16").stdout
    assert "randomly initialised" in text
    manifest = json.loads(cli("identity", "--drafter", out, "--target", models["target"],
                              "--out", str(tmp_path / "m.json")).stdout)
    assert manifest["kind"] == "dspark" and json.load(open(tmp_path / "m.json")) == manifest
    worker = WorkerProcess(out, models["target"])
    try:
        status = json.loads(cli("status", "--worker", worker.address).stdout)
        assert status["manifest"] == manifest and status["open_requests"] == 0
        assert status["round_bytes_per_token"]["bfloat16"] == 4 + 3 * 64 * 2
        shadow = json.loads(cli("shadow", "--worker", worker.address, "--drafter", out, "--target",
                                models["target"], "--requests", "3", "--tokens", "24", "--json").stdout)
        assert shadow["fraction"] == 1.0 and shadow["rounds_compared"] > 0
        other = cli("shadow", "--worker", worker.address, "--drafter", models["dspark"], "--target",
                    models["target"], check=False)
        assert other.returncode == 2 and "another drafter" in other.stderr
    finally:
        worker.stop()


def test_a_bfloat16_worker_casts_its_checkpoint_and_says_so(models):
    worker = WorkerProcess(models["dspark"], models["target"], "tcp", 0, "--dtype", "bfloat16")
    try:
        shadow = cli("shadow", "--worker", worker.address, "--drafter", models["dspark"], "--target",
                     models["target"], "--requests", "2", "--tokens", "8", "--json", check=False)
        assert "the worker runs bfloat16 weights" in shadow.stderr, shadow.stderr
        assert json.loads(shadow.stdout)["rounds_compared"] > 0
    finally:
        worker.stop()


def test_env_lists_every_variable():
    text = cli("env").stdout
    for name in ("REMOTE_DRAFTER_ADDRESS", "REMOTE_DRAFTER_CAPACITY_MODE", "REMOTE_DRAFTER_DEPTH"):
        assert name in text


def test_worker_refuses_a_cache_it_cannot_keep_exact(models):
    p = subprocess.run([sys.executable, "-m", "remote_drafter.cli", "worker", "--drafter", models["dspark"],
                        "--target", models["target"], "--listen", "127.0.0.1:0", "--spec-cache"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "tokens alone" in p.stderr


def test_a_kernel_back_end_another_package_registers_is_found_by_name(tmp_path):
    """As native-drafter registers `native`: a distribution on the path whose entry point
    in remote_drafter.kernels names a loader; the worker serves what the loader returns."""
    (tmp_path / "probe_kernels.py").write_text(
        "def load(drafter, device):\n"
        "    described = drafter.describe()\n"
        "    drafter.describe = lambda: {**described, 'kernels': 'probe on ' + device}\n"
        "    return drafter\n")
    info = tmp_path / "probe_kernels-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: probe-kernels\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[remote_drafter.kernels]\nprobe = probe_kernels:load\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    proc, address = spawn_worker(["--drafter", "ngram", "--listen", "127.0.0.1:0", "--kernels", "probe"],
                                 env={**os.environ, "PYTHONPATH": path})
    try:
        status = json.loads(cli("status", "--worker", address).stdout)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert status["drafter"]["kernels"] == "probe on cpu"


def test_kernels_not_installed_are_refused_naming_the_package_that_brings_them(monkeypatch, capsys):
    monkeypatch.setattr(remote_drafter.cli, "entry_points", lambda group: [])
    assert remote_drafter.cli.main(["worker", "--drafter", "ngram", "--kernels", "native"]) == 2
    err = capsys.readouterr().err
    assert err == ("remote-drafter worker: --kernels native is not installed: it comes with "
                   "dsv41-native-drafter and Triton (pip install packages/native-drafter) "
                   "(installed: torch)\n")
    monkeypatch.undo()
    assert remote_drafter.cli.main(["worker", "--drafter", "ngram", "--kernels", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--kernels nope is not installed: it comes with a package registering it under " \
           "remote_drafter.kernels (installed: torch" in err


def test_ordinary_mistakes_are_one_line_and_exit_2(capsys):
    """An unreachable worker, a server that is not a drafter worker, a port already taken:
    one line naming the cause, exit 2 (1 is a check that failed), no traceback."""
    import socket

    from ofl.server import Server
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"
    assert remote_drafter.cli.main(["status", "--worker", nobody]) == 2
    err = capsys.readouterr().err
    assert err.startswith("remote-drafter status: ") and err.count("\n") == 1 and "Traceback" not in err
    with Server("tcp", "127.0.0.1", 0) as other:  # an ofl server of another kind (an Engram server's)
        host, port = other.address
        assert remote_drafter.cli.main(["status", "--worker", f"{host}:{port}"]) == 2
        assert "is an ofl server but not a drafter worker" in capsys.readouterr().err
        assert remote_drafter.cli.main(["worker", "--drafter", "ngram", "--listen", f"{host}:{port}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("remote-drafter worker: ") and "Address already in use" in err
