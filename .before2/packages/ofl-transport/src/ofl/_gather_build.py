"""cffi (API mode) builder of `ofl._gather_cffi`, the row-gather loop (plain C, no libraries);
run by hatch_build.py. Without it ofl.gather falls back to numpy (same bytes, slower)."""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

CSRC = Path(__file__).parent / "csrc"


def builder() -> FFI:
    ffi = FFI()
    ffi.cdef("""
        void ofl_gather_rows(uint8_t *dst, const uint8_t *src, const uint64_t *offsets,
                             size_t count, size_t len);
        void ofl_gather_ranges(uint8_t *dst, const uint8_t *src, const uint64_t *offsets,
                               const uint32_t *lengths, size_t count);
    """)
    ffi.set_source("ofl._gather_cffi", "", sources=[str(CSRC / "ofl_gather.c")],
                   extra_compile_args=["-O2", "-std=gnu11", "-Wall"])
    return ffi
