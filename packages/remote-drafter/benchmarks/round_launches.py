"""How many kernels one round of DeepSeek's drafter launches, and which lines of code launch
them: a count no machine's speed changes, so the round's small kernels can be cut (fused,
hoisted, kept in one dtype) and checked on any CPU before a GPU times them.

The tiny V4.1 checkpoint (models/dsv41/tiny.py) in bf16 with float32 arithmetic, as the
Flash drafter serves, the round's Triton kernels serving (kernels.py; on a CPU in Triton's
interpreter, set here before Triton loads), one greedy round at each batch after a warm one.
Counted: every aten operator dispatched that computes (a view, an allocation or a metadata
change launches nothing on a GPU; a host read of a device value, `_local_scalar_dense`, is
counted apart as a sync) and every Triton kernel launch; each attributed to the innermost
line of remote_drafter that made it. The counted round runs under no_grad in place of
inference mode, where a dispatch mode would see composite operators whole and casts not at
all (the arithmetic is the same). On a GPU a few operators launch more than one kernel
(a sort, a top-k) and cuBLAS may add a split-K reduction, so this is a floor of what a GPU
profile lists. The routed experts run here as on a CPU, a loop over the chosen experts (not
the grouped GEMMs or the EXL3 kernels a GPU serves): their lines (modules/moe.py's CPU path,
the dense linears it calls) are the CPU's own, and its `nonzero` and `unique` are counted as
syncs too, as they would be on a GPU.

`--experts` counts one MoE layer of our EXL3 experts' kernels apart (models/exl3_triton_experts.py,
which a GPU serves and this round does not reach): random trellis bytes at a small width (the
count does not depend on it), its call planned by the plan's kernel and by torch's sort.

    python packages/remote-drafter/benchmarks/round_launches.py --batches 1,16 --out round-launches.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before Triton defines a kernel: it picks interpreter or compiler then
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from dsv41_gpu import random_rounds  # noqa: E402

import remote_drafter  # noqa: E402
from remote_drafter.engine.identity import Manifest  # noqa: E402
from remote_drafter.models.dsv41 import checkpoint, tiny  # noqa: E402
from remote_drafter.models.dsv41.drafter import Dsv41Drafter  # noqa: E402
from remote_drafter.models.dsv41.model import Dsv41Model  # noqa: E402

PACKAGE = str(Path(remote_drafter.__file__).parent)
# operators that launch nothing on a GPU: allocations and metadata
NO_LAUNCH = {"_unsafe_view", "empty", "empty_permuted", "empty_strided", "empty_like", "new_empty",
             "new_empty_strided", "lift_fresh", "set_", "resize_", "_reshape_alias", "detach", "alias",
             "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
             "_has_compatible_shallow_copy_type"}
SYNC = "_local_scalar_dense"  # .item() and friends: the host waits for the device
SYNCING = {"nonzero", "_unique2", "masked_select"}  # launch, then the host waits for the result's size


def launches_nothing(func) -> bool:
    """A view (its result aliases an input without writing it) or an allocation."""
    schema = func._schema
    name = schema.name.split("::")[-1]
    if name in NO_LAUNCH:
        return True
    aliasing = [r.alias_info for r in schema.returns if r.alias_info is not None]
    return bool(aliasing) and not schema.is_mutable


def source_line() -> str:
    """file:line of the innermost frame in remote_drafter (relative to the package)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(PACKAGE):
            return f"{os.path.relpath(frame.filename, PACKAGE)}:{frame.lineno}"
    return "(outside remote_drafter)"


class LaunchCounter(TorchDispatchMode):
    """Counts, while active, the aten operators that launch work and the Triton kernels
    launched, by operator and by source line; host syncs apart."""

    def __init__(self):
        super().__init__()
        self.by_op: collections.Counter[str] = collections.Counter()
        self.by_line: collections.Counter[str] = collections.Counter()
        self.syncs: collections.Counter[str] = collections.Counter()
        self._original = None
        self._in_kernel = False  # the interpreter runs a kernel through torch: not the round's own

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if self._in_kernel:
            pass
        elif name == SYNC:
            self.syncs[source_line()] += 1
        elif not launches_nothing(func):
            self.by_op[f"aten.{name}"] += 1
            self.by_line[line := source_line()] += 1
            if name in SYNCING:
                self.syncs[line] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        if torch.is_inference_mode_enabled():
            raise RuntimeError("enter the counter outside inference mode: inside it, casts are not seen")
        from triton.runtime.jit import KernelInterface  # JITFunction's and the interpreter's
        entered = super().__enter__()
        counter, self._original = self, KernelInterface.__getitem__

        def launcher(kernel, grid, original=self._original):
            launch = original(kernel, grid)

            def counted(*args, **kwargs):
                counter.by_op[f"triton.{getattr(kernel, '__name__', None) or kernel.fn.__name__}"] += 1
                counter.by_line[source_line()] += 1
                counter._in_kernel = True
                try:
                    return launch(*args, **kwargs)
                finally:
                    counter._in_kernel = False
            return counted
        KernelInterface.__getitem__ = launcher
        # Under inference mode a dispatch mode sees composite operators whole and casts not at
        # all: the round runs under no_grad instead (the same arithmetic), so the operators
        # counted are those that reach the device
        mode = torch.autograd.grad_mode.inference_mode
        self._inference = mode.__enter__, mode.__exit__
        mode.__enter__, mode.__exit__ = (lambda self: None), (lambda self, *exc: None)
        self._no_grad = torch.no_grad()
        self._no_grad.__enter__()
        return entered

    def __exit__(self, *exc):
        from triton.runtime.jit import KernelInterface
        KernelInterface.__getitem__ = self._original
        mode = torch.autograd.grad_mode.inference_mode
        mode.__enter__, mode.__exit__ = self._inference
        self._no_grad.__exit__(*exc)
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.by_op.values())


def tiny_drafter(device: str) -> Dsv41Drafter:
    """The tiny V4.1 drafter in bf16 (float32 arithmetic), the round's Triton kernels serving."""
    with tempfile.TemporaryDirectory() as folder:
        tiny.write_tiny(folder)
        loaded = checkpoint.load(folder, torch.bfloat16, "cpu")
    model = Dsv41Model(loaded.config, loaded.weights, device, dtype=torch.bfloat16)
    if why := model.use_kernels(True):
        raise RuntimeError(f"the round's Triton kernels do not serve: {why}")
    return Dsv41Drafter(model, Manifest(*["tiny"] * 4, kind=Dsv41Drafter.kind), device)


def count_round(drafter: Dsv41Drafter, batch: int) -> LaunchCounter:
    """The launches of one greedy round at `batch` (160-token histories), after a warm one."""
    requests = random_rounds(drafter, batch, 160, batch)
    drafter.draft(requests, want_probs=False)
    with LaunchCounter() as counter:
        drafter.draft(requests, want_probs=False)
    return counter


def count_experts(rows: int, top_k: int = 6, experts: int = 16, width: int = 256) -> dict[str, dict]:
    """One call of our EXL3 experts' layer on `rows` rows (each choosing top_k of `experts`,
    plus the shared expert), after a warm one: {"plan kernel" | "torch sort": its launches by op}."""
    from exl3_moe_layer import random_stored

    from remote_drafter.models.exl3_triton_experts import TritonExl3Experts
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)

    def linear(n_in, n_out):
        return random_stored(n_in, n_out, gen, device=dev)
    three = [(linear(width, 128), linear(width, 128), linear(128, width)) for _ in range(experts + 1)]
    layer = TritonExl3Experts(three[:-1], three[-1], 7.0)
    x = torch.randn(rows, width, generator=gen, device=dev).half()
    chosen = torch.stack([torch.randperm(experts)[:top_k] for _ in range(rows)]).to(dev)
    weights = torch.full((rows, top_k), 1 / top_k, device=dev)
    out = {}
    for name, refusal in (("plan kernel", None), ("torch sort", "counted against")):
        layer.plan_refusal = refusal
        layer(x, weights, chosen)
        with LaunchCounter() as counter:
            layer(x, weights, chosen)
        out[name] = {"launches": counter.total, "by_op": dict(counter.by_op.most_common())}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16", help="requests per round (default: %(default)s)")
    ap.add_argument("--top", type=int, default=25, help="source lines printed (default: %(default)s)")
    ap.add_argument("--out", default="round-launches.json", help="JSON results (default: %(default)s)")
    ap.add_argument("--experts", action="store_true", help="also one MoE layer of our EXL3 experts' "
                    "kernels at each batch's block rows, planned by its kernel and by torch's sort")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    drafter = tiny_drafter(device)
    result = {"checkpoint": "tiny V4.1, bf16, float32 arithmetic", "device": device,
              "triton_interpreter": os.environ.get("TRITON_INTERPRET") == "1", "batches": {}}
    for batch in [int(b) for b in args.batches.split(",")]:
        c = count_round(drafter, batch)
        result["batches"][batch] = {"launches": c.total, "host_syncs": sum(c.syncs.values()),
                                    "by_op": dict(c.by_op.most_common()), "by_line": dict(c.by_line.most_common()),
                                    "syncs_by_line": dict(c.syncs)}
        print(f"batch {batch}: {c.total} launches a round ({sum(v for k, v in c.by_op.items() if k.startswith('triton.'))}"
              f" Triton), {sum(c.syncs.values())} host syncs")
        for line, n in c.by_line.most_common(args.top):
            print(f"  {n:5d}  {line}")
        if args.experts:
            counts = result["batches"][batch]["exl3_experts_layer"] = count_experts(batch * drafter.model.config.block_size)
            print("  one MoE layer of our EXL3 experts: " + ", ".join(f"{k} {v['launches']} launches"
                                                                     for k, v in counts.items()))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
