"""DeepSeek-V4.1's (or DeepSeek-V4's: config.py) drafter read out of its checkpoint folder:
config.json plus model.safetensors.index.json and its shards, or one model.safetensors.

Only the drafter's tensors are read (`mtp.*`, `embed.weight`, `head.weight`; vLLM's
DSparkDeepseekV4Model.load_weights skips everything else), each on its own through
safetensors' safe_open: the target's layers are never read, and shards holding none of the
drafter's tensors are never opened. What is there is checked against
`config.expected_tensors` before anything is read: a missing, extra or mis-shaped tensor, or
one stored in another dtype than DeepSeek's, is refused by name (but a bf16 confidence head,
which vLLM upcasts: UPCAST_FROM). FP8 and FP4 tensors are dequantised at load (`quant`),
their `.scale` tensors consumed; a checkpoint without a quantization_config stores them bf16.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace

import torch
from safetensors import safe_open

from remote_drafter.engine.identity import digest_tensors
from remote_drafter.models.tensors import tensor_bytes

from . import quant
from .config import Dsv41DrafterConfig, expected_tensors, in_slice, weight_table

CONFIG_FILE, INDEX_FILE, SINGLE_FILE = "config.json", "model.safetensors.index.json", "model.safetensors"
# The safetensors dtypes each kind of config.expected_tensors may be stored as.
STORED_AS = {"bf16": ("BF16",), "f32": ("F32",), "fp8": ("F8_E4M3",),
             "fp4": ("I8", "U8", "F4"), "e8m0": ("F8_E8M0", "U8")}
BYTES_PER_ELEMENT = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2,
                     "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
                     "F4": 1}  # F4: per stored byte (two values)
# vLLM keeps these in float32 whatever the model's dtype (attention sinks, mHC, router bias)
KEPT_FLOAT32 = ("f32",)
# Other dtypes a tensor may be stored in, read upcast to its kind: vLLM's DSparkConfidenceHead
# holds a float32 parameter and its default weight loader copies whatever is stored into it.
UPCAST_FROM = {".confidence_head.proj.weight": ("BF16",)}
REFUSALS_SHOWN = 8


def is_drafter_tensor(name: str) -> bool:
    """`mtp.*` and the shared embedding and head (an EXL3 head: `head.trellis`, ...)."""
    return name.startswith(("mtp.", "embed.", "head."))


def is_markov_tensor(name: str) -> bool:
    return ".markov_head." in name


def stored_as(name: str, kind: str) -> tuple[str, ...]:
    """The safetensors dtypes tensor `name` of `kind` may be stored as."""
    upcast = next((dtypes for suffix, dtypes in UPCAST_FROM.items() if name.endswith(suffix)), ())
    return STORED_AS[kind] + upcast


def scale_of(weight_name: str) -> str:
    """`<module>.weight` is scaled by `<module>.scale` (DeepSeek's naming)."""
    return weight_name.removesuffix(".weight") + ".scale"


@dataclass(frozen=True)
class StoredTensor:
    file: str
    dtype: str                # safetensors' name: BF16, F8_E4M3, I8, F8_E8M0, ...
    shape: tuple[int, ...]    # as a torch tensor holds it (F4: two values per element)

    @property
    def nbytes(self) -> int:
        n = BYTES_PER_ELEMENT.get(self.dtype, 0)
        for d in self.shape:
            n *= d
        return n


@dataclass
class DrafterCheckpoint:
    config: Dsv41DrafterConfig
    weights: dict[str, torch.Tensor]   # checkpoint name -> dequantised tensor (no scales)
    scales: tuple[str, ...]            # the `.scale` tensors dequantisation consumed
    drafter_digest: str                # config and every tensor read but the Markov head's
    markov_digest: str                 # the Markov head's tensors
    tensor_digests: dict[str, str]     # every tensor read: sha256 of its stored bytes
    experts: range | None = None       # the routed experts read (an expert-parallel slice; None: all)


def read_config(folder: str) -> dict:
    with open(os.path.join(folder, CONFIG_FILE)) as f:
        return json.load(f)


def tensor_files(folder: str) -> dict[str, str]:
    """Every tensor's name -> the file holding it (the index's weight map, or the single
    file's header)."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            return {name: os.path.join(folder, file) for name, file in json.load(f)["weight_map"].items()}
    single = os.path.join(folder, SINGLE_FILE)
    if not os.path.exists(single):
        raise FileNotFoundError(f"{folder}: neither {INDEX_FILE} nor {SINGLE_FILE}")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


def stored_drafter_tensors(folder: str, experts: range | None = None) -> dict[str, StoredTensor]:
    """The drafter's tensors as their headers describe them (no tensor data read); of the
    routed experts only `experts` (None: all)."""
    by_file: dict[str, list[str]] = {}
    for name, file in tensor_files(folder).items():
        if is_drafter_tensor(name) and in_slice(name, experts):
            by_file.setdefault(file, []).append(name)
    found = {}
    for file, names in by_file.items():
        with safe_open(file, "pt") as f:
            for name in names:
                view = f.get_slice(name)
                shape, dtype = tuple(view.get_shape()), view.get_dtype()
                if dtype == "F4":  # safetensors counts values; torch holds pairs
                    shape = (*shape[:-1], shape[-1] // 2)
                found[name] = StoredTensor(file, dtype, shape)
    return found


def with_optional_heads(config: Dsv41DrafterConfig, stored: dict) -> Dsv41DrafterConfig:
    """vLLM drops the confidence head when the checkpoint has none (load_weights)."""
    heads = [n for n in expected_tensors(config) if ".confidence_head." in n]
    if heads and not any(n in stored for n in heads):
        return replace(config, enable_confidence_head=False)
    return config


def problems(config: Dsv41DrafterConfig, stored: dict[str, StoredTensor],
             experts: range | None = None) -> list[str]:
    """What differs from DeepSeek's table (of the routed experts only `experts`), one line
    per tensor, by name."""
    expected = expected_tensors(config, experts)
    found = [f"{n}: missing" for n in sorted(set(expected) - set(stored))]
    found += [f"{n}: extra (not a tensor of this drafter)" for n in sorted(set(stored) - set(expected))]
    for name in sorted(set(stored) & set(expected)):
        (shape, kind), have = expected[name], stored[name]
        if have.dtype not in stored_as(name, kind):
            found.append(f"{name}: stored as {have.dtype}, expected {kind} "
                         f"({' / '.join(stored_as(name, kind))})")
        elif have.shape != tuple(shape):
            found.append(f"{name}: shape {list(have.shape)}, expected {list(shape)}")
    return found


def refuse(folder: str, found: list[str], name: str) -> None:
    if found:
        more = f"; and {len(found) - REFUSALS_SHOWN} more" if len(found) > REFUSALS_SHOWN else ""
        raise ValueError(f"{folder} does not hold {name}'s drafter as its config "
                         f"describes it: {'; '.join(found[:REFUSALS_SHOWN])}{more}")


def tensor_digests(stored: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each tensor's stored bytes, by name: what the drafter's digests combine, so
    the ranks of an expert-parallel pair, each reading a slice, combine into the one-card
    worker's digests."""
    return {n: hashlib.sha256(tensor_bytes(t)).hexdigest() for n, t in stored.items()}


def digests(config: Dsv41DrafterConfig, hashes: dict[str, str]) -> tuple[str, str]:
    """(drafter, Markov head) digests over the config and the stored tensors' digests
    (tensor_digests), the Markov head's apart (a checkpoint's, or an EXL3 pack's)."""
    drafter = digest_tensors([("config", json.dumps(asdict(config), sort_keys=True).encode())]
                             + [(n, bytes.fromhex(hashes[n])) for n in sorted(hashes)
                                if not is_markov_tensor(n)])
    markov = digest_tensors([(n, bytes.fromhex(hashes[n])) for n in sorted(hashes) if is_markov_tensor(n)])
    return drafter, markov


def load(folder: str, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
         experts: range | None = None) -> DrafterCheckpoint:
    """The drafter's weights, dequantised to `dtype` on `device` (float32 tensors stay
    float32, and those stored narrower are upcast to float32), with digests over exactly the
    stored bytes read. experts: read only these routed experts (an expert-parallel rank's
    slice: the others are never read, and may be missing; the digests are then the slice's)."""
    config = Dsv41DrafterConfig.from_json(read_config(folder))
    stored = stored_drafter_tensors(folder, experts)
    config = with_optional_heads(config, stored)
    refuse(folder, problems(config, stored, experts), config.name)
    raw = read_tensors(stored)
    hashes = tensor_digests(raw)
    drafter_digest, markov_digest = digests(config, hashes)
    kinds = expected_tensors(config, experts)
    weights, scales = {}, []
    for name in weight_table(config, experts):
        kind, weight = kinds[name].kind, raw.pop(name).to(device)
        if kind == "fp8":
            scales.append(scale_of(name))
            weights[name] = quant.dequantize_fp8(weight, raw.pop(scale_of(name)).to(device), dtype,
                                                 config.weight_block_size)
        elif kind == "fp4":
            scales.append(scale_of(name))
            weights[name] = quant.dequantize_fp4(weight, raw.pop(scale_of(name)).to(device), dtype)
        else:
            weights[name] = weight.to(torch.float32 if kind in KEPT_FLOAT32 else dtype)
    return DrafterCheckpoint(config, weights, tuple(scales), drafter_digest, markov_digest, hashes, experts)


def read_tensors(stored: dict[str, StoredTensor]) -> dict[str, torch.Tensor]:
    """The named tensors as stored (on the CPU), each file opened once."""
    with ExitStack() as files:
        handles = {file: files.enter_context(safe_open(file, "pt"))
                   for file in sorted({s.file for s in stored.values()})}
        return {name: handles[s.file].get_tensor(name) for name, s in stored.items()}


def describe(folder: str) -> dict:
    """The drafter's tensors (shape, stored dtype, bytes), totals, the config values that
    matter and any problems, from the headers alone (no tensor data read). `loaded_bytes`
    is what `load` holds at bfloat16 (scales consumed, float32 tensors kept)."""
    config = Dsv41DrafterConfig.from_json(read_config(folder))
    stored = stored_drafter_tensors(folder)
    config = with_optional_heads(config, stored)
    kinds = expected_tensors(config)
    loaded_bytes = 0
    for name, (shape, _) in weight_table(config).items():
        numel = 1
        for d in shape:
            numel *= d
        loaded_bytes += numel * (4 if kinds[name].kind in KEPT_FLOAT32 else 2)
    files = tensor_files(folder)
    return {
        "folder": folder,
        "drafter": config.name,
        "config": asdict(config),
        "tensors": {n: {"shape": list(s.shape), "dtype": s.dtype, "bytes": s.nbytes}
                    for n, s in sorted(stored.items())},
        "stored_bytes": sum(s.nbytes for s in stored.values()),
        "loaded_bytes_bf16": loaded_bytes,
        "scales": sum(1 for n in stored if n.endswith(".scale")),
        "trunk_tensors": sum(1 for n in files if not is_drafter_tensor(n)),
        "problems": problems(config, stored),
    }
