"""Which EXL3 linears also hold a dense fp16 copy of their weights, and from how many rows
they use it.

exllamav3's kernels decode every weight from its trellis as they read it. With few rows on a
GPU whose arithmetic keeps up with its memory (an RTX 3090) that costs little; with more rows,
or on a GPU whose bandwidth outruns its arithmetic (an H200), a dense GEMM over exllamav3's
own reconstruction of the same weights is faster although it reads four times the bytes.
Which holds where is measured on the serving GPU at start-up, at the row counts each linear
runs at in the rounds and encodings, and the copies that save the most time per byte are
kept within a memory budget. The weights are the same either way; the GEMM sums in another
order, and the shared expert's (exl3_experts.py) rounds its gate, up and down products to
fp16 where exllamav3's kernel keeps them in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

MARGIN = 0.9  # dense must take at most this fraction of the kernel's time: copies cost memory
WARMUP, REPEATS = 3, 20  # exllamav3 tunes a kernel's launch on its first calls: warmed up first


class DenseCopy:
    """What a linear that may hold a dense copy shares (exl3.Exl3Linear, Exl3Groups,
    exl3_experts.Exl3SharedExpert); each also has probe(rows), run(x, weight or None),
    dense() and the sizes dense_bytes and stored_bytes."""
    dense_weight = None  # dense(), once kept
    dense_from: int | None = None

    def keep_dense(self, from_rows: int) -> None:
        """Hold dense() and take it from `from_rows` rows up. Held for good: a CUDA graph
        captured over it reads its memory."""
        if self.dense_weight is None:
            self.dense_weight = self.dense()
        self.dense_from = from_rows

    def weight_for(self, rows: int):
        """The dense copy if it serves `rows` rows, else None (the kernel)."""
        return self.dense_weight if self.dense_from is not None and rows >= self.dense_from else None


@dataclass(frozen=True)
class Choice:
    name: str
    from_rows: int      # the dense copy serves from this many rows up
    saved_ms: float     # kernel minus dense time, summed over the measured row counts it serves
    nbytes: int         # the dense copy's size
    stored_bytes: int   # the EXL3 weights' size (what the kernel reads instead)


Timing = Callable[[object, list[int]], dict[int, tuple[float, float]]]  # {rows: (kernel ms, dense ms)}


def time_paths(linear, counts: list[int]) -> dict[int, tuple[float, float]]:
    """Milliseconds a call of `linear` (exl3.Exl3Linear, Exl3Groups or exl3_experts'
    Exl3SharedExpert) takes at each row count through exllamav3's kernel and as a dense GEMM,
    each the mean of REPEATS calls after WARMUP, timed on the linear's own GPU."""
    dense, times = linear.dense(), {}
    for rows in counts:
        x, pair = linear.probe(rows), []
        with torch.cuda.device(x.device):
            stream = torch.cuda.current_stream(x.device)
            for weight in (None, dense):
                for _ in range(WARMUP):
                    linear.run(x, weight)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                for _ in range(REPEATS):
                    linear.run(x, weight)
                end.record(stream)
                end.synchronize()
                pair.append(start.elapsed_time(end) / REPEATS)
        times[rows] = (pair[0], pair[1])
    return times


def threshold(times: dict[int, tuple[float, float]]) -> int | None:
    """The fewest rows from which dense beats the kernel (by MARGIN) at every measured count
    up: None if it does not at the most rows."""
    from_rows = None
    for rows in sorted(times, reverse=True):
        kernel, dense = times[rows]
        if dense > MARGIN * kernel:
            break
        from_rows = rows
    return from_rows


def choose(linears: dict[str, tuple[object, list[int]]], budget_bytes: int,
           timing: Timing = time_paths) -> list[Choice]:
    """Measure each linear at its row counts ({name: (linear, the row counts it runs at)}),
    then keep the dense copies that save the most time per byte while they fit in
    `budget_bytes` (keep_dense on each chosen linear)."""
    candidates = []
    for name, (linear, counts) in linears.items():
        if budget_bytes < linear.dense_bytes or not counts:
            continue
        times = timing(linear, sorted(set(counts)))
        from_rows = threshold(times)
        if from_rows is not None:
            saved = sum(k - d for rows, (k, d) in times.items() if rows >= from_rows)
            candidates.append(Choice(name, from_rows, saved, linear.dense_bytes, linear.stored_bytes))
    chosen, left = [], budget_bytes
    for c in sorted(candidates, key=lambda c: c.saved_ms / c.nbytes, reverse=True):
        if c.nbytes <= left:
            linears[c.name][0].keep_dense(c.from_rows)
            chosen.append(c)
            left -= c.nbytes
    return chosen


def describe(chosen: list[Choice]) -> dict:
    """Status: which linears hold a dense copy, from how many rows, and the bytes held."""
    return {"bytes": sum(c.nbytes for c in chosen),
            "from_rows": {c.name: c.from_rows for c in sorted(chosen, key=lambda c: c.name)}}
