"""EXL3 weights for the worker's drafters: their linears quantised with exllamav3's own
trellis quantiser and run through its quantised linear (`modules/quant/exl3.py`,
LinearEXL3) on a CUDA GPU; everything else stays this project's code (ARCHITECTURE.md
§ DeepSeek-V4.1's drafter).

The only module that imports exllamav3 (exl3_experts.py reaches its kernels through
load_exllamav3), and only inside functions: nothing loads it unless
EXL3 weights are asked for (`remote-drafter worker --weights exl3`, `exl3 convert`). Its
first import on a machine builds its CUDA extension, which `load_exllamav3` says while it waits.

A pack is a drafter folder whose quantised linears are stored as exllamav3 stores them,
`<module>.trellis` / `.suh` / `.svh` (+ the codebook marker `.mul1` or `.mcg`) in place of
`<module>.weight`, and `exl3.json` naming them; or a DeepSeek-V4 / V4.1 model exllamav3's
`convert_model` made (quant_method "exl3" in its config.json), whose `mtp.*` tensors carry
the same names (models/dsv41/exl3_pack.py reads them). Quantisation is what convert_model
does for side models (`quantize_side_model`): uncalibrated (no Hessian: its fallback
quantiser), default mul1 codebook, a seed per tensor. Both dimensions are zero-padded to 128
as exllamav3's Linear pads (pad_to): a linear's padded sizes are read off its trellis, padded
inputs see zeros, padded outputs are cut.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from .exl3_dense import DenseCopy

EXTRA = "pip install 'dsv41-remote-drafter[exl3]'"
PACK_FILE = "exl3.json"
STORED = ("trellis", "suh", "svh", "mcg", "mul1")  # LinearEXL3.get_tensors' subkeys we keep
PAD = 128
FORMAT = 1

_lib = None


def refusal(device: str) -> str | None:
    """Why EXL3 weights cannot run on `device` (None: they can), without importing exllamav3."""
    if torch.device(device).type != "cuda":
        return f"EXL3 weights run exllamav3's CUDA kernels: pass --device cuda:N, not {device}"
    if not torch.cuda.is_available():
        return "EXL3 weights need a CUDA GPU, and this torch sees none"
    if importlib.util.find_spec("exllamav3") is None:
        return f"EXL3 weights need exllamav3 ({EXTRA})"
    return None


def require(device: str) -> None:
    reason = refusal(device)
    if reason:
        raise ValueError(reason)


def load_exllamav3(log=None) -> SimpleNamespace:
    """exllamav3's quantiser, quantised linear and kernels (`ext`: exl3_experts.py's fused
    MoE), imported once."""
    global _lib
    if _lib is None:
        say = log or (lambda m: print(m, file=sys.stderr, flush=True))
        say("remote-drafter: importing exllamav3; the first time on a machine it builds its CUDA "
            "extension (about 5 minutes on 16 cores; TORCH_CUDA_ARCH_LIST=<this GPU's> and MAX_JOBS "
            "shorten it)")
        t0 = time.monotonic()
        from exllamav3.ext import exllamav3_ext
        from exllamav3.modules.quant.exl3 import LinearEXL3
        from exllamav3.modules.quant.exl3_lib.quantize import quantize_exl3
        from exllamav3.version import __version__
        _lib = SimpleNamespace(LinearEXL3=LinearEXL3, quantize_exl3=quantize_exl3, ext=exllamav3_ext,
                               version=__version__)
        say(f"remote-drafter: exllamav3 {__version__} ready in {time.monotonic() - t0:.0f} s")
    return _lib


def require_pack(folder: str, device: str) -> None:
    """A pack about to be served or measured: refused without CUDA or exllamav3, or for a
    folder with no EXL3 weights; then exllamav3 is imported (its extension built, said while
    it waits)."""
    require(device)
    if not is_pack(folder):
        raise ValueError(f"{folder} holds no EXL3 weights ({PACK_FILE}): make them with "
                         "`remote-drafter exl3 convert`")
    load_exllamav3()


def padded(n: int) -> int:
    return -(-n // PAD) * PAD


# -- packs ---------------------------------------------------------------------------------

def is_pack(folder: str) -> bool:
    """A folder with EXL3 weights: a pack of ours, or a model exllamav3 converted."""
    return os.path.exists(os.path.join(folder, PACK_FILE)) or made_by_exllamav3(folder)


def made_by_exllamav3(folder: str) -> bool:
    """exllamav3's convert_model writes quant_method "exl3" into the model's config.json."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return (config.get("quantization_config") or {}).get("quant_method") == "exl3"


def read_pack(folder: str) -> dict:
    with open(os.path.join(folder, PACK_FILE)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{folder}: EXL3 pack format {meta.get('format')}, this version reads {FORMAT}")
    return meta


def write_pack(out: str, meta: dict) -> None:
    with open(os.path.join(out, PACK_FILE), "w") as f:
        json.dump({"format": FORMAT, **meta}, f, indent=1)


def module_of(weight_name: str) -> str:
    return weight_name.removesuffix(".weight")


def is_exl3_tensor(name: str) -> bool:
    return name.rpartition(".")[2] in STORED


def quantise(weight: torch.Tensor, bits: float, seed: int, device: str) -> dict[str, torch.Tensor]:
    """weight [out, in] (torch's layout) -> exllamav3's stored tensors, on the CPU."""
    lib = load_exllamav3()
    device = torch.device(device)
    if device.index is None:  # its quantiser asserts the weight's device == devices[0], index included
        device = torch.device("cuda", torch.cuda.current_device())
    n_out, n_in = weight.shape
    w = torch.zeros(padded(n_in), padded(n_out), dtype=torch.float32, device=device)
    w[:n_in, :n_out] = weight.T.to(device, torch.float32)  # exllamav3 quantises W^T (in, out)
    uncalibrated = {"H": torch.zeros(padded(n_in), padded(n_in), device="meta"),
                    "device": torch.device(device)}
    args = {"seed": seed, "K": bits, "devices": [device], "device_ratios": None,
            "apply_out_scales": None, "mul1": True}
    _, _, tensors = lib.quantize_exl3(w, uncalibrated, args, False)
    return {k: v.cpu() for k, v in tensors.items() if k in STORED}


def quantise_all(state: dict[str, torch.Tensor], names: list[str], bits: dict[str, float],
                 device: str, log=None) -> dict[str, torch.Tensor]:
    """`state` with each weight in `names` replaced by its EXL3 tensors (at bits[name])."""
    out = {k: v for k, v in state.items() if k not in names}
    for seed, name in enumerate(sorted(names)):
        t0 = time.monotonic()
        q = quantise(state[name], bits[name], seed, device)
        out.update({f"{module_of(name)}.{k}": v for k, v in q.items()})
        if log:
            log(f"  {name} {tuple(state[name].shape)} -> {bits[name]} bits ({time.monotonic() - t0:.1f} s)")
    return out


# -- running them --------------------------------------------------------------------------

def unpadded(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """A weight exllamav3 stored unquantised but zero-padded to its Linear's pad_to (128: a
    Markov rank of 64 is stored 128 wide), cut back to `shape`; None if `t` is not that."""
    if t.dim() != len(shape) or any(have < want for have, want in zip(t.shape, shape)):
        return None
    kept = tuple(slice(0, n) for n in shape)
    rest = t.clone()
    rest[kept] = 0
    return None if rest.any() else t[kept].contiguous()


def stored_sizes(trellis: torch.Tensor) -> tuple[int, int]:
    """(in, out) as stored, padding included: the trellis holds 16 x 16 tiles."""
    return trellis.shape[0] * 16, trellis.shape[1] * 16


class Exl3Linear(DenseCopy, nn.Module):
    """x @ W.T with W in EXL3 form: exllamav3's LinearEXL3 on fp16 rows (its kernels' input),
    the result back in x's dtype. From `dense_from` rows up (keep_dense; exl3_dense.py picks
    where), a dense fp16 GEMM over exllamav3's reconstruction of the same W instead."""

    def __init__(self, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                 device: str):
        super().__init__()
        lib = load_exllamav3()
        t = {k: v.to(device) for k, v in tensors.items()}
        self.in_features, self.out_features = in_features, out_features
        self.in_stored, out_stored = stored_sizes(t["trellis"])
        if self.in_stored < in_features or out_stored < out_features:
            raise ValueError(f"EXL3 linear stored as {self.in_stored} x {out_stored}, too small for "
                             f"{in_features} x {out_features}")
        self.inner = lib.LinearEXL3(None, self.in_stored, out_stored,
                                    suh=t["suh"], svh=t["svh"], trellis=t["trellis"],
                                    mcg=t.get("mcg"), mul1=t.get("mul1"), out_dtype=torch.half)
        self.stored_bytes = sum(v.numel() * v.element_size() for v in t.values())
        self.device = t["trellis"].device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.half_rows(x.reshape(-1, x.shape[-1]).half())
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def half_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """fp16 rows [N, in] -> fp16 [N, out] (no casts: the caller's)."""
        return self.run(rows, self.weight_for(rows.shape[0]))

    def run(self, rows: torch.Tensor, dense: torch.Tensor | None) -> torch.Tensor:
        """fp16 rows [N, in] through exllamav3's kernel, or (dense: this linear's dense()) a GEMM."""
        if dense is not None:
            return F.linear(rows, dense)
        if self.in_stored != self.in_features:
            rows = F.pad(rows, (0, self.in_stored - self.in_features))
        return self.inner.forward(rows.contiguous(), {})[:, :self.out_features]

    def probe(self, rows: int) -> torch.Tensor:
        """Random fp16 input of `rows` rows, as run takes it."""
        return random_half((rows, self.in_features), self.device)

    def dense(self) -> torch.Tensor:
        """W [out, in] as exllamav3 reconstructs it (fp16)."""
        return self.inner.get_weight_tensor()[:self.in_features, :self.out_features].T.contiguous()

    @property
    def dense_bytes(self) -> int:
        return 2 * self.in_features * self.out_features


class Exl3Groups(DenseCopy, nn.Module):
    """A grouped projection (DeepSeek's wo_a): group g's rows through its own EXL3 linear, as
    exllamav3 stores wo_a (`wo_a.slice.<g>`); x [..., G, in] -> [..., G, out]. From
    `dense_from` rows up, one batched GEMM over every group's reconstruction instead."""

    def __init__(self, groups: list[Exl3Linear]):
        super().__init__()
        self.groups = nn.ModuleList(groups)
        self.stored_bytes = sum(g.stored_bytes for g in groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One cast to fp16 in and one back for all groups (not one each way per group)."""
        x16 = x.half().reshape(-1, *x.shape[-2:])
        y = self.run(x16, self.weight_for(x16.shape[0]))
        return y.to(x.dtype).reshape(*x.shape[:-2], len(self.groups), -1)

    def run(self, x16: torch.Tensor, dense: torch.Tensor | None) -> torch.Tensor:
        """fp16 [N, G, in] -> [N, G, out], each group through its kernel, or (dense: dense()) one bmm."""
        if dense is not None:
            return torch.einsum("ngi,goi->ngo", x16, dense)
        return torch.stack([g.run(x16[:, i], None) for i, g in enumerate(self.groups)], -2)

    def probe(self, rows: int) -> torch.Tensor:
        g = self.groups[0]
        return random_half((rows, len(self.groups), g.in_features), g.device)

    def dense(self) -> torch.Tensor:
        """Every group's W [G, out, in] (fp16)."""
        return torch.stack([g.dense() for g in self.groups])

    @property
    def dense_bytes(self) -> int:
        return sum(g.dense_bytes for g in self.groups)


def random_half(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A fixed random fp16 input of `shape` (exl3_dense.py times the two paths on it)."""
    gen = torch.Generator(device=device).manual_seed(shape[0])
    return torch.randn(shape, generator=gen, device=device).half()


def linear_from(state: dict[str, torch.Tensor], module: str, shape: tuple[int, int],
                device: str) -> Exl3Linear:
    """The EXL3 linear stored under `module` in `state`, for a weight of `shape` [out, in]."""
    tensors = {k: state[f"{module}.{k}"] for k in STORED if f"{module}.{k}" in state}
    if "trellis" not in tensors:
        raise ValueError(f"EXL3 pack: no {module}.trellis")
    return Exl3Linear(tensors, shape[1], shape[0], device)


def install(model: nn.Module, state: dict[str, torch.Tensor], weight_names: list[str],
            device: str) -> nn.Module:
    """Replace each nn.Linear whose weight is in `weight_names` with its EXL3 linear."""
    for name in weight_names:
        path = module_of(name)
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        dense = getattr(parent, attr)
        setattr(parent, attr, linear_from(state, path, (dense.out_features, dense.in_features), device))
    return model
