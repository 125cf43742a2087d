"""DeepSeek's drafter's round at the estimated V4.1-Flash width (dsv41_gpu.py's FLASH, random
weights drawn on the card) on one GPU, every variant side by side in one run
(benchmarks/gpu.sh ONLY_DRAFTER_ROUND=1, an H200):

  exl3_4   EXL3 4-bit linears (random trellis): the experts per matrix, eager (the path
           before the fused kernels); the experts through exllamav3's fused kernels, eager;
           fused with the round captured as CUDA graphs (the worker's default), with the
           round's Triton kernels (mixes, top two: the default) and with torch's; and with
           a 6-bit EXL3 head in place of the bf16 one
  bf16     the same width in bf16, CUDA graphs: each row's chosen experts in grouped GEMMs
           (torch._grouped_mm), and every expert on every row (its baseline)

Per variant and batch (1 / 4 / 16 requests, a block of W rows each): round p50 / p99 (the
drafter alone, synchronised), against its floor: the bytes the round reads (every weight
once, of the routed experts only those its rows chose, found by recording one round's
router) over the read bandwidth measured in this run. Beside them: one MoE layer, ours (the
experts module the drafter serves) against exllamav3's own BlockSparseMLP on the same weights
and rows (time eager and agreement; `--moe-layers` alone: also in a CUDA graph, as a round
serves it); the fused drafter through the real worker over tcp loopback
(dsv41_gpu.measure: p50 as the engine sees it, the device p50, request bytes); peak memory
with four sequences' windows, over the whole EXL3 section and (`served_memory`) of the
served drafter alone in a process of its own, its CUDA context included; and a 3090
estimate (the floor scaled by bandwidth).

    python packages/remote-drafter/benchmarks/drafter_round.py --out drafter-round.json
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dsv41_gpu import (  # noqa: E402
    FLASH,
    measure,
    random_drafter,
    random_rounds,
    round_options,
    round_times,
    timed,
    width_config,
)
from exl3_moe_layer import exl3_linear, random_stored  # noqa: E402
from round_phases import in_graph  # noqa: E402

import ofl  # noqa: E402
import remote_drafter  # noqa: E402
from remote_drafter.engine.identity import Manifest  # noqa: E402
from remote_drafter.models import exl3  # noqa: E402
from remote_drafter.models.dsv41 import tiny  # noqa: E402
from remote_drafter.models.dsv41.config import linear_names, markov_names, weight_table  # noqa: E402
from remote_drafter.models.dsv41.drafter import GRAPH_BATCHES, Dsv41Drafter  # noqa: E402
from remote_drafter.models.dsv41.model import Dsv41Model  # noqa: E402
from remote_drafter.testing import draft_agreement  # noqa: E402

GIB = 1 << 30
CARD_3090 = 24 * 10**9
BANDWIDTH_3090 = 936e9  # bytes/s, the card's datasheet figure
BITS = 4
HEAD_BITS = 6  # exllamav3's default for heads
FLASH_EXL3_MANIFEST = Manifest(*["random-flash-exl3"] * 4, kind="dsv41")  # the random Flash-width EXL3 drafter
SERVED_MEMORY_TIMEOUT_S = 300  # the child's start-up as a worker's: experts tuned, copies timed, graphs captured
GOALS = {"exl3_4": {1: 3.0, 4: 3.0, 16: 2.0}, "bf16": {1: 3.0, 4: 3.0, 16: 3.0}}  # x floor


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def read_bandwidth(gib: float = 4.0, repeats: int = 10) -> float:
    """Bytes per second the device reads (a sum over a buffer far larger than its caches)."""
    x = torch.ones(int(gib * GIB) // 2, dtype=torch.half, device="cuda")
    nbytes = x.numel() * x.element_size()
    return nbytes / (timed(lambda: x.sum(dtype=torch.float32), repeats, warm_up=2)["p50_ms"] / 1e3)


def random_exl3(shape: tuple[int, int], bits: int, gen) -> exl3.Exl3Linear:
    """An EXL3 linear of `shape` [out, in] with random trellis bytes (timing and memory only),
    stored padded as exllamav3 stores it."""
    n_out, n_in = shape
    return exl3_linear(random_stored(exl3.padded(n_in), exl3.padded(n_out), gen, bits), n_in, n_out)


def exl3_flash_model() -> tuple[Dsv41Model, dict[str, int]]:
    """The Flash width with random EXL3 linears at BITS and bf16 for the rest; and the bytes
    of every weight as served."""
    config, gen = width_config("flash"), torch.Generator(device="cuda").manual_seed(0)
    table, linears = weight_table(config), {}
    for name in linear_names(config):
        shape = table[name][0]
        if name.endswith(".attn.wo_a.weight"):
            linears[name] = exl3.Exl3Groups([random_exl3((config.o_lora_rank, shape[1]), BITS, gen)
                                             for _ in range(config.o_groups)])
        else:
            linears[name] = random_exl3(shape, BITS, gen)
    weights = {n: tiny.random_values(n, s, config, gen).to(torch.bfloat16)
               for n, (s, _) in table.items() if n not in linears}
    sizes = {n: t.numel() * t.element_size() for n, t in weights.items()}
    for name, m in linears.items():
        sizes[name] = m.stored_bytes
    return Dsv41Model(config, weights, "cuda", linears=linears), sizes


def exl3_head_rounds(model: Dsv41Model, manifest, sizes, floors, batches, rounds, bandwidth) -> list[dict]:
    """Rounds with the head module's linear replaced by a random HEAD_BITS EXL3 one, in
    graphs, against the same rounds' floors with the EXL3 head's bytes for the bf16 head's
    (a captured round runs no Python router to record); the bf16 head put back after."""
    dense_head = model.head.proj
    shape = weight_table(model.config)["head.weight"][0]
    model.head.proj = random_exl3(shape, HEAD_BITS, torch.Generator(device="cuda").manual_seed(2))
    change = model.head.proj.stored_bytes - sizes["head.weight"]
    head_floors = shifted(floors, [change] * len(floors), bandwidth)
    try:
        drafter = Dsv41Drafter(model, manifest, "cuda", cuda_graphs=None)
        return rounds_of(drafter, sizes, batches, rounds, bandwidth, head_floors)
    finally:
        model.head.proj = dense_head


def dense_sizes(model: Dsv41Model) -> dict[str, int]:
    """Bytes of every weight of a dense model (bf16 at 2 bytes a parameter, f32 at 4)."""
    return {n: int(np.prod(shape)) * (4 if storage == "f32" else model.dtype.itemsize)
            for n, (shape, storage) in weight_table(model.config).items()}


def round_floor(drafter: Dsv41Drafter, sizes: dict[str, int], batch: int, bandwidth: float) -> dict:
    """The bytes one round must read: every weight once but the gathered embeddings, and of
    the routed experts only those the round's rows chose (one real round's router, recorded)."""
    model, chosen = drafter.model, {}

    def recording(j, route):
        def recorded(x):
            weights, experts = route(x)
            chosen.setdefault(j, set()).update(experts.unique().tolist())
            return weights, experts
        return recorded
    for j, layer in enumerate(model.layers):
        layer.moe.route = recording(j, layer.moe.route)
    try:
        drafter.draft(random_rounds(drafter, batch, 160, batch), want_probs=False)
    finally:
        for layer in model.layers:
            del layer.moe.route
    gathered = {"embed.weight", markov_names(model.config)[0]}
    fixed = sum(b for n, b in sizes.items() if ".ffn.experts." not in n and n not in gathered)
    routed = sum(sizes[f"mtp.{j}.ffn.experts.{e}.{w}.weight"] for j, es in chosen.items()
                 for e in es for w in ("w1", "w3", "w2"))
    return floor_entry([len(chosen[j]) for j in sorted(chosen)], routed, fixed, bandwidth)


def shifted(floors: list[dict], changes: list[int], bandwidth: float) -> list[dict]:
    """The same rounds' floors with each one's other bytes changed (a weight served otherwise)."""
    return [floor_entry(f["experts_chosen_per_layer"], f["routed_expert_bytes"], f["other_bytes"] + change,
                        bandwidth) for f, change in zip(floors, changes)]


def dense_floors(model: Dsv41Model, floors: list[dict], batches: list[int], bandwidth: float) -> list[dict]:
    """The floors of rounds whose EXL3 linears read their dense copies where the block's rows
    take them (exl3_dense.py), in place of their trellises. Only the linears a block runs: a
    timed round (windows already current) runs no encoding of new rows."""
    in_block = {n for n, (_, rows) in model.dense_candidates([1], []).items() if rows}

    def change(batch: int) -> int:
        rows = batch * model.config.block_size
        return sum(c.nbytes - c.stored_bytes for c in model.dense_exl3 if c.from_rows <= rows and c.name in in_block)
    return shifted(floors, [change(b) for b in batches], bandwidth)


def floor_entry(experts_chosen: list[int], routed: int, fixed: int, bandwidth: float) -> dict:
    total = routed + fixed
    return {"experts_chosen_per_layer": experts_chosen,
            "routed_expert_bytes": routed, "other_bytes": fixed, "round_bytes": total,
            "floor_ms": round(1e3 * total / bandwidth, 3),
            "rtx3090_floor_ms_estimate": round(1e3 * total / BANDWIDTH_3090, 3)}


def rounds_of(drafter, sizes, batches, rounds, bandwidth, floors=None) -> list[dict]:
    out = []
    for i, batch in enumerate(batches):
        floor = floors[i] if floors else round_floor(drafter, sizes, batch, bandwidth)
        t = round_times(drafter, batch, rounds)
        out.append({"batch": batch, **t, **floor, "p50_over_floor": round(t["p50_ms"] / floor["floor_ms"], 1)})
        say(f"    batch {batch}: p50 {t['p50_ms']:.2f} ms, p99 {t['p99_ms']:.2f} ms, floor "
            f"{floor['floor_ms']:.3f} ms ({out[-1]['p50_over_floor']}x)")
    return out


def code_paths() -> dict[str, str]:
    """Which tree's code this run timed (--compare refuses two runs of one tree)."""
    return {"remote_drafter": str(Path(remote_drafter.__file__).parent), "ofl": str(Path(ofl.__file__).parent)}


def kept(drafts: list) -> list[dict]:
    """Greedy drafts as a run's JSON keeps them (--compare reads them back)."""
    return [{"tokens": d.tokens.tolist(), "own_probs": d.own_probs.tolist(), "alt_probs": d.alt_probs.tolist()}
            for d in drafts]


def greedy_drafts(drafter: Dsv41Drafter, batches) -> list:
    return [d for batch in batches for d in drafter.draft(random_rounds(drafter, batch, 160, 1000 + batch), False)]


# -- one MoE layer: ours against exllamav3's BlockSparseMLP --------------------------------

def upstream_layer(model: Dsv41Model, j: int):
    """exllamav3's BlockSparseMLP over layer j's own EXL3 linears (no copy), built as its
    tensor-parallel import builds one (config None, load_local), fed our routing."""
    from exllamav3.modules import BlockSparseMLP, GatedMLP, Linear
    c, dev = model.config, torch.device("cuda", torch.cuda.current_device())

    def wrap(name):
        m = model.served[name]
        linear = Linear(None, name, m.in_stored, m.inner.trellis.shape[1] * 16, out_dtype=torch.half)
        linear.device, linear.inner, linear.quant_type = dev, m.inner, "exl3"
        return linear

    def three(prefix):
        return [[wrap(f"{prefix}.{w}.weight")] for w in ("w1", "w3", "w2")]
    g, u, d = three(f"mtp.{j}.ffn.shared_experts")
    shared = GatedMLP(None, f"mtp.{j}.ffn.shared_experts", c.hidden_size, c.moe_intermediate_size,
                      out_dtype=torch.float, activation_fn="silu", act_limit=c.swiglu_limit or 0.0,
                      gates=g, ups=u, downs=d)
    shared.device = dev
    shared.load_local(dev, 0)
    experts = [three(f"mtp.{j}.ffn.experts.{e}") for e in range(c.n_routed_experts)]
    mlp = BlockSparseMLP(None, f"mtp.{j}.ffn", c.hidden_size, c.moe_intermediate_size, c.n_routed_experts,
                         c.num_experts_per_tok, interm_dtype=torch.half, out_dtype=torch.float,
                         activation_fn="silu", act_limit=c.swiglu_limit or 0.0, router_type="sqrtsp",
                         shared_experts=shared, gates=[e[0][0] for e in experts],
                         ups=[e[1][0] for e in experts], downs=[e[2][0] for e in experts])
    mlp.device = dev
    mlp.load_local()
    mlp.routing_gate = object()  # forward routes through routing_fn only with a gate: ours instead
    mlp.routing_fn = lambda bsz, cfg, z, params: (params["sel"], params["rw"])
    return mlp


def moe_layers(model: Dsv41Model, batches: list[int], res: dict, save, graphs: bool = False) -> None:
    """Layer 0's MoE, ours (the experts module the drafter serves) and exllamav3's
    BlockSparseMLP over the same linears and routing, at each batch's rows: p50 ms eager (the
    launches' host time included, which a served round does not pay) and their agreement.
    With `graphs`, each also in a CUDA graph, as a round serves it (`graph_p50_ms`): ours
    first, exllamav3's last, since a capture that fails can leave the process's CUDA state
    unusable (its error is recorded instead). In res["ours_moe_layer"] and
    res["exllamav3_moe_layer"], save() after each step."""
    c, j = model.config, 0
    ours = res["ours_moe_layer"] = {"rows": []}
    upstream = res["exllamav3_moe_layer"] = {"rows": []}
    try:
        mlp = upstream_layer(model, j)
    except Exception as exc:  # noqa: BLE001 - recorded; ours is still measured
        upstream["error"] = f"{type(exc).__name__}: {exc}"
        mlp = None
    gen = torch.Generator(device="cuda").manual_seed(1)
    calls = []  # per batch: ours, theirs (None where it failed)
    for batch in batches:
        rows = batch * c.block_size
        x = torch.randn(rows, c.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        weights, experts = model.layers[j].moe.route(x)
        layer = model.layers[j].moe.experts
        mine_call = functools.partial(layer, x, weights, experts)
        mine = mine_call().clone()
        ours["rows"].append({"batch": batch, "rows": rows, "p50_ms": timed(mine_call, 50, warm_up=3)["p50_ms"]})
        theirs_call = None
        if mlp is not None:
            params = {"sel": experts.contiguous(), "rw": weights.half().contiguous()}
            theirs_call = functools.partial(mlp.forward, x.half().view(1, rows, -1), params)
            try:
                theirs = theirs_call().view(rows, -1).float()
                entry = {"batch": batch, "rows": rows, "p50_ms": timed(theirs_call, 50, warm_up=3)["p50_ms"],
                         "relative_difference_to_ours": float((theirs - mine).norm() / theirs.norm())}
            except Exception as exc:  # noqa: BLE001
                entry, theirs_call = {"batch": batch, "rows": rows, "error": f"{type(exc).__name__}: {exc}"}, None
            upstream["rows"].append(entry)
        calls.append((mine_call, theirs_call))
        say(f"    MoE layer, {rows} rows, eager: ours {ours['rows'][-1]['p50_ms']:.3f} ms, exllamav3 "
            f"{upstream['rows'][-1] if mlp is not None else upstream.get('error')}")
        save()
    if graphs:
        for side, k in ((ours, 0), (upstream, 1)):
            for row, pair in zip(side["rows"], calls):
                if pair[k] is not None:
                    row.update(graph_times(pair[k]))
                    say(f"    MoE layer, {row['rows']} rows, in a CUDA graph, {'ours' if k == 0 else 'exllamav3'}: {row}")
                    save()


def graph_times(fn) -> dict:
    """fn()'s p50 ms in a CUDA graph (`graph_p50_ms`), or why it could not be captured
    (`graph_error`; the current stream restored, which a failed capture leaves switched)."""
    stream = torch.cuda.current_stream()
    try:
        return {"graph_p50_ms": in_graph(fn, 50, calls=1) / 1e3}
    except Exception as exc:  # noqa: BLE001 - recorded: the eager figure still stands
        torch.cuda.set_stream(stream)
        return {"graph_p50_ms": None, "graph_error": f"{type(exc).__name__}: {exc}"}


# -- the run --------------------------------------------------------------------------------

def run(batches: list[int], rounds: int, out: str, variants: list[str]) -> dict:
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": FLASH,
                 "bits": BITS, "batches": batches, "rounds": rounds, "goals_x_floor": GOALS}

    def save():
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    res.update(code_paths())
    res["read_bandwidth_bytes_per_s"] = bandwidth = read_bandwidth()
    say(f"== read bandwidth {bandwidth / 1e12:.2f} TB/s")
    if "exl3_4" in variants:
        res["exllamav3"] = exl3.load_exllamav3(say).version
        res["exl3_4_served_memory"] = served_memory_apart()
        save()
        run_exl3(res, batches, rounds, bandwidth, save)
    if "bf16" in variants:
        say("== bf16, CUDA graphs (the chosen experts in grouped GEMMs)")
        drafter, weight_bytes = random_drafter("flash", "cuda", torch.bfloat16)
        bsizes = dense_sizes(drafter.model)
        bfloors = [round_floor(drafter, bsizes, b, bandwidth) for b in batches]  # eager: the chosen experts
        graphed = Dsv41Drafter(drafter.model, drafter.manifest(), "cuda", cuda_graphs=True)
        b = res["bf16"] = {"weight_bytes": weight_bytes, "round_kernels": graphed.describe()["round_kernels"],
                           "attention": graphed.describe()["attention"],
                           "experts": graphed.experts,
                           "rounds": rounds_of(graphed, bsizes, batches, rounds, bandwidth, bfloors)}
        grouped_drafts = greedy_drafts(graphed, batches)
        b["greedy_drafts"] = kept(grouped_drafts)  # --compare sets them against another run's
        save()
        stacked = [layer.moe.experts for layer in drafter.model.layers]
        if all(getattr(experts, "grouped", False) for experts in stacked):
            say("== bf16, CUDA graphs, every expert on every row (the grouped GEMMs' baseline)")
            for experts in stacked:
                experts.grouped = False
            every = Dsv41Drafter(drafter.model, drafter.manifest(), "cuda", cuda_graphs=True)
            b["rounds_every_expert"] = rounds_of(every, bsizes, batches, rounds, bandwidth, bfloors)
            b["grouped_vs_every_expert"] = draft_agreement(greedy_drafts(every, batches), grouped_drafts)
            save()
    print_table(res)
    return res


def served_memory_apart() -> dict:
    """served_memory in a child process, this one idle meanwhile: what the card holds for the
    served drafter alone, apart from this process's own context and cached blocks; or, where
    the child fails, why (recorded: the rest of the run goes on)."""
    say("== the served EXL3 drafter's memory, alone in a process of its own")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        try:
            subprocess.run([sys.executable, __file__, "--served-memory", str(total - free), "--out", out.name],
                           check=True, timeout=SERVED_MEMORY_TIMEOUT_S)
            return json.loads(Path(out.name).read_text())
        except (subprocess.SubprocessError, OSError, ValueError) as exc:
            say(f"    the served drafter's memory: not measured ({type(exc).__name__}: {exc})")
            return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def served_memory(others_bytes: int) -> dict:
    """The served EXL3 drafter (fused experts, CUDA graphs, dense copies where faster) built
    in this process and drafting four sequences' windows: torch's allocated and reserved peaks
    at start-up and serving, and the process's whole footprint (its CUDA context, modules and
    kernels' workspaces beside what torch reserves) read off the card's free memory, less
    `others_bytes`, what other processes held when this one started."""
    torch.zeros(1, device="cuda")  # the context
    free, total = torch.cuda.mem_get_info()
    context = total - free - others_bytes
    exl3.load_exllamav3(say)
    model, _ = exl3_flash_model()
    drafter = Dsv41Drafter(model, FLASH_EXL3_MANIFEST, "cuda", cuda_graphs=None)
    torch.cuda.synchronize()
    started = {"allocated": torch.cuda.memory_allocated(), "peak_allocated": torch.cuda.max_memory_allocated(),
               "peak_reserved": torch.cuda.max_memory_reserved()}
    torch.cuda.reset_peak_memory_stats()
    drafter.draft(random_rounds(drafter, 4, 160, 0), want_probs=False)  # four sequences' windows
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    process, reserved = total - free - others_bytes, torch.cuda.memory_reserved()
    peak_reserved = max(started["peak_reserved"], torch.cuda.max_memory_reserved())
    return {"graphs": drafter.describe()["cuda_graphs"], "context_bytes": context,
            "after_start_up": started,
            "serving_four_sequences": {"peak_allocated": torch.cuda.max_memory_allocated(),
                                       "peak_reserved": torch.cuda.max_memory_reserved()},
            "process_bytes_now": process,
            # what torch released of its peak is the only part of the process not resident now
            "process_peak_bytes": process - reserved + peak_reserved,
            "card_3090_bytes": CARD_3090}


def run_exl3(res: dict, batches: list[int], rounds: int, bandwidth: float, save) -> None:
    say("== EXL3 4 bits, experts per matrix, eager")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model, sizes = exl3_flash_model()
    manifest = FLASH_EXL3_MANIFEST
    per_matrix = Dsv41Drafter(model, manifest, "cuda", cuda_graphs=False, fuse_experts=False, dense_mib=0)
    e = res["exl3_4"] = {"linear_bytes": sum(b for n, b in sizes.items() if n in model.served),
                         "per_matrix_eager": rounds_of(per_matrix, sizes, batches, max(3, rounds // 4), bandwidth)}
    reference = greedy_drafts(per_matrix, batches)
    floors = [{k: r[k] for k in ("experts_chosen_per_layer", "routed_expert_bytes", "other_bytes",
                                  "round_bytes", "floor_ms", "rtx3090_floor_ms_estimate")}
              for r in e["per_matrix_eager"]]
    save()
    say("== EXL3 4 bits, fused experts, eager")
    fused_eager = Dsv41Drafter(model, manifest, "cuda", cuda_graphs=False, dense_mib=0)
    e["experts"] = fused_eager.experts
    if model.experts_fused:
        e["fused_eager"] = rounds_of(fused_eager, sizes, batches, rounds, bandwidth, floors)
        eager_drafts = greedy_drafts(fused_eager, batches)
        e["fused_vs_per_matrix"] = draft_agreement(reference, eager_drafts)
        save()
        say("== one MoE layer: ours vs exllamav3's BlockSparseMLP")
        moe_layers(model, batches, res, save)
        say("== EXL3 4 bits, fused experts, CUDA graphs, no dense copies (the dense copies' baseline)")
        kernels_only = Dsv41Drafter(model, manifest, "cuda", cuda_graphs=None, dense_mib=0)
        e["rounds_kernels_only"] = rounds_of(kernels_only, sizes, batches, rounds, bandwidth, floors)
        kernels_only_drafts = greedy_drafts(kernels_only, batches)
        del kernels_only
        save()
        say("== EXL3 4 bits, fused experts, CUDA graphs, dense copies where faster (as served)")
        t0 = time.monotonic()
        graphed = Dsv41Drafter(model, manifest, "cuda", cuda_graphs=None)
        e["graphs_capture_s"] = round(time.monotonic() - t0, 1)  # with the dense copies' timing
        e["graphs"] = graphed.describe()["cuda_graphs"]
        e["dense"] = graphed.describe()["exl3_dense"]
        say(f"    dense copies: {e['dense']}")
        floors = dense_floors(model, floors, batches, bandwidth)
        e["rounds"] = rounds_of(graphed, sizes, batches, rounds, bandwidth, floors)
        e["round_kernels"] = graphed.describe()["round_kernels"]
        e["attention"] = graphed.describe()["attention"]  # its form per batch, timed at start-up
        graphed_drafts = greedy_drafts(graphed, batches)
        e["graphs_vs_eager"] = draft_agreement(eager_drafts, graphed_drafts)
        e["dense_vs_kernels_only"] = draft_agreement(kernels_only_drafts, graphed_drafts)
        say("== the same, the mixes and the top two in torch (the round kernels' baseline)")
        in_torch = Dsv41Drafter(model, manifest, "cuda", cuda_graphs=None, round_kernels=False)
        e["rounds_torch_kernels"] = rounds_of(in_torch, sizes, batches, rounds, bandwidth, floors)
        e["round_kernels_vs_torch"] = draft_agreement(greedy_drafts(in_torch, batches), graphed_drafts)
        del in_torch
        model.use_kernels()
        graphed.draft(random_rounds(graphed, 4, 160, 0), want_probs=False)  # four sequences' windows
        e["peak_four_sequences"] = torch.cuda.max_memory_allocated() - base
        e["card_3090_bytes"] = CARD_3090
        save()
        say("== the worker over tcp loopback (fused, graphs)")
        res["worker_tcp"] = {"rounds": measure(graphed, batches, rounds)}
        save()
        say("== the same, a round's new rows encoded eagerly (the encoding graphs' baseline)")
        encode_graphs, graphed._encode_rows.graphs = graphed._encode_rows.graphs, {}
        res["worker_tcp_encode_eager"] = {"rounds": measure(graphed, batches, rounds)}
        graphed._encode_rows.graphs = encode_graphs
        save()
        say(f"== the same round with a {HEAD_BITS}-bit EXL3 head (exl3 convert --head-bits)")
        e["rounds_exl3_head"] = exl3_head_rounds(model, manifest, sizes, floors, batches, rounds, bandwidth)
        e["exl3_head_bits"] = HEAD_BITS
        save()
        del graphed
    del per_matrix, fused_eager, model
    torch.cuda.empty_cache()


def print_table(res: dict) -> None:
    e = res.get("exl3_4", {})
    print(f"{res['device']}, read {res['read_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; EXL3 experts: "
          f"{e.get('experts')}; round kernels: {e.get('round_kernels')}; attention's form per batch: "
          f"{e.get('attention')}")
    print("batch | EXL3 per matrix | EXL3 fused eager | EXL3 fused graphs p50 / p99 | floor (3090 est.) | x floor "
          "| no dense copies (x its floor) | graphs, torch's | EXL3 head (x its floor) | bf16 graphs | bf16 floor | x floor")
    def cell(rows, i, key, fmt="{:.2f}"):
        return fmt.format(rows[i][key]) if rows and i < len(rows) and key in rows[i] else "-"
    for i, b in enumerate(res["batches"]):
        def at(rows, key, fmt="{:.2f}", i=i):
            return cell(rows, i, key, fmt)
        g, bf, hd = e.get("rounds"), res.get("bf16", {}).get("rounds"), e.get("rounds_exl3_head")
        ko = e.get("rounds_kernels_only")
        print(f"{b:5d} | {at(e.get('per_matrix_eager'), 'p50_ms'):>15} | {at(e.get('fused_eager'), 'p50_ms'):>16} | "
              f"{at(g, 'p50_ms'):>13} / {at(g, 'p99_ms'):<12} | {at(g, 'floor_ms', '{:.3f}')} "
              f"({at(g, 'rtx3090_floor_ms_estimate', '{:.2f}')}) | {at(g, 'p50_over_floor', '{}'):>7} | "
              f"{at(ko, 'p50_ms'):>12} ({at(ko, 'p50_over_floor', '{}')}) | "
              f"{at(e.get('rounds_torch_kernels'), 'p50_ms'):>15} | "
              f"{at(hd, 'p50_ms'):>14} ({at(hd, 'p50_over_floor', '{}')}) | {at(bf, 'p50_ms'):>11} | {at(bf, 'floor_ms', '{:.3f}'):>10} | {at(bf, 'p50_over_floor', '{}')}")
    tcp, eager = res.get("worker_tcp", {}).get("rounds"), res.get("worker_tcp_encode_eager", {}).get("rounds")
    if tcp:
        print("batch | over tcp p50 | device round | in draft() | worker's own | its payload over a plain socket "
              "| own beyond that | new rows encoded eagerly: over tcp / in draft()")
        for i, r in enumerate(tcp):
            print(f"{r['batch']:5d} | {r['tcp_p50_ms']:12.2f} | {r['device_p50_ms']:12.2f} | "
                  f"{r['tcp_inside_draft_p50_ms']:10.2f} | {r['tcp_worker_own_ms']:12.2f} | "
                  f"{cell(tcp, i, 'wire_p50_ms'):>31} | {cell(tcp, i, 'tcp_worker_own_beyond_wire_ms'):>15} | "
                  f"{cell(eager, i, 'tcp_p50_ms')} / {cell(eager, i, 'tcp_inside_draft_p50_ms')}")
    if (m := res.get("exl3_4_served_memory")) and "error" in m:
        print(f"the served EXL3 drafter alone: not measured ({m['error']})")
    elif m:
        serving = m["serving_four_sequences"]
        print(f"the served EXL3 drafter alone, four sequences' windows: process peak "
              f"{m['process_peak_bytes'] / GIB:.2f} GiB ({m['process_peak_bytes'] / m['card_3090_bytes']:.0%} "
              f"of a 24 GB card; CUDA context {m['context_bytes'] / GIB:.2f} GiB), torch's peaks serving "
              f"{serving['peak_allocated'] / GIB:.2f} allocated / {serving['peak_reserved'] / GIB:.2f} GiB reserved")


def profile(batches: list[int], out: str, variant: str) -> None:
    """Where a round's device time goes: the fused EXL3 drafter (exl3_4) or the bf16 one, eager
    and in graphs, kernels grouped by name (torch's profiler), written as text."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    if variant == "exl3_4":
        exl3.load_exllamav3(say)
        model, _ = exl3_flash_model()
        manifest = FLASH_EXL3_MANIFEST
    else:
        drafter, _ = random_drafter("flash", "cuda", torch.bfloat16)
        model, manifest = drafter.model, drafter.manifest()
    lines = []
    for name, graphs in (("eager", False), ("graphs", None)):
        drafter = Dsv41Drafter(model, manifest, "cuda", cuda_graphs=graphs)
        for batch in batches:
            requests = random_rounds(drafter, batch, 160, batch)
            for _ in range(3):
                drafter.draft(requests, want_probs=False)
            torch.cuda.synchronize()
            eager = name == "eager"  # a replayed graph records no operators: shapes come from eager rounds
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=eager) as prof:
                for _ in range(5):
                    drafter.draft(requests, want_probs=False)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70)
            lines += [f"== {variant}, {name}, batch {batch}, 5 rounds", table]
            say(lines[-2] + "\n" + "\n".join(table.splitlines()[:30]))
            if eager:
                lines += [f"== {variant}, {name}, batch {batch}, by operator and input shapes",
                          prof.key_averages(group_by_input_shape=True).table(
                              sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=40,
                              max_shapes_column_width=90)]
    with open(out, "w") as f:
        f.write("\n".join(lines))


def compile_experiment(batches: list[int], rounds: int, out: str) -> None:
    """Whether fusing the small kernels pays: the bf16 round in graphs as served, then with the
    hyper-connection sublayers (mixes, Sinkhorn, collapse) compiled by torch.compile (inductor
    fuses their elementwise and reduction kernels), the same requests, greedy drafts compared."""
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    drafter, _ = random_drafter("flash", "cuda", torch.bfloat16)
    graphed = Dsv41Drafter(drafter.model, drafter.manifest(), "cuda", cuda_graphs=True)
    res["as_served"] = [{"batch": b, **round_times(graphed, b, rounds)} for b in batches]
    reference = greedy_drafts(graphed, batches)
    say(f"  as served: {res['as_served']}")
    model = drafter.model
    torch._dynamo.config.cache_size_limit = 64  # one graph per layer, sublayer and shape class
    for mix in (m for layer in model.layers for m in (layer.attn_mix, layer.ffn_mix)):
        mix.pre, mix.post = torch.compile(mix.pre), torch.compile(mix.post)
    t0 = time.monotonic()
    compiled = Dsv41Drafter(model, drafter.manifest(), "cuda", cuda_graphs=False)  # stacked already
    compiled._forward.capture(GRAPH_BATCHES, compiled._blank)
    res["compile_and_capture_s"] = round(time.monotonic() - t0, 1)
    res["compiled_mhc"] = [{"batch": b, **round_times(compiled, b, rounds)} for b in batches]
    res["compiled_vs_served"] = draft_agreement(reference, greedy_drafts(compiled, batches))
    say(f"  compiled mHC: {res['compiled_mhc']}, {res['compiled_vs_served']}, "
        f"{res['compile_and_capture_s']} s to compile and capture")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


def moe_layers_alone(batches: list[int], out: str) -> None:
    """One MoE layer, ours against exllamav3's BlockSparseMLP (moe_layers), eager and in CUDA
    graphs, without the rest of the run: the layer's kernels chosen as a drafter chooses them
    at start-up."""
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "exllamav3": exl3.load_exllamav3(say).version, "batches": batches}
    model, _ = exl3_flash_model()
    res["experts"] = Dsv41Drafter(model, FLASH_EXL3_MANIFEST, "cuda", cuda_graphs=False, dense_mib=0).experts

    def save():
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    moe_layers(model, batches, res, save, graphs=True)


def experts_ab(batches: list[int], rounds: int, out: str, modes: list[str]) -> None:
    """The EXL3 round as served (CUDA graphs, the dense copies the drafter chose) with each
    MoE's experts on exllamav3's fused kernels, then on the kernels chosen at start-up (modes:
    REMOTE_DRAFTER_EXL3_EXPERTS values, in turn), on one model in one run: p50 / p99 against
    the floor, the GPU memory each drafter adds to the weights (with four sequences' windows),
    their greedy drafts compared and kept (`--compare` sets them against another run's),
    `auto` through the worker over tcp loopback."""
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": FLASH,
                 "bits": BITS, "batches": batches, "rounds": rounds, "goals_x_floor": GOALS}
    res.update(code_paths())
    res["read_bandwidth_bytes_per_s"] = bandwidth = read_bandwidth()
    res["exllamav3"] = exl3.load_exllamav3(say).version
    model, sizes = exl3_flash_model()
    manifest = FLASH_EXL3_MANIFEST
    eager = Dsv41Drafter(model, manifest, "cuda", cuda_graphs=False, dense_mib=0)  # the floors' router
    floors = [round_floor(eager, sizes, b, bandwidth) for b in batches]
    del eager
    drafts = {}
    for mode in modes:
        say(f"== EXL3 4 bits as served, REMOTE_DRAFTER_EXL3_EXPERTS={mode}")
        os.environ["REMOTE_DRAFTER_EXL3_EXPERTS"] = mode
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        drafter = Dsv41Drafter(model, manifest, "cuda", cuda_graphs=None)
        res[mode] = {"experts": drafter.describe()["experts"], "dense": drafter.describe()["exl3_dense"],
                     "rounds": rounds_of(drafter, sizes, batches, rounds, bandwidth,
                                         dense_floors(model, floors, batches, bandwidth))}
        drafter.draft(random_rounds(drafter, 4, 160, 0), want_probs=False)  # four sequences' windows
        # what this drafter adds to the model's weights: its graphs' pools, windows, kernels'
        # buffers and the dense copies it bought (not those an earlier drafter bought)
        res[mode]["memory"] = {"allocated_bytes": torch.cuda.memory_allocated() - allocated,
                               "reserved_bytes": torch.cuda.memory_reserved() - reserved,
                               "peak_allocated_bytes": torch.cuda.max_memory_allocated() - allocated}
        say(f"    experts: {res[mode]['experts']}; memory beyond the weights: {res[mode]['memory']}")
        drafts[mode] = greedy_drafts(drafter, batches)
        res[mode]["greedy_drafts"] = kept(drafts[mode])
        if mode == "auto":
            say("== the same through the worker over tcp loopback")
            res["worker_tcp"] = {"rounds": measure(drafter, batches, rounds)}
        del drafter
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    if len(modes) == 2:
        first, second = modes
        res[f"{second}_vs_{first}"] = draft_agreement(drafts[first], drafts[second])
        for a, b in zip(res[first]["rounds"], res[second]["rounds"]):
            say(f"    batch {b['batch']}: {a['p50_ms']:.2f} -> {b['p50_ms']:.2f} ms ({b['p50_over_floor']}x floor)")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


def compare(before: str, after: str, out: str, mode: str = "auto") -> dict:
    """Two runs of one machine and call (the code before a change, then after), of --experts-ab
    (mode: the experts' mode set side by side) or of --variants bf16 (mode bf16): each batch's
    p50 and p99 after over before, the worker's own cost over tcp in both where timed, and
    their greedy drafts compared (the same random model and requests in both)."""
    runs = []
    for path in (before, after):
        with open(path) as f:
            runs.append(json.load(f))
    if runs[0].get("remote_drafter") == runs[1].get("remote_drafter"):
        raise SystemExit(f"both runs timed the same code ({runs[0].get('remote_drafter')}): nothing to compare")
    a, b = (r[mode] for r in runs)
    res = {"before": before, "after": after, "device": runs[1]["device"], "mode": mode, "rounds": [],
           "code": [{k: r.get(k) for k in ("remote_drafter", "ofl")} for r in runs]}
    if runs[0].get("ofl") == runs[1].get("ofl"):
        res["note"] = "ofl is the same tree in both runs: its changes are not in this comparison"
        say(f"    note: {res['note']}")
    for x, y in zip(a["rounds"], b["rounds"]):
        res["rounds"].append({"batch": y["batch"], "p50_ms": [x["p50_ms"], y["p50_ms"]],
                              "p99_ms": [x["p99_ms"], y["p99_ms"]],
                              "p50_after_over_before": round(y["p50_ms"] / x["p50_ms"], 3),
                              "p99_after_over_before": round(y["p99_ms"] / x["p99_ms"], 3),
                              "after_p50_over_floor": y["p50_over_floor"]})
        say(f"    batch {y['batch']}: {x['p50_ms']:.2f} -> {y['p50_ms']:.2f} ms "
            f"({res['rounds'][-1]['p50_after_over_before']}x; {y['p50_over_floor']}x floor)")
    if all("worker_tcp" in r for r in runs):
        res["worker_own_beyond_wire_ms"] = [[r["tcp_worker_own_beyond_wire_ms"] for r in run["worker_tcp"]["rounds"]]
                                            for run in runs]
    drafts = [[SimpleNamespace(**{k: np.array(v) for k, v in d.items()}) for d in r["greedy_drafts"]] for r in (a, b)]
    res["drafts_after_vs_before"] = draft_agreement(*drafts)
    say(f"    drafts: {res['drafts_after_vs_before']}")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return res


def main(argv=None) -> int:
    ap = round_options(__doc__, "drafter-round.json")
    ap.add_argument("--variants", default="exl3_4,bf16", help="which drafters, in one process "
                    "(default: %(default)s)")
    ap.add_argument("--profile", metavar="TXT", help="instead: where the round's device time goes, "
                    "by kernel (torch's profiler), written to TXT, for the first of --variants")
    ap.add_argument("--compile-experiment", action="store_true", help="instead: the bf16 round with "
                    "its hyper-connection sublayers compiled by torch.compile, against it as served (--out)")
    ap.add_argument("--experts-ab", action="store_true", help="instead: the EXL3 round as served with "
                    "exllamav3's fused experts against the same with each MoE's kernels chosen at start-up "
                    "(ours where faster: REMOTE_DRAFTER_EXL3_EXPERTS=auto), the GPU memory each adds, and the latter "
                    "through the worker over tcp (--out)")
    ap.add_argument("--modes", default="exllamav3,auto", help="with --experts-ab: the expert kernels, "
                    "in turn (REMOTE_DRAFTER_EXL3_EXPERTS values; default: %(default)s)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="instead: two JSONs of one "
                    "call (the code before a change and after) set side by side (--out): --experts-ab runs, "
                    "or with --compare-mode bf16 runs of --variants bf16")
    ap.add_argument("--compare-mode", default="auto", help="with --compare: the rounds compared, an "
                    "--experts-ab mode or bf16 (default: %(default)s)")
    ap.add_argument("--served-memory", type=int, metavar="OTHERS_BYTES", help="instead (a child of the "
                    "default run): the served EXL3 drafter's memory in this process alone (--out), other "
                    "processes holding OTHERS_BYTES of the card")
    ap.add_argument("--moe-layers", action="store_true", help="instead: one MoE layer alone, ours "
                    "against exllamav3's BlockSparseMLP on the same weights and rows, in a CUDA graph "
                    "and eager (--out)")
    args = ap.parse_args(argv)
    if args.compare:
        compare(*args.compare, args.out, args.compare_mode)
        return 0
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (and exllamav3: the [exl3] extra)")
    if args.profile:
        profile([int(b) for b in args.batches.split(",")], args.profile, args.variants.split(",")[0])
        return 0
    if args.compile_experiment:
        compile_experiment([int(b) for b in args.batches.split(",")], args.rounds, args.out)
        return 0
    if args.served_memory is not None:
        with open(args.out, "w") as f:
            json.dump(served_memory(args.served_memory), f, indent=1)
        return 0
    if args.moe_layers:
        moe_layers_alone([int(b) for b in args.batches.split(",")], args.out)
        return 0
    if args.experts_ab:
        experts_ab([int(b) for b in args.batches.split(",")], args.rounds, args.out, args.modes.split(","))
        return 0
    run([int(b) for b in args.batches.split(",")], args.rounds, args.out, args.variants.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
