"""Which back end a drafter spec names, and loading it: `dsv41` (DeepSeek-V4.1's own DSpark
drafter, the `mtp.*` tensors of its checkpoint, as vLLM 0.33 computes it: `dsv41:<folder>`),
`dspark` (a Llama-style DSpark chain drafter of this repository's own format, a checkpoint
folder: the small variant the SmolLM2 miniature and the native drafter train and serve),
`lm` (a small causal LM drafting token by token, e.g. the target's own copy), `ngram`
(prompt lookup, no weights), or 'module:Class' (any other back end). An EXL3 pack is a
`dsv41` or `dspark` folder too (models.exl3). `dsv41`, `dspark` and `lm` need torch (the
[worker] extra); `ngram` and this module do not."""

from __future__ import annotations

import importlib
import json
import os

from remote_drafter.engine.identity import Manifest

from .base import Drafter

WORKER_EXTRA = "dsv41-remote-drafter[worker]"
WORKER_PACKAGES = ("torch", "safetensors")  # what the extra adds to the engine-side install
DSV41_PREFIX = "dsv41:"


def spec_folder(spec: str) -> str:
    """The folder a drafter spec names (`dsv41:<folder>` or a folder itself)."""
    return spec.removeprefix(DSV41_PREFIX)


class WorkerExtraMissing(ImportError):
    """The torch side was asked for where only the engine side is installed."""

    def __init__(self, needed_by: str, missing: str):
        super().__init__(f"{needed_by} needs {missing}, which remote-drafter's engine-side "
                         f"install leaves out: pip install '{WORKER_EXTRA}'")


def worker_side(module: str, needed_by: str | None = None):
    """Import a module of the torch side (a neural drafter, the target, torch itself);
    WorkerExtraMissing, naming the extra, where torch or safetensors is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name not in WORKER_PACKAGES:
            raise
        raise WorkerExtraMissing(needed_by or module, exc.name) from exc


def load_drafter(spec: str, target: str | None = None, device: str = "cpu", dtype=None,
                 **options) -> Drafter:
    """'ngram', 'lm' (the target itself as drafter), 'dsv41:<folder>' (DeepSeek-V4.1's
    drafter in its checkpoint folder), a DSpark checkpoint folder, or 'module:Class' (a
    class taking (target, device, **options)); `dtype` (a torch dtype) casts a drafter's
    weights, a checkpoint's as they move to the device."""
    if spec.startswith(DSV41_PREFIX):  # before the 'module:Class' rule, which it resembles
        Dsv41Drafter = worker_side("remote_drafter.models.dsv41.drafter").Dsv41Drafter
        return Dsv41Drafter.load(spec.removeprefix(DSV41_PREFIX), target, device, dtype, **options)
    if os.path.isdir(spec):
        DSparkDrafter = worker_side("remote_drafter.models.dspark").DSparkDrafter
        # cast tensor by tensor on the way: cast on the card, the float32 copy (twice the
        # bf16 weights) would stay reserved by the allocator beside them
        return DSparkDrafter.load(spec, target, device=device, **({"dtype": dtype} if dtype else {}))
    drafter = _other_drafter(spec, target, device, options)
    if dtype is not None and hasattr(drafter, "model"):
        drafter.model.to(dtype)
    return drafter


def _other_drafter(spec: str, target: str | None, device: str, options: dict) -> Drafter:
    if spec == "ngram":
        from remote_drafter.engine.identity import target_digest, tokenizer_digest

        from .ngram import NgramDrafter
        if target:  # it serves this target: its vocabulary bounds ids, its digests identify it
            with open(os.path.join(target, "config.json")) as f:
                options.setdefault("vocab_size", int(json.load(f)["vocab_size"]))
            options["target"] = Manifest(target_digest(target), tokenizer_digest(target))
        return NgramDrafter(**options)
    if spec == "lm":
        LMDrafter = worker_side("remote_drafter.models.lm").LMDrafter
        if not target:
            raise ValueError("the 'lm' drafter runs the target checkpoint: pass --target")
        return LMDrafter.from_folder(target, device=device, **options)
    if ":" in spec:
        module, _, name = spec.partition(":")
        return getattr(importlib.import_module(module), name)(target, device, **options)
    raise ValueError(f"unknown drafter {spec!r}: 'ngram', 'lm', 'dsv41:<folder>', a checkpoint "
                     "folder or 'module:Class'")
