"""A DeepSeek drafter MoE layer's EXL3 experts through exllamav3's fused multi-expert kernels:
the routed experts every row chose, and the shared expert, in a handful of launches with no
host synchronisation, so a CUDA graph captures the whole round (the per-matrix path reads
the routing on the host and launches three kernels per chosen expert).

Two tiers, as exllamav3's own BlockSparseMLP has them, both reading each chosen expert's
weights once per call:
* up to COOP_SLOTS routed slots (rows x top-k): `exl3_moe_coop`, gate/up, activation, down
  and the weighted sum in two launches; the shared expert is a one-expert launch (or, where
  it measured faster, three dense GEMMs: exl3_dense.py) whose output the routed launch adds;
* more rows: `exl3_moe` over the assignments sorted by expert, then `exl3_moe_gather` sums
  each row's slots in a fixed order (deterministic), the shared expert added after.
The routing stays the model's (dsv41/modules/moe.py MoE.route); its weights go in as fp16, as exllamav3's
routers hand them over. The activation is exllamav3's SiLU with a limit,
min(silu(g), L) * clamp(u, -L, L): DeepSeek's silu(min(g, L)) * clamp(u, -L, L) differs only
where g > L, by at most L / (1 + e^L).

exllamav3 is reached through exl3.load_exllamav3 (exl3.py stays its only importer): nothing
loads it unless EXL3 weights are served. The pointer tables hold the addresses of the Exl3Linears' own tensors (no copy of
any weight), so those linears must stay alive and in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .exl3 import Exl3Linear, load_exllamav3, random_half
from .exl3_dense import DenseCopy

SILU = 0  # exllamav3's MOE_COOP_ACT_SILU == MOE_ACT_SILU
COOP_SLOTS = 256  # exl3_moe_coop's scratch holds 1..256 slots
ALIGN = 128  # the fused kernels' dimension granularity


def _ext():
    return load_exllamav3().ext


@dataclass
class _Projection:
    """One projection (gate, up or down) of a set of experts: device tables of its tensors'
    addresses, expert order, and what every expert shares."""
    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    bits: float
    in_stored: int
    out_stored: int
    mcg: bool
    mul1: bool

    @classmethod
    def of(cls, linears: list[Exl3Linear], device) -> _Projection:
        inner = [m.inner for m in linears]
        first = inner[0]
        shapes = {(m.in_stored, m.inner.trellis.shape[1] * 16) for m in linears}
        if len(shapes) > 1 or any((i.K, i.mcg, i.mul1) != (first.K, first.mcg, first.mul1) for i in inner):
            raise ValueError("experts of one projection differ in shape, bits or codebook")

        def table(name):
            return torch.tensor([getattr(i, name).data_ptr() for i in inner], dtype=torch.long, device=device)
        (k_in, n_out), = shapes
        return cls(table("trellis"), table("suh"), table("svh"), float(first.K), k_in, n_out,
                   bool(first.mcg), bool(first.mul1))

    @property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.trellis, self.suh, self.svh


class _CoopScratch:
    """exl3_moe_coop's working buffers for `slots` slots and `rows` rows (its counters are
    zeroed once: each launch re-zeroes the other's)."""

    def __init__(self, slots: int, rows: int, gate: _Projection, down: _Projection, width: int, device):
        half, f32 = dict(dtype=torch.half, device=device), dict(dtype=torch.float, device=device)
        i, ho = gate.out_stored, down.out_stored
        self.had_g, self.had_u = torch.empty(slots, gate.in_stored, **half), torch.empty(slots, gate.in_stored, **half)
        self.gu_g, self.gu_u = torch.empty(slots, i, **f32), torch.empty(slots, i, **f32)  # fp32 pre-activation
        self.act = torch.empty(slots, i, **half)
        self.d_out = torch.empty(slots, ho, **f32)
        self.ctr = torch.zeros(slots * (i // ALIGN) + rows * (ho // ALIGN) + 2 + (slots + 1) + slots,
                               dtype=torch.int, device=device)
        self.out = torch.empty(rows, width, **f32)


def _coop(projections, scratch: _CoopScratch, x, sel, rw, shared, limit: float) -> None:
    gate, up, down = projections
    _ext().exl3_moe_coop(
        x, sel, rw, -1, -1, gate.in_stored, *gate.tables, *up.tables, *down.tables, None, None, None,
        gate.bits, up.bits, down.bits, gate.mcg, gate.mul1, SILU, limit, True,
        scratch.had_g, scratch.had_u, scratch.gu_g, scratch.gu_u, scratch.act, scratch.d_out,
        scratch.ctr, scratch.out, shared, None)


class Exl3SharedExpert(DenseCopy):
    """A layer's shared expert on every row, fp16 x [rows, H] -> float32 [rows, H]: a
    one-expert coop launch per COOP_SLOTS rows (its result in its buffers until the next
    call), or from `dense_from` rows up (keep_dense: exl3_dense.py) three dense GEMMs over
    exllamav3's reconstruction of its weights, with the kernels' activation (their products
    rounded to fp16, where the kernels keep fp32)."""

    def __init__(self, linears: tuple[Exl3Linear, Exl3Linear, Exl3Linear], limit: float, width: int, device):
        self.linears, self.limit, self.width, self.device = linears, limit, width, device
        self.projections = tuple(_Projection.of([m], device) for m in linears)
        Exl3Experts.check(*self.projections)
        gate, _, down = self.projections
        self.scratch = _CoopScratch(COOP_SLOTS, COOP_SLOTS, gate, down, width, device)
        self.one_expert = (torch.zeros(COOP_SLOTS, 1, dtype=torch.long, device=device),
                           torch.ones(COOP_SLOTS, 1, dtype=torch.half, device=device))
        self.stored_bytes = sum(m.stored_bytes for m in linears)
        self.dense_bytes = sum(m.dense_bytes for m in linears)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, self.weight_for(x.shape[0]))

    def run(self, x: torch.Tensor, dense: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
        if dense is not None:
            w1, w3, w2 = dense
            gate, up = F.silu(F.linear(x, w1).float()), F.linear(x, w3).float()
            if self.limit:
                gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return F.linear((gate * up).half(), w2).float()
        rows = x.shape[0]
        if rows > COOP_SLOTS:
            return torch.cat([self.run(x[i:i + COOP_SLOTS], None).clone() for i in range(0, rows, COOP_SLOTS)])
        sel, rw = self.one_expert
        _coop(self.projections, self.scratch, x, sel[:rows], rw[:rows], None, self.limit)
        return self.scratch.out[:rows]

    def probe(self, rows: int) -> torch.Tensor:
        return random_half((rows, self.width), self.device)

    def dense(self) -> tuple[torch.Tensor, ...]:
        return tuple(m.dense() for m in self.linears)


class Exl3Experts:
    """Layer j's MoE in EXL3: call with x [rows, H], the routing (weights [rows, k], chosen
    experts [rows, k] int64) -> [rows, H] float32, routed sum plus the shared expert. The
    result of the coop tier lives in this layer's buffers until its next call."""

    def __init__(self, routed: list[tuple[Exl3Linear, Exl3Linear, Exl3Linear]],
                 shared: tuple[Exl3Linear, Exl3Linear, Exl3Linear] | None, top_k: int,
                 limit: float | None, device, sorted_tier: bool = True):
        """sorted_tier False: above COOP_SLOTS slots, the coop tier in chunks (an
        expert-parallel slice: the exl3_moe tier summed a slice's rows wrongly on the GPU
        tier, cause not found yet, while the coop tier summed them right)."""
        self.device = torch.device(device)
        self.gate, self.up, self.down = (_Projection.of([e[p] for e in routed], self.device) for p in range(3))
        self.top_k, self.experts = top_k, len(routed)
        self.limit = float(limit or 0.0)
        self.width = routed[0][2].out_features
        self.check(self.gate, self.up, self.down)
        self.coop_rows = COOP_SLOTS // top_k
        self.coop = _CoopScratch(self.coop_rows * top_k, self.coop_rows, self.gate, self.down, self.width, self.device)
        self.shared = None if shared is None else Exl3SharedExpert(shared, self.limit, self.width, self.device)
        # the exl3_moe tier reads rows unpadded: every expert dimension exact
        self.fused_tier = sorted_tier and self.gate.in_stored == self.width == self.down.out_stored and \
            routed[0][0].out_features == self.gate.out_stored
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.concurrency = _ext().exl3_moe_max_concurrency(index)

    @staticmethod
    def check(gate: _Projection, up: _Projection, down: _Projection) -> None:
        why = None
        if (gate.mcg, gate.mul1) != (up.mcg, up.mul1) or (up.mcg, up.mul1) != (down.mcg, down.mul1):
            why = "gate, up and down use different codebooks"
        elif gate.bits != up.bits:
            why = f"gate and up differ in bits ({gate.bits} vs {up.bits})"
        elif any(n % ALIGN for n in (gate.in_stored, gate.out_stored, down.out_stored)):
            why = f"dimensions not multiples of {ALIGN}"
        elif (gate.in_stored, gate.out_stored) != (up.in_stored, up.out_stored) or down.in_stored != gate.out_stored:
            why = "gate, up and down shapes do not chain"
        if why:
            raise ValueError(f"EXL3 experts cannot run fused: {why}")

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        x = x.to(torch.half).contiguous()
        sel, rw = experts.contiguous(), weights.to(torch.half).contiguous()
        shared = self.shared(x) if self.shared is not None else None
        if rows <= self.coop_rows:
            _coop((self.gate, self.up, self.down), self.coop, x, sel, rw, shared, self.limit)
            return self.coop.out[:rows]
        if not self.fused_tier:  # padded dimensions: coop in chunks
            return torch.cat([self(x[i:i + self.coop_rows], weights[i:i + self.coop_rows],
                                   experts[i:i + self.coop_rows]).clone()
                              for i in range(0, rows, self.coop_rows)])
        out = self._sorted(x, sel, rw)
        return out if shared is None else out.add_(shared)

    def _sorted(self, x: torch.Tensor, sel: torch.Tensor, rw: torch.Tensor) -> torch.Tensor:
        """exl3_moe over the assignments sorted by expert, counts without a host read."""
        ext, rows, k, dev = _ext(), x.shape[0], self.top_k, self.device
        flat = sel.view(-1)
        order = flat.argsort()
        slots = rows * k
        token_sorted = torch.arange(rows, device=dev).repeat_interleave(k)[order]
        weight_sorted = rw.view(-1)[order]
        count = torch.zeros(self.experts + 1, dtype=torch.long, device=dev).index_add_(0, flat, torch.ones_like(flat))
        start = count.cumsum(0) - count
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(slots, device=dev))
        kind = (count > 0).long()
        half = dict(dtype=torch.half, device=dev)
        c, i = self.concurrency, self.gate.out_stored
        state_g, state_u = torch.empty(c, rows, self.width, **half), torch.empty(c, rows, self.width, **half)
        inter_g, inter_u = torch.empty(c, rows, i, **half), torch.empty(c, rows, i, **half)
        scratch = torch.empty(slots, self.width, dtype=torch.float, device=dev)
        out = torch.zeros(rows, self.width, dtype=torch.float, device=dev)
        g, u, d = self.gate, self.up, self.down
        ext.exl3_moe(x, out, count, token_sorted, weight_sorted, state_g, state_u, inter_g, inter_u, SILU,
                     g.bits, u.bits, d.bits, *g.tables, *u.tables, *d.tables,
                     g.mcg, g.mul1, u.mcg, u.mul1, d.mcg, d.mul1, self.limit, -1, scratch, start, 1, rows, 16)
        e = self.experts
        ext.exl3_moe_gather(out, scratch, flat, inverse, start[:e], start[:e], kind[:e], weight_sorted)
        return out

