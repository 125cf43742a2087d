"""The round's Triton kernels compiled for the drafter's GPUs on any CPU (gpu_kernels.py, in a
process of its own): Hopper (sm_90: the H100 and H200 of the GPU tier) and Ampere (sm_86: the
RTX 3090 the deployment drafts on, which no tier here has). Triton's compiler lowers each
variant a Flash round launches to PTX and its own ptxas assembles a cubin, no GPU needed. A
kernel Triton cannot lower for the GPU (a construct the CPU interpreter accepts and the
compiler does not) fails here, in CI, not in a device call; so does one that spills registers
(cuobjdump counts them as STACK), which a round's single-program kernels cannot afford, or one
that takes more shared memory than the card gives a program. This is the CI's Triton; the GPU
machine's (benchmarks/gpu.sh) compiles them again when its tests run them."""

import importlib.util
from pathlib import Path

import pytest

# found, not imported: Triton fixes on import whether the CPU tests after this one interpret it
if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
    pytest.skip("needs torch and Triton: the dev venv / tools/test's unit tier runs it", allow_module_level=True)

# the most shared memory one program may take (opted in): an H100 or H200, an RTX 3090
SHARED_LIMIT = {90: 227 << 10, 86: 99 << 10}
KERNELS = [*(f"plan shared={s} experts={e}" for s in (True, False) for e in (192, 256)),
           *(f"route {f} bias={b}" for f in ("sqrtsoftplus", "sigmoid", "softmax") for b in (True, False)),
           "experts combine", "top two part, biased", "top two join", "mix products", "mix pre collapse=0",
           "mix pre collapse=1", "mix pre collapse=2", "mix post", "rope", "rms norm", "attend", "attend tf32x3", "attend split",
           "attend split tf32x3", "attend join",
           "expert products nt=4 warps=2", "expert products nt=8 warps=4", "expert products nt=16 warps=4",
           "experts rows in", "experts activation"]
# strict: a spill that goes away fails here, so the entry goes with it
KNOWN_SPILLS = {(86, "plan shared=False experts=192"):
                "ptxas keeps one register of the plan's second loop in local memory on sm_86 (a store "
                "and a load an iteration of its slot blocks)"}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """compiled(arch) -> {kernel variant: {"usage": its resource usage or the error, "shared":
    bytes}}, once per arch."""
    from remote_drafter.testing import compile_report
    cache, done = tmp_path_factory.mktemp("triton-cache"), {}

    def run(arch: int) -> dict:
        if arch not in done:
            done[arch] = compile_report(Path(__file__).with_name("gpu_kernels.py"), arch, cache)
        return done[arch]
    return run


@pytest.mark.parametrize("arch, kernel", [
    pytest.param(arch, kernel, marks=[pytest.mark.xfail(strict=True, reason=KNOWN_SPILLS[arch, kernel])]
                 if (arch, kernel) in KNOWN_SPILLS else [])
    for arch in SHARED_LIMIT for kernel in KERNELS])
def test_the_kernel_compiles_without_spilling(compiled, arch, kernel):
    from remote_drafter.testing import spill_free
    result = compiled(arch)[kernel]
    line = result["usage"]
    assert line.startswith("REG:"), line
    assert result["shared"] <= SHARED_LIMIT[arch], result
    assert spill_free(line), line


@pytest.mark.parametrize("arch", SHARED_LIMIT)
def test_every_variant_is_checked(compiled, arch):
    """The parametrisation above names every variant the script compiles (a new kernel joins it)."""
    assert sorted(compiled(arch)) == sorted(KERNELS)
