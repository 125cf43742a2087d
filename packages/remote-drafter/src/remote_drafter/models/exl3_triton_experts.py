"""A DeepSeek drafter MoE layer's EXL3 experts on our own kernel (exl3_triton.py): each expert
a call chose is decoded once for every 16 rows that chose it, the shared expert being one more
expert that every row chose. The same call as exl3_experts.Exl3Experts (exllamav3's fused
kernels), with no host synchronisation either, so a CUDA graph captures it:

1. the (row, expert) slots sorted by expert on the device and cut into work items of up to 16
   slots of one expert, so that the kernel's grid spans the slots, not every expert, and an
   expert many rows chose (the shared one) is spread over as many programs: one kernel
   (`_plan_kernel`, a counting sort) where it matched torch's sort at start-up, else torch's;
2. gate and up: each slot's row gathered, times its expert's suh and rotated (128-point
   Hadamard blocks) in one kernel (`_rows_in_kernel`), then the grouped product;
3. one kernel (`_activation_kernel`) per 16 slots and 128 intermediate columns: the split's
   partial products summed, gate and up rotated back and times svh, exllamav3's activation
   min(silu(g), L) · clamp(u) rounded to fp16 as its kernels hand it on, then times down's
   suh and rotated: down's rows;
4. down's grouped product, then one kernel (`_combine_kernel`) per row and 128 outputs: each
   of the row's slots summed over the split, rotated back, times svh and its routing weight,
   and the slots added in a fixed order (the same result every run).

The rotations run inside those kernels, near fp32 precision (exllamav3 rotates in fp32) on the
tensor cores (`_rotated`): a rotation mixes only the 128 columns of its block, so each block
is a program's own. It serves exllamav3's 4-bit mul1 trellis (what our packs and exllamav3's
conversions store); `refusal` says why not otherwise. `TritonExl3Experts.tune` picks the
product's configuration per row count by timing, at a worker's start-up."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import exl3_format, exl3_triton
from .cuda_graphs import bucket_for, graph_ms

log = logging.getLogger(__name__)
HAD = exl3_format.HAD
_HAD = tl.constexpr(HAD)  # a kernel reads a global only as a constexpr
SLOT_BLOCK = 16  # slots a program of the rotations takes (the tensor cores' M: 16 or more)
PLAN_BLOCK = 32  # slots (and work items) the plan's kernel takes at a time
# warps of the plan's kernel and of the activation's: with 4 the activation's two rotations
# spill registers on sm_90 (tests/test_kernels_compile_for_the_gpus.py)
PLAN_WARPS = ACTIVATION_WARPS = 8


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

    def partials(self, x: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """fp32 [splits, slots, out]: x (fp16 [slots, in], rotated, sorted by expert) through each
        slot's expert, a partial product per split of the input."""
        return exl3_triton.expert_products(x, plan.items, self.table, plan.counts, plan.starts,
                                           self.in_features, self.out_features,
                                           **plan.config(self.in_features, self.out_features))


class _Plan(NamedTuple):
    """A call's slots by expert, on the device: `row_of_slot`, `expert_of_slot` for each slot in
    sorted order, `slot_of` each (row, choice)'s slot in it (the shared expert a row's last
    choice); `items` the work items
    (exl3_triton.work_items), `counts` and `starts` where each expert's slots lie; `sms` the
    GPU's multiprocessors, `kernel` the product's configuration for this call's row count
    (TritonExl3Experts.CONFIGS' form), `signs` the rotation's signs (fp16 ±1)."""
    row_of_slot: torch.Tensor
    expert_of_slot: torch.Tensor
    slot_of: torch.Tensor
    items: tuple[torch.Tensor, torch.Tensor]
    counts: torch.Tensor
    starts: torch.Tensor
    sms: int
    kernel: dict
    signs: torch.Tensor

    def config(self, in_features: int, out_features: int) -> dict:
        """exl3_triton.expert_products' configuration for one projection: the plan's tile
        columns a program and warps, and a split of the input into enough programs to reach
        `fill` a multiprocessor, counting every work item the call may have (the bound, as the
        routing is not read on the host; an item without slots returns at once), each split at
        least 8 input tiles (the partials are summed afterwards)."""
        nt = self.kernel["nt"]
        while (out_features // 16) % nt:  # a narrower weight: fewer tile columns a program
            nt //= 2
        programs = out_features // (16 * nt) * len(self.items[0])
        splits = 1
        while programs * splits < self.kernel["fill"] * self.sms and (in_features // 16) % (2 * splits) == 0 \
                and in_features // 16 // (2 * splits) >= 8:
            splits *= 2
        return {"nt": nt, "num_warps": self.kernel["num_warps"], "splits": splits}


class TritonExl3Experts:
    """Layer j's MoE in EXL3 on our kernel: call with x [rows, H], the routing (weights
    [rows, k], chosen experts [rows, k] int64) -> [rows, H] float32, routed sum plus the shared
    expert. The product's configuration per row count is `tuned`'s at the fewest rows it holds
    at or above the call's (past them all, the most's; `kernel` while it holds none). A call
    gives the same sums every time in one process; the configuration sets the input's split
    and so the order of the sums, so another tuning (a restart) may differ in the last bits."""

    # what a worker times at start-up per row count (tune, from Dsv41Model.choose_expert_kernels):
    # tile columns a program and warps, and `fill`, the programs a multiprocessor the input's
    # split aims at
    CONFIGS = [{"nt": nt, "num_warps": warps, "fill": fill} for nt, warps in ((4, 2), (8, 4), (16, 4))
               for fill in (8, 32, 128)]

    def __init__(self, routed: list[tuple[Stored, Stored, Stored]], shared: tuple[Stored, Stored, Stored] | None,
                 limit: float | None):
        every = routed + ([shared] if shared is not None else [])
        self.gate, self.up, self.down = (_Projection([e[p] for e in every]) for p in range(3))
        if (self.gate.out_features, self.down.in_features) != (self.up.out_features, self.gate.out_features):
            raise ValueError("EXL3 experts cannot run on our kernel: gate, up and down shapes do not chain")
        self.experts, self.has_shared = len(routed), shared is not None
        self.limit = float(limit or 0.0)
        self.kernel = {"nt": exl3_triton.NT_DEFAULT, "num_warps": exl3_triton.WARPS_DEFAULT, "fill": 8}  # untuned
        self.tuned: dict[int, dict] = {}  # row count -> the product's configuration timed fastest there
        self.plan_kernel_at: dict[int, bool] = {}  # row count -> the plan's kernel timed faster than torch's sort
        device = self.gate.table.device
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        self.signs = (exl3_triton.hadamard(device) * HAD ** 0.5).round().half()  # the rotation's, exact
        self.plan_refusal = None
        self.plan_refusal = self._check_plan()  # None: the plan's kernel serves

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

    def plan(self, experts: torch.Tensor) -> _Plan:
        """The slots of the chosen `experts` ([rows, k]) and the shared expert's, sorted by
        expert (stably: a row's slots of one expert in row order), on the device."""
        rows, k = experts.shape
        total = self.experts + self.has_shared
        slots = rows * (k + self.has_shared)
        if self.plan_kernel_serves(rows):
            parts = _device_plan(experts.contiguous(), total, self.has_shared, exl3_triton.max_items(slots, total))
        else:
            parts = _torch_plan(experts, total, self.has_shared, exl3_triton.max_items(slots, total))
        return _Plan(*parts, self.sms, self.config_at(rows), self.signs)

    def plan_kernel_serves(self, rows: int) -> bool:
        """The plan's kernel unless refused, or torch's sort timed faster at the fewest rows
        tuned at or above `rows` (past them all, the most's; untuned: the kernel)."""
        if self.plan_refusal is not None:
            return False
        at = self.plan_kernel_at
        return not at or at[bucket_for(at, rows, max(at))]

    def _check_plan(self) -> str | None:
        """None if the plan's kernel gives torch's plan on routings with repeated experts and
        padding items (the worker's start-up, outside any graph), else why not: torch's then
        serves, and a warning says so."""
        gen, dev = torch.Generator().manual_seed(0), self.gate.table.device
        total = self.experts + self.has_shared
        try:
            for rows, k in ((1, 1), (5, 3), (37, 8)):
                experts = torch.randint(0, self.experts, (rows, k), generator=gen).to(dev)
                experts[-1] = experts[0, 0].clone()  # a row choosing one expert k times (a slice's, a padding row's); one row: its own first
                bound = exl3_triton.max_items(rows * (k + self.has_shared), total)
                got, want = (plan(experts, total, self.has_shared, bound) for plan in (_device_plan, _torch_plan))
                for name, a, b in zip(PLAN_PARTS, _flat(got), _flat(want)):
                    if a.dtype != b.dtype or not torch.equal(a, b):
                        raise ValueError(f"its {name} differs from torch's at {rows} rows, {k} choices")
        except Exception as exc:  # noqa: BLE001 - torch's plan serves, the reason logged and shown
            why = f"{type(exc).__name__}: {exc}"
            log.warning("our expert kernels plan each call with torch's sort (the plan's kernel cannot serve: %s)", why)
            return why
        return None

    @torch.inference_mode()
    def tune(self, samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[int, dict]:
        """`tuned` afresh: for each sample call's row count (rows, routing weights, chosen
        experts), the fastest of CONFIGS, each timed in a CUDA graph as a round runs it (the
        median of 20 replays). A configuration that fails there is left out (its time inf, a
        warning logged); all of them failing raises the first failure. Then the plan's kernel
        and torch's sort, each timed alone in a graph: the faster plans calls of that row count
        (`plan_kernel_at`). {rows: {"ms": its time, "config": it, "trials": [every
        configuration's ms, in CONFIGS' order], "plan_ms": {"kernel": .., "torch": ..}}}."""
        self.tuned, self.plan_kernel_at, out = {}, {}, {}
        for x, weights, experts in samples:
            rows, trials, failure = x.shape[0], [], None
            for config in self.CONFIGS:
                self.tuned[rows] = config
                try:
                    trials.append(graph_ms(lambda a=(x, weights, experts): self(*a), x.device))
                except Exception as exc:  # noqa: BLE001 - this configuration left out; all failing raises
                    log.warning("our expert kernel's configuration %s failed at %d rows (left out): %s: %s",
                                config, rows, type(exc).__name__, exc)
                    failure = failure or exc
                    trials.append(float("inf"))
            best = min(range(len(trials)), key=trials.__getitem__)
            if trials[best] == float("inf"):
                del self.tuned[rows]
                raise failure
            self.tuned[rows] = self.CONFIGS[best]
            out[rows] = {"ms": trials[best], "config": self.CONFIGS[best], "trials": trials}
            if self.plan_refusal is None:
                try:
                    out[rows]["plan_ms"] = times = self._plan_times(experts)
                    self.plan_kernel_at[rows] = times["kernel"] < times["torch"]
                except Exception as exc:  # noqa: BLE001 - timing only: the checked kernel plans on
                    log.warning("the plan's kernel and torch's sort could not be timed at %d rows (the kernel "
                                "plans): %s: %s", rows, type(exc).__name__, exc)
        return out

    def _plan_times(self, experts: torch.Tensor) -> dict[str, float]:
        """The plan of `experts` by the kernel and by torch's sort, each timed in a graph."""
        total = self.experts + self.has_shared
        bound = exl3_triton.max_items(experts.numel() + len(experts) * self.has_shared, total)
        experts = experts.contiguous()
        return {name: graph_ms(lambda plan=plan: plan(experts, total, self.has_shared, bound), experts.device)
                for name, plan in (("kernel", _device_plan), ("torch", _torch_plan))}

    def config_at(self, rows: int) -> dict:
        """The product's configuration for a call of `rows` rows."""
        if not self.tuned:
            return self.kernel
        return self.tuned[bucket_for(self.tuned, rows, max(self.tuned))]

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        plan = self.plan(experts)
        x = x.contiguous()
        g = self.gate.partials(_rows_in(x, plan, self.gate.suh), plan)
        u = self.up.partials(_rows_in(x, plan, self.up.suh), plan)
        y = self.down.partials(_activation(g, u, plan, self.gate.svh, self.up.svh, self.down.suh, self.limit), plan)
        return _combine(y, plan, weights.float().contiguous(), self.down.svh, self.has_shared)


PLAN_PARTS = ("row_of_slot", "expert_of_slot", "slot_of", "item experts", "item rows", "counts", "starts")


def _flat(plan: tuple) -> tuple:
    """A plan's first six fields as PLAN_PARTS' seven tensors (the items are two)."""
    return (*plan[:3], *plan[3], *plan[4:])


def _torch_plan(experts: torch.Tensor, total: int, shared: bool, bound: int) -> tuple:
    """_Plan's first six fields in torch (sort, counts, scans, searches): `total` experts, the
    shared one (`shared`: the last) a further choice of every row, then the padding expert."""
    rows = experts.shape[0]
    if shared:
        experts = torch.cat([experts, torch.full((rows, 1), total - 1, dtype=experts.dtype, device=experts.device)], 1)
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(total + 1, dtype=torch.int32, device=flat.device)  # + the padding expert
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    starts = counts.cumsum(0, dtype=torch.int32) - counts
    items = exl3_triton.work_items(counts, bound)
    slot_of = torch.empty_like(order).index_copy_(0, order, torch.arange(len(order), device=order.device))
    return order // experts.shape[1], flat[order], slot_of, items, counts, starts


def _device_plan(experts: torch.Tensor, total: int, shared: bool, bound: int) -> tuple:
    """_torch_plan's result in one launch of _plan_kernel (experts contiguous int64)."""
    rows, k = experts.shape
    slots, dev = rows * (k + shared), experts.device
    long = dict(dtype=torch.int64, device=dev)
    row_of_slot, expert_of_slot, slot_of = (torch.empty(slots, **long) for _ in range(3))
    counts, starts = (torch.empty(total + 1, dtype=torch.int32, device=dev) for _ in range(2))
    items = (torch.empty(bound, **long), torch.empty(bound, dtype=torch.int32, device=dev))
    _plan_kernel[(1,)](experts, rows, k, total, bound, counts, starts, row_of_slot, expert_of_slot, slot_of,
                       *items, SHARED=shared, E=triton.next_power_of_2(total + 1), B=PLAN_BLOCK,
                       ITEM=exl3_triton.ITEM_ROWS, num_warps=PLAN_WARPS)
    return row_of_slot, expert_of_slot, slot_of, items, counts, starts


@triton.jit
def _expert_of(experts_ptr, i, slots, k, total, SHARED: tl.constexpr):
    """The expert of flat slots i ((row, choice), row-major; the shared expert, total - 1, a
    row's last choice under SHARED), -1 past the slots."""
    kk = k + SHARED
    row = i // kk
    j = i - row * kk
    e = tl.load(experts_ptr + row.to(tl.int64) * k + j, mask=(i < slots) & (j < k), other=0).to(tl.int32)
    if SHARED:
        e = tl.where(j == k, total - 1, e)
    return tl.where(i < slots, e, -1)


@triton.jit
def _plan_kernel(experts_ptr, rows, k, total, bound, counts_ptr, starts_ptr, row_of_slot_ptr, expert_of_slot_ptr,
                 slot_of_ptr, item_expert_ptr, item_row_ptr, SHARED: tl.constexpr, E: tl.constexpr,
                 B: tl.constexpr, ITEM: tl.constexpr):
    """One program, _torch_plan's plan: each expert's slots counted (the padding expert's,
    `total`, none), a slot's place its expert's start plus the slots of that expert before it
    (a stable counting sort, block by block: those in earlier blocks kept per expert), then the
    work items of ITEM slots (exl3_triton.work_items) up to `bound`."""
    slots = rows * (k + SHARED)
    e_ids = tl.arange(0, E)
    counts = tl.zeros([E], tl.int32)
    for c in range(0, slots, B):
        ex = _expert_of(experts_ptr, c + tl.arange(0, B), slots, k, total, SHARED)
        counts += tl.sum((ex[:, None] == e_ids[None, :]).to(tl.int32), 0)
    starts = tl.cumsum(counts, 0) - counts
    tl.store(counts_ptr + e_ids, counts, mask=e_ids <= total)
    tl.store(starts_ptr + e_ids, starts, mask=e_ids <= total)
    before = starts  # each expert's start plus its slots in the blocks before this one
    for c in range(0, slots, B):
        i = c + tl.arange(0, B)
        ex = _expert_of(experts_ptr, i, slots, k, total, SHARED)
        mine = ex[:, None] == e_ids[None, :]
        at = tl.sum(tl.where(mine, before[None, :], 0), 1)
        earlier = (ex[:, None] == ex[None, :]) & (i[None, :] < i[:, None])  # this block's slots before each
        at += tl.sum(earlier.to(tl.int32), 1)
        before += tl.sum(mine.to(tl.int32), 0)
        live = i < slots
        tl.store(slot_of_ptr + i, at.to(tl.int64), mask=live)
        tl.store(row_of_slot_ptr + at, (i // (k + SHARED)).to(tl.int64), mask=live)
        tl.store(expert_of_slot_ptr + at, ex.to(tl.int64), mask=live)
    ends = tl.cumsum((counts + ITEM - 1) // ITEM, 0)  # each expert's last item, past its end
    for c in range(0, bound, B):
        item = c + tl.arange(0, B)
        passed = (ends[None, :] <= item[:, None]) & (e_ids[None, :] <= total)  # experts wholly before
        expert = tl.minimum(tl.sum(passed.to(tl.int32), 1), total)
        first = tl.max(tl.where(passed, ends[None, :], 0), 1)  # the item's expert's first item
        live = item < bound
        tl.store(item_expert_ptr + item, expert.to(tl.int64), mask=live)
        tl.store(item_row_ptr + item, (item - first) * ITEM, mask=live)


_RSQRT_HAD = tl.constexpr(float(HAD) ** -0.5)


@triton.jit
def _rotated(v, signs_ptr):
    """v [R, 128] (fp32) through the 128-point rotation, near fp32 precision on the tensor cores:
    each row scaled by a power of two that puts its largest entry in [2**14, 2**15), split into
    two fp16 parts (22 significant bits), both multiplied by the rotation's signs (fp16 ±1,
    exact) with fp32 sums, then scaled back over sqrt(128). (Why not fp32 or tf32 products:
    findings/exl3-drafter.md, run 14.)"""
    i = tl.arange(0, _HAD)
    e = tl.maximum((tl.max(tl.abs(v), axis=1).to(tl.int32, bitcast=True) >> 23), 15)  # the biased exponent
    scale = ((268 - e) << 23).to(tl.float32, bitcast=True)[:, None]  # 2 ** (14 - exponent)
    back = ((e - 14) << 23).to(tl.float32, bitcast=True)[:, None] * _RSQRT_HAD
    v = v * scale
    hi = v.to(tl.float16)
    lo = (v - hi.to(tl.float32)).to(tl.float16)
    signs = tl.load(signs_ptr + i[:, None] * _HAD + i[None, :])
    return tl.dot(lo, signs, tl.dot(hi, signs)) * back


@triton.jit
def _summed(ptr, at, splits, stride, mask):
    """The split's partials at offsets `at` (split p's at p·stride further) summed in split order."""
    acc = tl.load(ptr + at, mask=mask, other=0.0)
    for p in range(1, splits):
        acc += tl.load(ptr + p * stride.to(tl.int64) + at, mask=mask, other=0.0)
    return acc


@triton.jit
def _rows_in_kernel(x_ptr, row_of_slot_ptr, expert_of_slot_ptr, suh_ptr, signs_ptr, out_ptr, slots, features,
                    S: tl.constexpr):
    """Program (slot block, 128-input block): out[slot] = x[the slot's row] (rounded to fp16, as
    exllamav3's kernels take it) times its expert's suh, rotated, rounded to fp16."""
    s = tl.program_id(0) * S + tl.arange(0, S)
    live = s < slots
    row = tl.load(row_of_slot_ptr + s, mask=live, other=0).to(tl.int64)
    e = tl.load(expert_of_slot_ptr + s, mask=live, other=0).to(tl.int64)
    cols = (tl.program_id(1) * _HAD + tl.arange(0, _HAD))[None, :]
    v = tl.load(x_ptr + row[:, None] * features + cols).to(tl.float16).to(tl.float32)
    v *= tl.load(suh_ptr + e[:, None] * features + cols).to(tl.float32)
    tl.store(out_ptr + s[:, None].to(tl.int64) * features + cols, _rotated(v, signs_ptr).to(tl.float16),
             mask=live[:, None] & (cols >= 0))


@triton.jit
def _activation_kernel(g_ptr, u_ptr, splits, slots, features, expert_of_slot_ptr, svh_g_ptr, svh_u_ptr, suh_d_ptr,
                       signs_ptr, out_ptr, limit, S: tl.constexpr, LIMITED: tl.constexpr):
    """Program (slot block, 128-column block of the intermediate): gate's and up's partials
    summed, rotated back, times svh; min(silu(g), limit) · clamp(u, ±limit) (LIMITED, else
    silu(g) · u) rounded to fp16; times down's suh, rotated, rounded to fp16: down's rows."""
    s = tl.program_id(0) * S + tl.arange(0, S)
    live = s < slots
    e = tl.load(expert_of_slot_ptr + s, mask=live, other=0).to(tl.int64)
    cols = (tl.program_id(1) * _HAD + tl.arange(0, _HAD))[None, :]
    at = s[:, None].to(tl.int64) * features + cols
    mask = live[:, None] & (cols >= 0)
    per_expert = e[:, None] * features + cols
    g = _rotated(_summed(g_ptr, at, splits, slots * features, mask), signs_ptr)
    g *= tl.load(svh_g_ptr + per_expert).to(tl.float32)
    u = _rotated(_summed(u_ptr, at, splits, slots * features, mask), signs_ptr)
    u *= tl.load(svh_u_ptr + per_expert).to(tl.float32)
    g = g * tl.sigmoid(g)
    if LIMITED:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = (g * u).to(tl.float16).to(tl.float32) * tl.load(suh_d_ptr + per_expert).to(tl.float32)
    tl.store(out_ptr + at, _rotated(h, signs_ptr).to(tl.float16), mask=mask)


@triton.jit
def _combine_kernel(y_ptr, splits, slots, features, slot_of_ptr, expert_of_slot_ptr, weights_ptr, svh_ptr, signs_ptr,
                    out_ptr, k, K: tl.constexpr, SHARED: tl.constexpr):
    """Program (row, 128-output block): each of the row's k slots (SHARED: and the shared
    expert's, its last, of weight 1) summed over the split, rotated back, times svh and its
    routing weight; the slots added (fp32)."""
    r = tl.program_id(0)
    j = tl.arange(0, K)
    live = j < k + SHARED
    slot = tl.load(slot_of_ptr + r * (k + SHARED) + j, mask=live, other=0).to(tl.int64)
    e = tl.load(expert_of_slot_ptr + slot, mask=live, other=0).to(tl.int64)
    w = tl.load(weights_ptr + r * k + j, mask=j < k, other=1.0)
    cols = (tl.program_id(1) * _HAD + tl.arange(0, _HAD))[None, :]
    y = _rotated(_summed(y_ptr, slot[:, None] * features + cols, splits, slots * features,
                         live[:, None] & (cols >= 0)), signs_ptr)
    y *= tl.load(svh_ptr + e[:, None] * features + cols).to(tl.float32) * w[:, None]
    tl.store(out_ptr + r.to(tl.int64) * features + cols, tl.sum(y, 0)[None, :])


def _rows_in(x: torch.Tensor, plan: _Plan, suh: torch.Tensor) -> torch.Tensor:
    """fp16 [slots, in]: each slot's row of x times its expert's suh ([experts, in]), rotated."""
    slots, features = len(plan.row_of_slot), x.shape[1]
    out = torch.empty((slots, features), dtype=torch.float16, device=x.device)
    _rows_in_kernel[(triton.cdiv(slots, SLOT_BLOCK), features // HAD)](
        x, plan.row_of_slot, plan.expert_of_slot, suh, plan.signs, out, slots, features, S=SLOT_BLOCK)
    return out


def _activation(g: torch.Tensor, u: torch.Tensor, plan: _Plan, svh_g: torch.Tensor, svh_u: torch.Tensor,
                suh_d: torch.Tensor, limit: float) -> torch.Tensor:
    """fp16 [slots, intermediate]: down's rows from gate's and up's partials ([splits, slots, I])."""
    splits, slots, features = g.shape
    out = torch.empty((slots, features), dtype=torch.float16, device=g.device)
    _activation_kernel[(triton.cdiv(slots, SLOT_BLOCK), features // HAD)](
        g, u, splits, slots, features, plan.expert_of_slot, svh_g, svh_u, suh_d, plan.signs, out, limit,
        S=SLOT_BLOCK, LIMITED=bool(limit), num_warps=ACTIVATION_WARPS)
    return out


def _combine(y: torch.Tensor, plan: _Plan, weights: torch.Tensor, svh: torch.Tensor, shared: bool) -> torch.Tensor:
    """fp32 [rows, out]: each row's slots of down's partials ([splits, slots, out]), rotated back,
    times svh and the routing weights (fp32 [rows, k]; the shared expert's slot, a row's last,
    weighs 1), summed."""
    splits, slots, features = y.shape
    rows, k = weights.shape
    out = torch.empty((rows, features), dtype=torch.float32, device=y.device)
    _combine_kernel[(rows, features // HAD)](
        y, splits, slots, features, plan.slot_of, plan.expert_of_slot, weights, svh, plan.signs, out, k,
        K=max(SLOT_BLOCK, triton.next_power_of_2(k + shared)), SHARED=shared)
    return out
