"""The native kernels' GPU tier (benchmarks/kernels.sh runs it; see there for the calls).

  pack     (here)  the target's tied embedding as bfloat16 in two parts, the real states
                   and the wheels -> .artifacts/native-drafter/kx0, kx1 (one per device call)
  unpack   (GPU)   the parts -> a target folder (the embedding) and the trained checkpoint
                   re-saved for that folder's digest (same weights; the GPU machine has no
                   target folder, and the bf16 embedding is another target than the fp32 one)
  worker   (GPU)   `remote-drafter worker --kernels torch` and `--kernels native`, the real
                   states sent to both through the client: drafts compared token for token
  latency  (GPU)   one greedy round at batch 1/4/16 x width 3/5/8 for torch eager, torch
                   eager in a CUDA graph, torch.compile, torch.compile in a CUDA graph,
                   native and native in a CUDA graph with the card's tiles, and where those
                   are ROOMY the same with COMPACT's (the 3090's, which spill no register)
                   (median of triton's do_bench); the bandwidth floor from a
                   device-to-device copy measured in the same run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import torch

KX = ".artifacts/native-drafter"


def cmd_pack(args) -> int:
    from safetensors import safe_open
    wheels = [w for w in (os.listdir(args.wheels) if os.path.isdir(args.wheels) else [])
              if w.startswith(("cffi-", "pycparser-")) and w.endswith(".whl")]
    if len(wheels) < 2:
        raise SystemExit(f"pack: {args.wheels} lacks the cffi and pycparser wheels the GPU machine "
                         "installs (it reaches no registry): python3 -m pip download --no-deps "
                         "--only-binary=:all: --python-version 3.12 --implementation cp --platform "
                         f"manylinux2014_x86_64 -d {args.wheels} cffi pycparser")
    with safe_open(os.path.join(args.target, "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    raw = embed.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
    half = len(raw) // 2
    for i, part in enumerate((raw[:half], raw[half:])):
        folder = os.path.join(KX, f"kx{i}")
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        with open(os.path.join(folder, f"embed.part{i}"), "wb") as f:
            f.write(part)
    meta = {"shape": list(embed.shape), "sha256": hashlib.sha256(raw).hexdigest()}
    with open(os.path.join(KX, "kx0", "embed.json"), "w") as f:
        json.dump(meta, f)
    for wheel in wheels:
        shutil.copy2(os.path.join(args.wheels, wheel), os.path.join(KX, "kx0"))
    shutil.copy2(args.states, os.path.join(KX, "kx1", "states.pt"))
    subprocess.run(["du", "-sh", os.path.join(KX, "kx0"), os.path.join(KX, "kx1")], check=True)
    return 0


def cmd_unpack(args) -> int:
    from safetensors.torch import load_file, save_file

    from remote_drafter.engine.identity import target_digest, tokenizer_digest
    from remote_drafter.models.dspark import (
        CONFIG_FILE,
        WEIGHTS_FILE,
        DSparkConfig,
        DSparkDrafter,
        DSparkModel,
    )
    with open(os.path.join(args.keep, "embed.json")) as f:
        meta = json.load(f)
    raw = b"".join(open(os.path.join(args.keep, f"embed.part{i}"), "rb").read() for i in (0, 1))
    if hashlib.sha256(raw).hexdigest() != meta["sha256"]:
        raise SystemExit("embedding parts missing or wrong (did the machine go cold between the calls?)")
    embed = torch.frombuffer(bytearray(raw), dtype=torch.int16).view(torch.bfloat16).reshape(meta["shape"]).float()
    target = os.path.join(args.out, "target")
    os.makedirs(target, exist_ok=True)
    save_file({"model.embed_tokens.weight": embed}, os.path.join(target, "model.safetensors"))
    with open(os.path.join(args.checkpoint, CONFIG_FILE)) as f:
        config = {k: v for k, v in json.load(f).items() if not k.endswith("_digest")}
    model = DSparkModel(DSparkConfig(**config), embed, embed)
    state = load_file(os.path.join(args.checkpoint, WEIGHTS_FILE))
    model.load_state_dict(state, strict=True)
    dtype = next(iter(state.values())).dtype
    DSparkDrafter.save(os.path.join(args.out, "drafter"), model, target_digest(target), tokenizer_digest(target), dtype)
    print(f"unpacked: {target} (embedding {meta['shape']} from bf16), {args.out}/drafter ({dtype} weights)")
    return 0


def _requests(args):
    from native_drafter.states import requests_from
    from remote_drafter.models.dspark import DSparkDrafter
    drafter = DSparkDrafter.load(args.checkpoint, args.target, device=args.device)
    return drafter, requests_from(torch.load(args.states), drafter)


def cmd_worker(args) -> int:
    from native_drafter.worker_check import compare_workers
    drafter, requests = _requests(args)
    result = compare_workers(args.checkpoint, args.target, requests, args.device, drafter.max_depth)
    result["states"] = args.states
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"worker drafts, --kernels native vs torch: {result['identical']}/{result['entries']} identical, "
          f"{result['drafted']} drafted by both ({len(requests)} real states, batched and one per round)")
    return 0 if result["identical"] == result["entries"] else 1


def torch_round(model, ctx, valid, pos, anchor, anchor_pos):
    """The round in torch: DSparkModel.block_logits, then the greedy Markov chain (what
    DSparkDrafter.draft computes at T = 0, without the host-side bookkeeping)."""
    z = model.block_logits(ctx, valid, pos, anchor, anchor_pos)
    previous, tokens = anchor, []
    for i in range(model.config.block_size):
        previous = (z[:, i] + model.markov(previous)).argmax(-1)
        tokens.append(previous)
    return torch.stack(tokens, 1)


def graphed(fn, warmup: int = 3):
    """fn captured in a CUDA graph (static inputs and outputs); returns replay. (The torch
    variants; the native round has its own, NativeRound.capture, the same steps.)"""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def floor_bytes(model, batch: int) -> dict:
    """Bytes one round must read: every weight once (the head whole; of the embedding and
    W1 only the W rows used) and the window's hidden rows."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "markov.w1.weight")
    weights += model.head.numel() * model.head.element_size()
    rows = (c.block_size * (c.hidden_size + c.markov_rank)) * 4
    window = batch * c.window * (c.feature or 1) * 4
    return {"weights": weights + rows, "window": window, "total": weights + rows + window}


def time_shape(base, batch: int, width: int, bench, bandwidth: float, compile_it: bool, device) -> list[dict]:
    """Every variant at one (batch, width): median ms, distance from the floor, and whether
    its drafts equal torch eager's."""
    from native_drafter import kernels
    from native_drafter.kernel_gate import random_inputs
    from native_drafter.native import NativeRound, with_width
    model = with_width(base, width)
    inputs = random_inputs(model.config, batch, torch.Generator().manual_seed(batch * 10 + width)).to(device)
    x = (inputs.ctx, inputs.ctx_valid, inputs.ctx_pos, inputs.anchor, inputs.anchor_pos)
    native = NativeRound(model)
    ws = native.workspace(batch, width)
    ws.load(inputs)
    floor_ms = floor_bytes(model, batch)["total"] / bandwidth * 1e3

    def eager():
        return torch_round(model, *x)

    def run_native():
        return native.run(ws)

    variants = {"torch eager": eager, "torch eager+graph": graphed(eager),
                "native": run_native, "native+graph": native.capture(ws).replay}
    drafts = {"native": run_native}
    if native.tiles is kernels.ROOMY:  # the other set too, where the card launches both
        compact = NativeRound(model, tiles=kernels.COMPACT)
        ws_compact = compact.workspace(batch, width)
        ws_compact.load(inputs)

        def run_compact():
            return compact.run(ws_compact)
        variants |= {"native compact": run_compact, "native compact+graph": compact.capture(ws_compact).replay}
        drafts["native compact"] = run_compact
    compile_s = None
    if compile_it:
        t0 = time.time()
        compiled = torch.compile(torch_round, dynamic=False)

        def step():
            return compiled(model, *x)
        step()
        compile_s = time.time() - t0
        variants |= {"torch.compile": step, "torch.compile+graph": graphed(step)}
        drafts["torch.compile"] = step
    reference, rows = eager(), []
    for name, fn in variants.items():
        fn()
        torch.cuda.synchronize()
        ms = bench(fn)
        own = drafts.get(name.removesuffix("+graph"))  # the function whose tokens this variant drafts
        rows.append({"batch": batch, "width": width, "variant": name, "ms": ms, "floor_ms": floor_ms,
                     "x_floor": ms / floor_ms, "tokens_equal_eager": bool(torch.equal(own(), reference)) if own else True,
                     **({"compile_s": compile_s} if name.startswith("torch.compile") else {})})
    return rows


def copy_bandwidth(bench, device) -> tuple[float, float]:
    """(ms, bytes/s read + written) of a 1 GiB device-to-device copy of random data."""
    src = torch.randn(1 << 28, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return ms, 2 * src.numel() * 4 / (ms / 1e3)


def cmd_latency(args) -> int:
    import triton.testing

    from remote_drafter.models.dspark import DSparkDrafter
    torch.backends.cuda.matmul.allow_tf32 = False
    dynamo = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(dynamo, name):
            setattr(dynamo, name, 64)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")
    copy_ms, bandwidth = copy_bandwidth(bench, args.device)
    base = DSparkDrafter.load(args.checkpoint, args.target, device=args.device).model
    rows, started = [], time.time()
    for batch in (1, 4, 16):
        for width in (3, 5, 8):
            rows += time_shape(base, batch, width, bench, bandwidth,
                               time.time() - started < args.compile_budget_s, args.device)
            print(f"  b{batch} w{width}: " + ", ".join(f"{r['variant']} {r['ms'] * 1e3:.0f} us"
                                                      for r in rows if (r["batch"], r["width"]) == (batch, width)),
                  flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "copy_bandwidth_Bps": bandwidth,
              "copy_ms_1GiB": copy_ms, "floor_bytes_b1": floor_bytes(base, 1), "rows": rows,
              "timing": {"do_bench_warmup_ms": args.warmup, "do_bench_rep_ms": args.rep, "stat": "median"}}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    rows, fb = result["rows"], result["floor_bytes_b1"]
    print(f"\ndevice-to-device copy: {result['copy_bandwidth_Bps'] / 1e12:.2f} TB/s (read + write); weights "
          f"{fb['weights'] / 1e6:.1f} MB float32 + window rows {fb['window'] / 1e6:.2f} MB per request")
    names = list(dict.fromkeys(r["variant"] for r in rows))
    print(f"{'batch':>5} {'W':>2} {'floor us':>8} " + " ".join(f"{n:>19}" for n in names))
    for batch in (1, 4, 16):
        for width in (3, 5, 8):
            mine = {r["variant"]: r for r in rows if r["batch"] == batch and r["width"] == width}
            floor = next(iter(mine.values()))["floor_ms"]
            cells = [f"{mine[n]['ms'] * 1e3:7.0f} us {mine[n]['x_floor']:5.1f}x"
                     + ("" if mine[n]["tokens_equal_eager"] else "!") if n in mine else "-" for n in names]
            print(f"{batch:>5} {width:>2} {floor * 1e3:8.1f} " + " ".join(f"{c:>19}" for c in cells))
    print("(median of do_bench; Nx = times the bandwidth floor; ! = tokens differ from torch eager's)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("pack")
    s.add_argument("--target", default=".artifacts/smollm2-135m")
    s.add_argument("--states", default=f"{KX}/kernels/states.pt")
    s.add_argument("--wheels", default=f"{KX}/wheels", help="a folder holding cffi's and pycparser's "
                   "Python 3.12 manylinux wheels (the GPU machine installs them; e.g. .whl-small)")
    s.set_defaults(fn=cmd_pack)
    s = sub.add_parser("unpack")
    s.add_argument("--keep", required=True)
    s.add_argument("--checkpoint", required=True)
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_unpack)
    for name, fn in (("worker", cmd_worker), ("latency", cmd_latency)):
        s = sub.add_parser(name)
        s.add_argument("--checkpoint", required=True)
        s.add_argument("--target", required=True)
        s.add_argument("--states", default=None)
        s.add_argument("--device", default="cuda")
        s.add_argument("--out", required=True)
        s.add_argument("--warmup", type=float, default=25)
        s.add_argument("--rep", type=float, default=200)
        s.add_argument("--compile-budget-s", type=float, default=240,
                       help="no torch.compile for shapes reached after this long (compiles are slow)")
        s.set_defaults(fn=fn)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
