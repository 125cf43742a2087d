"""cffi (API mode) builder of the verbs helper `ofl._verbs_cffi`; run by hatch_build.py.

API mode because ibv_post_send, ibv_post_recv and ibv_poll_cq are static inline functions
in verbs.h: only compiled code reaches them.
"""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

CSRC = Path(__file__).parent / "csrc"

# The declarations are the header's own (between its cdef markers), so they cannot drift;
# the verbs types they point to stay opaque to Python.
HEADER = (CSRC / "ofl_verbs.h").read_text()
CDEF = "\n".join([
    "struct ibv_context; struct ibv_pd; struct ibv_mr; struct ibv_qp; struct ibv_cq;",
    "struct ibv_comp_channel;",
    HEADER.split("/* cdef-begin */")[1].split("/* cdef-end */")[0],
    "const char *ibv_wc_status_str(int status);",
])


def builder() -> FFI:
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        "ofl._verbs_cffi",
        '#include "ofl_verbs.h"\n',
        sources=[str(CSRC / "ofl_verbs_dp.c"), str(CSRC / "ofl_verbs_setup.c")],
        include_dirs=[str(CSRC)],
        libraries=["ibverbs"],
        extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    )
    return ffi
