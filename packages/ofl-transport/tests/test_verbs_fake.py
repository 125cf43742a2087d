"""Unit tier for the verbs data path: work-request chaining, selective signalling,
completion errors and deadlines against fake QP/CQ objects (tests/csrc/test_verbs_dp.c).
Built and run natively, and cross-compiled for aarch64 (the Sparks) and run under
qemu-user. Both toolchains are installed by tools/test."""

import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).parent
CSRC = HERE.parent / "src" / "ofl" / "csrc"
SOURCES = [str(HERE / "csrc" / "test_verbs_dp.c"), str(CSRC / "ofl_verbs_dp.c")]
FLAGS = ["-O1", "-Wall", "-Werror", "-std=gnu11", f"-I{CSRC}"]


def need(tool: str) -> str:
    path = shutil.which(tool)
    if not path:
        pytest.fail(f"{tool} is missing: tools/test installs it (Debian: gcc-aarch64-linux-gnu, "
                    "qemu-user, libibverbs-dev)")
    return path


def cross_includes(tmp_path: Path) -> str:
    """verbs.h is architecture-neutral: give the cross compiler the host's copy alone."""
    inc = tmp_path / "inc"
    shutil.copytree("/usr/include/infiniband", inc / "infiniband")
    return f"-I{inc}"


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def test_data_path_against_fake_queues_native(tmp_path):
    exe = tmp_path / "t"
    build = run([need("cc"), *FLAGS, *SOURCES, "-o", str(exe)])
    assert build.returncode == 0, build.stderr
    res = run([str(exe)])
    assert res.returncode == 0 and "ok: 0 failures" in res.stdout, res.stdout + res.stderr


def test_data_path_against_fake_queues_aarch64(tmp_path):
    exe = tmp_path / "t-arm64"
    build = run([need("aarch64-linux-gnu-gcc"), "-static", *FLAGS, cross_includes(tmp_path),
                 *SOURCES, "-o", str(exe)])
    assert build.returncode == 0, build.stderr
    res = run([need("qemu-aarch64"), str(exe)])
    assert res.returncode == 0 and "ok: 0 failures" in res.stdout, res.stdout + res.stderr


def test_setup_code_compiles_for_aarch64(tmp_path):
    # Set-up links libibverbs at run time, so for aarch64 it is compiled, not run.
    res = run([need("aarch64-linux-gnu-gcc"), *FLAGS, cross_includes(tmp_path), "-c",
               str(CSRC / "ofl_verbs_setup.c"), "-o", str(tmp_path / "setup.o")])
    assert res.returncode == 0, res.stderr
