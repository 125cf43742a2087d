"""Where a graphed round's time goes besides its kernels, on a GPU: DeepSeek's drafter at the
estimated V4.1-Flash width in bf16, CUDA graphs, rounds whose every request brings `--new-rows`
new rows (as a worker in service drafts), against the same requests with none; per batch the
round's p50, the layout of its windows (new rows encoded and written, the context gathered),
the forward graph's replay alone and the encoding graph's replay alone. What a round spends
outside those replays is the host's share. With `--host-ab`, the round with new rows in four
forms, in turn round by round: its host work as served (the small host arrays - indices,
positions, rows kept, seeds - joined in one queued copy, staging.to_device_all; the graphs
replayed on the caller's stream), one queued copy per array, one copy per array with torch's
blocking copy (which waits for the device's queued work), and the replays on the owned
stream with an event each way (the forms before). Then (`--grouped-mm`) torch's grouped GEMM at the
experts' shapes (bf16, the routed experts a round chose): gate and up as two GEMMs or one over
their joined weights, and down, against their bytes over the H200's bandwidth; and
(`--host-profile`) the rounds' host time by function.

    python packages/remote-drafter/benchmarks/round_phases.py --out round-phases.json
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dsv41_gpu import random_drafter, random_rounds, round_options, timed  # noqa: E402

from remote_drafter.bench import percentiles  # noqa: E402
from remote_drafter.models import staging, window  # noqa: E402
from remote_drafter.models.cuda_graphs import BucketGraphs, bucket_for  # noqa: E402
from remote_drafter.models.dsv41.drafter import Dsv41Drafter  # noqa: E402

H200_BANDWIDTH = 4.2e12  # bytes/s read, as drafter_round.py measures it on these machines
# The experts a Flash-width round chose per layer at batch 1 / 4 / 16 (drafter_round.py's
# floors) and the (row, expert) slots of W = 5 rows a request.
CHOSEN_SLOTS = {1: (16, 40), 4: (40, 160), 16: (92, 640)}


def phases(batches: list[int], rounds: int, new_rows: int, host_profile: str | None,
           ab: bool = False) -> list[dict]:
    drafter, _ = random_drafter("flash", "cuda", torch.bfloat16)
    d = Dsv41Drafter(drafter.model, drafter.manifest(), "cuda", cuda_graphs=True)
    rng = np.random.default_rng(0)
    out, profiles = [], []
    for batch in batches:
        requests = random_rounds(d, batch, 160, batch)
        out.append(phase_row(d, requests, rounds, new_rows, rng, ab))
        print(f"  batch {batch}: {out[-1]}", file=sys.stderr, flush=True)
        if host_profile:
            profiles.append(f"== batch {batch}, {rounds} rounds with new rows\n"
                            + profile_host(d, requests, rounds, new_rows, rng))
    if host_profile:
        with open(host_profile, "w") as f:
            f.write("\n".join(profiles))
    return out


def profile_host(d: Dsv41Drafter, requests, rounds: int, new_rows: int, rng) -> str:
    """The rounds' host time by function (cProfile, tottime), the histories grown outside it."""
    profiler = cProfile.Profile()
    for _ in range(rounds):
        for r in requests:
            r.history.extend(rng.integers(0, d.vocab_size, new_rows, dtype=np.int32),
                             rng.standard_normal((new_rows, d.feature)).astype(np.float32))
        profiler.enable()
        d.draft(requests, False)
        profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def blocking_copy(a: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(a).to(device)


def per_array(copy):
    """to_device_all's signature, one `copy` per array (the round's copies before they were joined)."""
    return lambda arrays, device: [copy(np.ascontiguousarray(np.asarray(a).astype(np.int64)), device)
                                   for a in arrays]


def replay_on_owned_stream(self: BucketGraphs, *inputs: torch.Tensor):
    """BucketGraphs.__call__ as it was: the inputs' copies and the replay on the owned stream,
    ordered against the caller's stream with an event each way."""
    b = inputs[0].shape[0]
    graph, static, captured = self.graphs[bucket_for(self.graphs, b)]
    caller = torch.cuda.current_stream(self.device)
    self.stream.wait_stream(caller)
    with torch.cuda.stream(self.stream):
        for dst, src in zip(static, inputs):
            dst[:b].copy_(src)
            if b < len(dst):
                dst[b:].zero_()
        graph.replay()
    caller.wait_stream(self.stream)
    return tuple(t[:b] for t in captured) if isinstance(captured, tuple) else captured[:b]


@contextlib.contextmanager
def served():
    yield


@contextlib.contextmanager
def patched(owner, name: str, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


# the round's host work as served, and each change to it undone (the forms before)
HOST_WAYS = {
    "served": served,
    "per_array": lambda: patched(window, "to_device_all", per_array(staging.to_device)),
    "per_array_blocking": lambda: patched(window, "to_device_all", per_array(blocking_copy)),
    "owned_stream_replays": lambda: patched(BucketGraphs, "__call__", torch.inference_mode()(replay_on_owned_stream)),
}


def host_ab(d: Dsv41Drafter, requests, rounds: int, grow) -> dict:
    """The round with new rows, its host work as served and in the forms before, in turn
    round by round: the small host arrays in one queued copy (served), one queued copy per
    array, one blocking copy per array (torch's default, which waits for the device's queued
    work); the graphs replayed on the caller's stream (served) or on the owned one, with an
    event each way. p50 / p99 of each and each over the served."""
    times: dict[str, list[float]] = {way: [] for way in HOST_WAYS}
    for i in range(len(HOST_WAYS) * rounds):
        way = list(HOST_WAYS)[i % len(HOST_WAYS)]
        with HOST_WAYS[way]():
            times[way].append(timed(lambda: d.draft(requests, False), 1, before=grow)["p50_ms"] / 1e3)
    out = {way: percentiles(t) for way, t in times.items()}
    for way in HOST_WAYS:
        if way != "served":
            out[f"{way}_over_served_p50"] = round(out[way]["p50_ms"] / out["served"]["p50_ms"], 3)
    return out


def phase_row(d: Dsv41Drafter, requests, rounds: int, new_rows: int, rng, ab: bool = False) -> dict:
    batch = len(requests)

    def grow():
        for r in requests:
            r.history.extend(rng.integers(0, d.vocab_size, new_rows, dtype=np.int32),
                             rng.standard_normal((new_rows, d.feature)).astype(np.float32))

    @torch.inference_mode()
    def lay_out():
        d._windows.lay_out([r.history for r in requests], "cuda")

    for _ in range(3):
        grow()
        d.draft(requests, False)
    forward = d._forward.graphs[min(b for b in d._forward.graphs if b >= batch)][0]
    encode = d._encode_rows.graphs[min(b for b in d._encode_rows.graphs if b >= new_rows * batch)][0]
    row = {"batch": batch, "new_rows_per_request": new_rows,
           "round_no_new_rows": timed(lambda: d.draft(requests, False), rounds),
           "round_new_rows": timed(lambda: d.draft(requests, False), rounds, before=grow),
           "lay_out_new_rows": timed(lay_out, rounds, before=grow),
           "forward_replay": timed(forward.replay, rounds),
           "encode_replay": timed(encode.replay, rounds)}
    row["host_share_p50_ms"] = round(row["round_new_rows"]["p50_ms"] - row["forward_replay"]["p50_ms"]
                                     - row["encode_replay"]["p50_ms"], 3)
    if ab:
        row["host_ab"] = host_ab(d, requests, rounds, grow)
    return row


def grouped_mm(rounds: int) -> list[dict]:
    """torch._grouped_mm at the experts' shapes, in CUDA graphs (20 calls a replay)."""
    experts, hidden, inter = 192, 4096, 2048
    g = torch.Generator(device="cuda").manual_seed(0)

    def weights(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    w1, w3, w2 = weights(experts, inter, hidden), weights(experts, inter, hidden), weights(experts, hidden, inter)
    w13 = torch.cat([w1, w3], 1)
    out = []
    for batch, (chosen, slots) in CHOSEN_SLOTS.items():
        counts = torch.zeros(experts, dtype=torch.int32)
        picked = torch.randperm(experts, generator=torch.Generator().manual_seed(chosen))[:chosen]
        for i in range(slots):
            counts[picked[i % chosen]] += 1
        offs = counts.cumsum(0, dtype=torch.int32).cuda()
        out.append({"batch": batch, "experts": chosen, "slots": slots,
                    **grouped_row(weights(slots, hidden), weights(slots, inter), (w1, w3, w13, w2), offs, rounds)})
        gate_up_floor = chosen * 2 * inter * hidden * 2 / H200_BANDWIDTH * 1e6
        out[-1].update(gate_up_floor_us=round(gate_up_floor, 1), down_floor_us=round(gate_up_floor / 2, 1))
        print(f"  grouped GEMM, batch {batch}: {out[-1]}", file=sys.stderr, flush=True)
    return out


def grouped_row(x, a, w, offs, rounds: int) -> dict:
    w1, w3, w13, w2 = w

    def gemm(rows, weight):
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=offs)
    return {"gate_up_two_gemms_us": in_graph(lambda: (gemm(x, w1), gemm(x, w3)), rounds),
            "gate_up_one_gemm_us": in_graph(lambda: gemm(x, w13), rounds),
            "down_us": in_graph(lambda: gemm(a, w2), rounds),
            "one_gemm_bitwise_equal": torch.equal(torch.cat([gemm(x, w1), gemm(x, w3)], 1), gemm(x, w13))}


def in_graph(fn, rounds: int, calls: int = 20) -> float:
    """µs per fn() call: `calls` calls captured in one graph, the median replay of `rounds`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return round(float(np.median(times)), 1)


def main(argv=None) -> int:
    ap = round_options(__doc__, "round-phases.json", rounds=40)
    ap.add_argument("--new-rows", type=int, default=3, help="rows each request brings a round "
                    "(default: %(default)s)")
    ap.add_argument("--host-ab", action="store_true", help="also the round with its host work as "
                    "served and in the forms before, in turn: small arrays in one queued copy, one "
                    "queued copy each, one blocking copy each; replays on the caller's stream or "
                    "on the owned one")
    ap.add_argument("--grouped-mm", action="store_true", help="also torch's grouped GEMM at the "
                    "experts' shapes")
    ap.add_argument("--host-profile", metavar="TXT", help="also the rounds' host time by function "
                    "(cProfile), written to TXT")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "rounds": phases([int(b) for b in args.batches.split(",")], args.rounds, args.new_rows,
                             args.host_profile, args.host_ab)}
    if args.grouped_mm:
        res["grouped_mm"] = grouped_mm(args.rounds)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print("batch | round, no new rows | with new rows | lay-out | forward replay | encode replay | host share (p50 ms)")
    for r in res["rounds"]:
        print(f"{r['batch']:>5} | {r['round_no_new_rows']['p50_ms']:>18.2f} | {r['round_new_rows']['p50_ms']:>13.2f} | "
              f"{r['lay_out_new_rows']['p50_ms']:>7.2f} | {r['forward_replay']['p50_ms']:>14.2f} | "
              f"{r['encode_replay']['p50_ms']:>13.2f} | {r['host_share_p50_ms']:.2f}")
    for r in res["rounds"]:
        if "host_ab" in r:
            ab = r["host_ab"]
            print(f"batch {r['batch']}: as served {ab['served']['p50_ms']:.3f} ms p50; " + ", ".join(
                f"{way} {ab[way]['p50_ms']:.3f} ({ab[f'{way}_over_served_p50']}x)" for way in HOST_WAYS if way != "served"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
