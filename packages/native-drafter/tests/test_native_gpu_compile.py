"""The kernels compile for the GPU tier's H200 (sm_90) and the deployment's RTX 3090 (sm_86) on
a machine without either (see native_gpu_compile), each with the tiles its shared memory takes,
and a program's shared memory fits what the card gives one. On the 3090 no variant spills
registers; on the H200 the projections do (ROOMY is the set its runs were timed with)."""

from pathlib import Path

import pytest

pytest.importorskip("triton", reason="needs Triton (native-drafter[test])")
from native_drafter import kernels as K  # noqa: E402
from remote_drafter.testing import compile_report, spill_free  # noqa: E402

# the most shared memory one program may take, bytes: ROOMY's tiles on an H100 or H200 (which
# give 227 KiB: ROOMY_SHARED is what tiles_for asks of a card before it takes them), COMPACT's
# on an RTX 3090 (99 KiB)
LIMIT = {90: K.ROOMY_SHARED, 86: 99 << 10}


@pytest.mark.parametrize("arch", LIMIT)
def test_every_kernel_variant_compiles_and_fits_the_card(tmp_path, arch):
    variants = compile_report(Path(__file__).with_name("native_gpu_compile.py"), arch, tmp_path / "triton-cache")
    assert len(variants) == 10
    for name, v in variants.items():
        assert v["usage"].startswith("REG:"), (name, v)
        assert v["shared"] <= LIMIT[arch], (name, v)
        if arch == 86:
            assert spill_free(v["usage"]), (name, v)
