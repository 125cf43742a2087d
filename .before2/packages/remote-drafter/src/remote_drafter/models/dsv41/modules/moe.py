"""A drafter layer's FFN: routed experts (top-k of score + gate.bias) plus a shared expert,
SwiGLU clamped. The routed experts have several implementations behind one call,
experts(rows, routing weights, chosen experts) -> the weighted sum in `wide`:

* PerMatrixExperts: each expert three linears, dense or EXL3; the chosen ones on the rows
  that chose them (the routing read on the host), or every expert on every row (no host
  read: a CUDA graph captures it);
* StackedExperts: dense experts stacked [experts, out, in]; the chosen ones through grouped
  GEMMs, or every expert on every row (shapes fixed by the batch: graphs capture both);
* FusedExperts: EXL3 experts in a few launches, the shared expert in the same ones: through
  exllamav3's fused multi-expert kernels (exl3_experts.py) or our own (exl3_triton_experts.py),
  per row count.

Expert parallel (drafter_tp2): a module may hold a slice of the routed experts. It routes
over all of them as one card does, runs the chosen ones it holds (the others weigh zero),
adds the shared expert on one rank only, and `sum_over_ranks` adds every rank's partial sum."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from remote_drafter.models.cuda_graphs import bucket_for, graph_ms, side_stream_graph

from .module import Dense, Module, Weights
from .numerics import Numerics, relative_error, swiglu

_SCORES = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid,
           "softmax": lambda x: x.softmax(-1)}
PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down


def dense_routing(num: Numerics, flat, weights, experts, count: int) -> torch.Tensor:
    """[rows, count]: each row's routing weight of every expert, zero where not chosen."""
    share = torch.zeros(flat.shape[0], count, dtype=num.wide, device=flat.device)
    return share.scatter_(1, experts, weights)


class PerMatrixExperts(Module):
    includes_shared = False

    def __init__(self, numerics: Numerics, weights: Weights, prefix: str, held: range):
        super().__init__(numerics)
        self.experts = [tuple(self.linear(weights, f"{prefix}ffn.experts.{e}.{p}.weight") for p in PROJECTIONS)
                        for e in held]
        self.every_row = False

    @property
    def dense(self) -> bool:
        return all(isinstance(m, Dense) for three in self.experts for m in three)

    def __call__(self, flat, weights, experts) -> torch.Tensor:
        num = self.numerics
        out = torch.zeros(flat.shape, dtype=num.wide, device=flat.device)
        limit = num.config.swiglu_limit
        if self.every_row:  # weighted by the routing, zero where not chosen
            share = dense_routing(num, flat, weights, experts, len(self.experts))
            for e, (w1, w3, w2) in enumerate(self.experts):
                out += swiglu(flat, w1, w3, w2, limit).to(num.wide) * share[:, e, None]
            return out
        for e in experts.unique().tolist():
            rows, slot = (experts == e).nonzero(as_tuple=True)
            y = swiglu(flat[rows], *self.experts[e], limit)
            # index_add_: a row may hold e twice (an expert-parallel slice's zero-weight slots)
            out.index_add_(0, rows, y.to(num.wide) * weights[rows, slot, None])
        return out


class StackedExperts(Module):
    """The experts' dense weights moved into [experts, out, in] tensors (the per-expert ones
    are dropped with the PerMatrixExperts they came from)."""
    includes_shared = False

    def __init__(self, per_matrix: PerMatrixExperts, prefix: str):
        super().__init__(per_matrix.numerics)
        if not per_matrix.dense:
            raise ValueError("stacked experts need dense expert weights (another back end serves these)")
        per_matrix.own.clear()
        self.w1, self.w3, self.w2 = (self._moved(per_matrix.experts, p) for p in range(3))
        self.own = {f"{prefix}ffn.experts.{p}.stacked": t for p, t in zip(PROJECTIONS, (self.w1, self.w3, self.w2))}
        self.grouped, self.refusal = False, "not checked"  # refusal: why grouped GEMMs may not serve

    @staticmethod
    def _moved(experts: list[tuple[Dense, ...]], p: int) -> torch.Tensor:
        """Projection p of every expert in one [experts, out, in] tensor, each expert's own
        tensor let go as soon as it is copied: no transient second copy of the layer."""
        first = experts[0][p].weight
        out = torch.empty((len(experts), *first.shape), dtype=first.dtype, device=first.device)
        for e, three in enumerate(experts):
            out[e].copy_(three[p].weight)
            three[p].weight = None
        return out

    def __call__(self, flat, weights, experts) -> torch.Tensor:
        return (self.chosen_grouped if self.grouped else self.every_expert)(flat, weights, experts)

    def every_expert(self, flat, weights, experts) -> torch.Tensor:
        """Every expert on every row, weighted by its routing weight (zero where not chosen)."""
        share = dense_routing(self.numerics, flat, weights, experts, len(self.w1))
        w1, w3, w2 = self.w1, self.w3, self.w2
        y = swiglu(flat, lambda x: torch.einsum("th,eih->eti", x, w1),
                   lambda x: torch.einsum("th,eih->eti", x, w3),
                   lambda a: torch.einsum("eti,ehi->eth", a, w2), self.numerics.config.swiglu_limit)
        return torch.einsum("eth,te->th", y.to(self.numerics.wide), share)

    def chosen_grouped(self, flat, weights, experts) -> torch.Tensor:
        """Each row through its chosen experts only: the (row, expert) slots sorted by expert
        on the device, three grouped GEMMs over the stacked weights (group e: expert e's
        rows), the results put back in slot order and summed per row in a fixed order."""
        n, k = experts.shape
        order = experts.flatten().argsort(stable=True)
        counts = torch.zeros(len(self.w1), dtype=torch.int32, device=flat.device)
        counts.index_add_(0, experts.flatten(), torch.ones_like(order, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)

        def grouped(w):
            return lambda x: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        y = swiglu(flat[order // k], grouped(self.w1), grouped(self.w3), grouped(self.w2),
                   self.numerics.config.swiglu_limit)
        slots = torch.empty_like(y).index_copy_(0, order, y).view(n, k, -1)
        return torch.einsum("tkh,tk->th", slots.to(self.numerics.wide), weights)


class FusedExperts(Module):
    """EXL3 routed experts and the shared one in a few launches with no host read: through
    exllamav3's fused kernels (exl3_experts.py) or our own (exl3_triton_experts.py), per row
    count as `ours_at` says (exllamav3's where it says nothing). Its result may live in the
    kernels' buffers until the next call: MoE copies it out."""
    includes_shared = True

    def __init__(self, per_matrix: PerMatrixExperts, shared, device, whole: bool = True):
        super().__init__(per_matrix.numerics)
        from remote_drafter.models.exl3_experts import Exl3Experts
        c = self.numerics.config
        self.per_matrix = per_matrix  # the kernels' pointer tables address these linears' tensors
        self.kernels = Exl3Experts(per_matrix.experts, shared, c.num_experts_per_tok, c.swiglu_limit, device,
                                   sorted_tier=whole)
        self.shared = shared
        self.ours, self.ours_refusal = None, None  # our kernel's layer once asked for (build_ours)
        self.ours_at: dict[int, bool] = {}  # row count -> whether ours serves it

    def build_ours(self) -> None:
        """Our kernel's layer over the same tensors, once: whatever stops it leaves exllamav3's
        kernels serving, the reason in ours_refusal."""
        if self.ours is not None or self.ours_refusal is not None:
            return
        from remote_drafter.models.exl3_triton_experts import TritonExl3Experts
        try:
            self.ours = TritonExl3Experts.of(self.per_matrix.experts, self.shared, self.numerics.config.swiglu_limit)
        except Exception as exc:  # noqa: BLE001 - recorded, shown in status
            self.ours_refusal = f"{type(exc).__name__}: {exc}"

    def __call__(self, flat, weights, experts) -> torch.Tensor:
        if self.ours is not None and self.ours_serves(flat.shape[0]):
            return self.ours(flat, weights, experts)
        return self.kernels(flat, weights, experts)

    def ours_serves(self, rows: int) -> bool:
        """The choice at the smallest row count chosen for >= rows (past them all, the largest's)."""
        if not self.ours_at:
            return False
        return self.ours_at[bucket_for(self.ours_at, rows, max(self.ours_at))]

    @torch.inference_mode()
    def faster_ours(self, samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[int, bool]:
        """For each sample call (rows, routing weights, chosen experts): whether ours, tuned at its
        row count (TritonExl3Experts.tune), ran it faster than exllamav3's kernels, each timed
        once more in a CUDA graph as a round runs them, side by side (the tuning's figure is the
        best of several, which would favour ours)."""
        self.ours.tune(samples)
        dev = self.numerics.device
        return {flat.shape[0]: graph_ms(lambda a=(flat, w, e): self.ours(*a), dev) <
                graph_ms(lambda a=(flat, w, e): self.kernels(*a), dev) for flat, w, e in samples}

    def describe(self) -> str:
        if self.ours_refusal is not None:
            return f"exl3 fused (exllamav3's kernels; ours cannot serve: {self.ours_refusal})"
        if self.ours is None:
            return "exl3 fused (exllamav3's kernels)"
        ours = sorted(n for n, mine in self.ours_at.items() if mine) or "no"
        theirs = sorted(n for n, mine in self.ours_at.items() if not mine) or ("no" if self.ours_at else "all")
        torch_sorts = sorted(n for n, kernel in self.ours.plan_kernel_at.items() if not kernel)
        sort = (f"; ours sort with torch: {self.ours.plan_refusal}" if self.ours.plan_refusal is not None
                else f"; ours sort with torch at {torch_sorts} rows (faster there)" if torch_sorts else "")
        return f"exl3 fused (ours at {ours} rows, exllamav3's at {theirs} rows{sort})"


class MoE(Module):
    """held: the routed experts this module holds (all of them on one card)."""

    def __init__(self, numerics: Numerics, weights: Weights, prefix: str, held: range):
        super().__init__(numerics)
        c = numerics.config
        self.prefix, self.held = prefix, held
        self.gate = self.take(weights, f"{prefix}ffn.gate.weight")
        self.bias = self.take(weights, f"{prefix}ffn.gate.bias") if c.gate_bias else None
        self.experts: PerMatrixExperts | StackedExperts | FusedExperts = PerMatrixExperts(numerics, weights, prefix, held)
        self.shared = tuple(self.linear(weights, f"{prefix}ffn.shared_experts.{p}.weight")
                            for p in PROJECTIONS) if c.n_shared_experts else None
        self.adds_shared = True  # expert parallel: one rank adds the shared expert, the others not
        self.sum_over_ranks = None  # expert parallel: x -> every rank's x added (drafter_tp2)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (routing weights [N, top-k] in `wide`, chosen experts [N, top-k])."""
        return self.routing(x @ self.gate.T)

    def routing(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """route after the product with the gate (logits [N, experts], any float dtype): one
        kernel where the round's kernels serve. Of experts whose scores tie, the kernel takes
        the lowest; torch's top-k may take another (a tie either way)."""
        c, kernels = self.numerics.config, self.numerics.kernels
        if kernels is not None:
            return kernels.route(logits, self.bias, c.num_experts_per_tok, c.scoring_func,
                                 c.norm_topk_prob, c.routed_scaling_factor)
        scores = _SCORES[c.scoring_func](logits.to(self.numerics.wide))
        choose = scores + self.bias if self.bias is not None else scores
        experts = choose.topk(c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(-1, experts)
        if c.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * c.routed_scaling_factor, experts

    def held_routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """route(x) in this module's own expert numbering: a chosen expert it does not hold
        weighs zero (at its first expert, which then adds exact zeros)."""
        weights, experts = self.route(x)
        if len(self.held) == self.numerics.config.n_routed_experts:
            return weights, experts
        local = experts - self.held.start
        mine = (local >= 0) & (local < len(self.held))
        return torch.where(mine, weights, torch.zeros_like(weights)), torch.where(mine, local, torch.zeros_like(local))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        num = self.numerics
        flat = x.reshape(-1, x.shape[-1])
        out = self.experts(flat, *self.held_routing(flat))
        if self.shared is not None and self.adds_shared and not self.experts.includes_shared:
            out = out + swiglu(flat, *self.shared, num.config.swiglu_limit).to(num.wide)
        if self.sum_over_ranks is not None:
            out = self.sum_over_ranks(out)
        return out.to(x.dtype, copy=True).view_as(x)  # a copy: fused results live in their buffers

    def routed_samples(self, row_counts: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(rows, routing weights, chosen experts) of random rows through this layer's own
        router, one per row count (what an experts' implementation is timed on)."""
        c, gen = self.numerics.config, torch.Generator(device=self.numerics.device).manual_seed(0)
        out = []
        for n in row_counts:
            flat = torch.randn(n, c.hidden_size, generator=gen, device=self.numerics.device).to(self.numerics.dtype)
            out.append((flat, *self.held_routing(flat)))
        return out

    def fused_shared(self):
        """The shared expert as the fused kernels run it (exl3_experts.Exl3SharedExpert), or None."""
        return self.experts.kernels.shared if isinstance(self.experts, FusedExperts) else None

    # -- choosing the implementation -----------------------------------------------------
    def every_expert_on_every_row(self) -> None:
        """Per-matrix experts without a host read of the routing (what a graph captures)."""
        if isinstance(self.experts, PerMatrixExperts):
            self.experts.every_row = True

    def fuse(self, device) -> str | None:
        """EXL3 experts through exllamav3's fused kernels. None when done, else why not (the
        per-matrix path stays). Fused experts stay fused, with the same buffers: CUDA graphs
        another drafter captured over this model point into them."""
        if isinstance(self.experts, FusedExperts):
            return None
        try:
            self.experts = FusedExperts(self.experts, self.shared if self.adds_shared else None, device,
                                        whole=len(self.held) == self.numerics.config.n_routed_experts)
        except (KeyError, ValueError, ImportError, AttributeError, RuntimeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def stack(self) -> str | None:
        """Dense experts stacked (moved, not copied), so they run with shapes fixed by the
        batch: what a CUDA graph can capture. The chosen experts then run as grouped GEMMs
        (torch._grouped_mm: only their weights read) once those have matched every expert on
        every row here (and, on CUDA, inside a captured graph); else every expert on every
        row. None when grouped, else why not. Checked once: stacking again keeps the choice
        (a baseline may have switched grouped GEMMs off)."""
        if isinstance(self.experts, StackedExperts):
            stacked = self.experts
            return None if stacked.grouped else stacked.refusal or "grouped GEMMs switched off"
        self.experts = StackedExperts(self.experts, self.prefix)
        self.experts.refusal = self._grouped_refusal()
        self.experts.grouped = self.experts.refusal is None
        return self.experts.refusal

    @torch.inference_mode()
    def _grouped_refusal(self) -> str | None:
        num, stacked = self.numerics, self.experts
        if num.device.type == "cuda" and num.dtype != torch.bfloat16:
            # torch's grouped GEMM serves other dtypes by a path that reads the groups on the
            # host, which a CUDA graph cannot hold
            return f"grouped GEMMs on CUDA take bf16, this model is {num.dtype}"
        c = num.config
        rows = torch.randn(2 * c.block_size, c.hidden_size, generator=torch.Generator().manual_seed(0))
        flat = rows.to(num.device, num.dtype)
        weights, experts = self.held_routing(flat)
        try:
            want = stacked.every_expert(flat, weights, experts)
            got = stacked.chosen_grouped(flat, weights, experts)
            if num.device.type == "cuda":  # and inside a graph, as a round runs them
                got = captured(lambda: stacked.chosen_grouped(flat, weights, experts), num.device)
        except Exception as exc:  # noqa: BLE001 - a torch or device without grouped GEMMs
            return f"{type(exc).__name__}: {exc}"
        err = relative_error(want, got)
        if not err <= num.rounding:
            return f"grouped GEMMs differ from every expert on every row by {err:.2e}"
        return None


def captured(fn, device) -> torch.Tensor:
    """fn() captured in a CUDA graph on a side stream and replayed: its output then."""
    graph, out = side_stream_graph(fn, device)
    graph.replay()
    torch.cuda.synchronize(device)
    return out.clone()
