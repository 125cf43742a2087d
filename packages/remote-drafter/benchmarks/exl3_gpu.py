"""EXL3 drafting: the drafter's linears quantised with exllamav3's quantiser and run
through its LinearEXL3, against the same drafter dense. Two modes:

  --prepare DIR   (CPU, before) the SmolLM2 miniature's real taps: round starts from this
                  repository's text, the target (SmolLM2-135M, float32) run over each prefix;
                  DIR holds each round's taps (layers 2, 15, 29; the last <= 128 positions
                  before the anchor, fp16), its prefix, and the embedding rows the block needs
                  (anchor and mask tokens): the 0.5 GB target does not travel.
  --gpu DIR       (GPU, benchmarks/gpu.sh ONLY_EXL3_DRAFTER=1) steps, smallest first, JSON
                  rewritten after each: exllamav3's import (its extension build); the trained
                  SmolLM2 drafter converted at 4 and 6 bits (exl3 convert's code), its pack
                  loaded as the worker loads it (DSparkDrafter.load), and the final normed
                  hidden rows of every round from the same taps, dense float32 / bf16 / EXL3;
                  exllamav3's reconstruction of each quantised weight (for the CPU's exact
                  acceptance); the tiny V4.1 drafter converted at 4 and 6 bits and served
                  from its pack (Dsv41Drafter.load) vs bf16: greedy drafts and T = 1
                  distributions, and through the real worker over tcp. The round at the
                  V4.1-Flash width is drafter_round.py's.

The CPU evaluation of what --gpu returns (agreement, TV and exact acceptance with
native-drafter's evaluator) is packages/native-drafter/benchmarks/exl3_evaluate.py.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[3]
CHECKPOINT = ROOT / "packages/native-drafter/checkpoints/smollm2-135m-dspark"
TARGET = ROOT / ".artifacts/smollm2-135m"
BITS = (4, 6)
ROUNDS = 64
DEPTH = 5  # drafts per round (the drafter's block)
FILE_LIMIT = 15 << 20  # what one file may carry back from the device


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- CPU, before ---------------------------------------------------------------------------

def text_docs() -> list[str]:
    docs = []
    for pattern in ("**/*.md", "packages/*/src/**/*.py"):
        for path in sorted(ROOT.glob(pattern)):
            if ".venv" not in path.parts and ".artifacts" not in path.parts:
                docs.append(path.read_text(errors="replace"))
    return docs


def prepare(out: str, rounds: int) -> None:
    """A gate rounds file (remote_drafter.models.fidelity_gate) of the SmolLM2 target, with the embedding rows
    the block needs riding along."""
    from tokenizers import Tokenizer

    from remote_drafter.decode_loop import plain_decode
    from remote_drafter.engine.identity import target_digest
    from remote_drafter.models import fidelity_gate
    from remote_drafter.models.dspark import DSparkConfig
    from remote_drafter.models.llama import LlamaLM
    meta = json.load(open(CHECKPOINT / "drafter.json"))
    config = DSparkConfig(**{k: v for k, v in meta.items() if not k.endswith("_digest")})
    tok = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    target = LlamaLM.load(str(TARGET), "cpu")
    rng = np.random.default_rng(0)
    docs = [d for d in text_docs() if len(d) > 4000]
    taken, used = [], {config.mask_token_id}
    for d in rng.choice(len(docs), rounds, replace=False):
        ids = tok.encode(docs[d][int(rng.integers(0, len(docs[d]) - 3000)):]).ids
        t = int(rng.integers(40, 200))
        prefix = ids[:t + 1]
        with torch.no_grad():
            _, hidden = target(torch.tensor(prefix), tuple(config.target_layers))
        n = min(t, config.window)
        taken.append(fidelity_gate.Round(hidden[t - n:t].half().numpy(), np.array(prefix),
                                np.array(plain_decode(target, prefix, DEPTH))))
        used.add(prefix[-1])
    rows = sorted(used)
    embed = load_file(str(TARGET / "model.safetensors"))["model.embed_tokens.weight"]
    os.makedirs(out, exist_ok=True)
    fidelity_gate.write_rounds(os.path.join(out, "taps.safetensors"), taken, target_digest(str(TARGET)),
                      {"embed_ids": np.array(rows), "embed_rows": embed[rows].numpy()},
                      hidden_layers=config.target_layers)
    say(f"prepared {rounds} rounds in {out}")


# -- GPU -----------------------------------------------------------------------------------

class Results(dict):
    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self, f, indent=1)


def smollm2_model(state_folder: str, taps: dict, dtype, device):
    """The drafter of `state_folder` (a checkpoint or an EXL3 pack) with the carried embedding
    rows and an identity 'head', so block_logits returns the final normed hidden rows."""
    from remote_drafter.models import exl3
    from remote_drafter.models.dspark import DSparkConfig, DSparkModel
    meta = json.load(open(os.path.join(state_folder, "drafter.json")))
    c = DSparkConfig(**{k: v for k, v in meta.items() if not k.endswith("_digest")})
    embed = torch.zeros(c.vocab_size, c.hidden_size)
    embed[taps["embed_ids"]] = taps["embed_rows"].float()
    model = DSparkModel(c, embed, torch.eye(c.hidden_size))
    state = load_file(os.path.join(state_folder, "drafter.safetensors"))
    names = exl3.read_pack(state_folder)["linears"] if exl3.is_pack(state_folder) else []
    model.load_state_dict({k: v for k, v in state.items() if not exl3.is_exl3_tensor(k)}, strict=not names)
    model = model.to(device, dtype).eval()
    return exl3.install(model, state, names, device), names


def smollm2_rows(model, taps: dict, rounds: int, device) -> torch.Tensor:
    c = model.config
    out = []
    for i in range(rounds):
        prefix, rows = taps[f"prefix.{i}"], taps[f"taps.{i}"]
        t, n = len(prefix) - 1, len(rows)
        ctx = torch.zeros(1, c.window, c.feature, device=device)
        valid = torch.zeros(1, c.window, dtype=torch.bool, device=device)
        pos = torch.zeros(1, c.window, dtype=torch.long, device=device)
        ctx[0, -n:], valid[0, -n:] = rows.to(device).float(), True
        pos[0, -n:] = torch.arange(t - n, t, device=device)
        with torch.no_grad():
            h = model.block_logits(ctx.to(model.embed.dtype), valid, pos,
                                   prefix[-1:].to(device), torch.tensor([t], device=device))
        out.append(h[0].float().cpu())
    return torch.stack(out)


def save_split(tensors: dict, out: str, stem: str) -> list[str]:
    """fp16 tensors in files under FILE_LIMIT each."""
    files, part, size = [], {}, 0
    for name in sorted(tensors):
        t = tensors[name].half().contiguous()
        if part and size + t.numel() * 2 > FILE_LIMIT:
            files.append(f"{stem}-{len(files)}.safetensors")
            save_file(part, os.path.join(out, files[-1]))
            part, size = {}, 0
        part[name], size = t, size + t.numel() * 2
    files.append(f"{stem}-{len(files)}.safetensors")
    save_file(part, os.path.join(out, files[-1]))
    return files


def step_smollm2(res: Results, taps_dir: str, out: str, work: str) -> None:
    from remote_drafter.models import exl3
    from remote_drafter.models.dspark import DSparkDrafter
    taps = load_file(os.path.join(taps_dir, "taps.safetensors"))
    rounds = sum(1 for k in taps if k.startswith("prefix."))
    rows = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        rows[name] = smollm2_rows(smollm2_model(str(CHECKPOINT), taps, dtype, "cuda")[0], taps, rounds, "cuda")
    r = res.setdefault("smollm2", {"rounds": rounds, "checkpoint": str(CHECKPOINT.relative_to(ROOT))})
    for bits in BITS:
        pack = os.path.join(work, f"smollm2-exl3-{bits}")
        t0 = time.monotonic()
        DSparkDrafter.convert_exl3(str(CHECKPOINT), pack, bits, "cuda")
        convert_s = time.monotonic() - t0
        model, names = smollm2_model(pack, taps, torch.bfloat16, "cuda")
        rows[f"exl3_{bits}"] = smollm2_rows(model, taps, rounds, "cuda")
        linear_bytes = sum(m.stored_bytes for m in model.modules() if isinstance(m, exl3.Exl3Linear))
        dense_params = sum(m.in_features * m.out_features for m in model.modules()
                           if isinstance(m, exl3.Exl3Linear))
        files = save_split({f"{n}": m.dense() for n, m in model.named_modules()
                            if isinstance(m, exl3.Exl3Linear)}, out, f"smollm2-exl3-{bits}-dense")
        r[f"exl3_{bits}"] = {"convert_s": round(convert_s, 1), "linears": len(names),
                             "linear_params": dense_params, "exl3_linear_bytes": linear_bytes,
                             "bf16_linear_bytes": 2 * dense_params,
                             "bits_per_weight": round(8 * linear_bytes / dense_params, 3),
                             "pack_bytes": sum(os.path.getsize(p) for p in glob.glob(pack + "/*")),
                             "reconstructed_files": files}
        res.save()
        say(f"  smollm2 {bits} bits: {r[f'exl3_{bits}']}")
        # the pack as the worker loads it: refusal-free, a manifest of its own
        try:
            d = DSparkDrafter.load(pack, str(TARGET), device="cuda", dtype=torch.bfloat16)
            r[f"exl3_{bits}"]["manifest"] = d.manifest().to_json()
        except (ValueError, FileNotFoundError) as exc:  # the target does not travel
            r[f"exl3_{bits}"]["worker_load"] = f"not run here: {exc}"
    save_file({k: v.contiguous() for k, v in rows.items()}, os.path.join(out, "smollm2-rows.safetensors"))
    res.save()


def step_tiny_dsv41(res: Results, work: str) -> None:
    from remote_drafter.models.dsv41 import tiny
    from remote_drafter.models.dsv41.drafter import Dsv41Drafter
    sys.path.insert(0, str(Path(__file__).parent))
    from dsv41_gpu import random_rounds
    folder = os.path.join(work, "tiny-v41")
    tiny.write_tiny(folder)
    dense = Dsv41Drafter.load(folder, device="cuda", dtype=torch.bfloat16)
    out = res.setdefault("tiny_dsv41", {})
    for bits in BITS:
        pack = os.path.join(work, f"tiny-v41-exl3-{bits}")
        t0 = time.monotonic()
        Dsv41Drafter.convert_exl3(folder, pack, bits, None, "cuda")
        q = Dsv41Drafter.load(pack, device="cuda", dtype=torch.bfloat16)
        same = total = 0
        tv = []
        for r in range(20):
            a, b = (d.draft(random_rounds(d, 4, 40 + r, r), want_probs=False) for d in (dense, q))
            same += sum(int(x == y) for u, v in zip(a, b) for x, y in zip(u.tokens, v.tokens))
            total += sum(len(u.tokens) for u in a)
            a, b = (d.draft(random_rounds(d, 4, 40 + r, r, 1.0), want_probs=True) for d in (dense, q))
            tv += [0.5 * float(np.abs(x.probs[0] - y.probs[0]).sum()) for x, y in zip(a, b)]
        out[f"exl3_{bits}"] = {"convert_load_s": round(time.monotonic() - t0, 1),
                               "greedy_drafts_same": same, "greedy_drafts": total,
                               "first_draft_tv_t1_mean": float(np.mean(tv)),
                               "manifest_differs": q.manifest().drafter != dense.manifest().drafter}
        res.save()
        say(f"  tiny v41 {bits} bits: {out[f'exl3_{bits}']}")
    out["gate_cli"] = gate_cli(dense, folder, os.path.join(work, "tiny-v41-exl3-4"), work)
    res.save()
    say(f"  tiny v41 gate: {out['gate_cli']}")


def gate_cli(dense, folder: str, pack: str, work: str) -> dict:
    """`remote-drafter exl3 gate` on the tiny pack, as an operator runs it. The tiny drafter has
    no trained target, so its rounds' continuations are the bf16 drafter's own greedy chains on
    random taps: the ratio is then the pack's chain agreement with bf16, not an acceptance."""
    import subprocess

    from remote_drafter.models import fidelity_gate
    from remote_drafter.models.base import DraftRequest
    rng, rounds = np.random.default_rng(11), []
    for _ in range(32):
        t = int(rng.integers(20, 300))
        prefix = rng.integers(0, dense.vocab_size, t + 1)
        taps = rng.standard_normal((min(t, dense.window), dense.feature)).astype(np.float16)
        r = fidelity_gate.Round(taps, prefix, np.zeros(dense.max_depth, np.int64))
        chain = dense.draft([DraftRequest(fidelity_gate.history_of(dense, r), dense.max_depth)], want_probs=False)
        rounds.append(fidelity_gate.Round(taps, prefix, chain[0].tokens.astype(np.int64)))
    path = os.path.join(work, "tiny-gate-rounds.safetensors")
    fidelity_gate.write_rounds(path, rounds)
    cmd = [sys.executable, "-m", "remote_drafter.cli", "exl3", "gate", pack, "--reference", folder,
           "--rounds", path, "--device", "cuda:0", "--dtype", "bfloat16"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return {"command": " ".join(cmd[1:]), "exit": done.returncode,
            "output_tail": (done.stdout + done.stderr)[-1500:], "record": fidelity_gate.read_record(pack)}


def step_worker(res: Results, work: str, rounds: int = 10, device: str = "cuda:0",
                weights: tuple[str, ...] | None = None, pack_name: str = "tiny-v41-exl3-4") -> None:
    """The pack served end to end: `remote-drafter worker --drafter dsv41:<pack> --weights
    exl3` (the CLI, its own process; --ungated only where gate_cli's record is no pass), a
    DrafterClient over tcp checking the pack's identity, its drafts against the same pack's
    drafter in this process, same requests, same batch."""
    import subprocess

    from remote_drafter.engine.client import DrafterClient
    from remote_drafter.engine.transport import RemoteTransport
    from remote_drafter.models.base import DraftRequest
    from remote_drafter.models.dsv41.drafter import Dsv41Drafter
    pack = os.path.join(work, pack_name)
    if not os.path.isdir(pack):
        raise RuntimeError(f"no {pack_name}: the tiny_dsv41 step did not make it")
    if weights is None:
        from remote_drafter.worker import exl3_admission
        weights = ("--weights", "exl3") + (("--ungated",) if exl3_admission.refusal(pack, None) else ())
    local = Dsv41Drafter.load(pack, device=device)
    cmd = [sys.executable, "-m", "remote_drafter.cli", "worker", "--listen", "127.0.0.1:0",
           "--drafter", f"dsv41:{pack}", "--device", device, *weights]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = res.setdefault("worker", {"command": " ".join(cmd[1:])})
    try:
        lines = []
        for line in proc.stdout:  # its start-up line names the address it listens on
            lines.append(line.rstrip())
            if " tcp on " in line:
                break
        else:
            raise RuntimeError("the worker exited: " + " | ".join(lines[-8:]))
        out["startup_line"], out["startup_s"] = lines[-1], round(time.monotonic() - t0, 1)
        address = lines[-1].rsplit(" tcp on ", 1)[1].split(";")[0].split()[0]
        client = DrafterClient(RemoteTransport(address, "tcp", local.manifest()), "64:5", deadline_s=30.0)
        rng, requests = np.random.default_rng(7), []
        for rid in range(8):
            tokens = rng.integers(0, local.vocab_size, 150, dtype=np.int32)
            rows = rng.standard_normal((149, local.feature)).astype(np.float32)
            client.add_request(rid, tokens, rows)
            h = local.new_history()
            h.reset(tokens, rows)
            requests.append(DraftRequest(h, 5))
        served = client.propose(5)
        mine = local.draft(requests, want_probs=False)
        times, drafts = [], served
        for _ in range(rounds):  # each round one more committed token (its first draft) per request
            for rid, d in drafts.items():
                client.commit(rid, d.tokens[:1], rng.standard_normal((1, local.feature)).astype(np.float32))
            t1 = time.perf_counter()
            drafts = client.propose(5)
            times.append(1000 * (time.perf_counter() - t1))
        out.update({"requests": len(requests), "served": len(served),
                    "drafts_identical": sum(int(np.array_equal(served[i].tokens, d.tokens))
                                            for i, d in enumerate(mine) if i in served),
                    "tokens_served": int(sum(len(d.tokens) for d in served.values())),
                    "tcp_round_p50_ms_batch8": round(float(np.median(times)), 2),
                    "client_counters": client.counters()})
        client.close()
    finally:
        proc.terminate()
        rest = proc.communicate(timeout=30)[0]
        out["worker_exit"], out["worker_log_tail"] = proc.returncode, rest[-1500:]
    res.save()
    say(f"  worker: {({k: v for k, v in out.items() if k != 'worker_log_tail'})}")


def gpu(taps_dir: str, out: str, steps: list[str]) -> None:
    res = Results(os.path.join(out, "exl3-gpu.json"))
    res.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
    from remote_drafter.models import exl3
    t0 = time.monotonic()
    res["exllamav3"] = exl3.load_exllamav3(say).version
    res["import_s"] = round(time.monotonic() - t0, 1)
    res.save()
    work = tempfile.mkdtemp()
    for name, fn in (("smollm2", lambda: step_smollm2(res, taps_dir, out, work)),
                     ("tiny_dsv41", lambda: step_tiny_dsv41(res, work)),
                     ("worker", lambda: step_worker(res, work))):
        if name not in steps:
            continue
        say(f"== {name}")
        t1 = time.monotonic()
        try:
            fn()
        except Exception as exc:  # a failed step is recorded; the next still runs
            import traceback
            traceback.print_exc()
            res.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
        res.setdefault("step_s", {})[name] = round(time.monotonic() - t1, 1)
        res.save()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", metavar="DIR")
    ap.add_argument("--gpu", metavar="DIR", help="the prepared taps")
    ap.add_argument("--out", required=True, help="--gpu: the folder its files go to")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--steps", default="smollm2,tiny_dsv41,worker")
    args = ap.parse_args(argv)
    if args.prepare:
        prepare(args.prepare, args.rounds)
    elif args.gpu:
        os.makedirs(args.out, exist_ok=True)
        gpu(args.gpu, args.out, args.steps.split(","))
    else:
        ap.error("--prepare DIR or --gpu DIR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
