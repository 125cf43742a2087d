"""cffi (API mode) builder of `async_handoff._hostflags` (C11 atomics + futex); run by the
shared hatch hook. The declarations are read from the header, between its cdef markers."""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

CSRC = Path(__file__).parent / "csrc"


def builder() -> FFI:
    header = (CSRC / "hostflags.h").read_text()
    ffi = FFI()
    ffi.cdef(header.split("/* cdef-begin */")[1].split("/* cdef-end */")[0])
    ffi.set_source("async_handoff._hostflags", '#include "hostflags.h"\n',
                   sources=[str(CSRC / "hostflags.c")], include_dirs=[str(CSRC)],
                   extra_compile_args=["-O2", "-std=gnu11", "-Wall"])
    return ffi
