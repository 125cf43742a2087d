"""DeepSeek's drafter from EXL3 weights: a pack of ours (Dsv41Drafter.convert_exl3) or a
DeepSeek-V4 / V4.1 model converted by exllamav3's own convert_model."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from remote_drafter.models import exl3

from . import checkpoint
from .config import Dsv41DrafterConfig, weight_table


def load(folder: str, dtype: torch.dtype, device: str, experts: range | None = None) -> SimpleNamespace:
    """EXL3 weights: a pack of ours (convert_exl3) or a DeepSeek-V4 / V4.1 model converted by
    exllamav3's own convert_model, whose `mtp.*` names are DeepSeek's. A weight stored as
    `<module>.trellis` (...) runs as an exl3.Exl3Linear (wo_a: its group slices,
    `wo_a.slice.<g>`); any other weight is used as stored, in any float dtype (exllamav3 keeps
    fp16), at the shape DeepSeek's table gives; a missing or mis-shaped one is refused by name.
    Digests as checkpoint.load computes them, over exactly the stored bytes read; experts:
    only these routed experts, as checkpoint.load reads them."""
    exl3.require(device)
    config = Dsv41DrafterConfig.from_json(checkpoint.read_config(folder))
    stored = checkpoint.stored_drafter_tensors(folder, experts)  # exllamav3's trunk is never read
    config = checkpoint.with_optional_heads(config, stored)
    state = checkpoint.read_tensors(stored)
    linears, weights, problems, used = {}, {}, [], set()
    for name, (shape, storage) in weight_table(config, experts).items():
        module = name.removesuffix(".weight")
        grouped = name.endswith(".attn.wo_a.weight")
        slices = [f"{module}.slice.{g}" for g in range(config.o_groups)] if grouped else []
        if f"{module}.trellis" in state:
            linears[name] = exl3.linear_from(state, module, shape, device)
            used |= {f"{module}.{k}" for k in exl3.STORED}
        elif slices and f"{slices[0]}.trellis" in state:
            linears[name] = exl3.Exl3Groups([exl3.linear_from(state, s, (config.o_lora_rank, shape[1]), device)
                                             for s in slices])
            used |= {f"{s}.{k}" for s in slices for k in exl3.STORED}
        elif name in state or (slices and f"{slices[0]}.weight" in state):
            t = state[name] if name in state else torch.cat([state[f"{s}.weight"] for s in slices])
            used |= {name} if name in state else {f"{s}.weight" for s in slices}
            cut = t if tuple(t.shape) == tuple(shape) else exl3.unpadded(t, shape)
            if cut is None:
                problems.append(f"{name}: shape {list(t.shape)}, expected {list(shape)}"
                                " (or that, zero-padded)")
                continue
            # float32 parameters stay float32 however they were stored, as checkpoint.load reads them
            wide = storage == "f32" or cut.dtype == torch.float32
            weights[name] = cut.to(device, torch.float32 if wide else dtype)
        else:
            problems.append(f"{name}: missing")
    checkpoint.refuse(folder, problems, config.name)
    hashes = checkpoint.tensor_digests(state)
    drafter_digest, markov_digest = checkpoint.digests(config, hashes)
    return SimpleNamespace(config=config, weights=weights, linears=linears, experts=experts,
                           drafter_digest=drafter_digest, markov_digest=markov_digest, tensor_digests=hashes,
                           not_read=sorted(set(state) - used))
