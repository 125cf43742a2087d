"""The round's Triton kernels compiled for a Hopper GPU (sm_90: the H100 and H200 of the GPU
tier) on any CPU (hopper_kernels.py, in a process of its own): Triton's compiler lowers each
variant a Flash round launches to PTX and its own ptxas assembles a cubin, no GPU needed. A
kernel Triton cannot lower for the GPU (a construct the CPU interpreter accepts and the
compiler does not) fails here, in CI, not in a device call; so does one that spills registers
(cuobjdump counts them as STACK), which a round's single-program kernels cannot afford. This
is the CI's Triton; the GPU machine's (benchmarks/gpu.sh) compiles them again when its tests
run them."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# found, not imported: Triton fixes on import whether the CPU tests after this one interpret it
if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
    pytest.skip("needs torch and Triton: the dev venv / tools/test's unit tier runs it", allow_module_level=True)


@pytest.fixture(scope="module")
def usage(tmp_path_factory):
    """{kernel variant: its resource usage, or the error}; Triton's cache under the test's
    folder (CI caches nothing outside the repo)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton >= 3.9 warns when unset; 3.6 fuses by default
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("hopper_kernels.py"))], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("kernel", [*(f"plan shared={s} experts={e}" for s in (True, False) for e in (192, 256)),
                                    *(f"route {f} bias={b}" for f in ("sqrtsoftplus", "sigmoid", "softmax")
                                      for b in (True, False)),
                                    "experts combine", "top two part, biased", "top two join",
                                    "mix products", "mix pre collapse=0", "mix pre collapse=1",
                                    "mix pre collapse=2", "mix post", "rope", "rms norm", "attend",
                                    "expert products nt=4 warps=2", "expert products nt=8 warps=4",
                                    "expert products nt=16 warps=4", "experts rows in", "experts activation"])
def test_the_kernel_compiles_for_hopper_without_spilling(usage, kernel):
    line = usage[kernel]
    assert line.startswith("REG:"), line
    assert " STACK:0 " in line and " LOCAL:0 " in line, line


def test_every_variant_is_checked(usage):
    """The parametrisation above names every variant the script compiles (a new kernel joins it)."""
    assert len(usage) == 26
