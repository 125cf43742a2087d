"""tools/exl3-ext.sh: exllamav3's extension built on one GPU machine and carried to the next
(the GPU tier's calls then skip its build). Any CPU: a stand-in extension module of the same
name, compiled here, plays the build; what is checked is which builds the GPU machine takes.
The real build is taken by the GPU tier's first call that carries .exl3ext (its log says
"installed (no build)" and exllamav3 is ready in seconds)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]
MODULE = """#include <Python.h>
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "exllamav3_ext", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_exllamav3_ext(void) { return PyModule_Create(&def); }
"""


def this_machine(**changed) -> dict:
    """exl3ext.json as a build made on this machine would record it."""
    arch = "%d.%d" % torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "arch": arch, **changed}


@pytest.fixture
def repo(tmp_path):
    """A checkout's tools/ with .exl3ext/ and a site folder; carry(so, record) fills .exl3ext."""
    (tmp_path / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "exl3-ext.sh", tmp_path / "tools")
    (tmp_path / "site").mkdir()

    def carry(so: bytes, record: dict) -> None:
        ext = tmp_path / ".exl3ext"
        ext.mkdir(exist_ok=True)
        (ext / "exl3ext.json").write_text(json.dumps(record))
        packed = subprocess.run(["xz", "-c"], input=so, capture_output=True, check=True).stdout
        half = len(packed) // 2  # in parts, as they come back from the device machine
        (ext / "exl3ext.so.xz.aa").write_bytes(packed[:half])
        (ext / "exl3ext.so.xz.ab").write_bytes(packed[half:])
    return tmp_path, carry


def run(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}  # this python3, with torch
    return subprocess.run(["bash", str(root / "tools" / "exl3-ext.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=120)


def stand_in(tmp_path: Path) -> bytes:
    """A real extension module named exllamav3_ext, built for this Python."""
    src = tmp_path / "ext.c"
    src.write_text(MODULE)
    out = tmp_path / "exllamav3_ext.so"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler: the packages' cffi helpers need one too (tools/setup.sh)")
    subprocess.run([cc, "-shared", "-fPIC", "-I", sysconfig.get_paths()["include"], str(src), "-o", str(out)],
                   check=True)
    return out.read_bytes()


def test_a_build_for_this_machine_is_installed_and_loads(repo, tmp_path):
    root, carry = repo
    carry(stand_in(tmp_path), this_machine())
    assert run(root, "check").returncode == 0
    done = run(root, "install", str(root / "site"))
    assert done.returncode == 0 and "installed (no build)" in done.stdout
    loaded = subprocess.run([sys.executable, "-c", "import exllamav3_ext; print(exllamav3_ext.__file__)"],
                            cwd=root / "site", capture_output=True, text=True, check=True)
    assert loaded.stdout.strip().endswith("exllamav3_ext.so")


@pytest.mark.parametrize("field,value", [("torch", "0.0.0"), ("python", "2.7.18"), ("arch", "1.0")])
def test_a_build_for_another_torch_python_or_gpu_is_left_out(repo, tmp_path, field, value):
    root, carry = repo
    carry(stand_in(tmp_path), this_machine(**{field: value}))
    check = run(root, "check")
    assert check.returncode != 0 and "does not fit" in check.stderr and field in check.stderr
    if field == "torch":  # install says the same and goes on (exllamav3 then builds its own)
        assert run(root, "install", str(root / "site")).returncode == 0
        assert not list((root / "site").iterdir())


def test_a_build_that_does_not_load_is_removed(repo):
    root, carry = repo
    carry(b"\x7fELF but not a library", this_machine())
    done = run(root, "install", str(root / "site"))
    assert done.returncode == 0 and "does not load here" in done.stderr
    assert not list((root / "site").iterdir())


def test_nothing_carried_changes_nothing(repo):
    root, _ = repo
    assert "no carried build" in run(root, "check").stderr
    assert run(root, "install", str(root / "site")).returncode == 0
    assert not list((root / "site").iterdir())
