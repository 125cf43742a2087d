"""The CPU evaluation of EXL3 drafting on the trained SmolLM2 drafter, after
packages/remote-drafter/benchmarks/exl3_gpu.py --gpu: from the rows the GPU returned and the
target's head, per-position draft agreement and total-variation distance of EXL3 (and bf16)
vs float32 along float32's chain; exact acceptance E_1..E_5 (this package's exact rounds,
T = 0) of the drafter with exllamav3's reconstructed weights vs the trained drafter; and the
fidelity gate as `remote-drafter exl3 gate` computes it.

    python packages/native-drafter/benchmarks/exl3_evaluate.py --taps .exl3taps \
        --got <the --gpu run's folder> --out findings/raw/exl3-drafter-gate-<date>.json

It lives here, not beside exl3_gpu.py, because it uses native-drafter's evaluator and
acceptance-ceiling, which remote-drafter does not depend on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[3]
CHECKPOINT = ROOT / "packages/native-drafter/checkpoints/smollm2-135m-dspark"
TARGET = ROOT / ".artifacts/smollm2-135m"
BITS = (4, 6)


def drafter_with(folder: str, weights: dict[str, torch.Tensor] | None = None, bf16: bool = False):
    """The trained drafter (float32, CPU) with `weights` (module name -> W) put in place, or
    with every weight rounded to bfloat16 (the bf16 drafter's values, computed in float32)."""
    from remote_drafter.models.dspark import DSparkDrafter
    d = DSparkDrafter.load(folder, str(TARGET))
    state = d.model.state_dict()
    for n, w in (weights or {}).items():
        state[n + ".weight"] = w.float()
    if bf16:
        state = {k: v.to(torch.bfloat16).float() for k, v in state.items()}
    d.model.load_state_dict(state)
    return d


def evaluate(taps_dir: str, got: str, out: str) -> None:
    from acceptance_ceiling.chain import exact
    from native_drafter.evaluate import TargetDists, dspark_chain
    from remote_drafter.models import fidelity_gate
    from remote_drafter.models.dspark import DSparkDrafter
    from remote_drafter.models.llama import LlamaLM
    taps = load_file(os.path.join(taps_dir, "taps.safetensors"))
    rows = load_file(os.path.join(got, "smollm2-rows.safetensors"))
    res = json.load(open(os.path.join(got, "exl3-gpu.json")))
    trained = DSparkDrafter.load(str(CHECKPOINT), str(TARGET))
    model = trained.model
    head = model.head.float()
    rounds = rows["float32"].shape[0]
    fidelity = {}
    for name in [k for k in rows if k != "float32"]:
        agree, tv = np.zeros(5), np.zeros(5)
        for i in range(rounds):
            prev = [int(taps[f"prefix.{i}"][-1])] * 2
            for j in range(5):
                ps = []
                for src, p in zip(("float32", name), prev):
                    z = rows[src][i, j] @ head.T + model.markov(torch.tensor([p]))[0]
                    ps.append(torch.softmax(z.double(), -1))
                agree[j] += int(ps[0].argmax() == ps[1].argmax())
                tv[j] += 0.5 * float((ps[0] - ps[1]).abs().sum())
                prev = [int(ps[0].argmax())] * 2  # along float32's chain
        fidelity[name] = {"agreement_per_position": (agree / rounds).round(4).tolist(),
                          "tv_t1_per_position": (tv / rounds).round(5).tolist()}
    res["smollm2_fidelity_vs_float32"] = fidelity
    target = LlamaLM.load(str(TARGET), "cpu")
    dists = TargetDists(target)
    drafters = {"trained_float32": trained, "bfloat16_weights": drafter_with(str(CHECKPOINT), bf16=True)}
    for bits in BITS:
        recon = {}
        for f in res["smollm2"][f"exl3_{bits}"]["reconstructed_files"]:
            recon.update(load_file(os.path.join(got, f)))
        drafters[f"exl3_{bits}_reconstructed"] = drafter_with(str(CHECKPOINT), recon)
    models = {n: d.model for n, d in drafters.items()}
    e = {n: [] for n in models}
    for i in range(rounds):
        prefix = [int(x) for x in taps[f"prefix.{i}"]]
        logits, hidden = dists.logits_hidden(prefix, tuple(model.config.target_layers))
        dists.remember(prefix, logits[-1])
        for n, m in models.items():
            chain = dspark_chain(m, hidden, prefix)
            e[n].append([exact(dists, chain, prefix, k).mean for k in range(1, 6)])
    acc = {n: {"E_k": np.mean(v, 0).round(4).tolist(), "accepted_length_k5": round(1 + float(np.mean(v, 0)[-1]), 4)}
           for n, v in e.items()}
    for n in acc:
        for base in ("trained_float32", "bfloat16_weights"):
            acc[n][f"vs_{base}_k5"] = round(acc[n]["E_k"][-1] / max(acc[base]["E_k"][-1], 1e-9), 4)
    res["smollm2_exact_acceptance"] = {"rounds": rounds, "temperature": 0.0, "per_drafter": acc}
    # the fidelity gate as `remote-drafter exl3 gate` computes it (remote_drafter.models.fidelity_gate), here on
    # exllamav3's reconstructed weights: greedy verification against the target's own tokens
    gate_rounds, _ = fidelity_gate.read_rounds(os.path.join(taps_dir, "taps.safetensors"))
    res["smollm2_gate"] = {n: fidelity_gate.measure(drafters["bfloat16_weights"], d, gate_rounds)
                           for n, d in drafters.items() if n != "bfloat16_weights"}
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("smollm2_fidelity_vs_float32", "smollm2_exact_acceptance",
                                          "smollm2_gate")}, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--taps", required=True, help="the folder exl3_gpu.py --prepare wrote")
    ap.add_argument("--got", required=True, help="the folder exl3_gpu.py --gpu wrote")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    args = ap.parse_args(argv)
    evaluate(args.taps, args.got, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
