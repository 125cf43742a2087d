"""A DeepSeek drafter MoE layer's EXL3 experts on our own kernel (exl3_triton.py): each expert
a call chose is decoded once for every 16 rows that chose it, the shared expert being one more
expert that every row chose. The same call as exl3_experts.Exl3Experts (exllamav3's fused
kernels), with no host synchronisation either, so a CUDA graph captures it:

1. the (row, expert) slots sorted by expert on the device and cut into work items of up to 16
   slots of one expert, so that the kernel's grid spans the slots, not every expert, and an
   expert many rows chose (the shared one) is spread over as many programs;
2. gate and up: each slot's row times suh and rotated (128-point Hadamard blocks), the grouped
   product, rotated back and times svh; exllamav3's activation min(silu(g), L) · clamp(u),
   rounded to fp16 as its kernels hand it on;
3. down likewise, each slot's result times its routing weight, then each row's slots summed in
   slot order (the same result every run).

It serves exllamav3's 4-bit mul1 trellis (what our packs and exllamav3's conversions store);
`refusal` says why not otherwise."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn import functional as F

from . import exl3_format, exl3_triton

HAD = exl3_format.HAD


class Stored(NamedTuple):
    """One EXL3 linear as exllamav3 stores it: trellis int16 [in/16, out/16, 16·bits], suh
    [in], svh [out] (fp16)."""
    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor


def refusal(linears: list[Stored], mul1: bool = True) -> str | None:
    """Why these linears cannot run on our kernel, or None."""
    if not mul1:
        return "not the mul1 codebook (our kernel decodes mul1 only)"
    shapes = {tuple(s.trellis.shape) for s in linears}
    if len(shapes) > 1:
        return "experts of one projection differ in shape"
    (tiles_in, tiles_out, words), = shapes
    if words != 16 * exl3_triton.BITS:
        return f"{words // 16}-bit trellis (our kernel decodes {exl3_triton.BITS}-bit)"
    if (16 * tiles_in) % HAD or (16 * tiles_out) % HAD:
        return f"dimensions not multiples of {HAD}"
    return None


class _Projection:
    """One projection (gate, up or down) of every expert: a table of the trellis tensors'
    addresses (the tensors themselves stay where they are, held here), suh and svh stacked."""

    def __init__(self, linears: list[Stored]):
        if why := refusal(linears):
            raise ValueError(f"EXL3 experts cannot run on our kernel: {why}")
        self.trellis = [s.trellis.contiguous() for s in linears]
        first = self.trellis[0]
        # the last entry: the plan's padding expert, whose slots are none (never read)
        addresses = [t.data_ptr() for t in self.trellis]
        self.table = torch.tensor(addresses + addresses[:1], dtype=torch.int64, device=first.device)
        self.suh = torch.stack([s.suh for s in linears]).half()
        self.svh = torch.stack([s.svh for s in linears]).half()
        self.in_features, self.out_features = 16 * first.shape[0], 16 * first.shape[1]

    def __call__(self, x: torch.Tensor, expert_of_slot: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """fp32 [slots, out]: x (fp16 [slots, in], sorted by expert) through each slot's expert."""
        inner = exl3_triton.expert_products(exl3_triton.rotated_in(x, self.suh[expert_of_slot], plan.hadamard),
                                            plan.items, self.table, plan.counts, plan.starts,
                                            self.in_features, self.out_features,
                                            **plan.config(self.in_features, self.out_features))
        return exl3_triton.rotated_out(inner, self.svh[expert_of_slot], plan.hadamard)


class _Plan(NamedTuple):
    """A call's slots by expert: `items` the work items (exl3_triton.work_items), `counts` and
    `starts` where each expert's slots lie in the sorted order; `sms` the GPU's multiprocessors,
    `kernel` the product's configuration (exl3_triton.expert_products' keywords but splits),
    `hadamard` the rotation."""
    items: tuple[torch.Tensor, torch.Tensor]
    counts: torch.Tensor
    starts: torch.Tensor
    sms: int
    kernel: dict
    hadamard: torch.Tensor

    def config(self, in_features: int, out_features: int) -> dict:
        """The kernel's configuration and its split of the input: enough programs to fill the
        GPU, counting every work item the call may have (the bound, as the routing is not read
        on the host; an item without slots returns at once), each split at least 8 input tiles
        (the partials are summed afterwards)."""
        nt = self.kernel["nt"]
        while (out_features // 16) % nt:  # a narrower weight: fewer tile columns a program
            nt //= 2
        programs = out_features // (16 * nt) * len(self.items[0])
        splits = 1
        while programs * splits < 8 * self.sms and (in_features // 16) % (2 * splits) == 0 \
                and in_features // 16 // (2 * splits) >= 8:
            splits *= 2
        return {**self.kernel, "nt": nt, "splits": splits}


class TritonExl3Experts:
    """Layer j's MoE in EXL3 on our kernel: call with x [rows, H], the routing (weights
    [rows, k], chosen experts [rows, k] int64) -> [rows, H] float32, routed sum plus the shared
    expert."""

    def __init__(self, routed: list[tuple[Stored, Stored, Stored]], shared: tuple[Stored, Stored, Stored] | None,
                 limit: float | None):
        every = routed + ([shared] if shared is not None else [])
        self.gate, self.up, self.down = (_Projection([e[p] for e in every]) for p in range(3))
        if (self.gate.out_features, self.down.in_features) != (self.up.out_features, self.gate.out_features):
            raise ValueError("EXL3 experts cannot run on our kernel: gate, up and down shapes do not chain")
        self.experts, self.has_shared = len(routed), shared is not None
        self.limit = float(limit or 0.0)
        self.kernel = {"nt": exl3_triton.NT_DEFAULT, "num_warps": exl3_triton.WARPS_DEFAULT}  # the product's configuration (a benchmark may try others)
        device = self.gate.table.device
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        self.hadamard = exl3_triton.hadamard(device)

    @classmethod
    def of(cls, routed: list, shared, limit: float | None) -> TritonExl3Experts:
        """From Exl3Linears (models/exl3.py: each holds exllamav3's LinearEXL3 as `inner`)."""
        def stored(linears):
            inner = [m.inner for m in linears]
            if any(not i.mul1 for i in inner):
                raise ValueError(f"EXL3 experts cannot run on our kernel: {refusal([], mul1=False)}")
            if any((m.in_features, m.out_features) != (16 * m.inner.trellis.shape[0], 16 * m.inner.trellis.shape[1])
                   for m in linears):
                raise ValueError("EXL3 experts cannot run on our kernel: stored padded (dimensions not "
                                 f"multiples of {HAD})")
            return tuple(Stored(i.trellis, i.suh, i.svh) for i in inner)
        return cls([stored(e) for e in routed], None if shared is None else stored(shared), limit)

    def plan(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, _Plan]:
        """(order: the slots sorted by expert, each sorted slot's expert, the plan), on the device."""
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        total = self.experts + self.has_shared
        counts = torch.zeros(total + 1, dtype=torch.int32, device=flat.device)  # + the padding expert
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        starts = counts.cumsum(0, dtype=torch.int32) - counts
        items = exl3_triton.work_items(counts, exl3_triton.max_items(len(flat), total))
        return order, flat[order], _Plan(items, counts, starts, self.sms, self.kernel, self.hadamard)

    def with_shared(self, weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing with the shared expert as one more chosen expert, of weight 1, on every row."""
        if not self.has_shared:
            return weights, experts
        rows = experts.shape[0]
        every = torch.full((rows, 1), self.experts, dtype=experts.dtype, device=experts.device)
        return (torch.cat([weights.float(), torch.ones((rows, 1), device=weights.device)], 1),
                torch.cat([experts, every], 1))

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        weights, experts = self.with_shared(weights, experts)
        k = experts.shape[1]
        order, expert_of_slot, plan = self.plan(experts)
        xs = x.half()[order // k]
        g = self.gate(xs, expert_of_slot, plan)
        u = self.up(xs, expert_of_slot, plan)
        g = F.silu(g)
        if self.limit:
            g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        y = self.down((g * u).half(), expert_of_slot, plan) * weights.reshape(-1)[order, None].float()
        return torch.empty_like(y).index_copy_(0, order, y).view(rows, k, -1).sum(1)
