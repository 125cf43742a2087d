"""GPU tier of DeepSeek-V4.1's drafter (run by benchmarks/gpu.sh on an H200; CI runs only its
smoke form, `--device cpu --width tiny`, in tests/test_dsv41_drafter.py).

1. The tiny random V4.1 checkpoint (dsv41/tiny.py), float32, CPU vs CUDA: the same greedy
   drafts for the same rounds, and the largest difference of their probabilities.
2. The drafter at an estimated DeepSeek-V4.1-Flash width (FLASH below; random weights drawn
   on the card; findings/dsv41-drafter.md says why these sizes), bfloat16: weight bytes,
   peak memory with four sequences' windows (the production batch: four sequences, five
   draft tokens) against a 24 GB card, and round p50 at batch 1 / 4 / 16, local (the service
   called in process) and through a worker over tcp loopback: eager (the chosen experts),
   then every expert at once with the round captured as CUDA graphs (the worker's default on
   CUDA, REMOTE_DRAFTER_CUDA_GRAPHS), and whether both give the same greedy drafts.
Prints a table last and writes JSON (--out).

With --own-process, only this: the round over tcp with the worker in a process of its own, as
deployed (one per batch, so its status' draft p50 is that batch's), and the worker's own cost
as the round p50 minus the p50 of the worker's `draft` calls."""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from ofl.bench import raw_message_round_trip
from remote_drafter.bench import drive_rounds, percentiles
from remote_drafter.engine import protocol as P
from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.identity import Manifest
from remote_drafter.engine.transport import LocalTransport, RemoteTransport, worker_stats
from remote_drafter.models.base import DraftRequest
from remote_drafter.models.dsv41 import tiny
from remote_drafter.models.dsv41.config import Dsv41DrafterConfig, weight_table
from remote_drafter.models.dsv41.drafter import Dsv41Drafter
from remote_drafter.models.dsv41.model import Dsv41Model
from remote_drafter.models.registry import load_drafter
from remote_drafter.worker.server import Worker
from remote_drafter.worker.service import DraftService, ServiceConfig

GIB = 1 << 30
CARD_3090 = 24 * 10**9  # bytes on an RTX 3090
# An estimate, not DeepSeek's published config (none names V4.1-Flash's sizes): a target of
# ~275 B parameters over 40 layers (hidden 4096, 256 experts of width 2048, top-8, one shared)
# and a drafter of three such layers with 192 experts (dspark_n_routed_experts), about
# 15.6 B parameters: ~2.5 GiB per Spark rank at 2.75 bits per weight, as reported.
FLASH = {"vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 40,
         "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64,
         "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
         "n_routed_experts": 256, "num_experts_per_tok": 8, "dspark_n_routed_experts": 192,
         "dspark_num_experts_per_tok": 8, "moe_intermediate_size": 2048,
         "dspark_target_layer_ids": [2, 20, 38], "dspark_markov_rank": 256,
         "dspark_noise_token_id": 128815}


def width_config(width: str) -> Dsv41DrafterConfig:
    config = tiny.tiny_config()
    if width == "flash":
        config["text_config"].update(FLASH)
    return Dsv41DrafterConfig.from_json(config)


def random_rounds(d, batch: int, tokens: int, seed: int, temperature: float = 0.0) -> list[DraftRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(batch):
        h = d.new_history()
        h.reset(rng.integers(0, d.vocab_size, tokens, dtype=np.int32),
                rng.standard_normal((tokens - 1, d.feature)).astype(np.float32))
        out.append(DraftRequest(h, d.max_depth, temperature, seed=i))
    return out


def tiny_agreement(rounds: int = 20) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        tiny.write_tiny(folder)
        cpu, gpu = (load_drafter("dsv41:" + folder, device=dev) for dev in ("cpu", "cuda"))
    same, diff = 0, 0.0
    for r in range(rounds):  # greedy drafts; then the distributions drawn from at T = 1
        a, b = (d.draft(random_rounds(d, 4, 40 + r, r), want_probs=False) for d in (cpu, gpu))
        same += sum(int(np.array_equal(x.tokens, y.tokens)) for x, y in zip(a, b))
        a, b = (d.draft(random_rounds(d, 4, 40 + r, r, 1.0), want_probs=True) for d in (cpu, gpu))
        diff = max(diff, max(float(np.abs(x.probs[:1] - y.probs[:1]).max()) for x, y in zip(a, b)))
    return {"requests": 4 * rounds, "same_greedy_drafts": same, "max_first_prob_diff_t1": diff}


def random_drafter(width: str, device: str, dtype: torch.dtype,
                   cuda_graphs: bool = False) -> tuple[Dsv41Drafter, int]:
    """Random weights drawn on `device` (a 30 GB model never passes through host memory);
    with cuda_graphs, its rounds captured as a worker serves them."""
    config, gen = width_config(width), torch.Generator(device=device).manual_seed(0)
    weights = {name: tiny.random_values(name, shape, config, gen).to(dtype)
               for name, (shape, _) in weight_table(config).items()}
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    model = Dsv41Model(config, weights, device)
    del weights
    tag = f"random-{width}"
    manifest = Manifest(target=tag, tokenizer=tag, drafter=tag, markov=tag, kind=Dsv41Drafter.kind)
    return Dsv41Drafter(model, manifest, device, cuda_graphs=cuda_graphs), weight_bytes


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, rounds: int, device: str = "cuda", warm_up: int = 0, before=None) -> dict:
    """p50 / p99 ms of fn() between two device synchronisations, after `warm_up` untimed
    calls; before(), if given, runs untimed ahead of each timed call."""
    for _ in range(warm_up):
        fn()
    times = []
    for _ in range(rounds):
        if before is not None:
            before()
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return percentiles(times)


def round_times(drafter, batch: int, rounds: int) -> dict:
    """p50 / p99 ms of the drafter's round at `batch` (160-token histories), after 3 warm-up rounds."""
    requests = random_rounds(drafter, batch, 160, batch)
    return timed(lambda: drafter.draft(requests, want_probs=False), rounds, drafter.device, warm_up=3)


def in_service(window: int) -> int:
    """Untimed rounds after which a request is in service: two windows of rows at one row a
    round, so its row blocks (on both hosts) are recycled ones, touched before, as those of
    a worker's long requests are, where a young request's still fault on their first write."""
    return 2 * window


def measure(drafter, batches: list[int], rounds: int) -> list[dict]:
    """Round p50 per batch: the drafter alone (its windows current), the service in process, a
    worker over tcp; and the time the worker's rounds spent inside drafter.draft (the new rows'
    encoding included), so tcp minus that is the worker's own cost: protocol, copies, Python;
    and the same payload's round trip over a plain socket (ofl.bench's baseline), so the own
    cost less that is what the worker adds beyond the link's own time. Each is timed on the
    second pass of the same requests (a worker in service has served before), after the
    requests are in service (in_service)."""
    rows = []
    service = DraftService(drafter, ServiceConfig(max_requests=64))
    inside, draft = [], drafter.draft

    def timed_draft(requests, want_probs):
        t0 = time.perf_counter()
        try:
            return draft(requests, want_probs)
        finally:
            inside.append(time.perf_counter() - t0)
    with Worker(drafter, "tcp", "127.0.0.1", 0, ServiceConfig(max_requests=64)) as worker:
        for batch in batches:
            device_ms = round_times(drafter, batch, rounds)["p50_ms"]
            via = {}
            for name, transport in (("local", LocalTransport(service)),
                                    ("tcp", RemoteTransport(worker.address, "tcp", Manifest()))):
                client = DrafterClient(transport, f"64:{drafter.max_depth}", deadline_s=30.0,
                                       row_dtype="bfloat16")
                warm = in_service(drafter.window)
                drive = functools.partial(drive_rounds, client, batch, rounds, drafter.max_depth,  # a bf16 target's rows
                                          drafter.vocab_size, drafter.feature, "sync", 0.0, row_dtype="bfloat16",
                                          warm_rounds=warm)
                drive()  # the same requests twice, timed the second time (a worker in service has served)
                inside.clear()
                drafter.draft = timed_draft
                try:
                    via[name] = drive()
                finally:
                    del drafter.draft
                via[name]["inside_p50_ms"] = percentiles(inside[warm:warm + rounds])["p50_ms"]
            tcp, in_draft = via["tcp"]["drafting"]["p50_ms"], via["tcp"]["inside_p50_ms"]
            sent = via["tcp"]["request_bytes_per_round"]
            # the same payload over a plain socket to a process of its own: its time on this link
            wire = raw_message_round_trip(sent, P.REPLY_HEADER.itemsize + batch * (
                P.REPLY_ENTRY.itemsize + 4 * drafter.max_depth), rounds)["p50_ms"]
            rows.append({"batch": batch, "device_p50_ms": device_ms,
                         "local_p50_ms": via["local"]["drafting"]["p50_ms"],
                         "tcp_p50_ms": tcp, "tcp_inside_draft_p50_ms": in_draft,
                         "tcp_worker_own_ms": round(tcp - in_draft, 3),
                         "tcp_request_bytes_per_round": sent, "wire_p50_ms": round(wire, 3),
                         "tcp_worker_own_beyond_wire_ms": round(tcp - in_draft - wire, 3)})
            print(f"  batch {batch}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def worker_process(script: str, *args: str) -> tuple[subprocess.Popen, str]:
    """`script --serve ARGS` in a process of its own, which prints its worker's address and
    serves until its stdin closes (leaving the `with` of the process closes it); and that
    address."""
    proc = subprocess.Popen([sys.executable, script, "--serve", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    address = proc.stdout.readline().strip()
    if not address:
        proc.kill()
        raise RuntimeError(f"the worker process exited ({proc.wait()}) before serving")
    return proc, address


def serve(width: str, device: str, graphs: str) -> None:
    """`measure_own_process`'s worker: the random drafter at `width` in bf16 (in CUDA graphs
    when `graphs` is "graphs"), over tcp until stdin closes."""
    drafter, _ = random_drafter(width, device, torch.bfloat16, cuda_graphs=graphs == "graphs")
    with Worker(drafter, "tcp", "127.0.0.1", 0, ServiceConfig(max_requests=64)) as worker:
        print(worker.address, flush=True)
        sys.stdin.read()


def measure_own_process(width: str, device: str, graphs: str, batches: list[int], rounds: int) -> list[dict]:
    """The round over tcp with the worker in a process of its own (a fresh one per batch),
    timed on the second pass of the same requests, in service (in_service); the worker's draft
    p50 is its status's (every round: the device's time does not change with the pass)."""
    rows = []
    for batch in batches:
        proc, address = worker_process(__file__, width, device, graphs)
        with proc:
            d = worker_stats(address)["drafter"]
            client = DrafterClient(RemoteTransport(address, "tcp", Manifest()), f"64:{d['max_depth']}",
                                   deadline_s=30.0, row_dtype="bfloat16")
            drive = functools.partial(drive_rounds, client, batch, rounds, d["max_depth"], d["vocab_size"],
                                      d["feature"], "sync", 0.0, row_dtype="bfloat16",  # a bf16 target's rows
                                      warm_rounds=in_service(d["window"]))
            try:
                drive()  # the same requests twice, timed the second time (as measure does)
                r = drive()
            finally:
                client.close()
            in_draft = worker_stats(address)["draft_p50_ms"]
        tcp = r["drafting"]["p50_ms"]
        rows.append({"batch": batch, "tcp_p50_ms": tcp, "worker_draft_p50_ms": in_draft,
                     "worker_own_ms": round(tcp - in_draft, 3),
                     "request_bytes_per_round": r["request_bytes_per_round"]})
        print(f"  batch {batch}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def round_options(description: str, out: str, rounds: int = 30) -> argparse.ArgumentParser:
    """The options every round benchmark in this folder takes: --out, --batches, --rounds."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=out, help="JSON results (default: %(default)s)")
    ap.add_argument("--batches", default="1,4,16", help="requests per round (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=rounds, help="timed rounds per figure (default: %(default)s)")
    return ap


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--serve"]:
        serve(*sys.argv[2:5])
        return 0
    ap = round_options(__doc__, "dsv41-gpu.json")
    ap.add_argument("--device", default="cuda", help="cuda (the GPU tier), or cpu with --width tiny "
                    "(a smoke run of this script) (default: %(default)s)")
    ap.add_argument("--width", default="flash", choices=["flash", "tiny"],
                    help="flash: the estimated V4.1-Flash drafter; tiny: the test checkpoint's sizes")
    ap.add_argument("--own-process", action="store_true",
                    help="only the round over tcp with the worker in its own process (above)")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    cuda = args.device.startswith("cuda")
    if args.own_process:
        graphs = "graphs" if cuda else "eager"
        rows = measure_own_process(args.width, args.device, graphs, batches, args.rounds)
        with open(args.out, "w") as f:
            json.dump({"width": args.width, "device": args.device, "rounds_as": graphs,
                       "worker_own_process": rows}, f, indent=1)
        print("batch | over tcp p50 | the worker's draft p50 | worker's own cost (ms)")
        for r in rows:
            print(f"{r['batch']:>5} | {r['tcp_p50_ms']:>12.2f} | {r['worker_draft_p50_ms']:>22.2f} | {r['worker_own_ms']:.2f}")
        return 0
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    if cuda:
        print("== tiny checkpoint: CPU vs CUDA float32", file=sys.stderr, flush=True)
        result["tiny_cpu_vs_cuda"] = tiny_agreement()
        torch.cuda.reset_peak_memory_stats()
    print(f"== {args.width} width, bfloat16", file=sys.stderr, flush=True)
    drafter, weight_bytes = random_drafter(args.width, args.device, torch.bfloat16)
    synchronize(args.device)
    loaded = torch.cuda.memory_allocated() if cuda else weight_bytes
    drafter.draft(random_rounds(drafter, 4, 160, 0), want_probs=False)  # four sequences' windows
    synchronize(args.device)
    result["flash"] = {"width": args.width, "config": FLASH if args.width == "flash" else "tiny",
                       "weight_bytes": weight_bytes, "allocated_after_load": loaded,
                       "peak_four_sequences": torch.cuda.max_memory_allocated() if cuda else None,
                       "card_3090_bytes": CARD_3090}
    requests = [random_rounds(drafter, 4, 160 + i, 100 + i) for i in range(8)]
    eager_drafts = [drafter.draft(r, want_probs=False) for r in requests]
    result["flash"]["rounds"] = measure(drafter, batches, args.rounds)
    print(f"== {args.width} width, bfloat16, every expert at once, CUDA graphs", file=sys.stderr, flush=True)
    graphed = Dsv41Drafter(drafter.model, drafter.manifest(), args.device, cuda_graphs=True)
    graphed.draft(random_rounds(graphed, 4, 160, 0), want_probs=False)
    synchronize(args.device)
    same = sum(int(np.array_equal(x.tokens, y.tokens)) for r, drafts in zip(requests, eager_drafts)
               for x, y in zip(drafts, graphed.draft(r, want_probs=False)))
    result["flash"]["graphs"] = {
        "buckets": graphed.describe()["cuda_graphs"], "same_greedy_drafts_as_eager": same,
        "requests": 4 * len(requests),
        "peak_four_sequences": torch.cuda.max_memory_allocated() if cuda else None,
        "rounds": measure(graphed, batches, args.rounds)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    fl = result["flash"]
    if cuda:
        t = result["tiny_cpu_vs_cuda"]
        print(f"tiny V4.1, CPU vs CUDA float32: {t['same_greedy_drafts']}/{t['requests']} identical "
              f"greedy drafts; first draft's distribution at T = 1: max |dp| "
              f"{t['max_first_prob_diff_t1']:.2e}")
        print(f"{args.width} width, bf16: weights {fl['weight_bytes'] / GIB:.1f} GiB, peak with "
              f"four sequences {fl['peak_four_sequences'] / GIB:.1f} GiB "
              f"({fl['peak_four_sequences'] / CARD_3090:.0%} of a 24 GB card)")
    g = fl["graphs"]
    print(f"every expert at once + CUDA graphs ({g['buckets']}): {g['same_greedy_drafts_as_eager']}/"
          f"{g['requests']} greedy drafts as eager's chosen experts")
    print("batch  eager: device  local   tcp | graphs: device  local   tcp  (p50 ms)")
    for e, r in zip(fl["rounds"], g["rounds"]):
        print(f"{e['batch']:>5}  {e['device_p50_ms']:>13.1f} {e['local_p50_ms']:>6.1f} {e['tcp_p50_ms']:>5.1f}"
              f" | {r['device_p50_ms']:>14.1f} {r['local_p50_ms']:>6.1f} {r['tcp_p50_ms']:>5.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
