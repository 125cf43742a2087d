"""remote-drafter: create a drafter, serve it, check it.

  remote-drafter init      --target DIR --out DIR [--target-layers 2,15,29 | --token-only]
  remote-drafter worker    --drafter SPEC --target DIR [--listen HOST:PORT [--insecure]] [--device cuda:0] [--kernels NAME]
                           [--weights exl3 [--ungated]] [--record-gate-rounds FILE [--gate-rounds 64]]
  remote-drafter identity  --drafter SPEC --target DIR [--out manifest.json]
  remote-drafter status    --worker HOST:PORT
  remote-drafter shadow    --worker HOST:PORT --drafter SPEC --target DIR
  remote-drafter inspect   DIR [--json]      (DeepSeek-V4.1's or V4's drafter in a checkpoint folder)
  remote-drafter tiny-dsv41 OUT [--variant v41|v4] [--seed N] [--experts-dtype fp4|fp8] [--unquantized] [--layers 3]
  remote-drafter exl3 convert FOLDER OUT --bits B [--head-bits H] [--device cuda:0]
  remote-drafter exl3 gate  PACK --reference FOLDER --rounds FILE [--target DIR] [--depth N] [--goal 0.97]
  remote-drafter env
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import traceback
from importlib.metadata import entry_points

from ofl.cli import emit_result, shutdown_event, wait_for_shutdown
from ofl.env import describe
from ofl.errors import OflError
from remote_drafter import env
from remote_drafter.models import fidelity_gate
from remote_drafter.models.registry import WorkerExtraMissing, spec_folder, worker_side
from remote_drafter.worker import exl3_admission
from remote_drafter.worker.capacity import add_capacity_args, capacity_config
from remote_drafter.worker.exposure import DEFAULT_PORT, add_exposure_args, listen_refusal

DRAFTER_HELP = ("'dsv41:DIR' (DeepSeek-V4.1's or V4's own drafter, from its checkpoint or an "
                "EXL3 pack: production), a DSpark checkpoint folder (from `init`), 'lm' (the target "
                "itself drafts: its own copy), 'ngram' (prompt lookup, no weights) or 'module:Class'")
# Kernel back ends other packages register (name = "module:loader", called as
# loader(drafter, device) -> the drafter to serve); this package imports none of them.
KERNELS_GROUP = "remote_drafter.kernels"
KERNEL_PROVIDERS = {"native": "dsv41-native-drafter and Triton (pip install packages/native-drafter)"}


# -- init ---------------------------------------------------------------------------------------
def init_parser(sub) -> None:
    p = sub.add_parser("init", help="write a randomly initialised DSpark drafter for a target")
    p.add_argument("--target", required=True, help="the target checkpoint folder (Llama-style)")
    p.add_argument("--out", required=True)
    p.add_argument("--target-layers", default="2,15,29",
                   help="target layers (0-based) whose hidden states condition the drafter")
    p.add_argument("--token-only", action="store_true",
                   help="condition on committed tokens only (engines without hidden states)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--block", type=int, default=5, help="W: drafts per parallel pass")
    p.add_argument("--markov-rank", type=int, default=32)
    p.add_argument("--window", type=int, default=128, help="context positions attended")
    p.add_argument("--heads", type=int, default=0, help="0: the target's")
    p.add_argument("--kv-heads", type=int, default=0, help="0: the target's")
    p.add_argument("--ffn", type=int, default=0, help="0: the target's intermediate size")
    p.add_argument("--mask-token", type=int, default=None, help="default: the last vocabulary id")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_init)


def cmd_init(args) -> int:
    LlamaConfig = worker_side("remote_drafter.models.llama", "a new drafter").LlamaConfig
    from remote_drafter.models.dspark import DSparkConfig, DSparkDrafter
    with open(f"{args.target}/config.json") as f:
        t = LlamaConfig.from_hf(json.load(f))
    layers = [] if args.token_only else [int(x) for x in args.target_layers.split(",")]
    if any(not 0 <= x < t.num_hidden_layers for x in layers):
        raise SystemExit(f"--target-layers must lie in [0, {t.num_hidden_layers})")
    config = DSparkConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_layers=args.layers,
        num_heads=args.heads or t.num_attention_heads, num_kv_heads=args.kv_heads or t.num_key_value_heads,
        intermediate_size=args.ffn or t.intermediate_size, block_size=args.block,
        markov_rank=args.markov_rank, window=args.window, target_layers=layers,
        target_hidden_size=t.hidden_size if layers else 0,
        mask_token_id=t.vocab_size - 1 if args.mask_token is None else args.mask_token,
        rope_theta=t.rope_theta, rms_norm_eps=t.rms_norm_eps)
    DSparkDrafter.create(args.out, args.target, config, seed=args.seed)
    print(f"remote-drafter init: {args.out} ({'token-only' if not layers else f'target layers {layers}'}, "
          f"{args.layers} layers, W={args.block}, Markov rank {args.markov_rank}, window {args.window}); "
          "randomly initialised: train it before expecting acceptance")
    return 0


# -- worker -------------------------------------------------------------------------------------
def worker_parser(sub) -> None:
    p = sub.add_parser("worker", help="serve a drafter to engines over ofl")
    add_serving_args(p)
    add_capacity_args(p)
    add_spec_cache_args(p)
    p.add_argument("--inject-delay-ms", type=float, default=0,
                   help="testing only: delay every round (a slow link, measurable on one machine)")
    add_gate_recording_args(p)
    p.set_defaults(fn=cmd_worker)


def add_serving_args(p: argparse.ArgumentParser) -> None:
    """Which drafter the worker serves, on what and how it is reached."""
    add_exposure_args(p)
    p.add_argument("--drafter", required=True, help=DRAFTER_HELP)
    p.add_argument("--target", default=None, help="the target folder (embedding, head, identity)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--weights", default="dense", choices=["dense", "exl3"],
                   help="exl3: the drafter folder is an EXL3 pack (`exl3 convert`) whose linears "
                        "run through exllamav3's kernels (CUDA and the [exl3] extra); refused "
                        "unless the pack passed `exl3 gate` for exactly these weights")
    p.add_argument("--ungated", action="store_true",
                   help="with --weights exl3: serve a pack that has not passed the fidelity "
                        "gate: for measuring it, never in production (status shows UNGATED)")
    p.add_argument("--backend", default="tcp", help="ofl backend: tcp, shm or verbs")
    p.add_argument("--kernels", default="torch",
                   help="what computes the drafter's round: torch, or a back end another package "
                        f"registers under {KERNELS_GROUP}: native = native-drafter's Triton "
                        "kernels (DSpark, float32; refused unless `native-drafter gate` passed "
                        "on this GPU). Not --backend: that names the ofl transport")


def add_spec_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec-cache", action="store_true",
                   help="pre-draft likely next rounds while the target verifies (token-only drafters)")
    p.add_argument("--spec-cache-outcomes", type=int, default=3, help="outcomes pre-drafted per round")
    p.add_argument("--spec-cache-mb", type=float, default=64, help="memory bound of the cache")
    p.add_argument("--spec-cache-max-batch", type=int, default=2,
                   help="rounds drafting more requests than this skip the cache (and draft batched)")


def add_gate_recording_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--record-gate-rounds", metavar="FILE", default=None,
                   help="record EXL3 fidelity gate rounds (`exl3 gate --rounds`) from the requests "
                        "served at temperature 0: their tap rows and the tokens the target "
                        "committed after them; written when --gate-rounds are in, or at shutdown")
    p.add_argument("--gate-rounds", type=int, default=64, help="rounds --record-gate-rounds keeps")


def _service_config(args):
    from remote_drafter.worker.service import ServiceConfig
    return ServiceConfig(**capacity_config(args),
                         spec_cache=args.spec_cache, spec_cache_outcomes=args.spec_cache_outcomes,
                         spec_cache_bytes=int(args.spec_cache_mb * (1 << 20)),
                         spec_cache_max_batch=args.spec_cache_max_batch,
                         inject_delay_s=args.inject_delay_ms / 1000,
                         record_gate_rounds=args.record_gate_rounds, gate_rounds=args.gate_rounds)


def kernel_loader(name: str):
    """The loader registered as `name` under KERNELS_GROUP; ValueError saying what to
    install when none is, or why it does not load."""
    registered = {ep.name: ep for ep in entry_points(group=KERNELS_GROUP)}
    if name not in registered:
        provider = KERNEL_PROVIDERS.get(name, f"a package registering it under {KERNELS_GROUP}")
        raise ValueError(f"--kernels {name} is not installed: it comes with {provider} "
                         f"(installed: {', '.join(['torch', *sorted(registered)])})")
    try:
        return registered[name].load()
    except ImportError as exc:
        raise ValueError(f"--kernels {name} ({registered[name].value}) does not load: {exc}") from exc


def cmd_worker(args) -> int:
    torch = worker_side("torch", "the worker")
    with_kernels = None if args.kernels == "torch" else kernel_loader(args.kernels)

    from remote_drafter.models.registry import load_drafter
    from remote_drafter.worker.device_lock import DeviceBusy, worker_lock
    from remote_drafter.worker.round_recorder import recording_refusal
    if args.ungated and args.weights != "exl3":
        raise ValueError("--ungated is for --weights exl3 (a pack and its fidelity gate)")
    if args.record_gate_rounds and (why := recording_refusal(args.record_gate_rounds, args.gate_rounds)):
        raise ValueError(why)
    if why := listen_refusal(args):  # ofl's reason starts "refusing to listen on ..."
        print(f"remote-drafter worker: {why}", file=sys.stderr)
        return 2
    try:  # refused before the card is locked; then exllamav3 builds
        ungated = exl3_admission.before_loading(args.drafter, args.weights, args.device, args.ungated)
    except exl3_admission.Refused as exc:
        return refuse_to_start(str(exc))
    stop = shutdown_event()
    try:  # before anything lands on the card: one drafter worker per device, of any kind
        lock = worker_lock(args.device)
    except (DeviceBusy, ValueError) as exc:
        return refuse_to_start(str(exc))
    try:
        drafter = load_drafter(args.drafter, args.target, args.device,
                               dtype=load_dtype(torch, args.dtype))
        if with_kernels:
            drafter = with_kernels(drafter, args.device)
        if args.weights == "exl3":
            try:
                exl3_admission.after_loading(args.drafter, drafter, bool(args.target), args.ungated)
            except exl3_admission.Refused as exc:
                return refuse_to_start(str(exc))
            note = drafter.serving_notes["exl3_gate"]
            ungated = None if note == "passed" else note
        serve(args, drafter, stop, locked=bool(lock), ungated=ungated)
    finally:
        if lock:
            if torch.device(args.device).type == "cuda":
                torch.cuda.synchronize(args.device)  # in-flight GPU work ends before the card is free
            lock.release()
    return 0


def serve(args, drafter, stop, locked: bool, ungated: str | None) -> None:
    """Serve `drafter` until `stop` (SIGTERM or Ctrl-C), after one ready line on stdout."""
    from ofl.server import parse_address
    from remote_drafter.worker.server import Worker
    host, port = parse_address(args.listen, DEFAULT_PORT)
    worker = Worker(drafter, args.backend, host, port, _service_config(args),
                    insecure=args.insecure).start()
    d = worker.service.describe()
    print(f"remote-drafter worker: {drafter.kind} drafter (depth {drafter.max_depth}, "
          f"feature {drafter.feature}, {d['max_requests']} requests x {d['bytes_per_request']} B, "
          f"{d['max_requests_per_client']} per client address, "
          f"spec cache {'on' if d['spec_cache'] else 'off'}, warm-up {worker.warm_up_s:.2f} s) "
          f"on {args.device}{', device locked' if locked else ''}, {args.backend} on {worker.address}"
          f"{'; EXL3 pack UNGATED (--ungated): not for production' if ungated else ''}", flush=True)
    try:
        wait_for_shutdown(stop)
    finally:
        worker.stop()


def load_dtype(torch, name: str):
    """--dtype as load_drafter's `dtype`: float32 is None (load_drafter's default, no cast)."""
    dtype = getattr(torch, name)
    return None if dtype == torch.float32 else dtype


def refuse_to_start(why: str) -> int:
    print(f"remote-drafter worker: refusing to start: {why}", file=sys.stderr)
    return 2


# -- identity, status, shadow -------------------------------------------------------------------
def identity_parser(sub) -> None:
    p = sub.add_parser("identity", help="print the identity manifest of a drafter")
    p.add_argument("--drafter", required=True, help=DRAFTER_HELP)
    p.add_argument("--target", default=None)
    p.add_argument("--out", default=None, help="also write it here (REMOTE_DRAFTER_MANIFEST)")
    p.set_defaults(fn=cmd_identity)


def cmd_identity(args) -> int:
    from remote_drafter.models.registry import load_drafter
    manifest = load_drafter(args.drafter, args.target).manifest().to_json()
    text = json.dumps(manifest, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def status_parser(sub) -> None:
    p = sub.add_parser("status", help="a worker's counters, limits, identities, whom it admits "
                                      "(admission) and what each peer holds (peers, by digest) (JSON)")
    p.add_argument("--worker", required=True)
    p.add_argument("--backend", default="tcp")
    p.set_defaults(fn=cmd_status)


def cmd_status(args) -> int:
    from remote_drafter.engine.transport import worker_stats
    print(json.dumps(worker_stats(args.worker, args.backend), indent=1))
    return 0


def shadow_parser(sub) -> None:
    p = sub.add_parser("shadow", help="compare a worker's drafts with a local copy's, round by round")
    p.add_argument("--worker", required=True)
    p.add_argument("--backend", default="tcp")
    p.add_argument("--drafter", required=True, help=DRAFTER_HELP)
    p.add_argument("--target", required=True)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--k", type=int, default=5, help="drafts per round")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--deadline-ms", type=float, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.set_defaults(fn=cmd_shadow)


def cmd_shadow(args) -> int:
    LlamaLM = worker_side("remote_drafter.models.llama", "the local copy").LlamaLM
    import torch  # present: the target needs it too

    from remote_drafter.decode_loop import speculative_decode
    from remote_drafter.engine.client import DrafterClient
    from remote_drafter.engine.identity import expectation
    from remote_drafter.engine.transport import LocalTransport, RemoteTransport
    from remote_drafter.models.registry import load_drafter
    from remote_drafter.worker.service import DraftService
    from remote_drafter.worker.shadow_parity import ShadowClient, synthetic_prompts
    torch.manual_seed(0)
    target = LlamaLM.load(args.target)
    local_drafter = load_drafter(args.drafter, args.target)
    expect = expectation(args.target, None)
    remote = DrafterClient(RemoteTransport(args.worker, args.backend, expect),
                           f"{args.requests}:{args.k}", deadline_s=args.deadline_ms / 1000)
    local = DrafterClient(LocalTransport(DraftService(local_drafter)), f"{args.requests}:{args.k}")
    info = remote.worker_info(remote.deadline_s)
    if info.manifest != local_drafter.manifest():
        print("remote-drafter shadow: the worker serves another drafter than --drafter "
              "(manifests differ)", file=sys.stderr)
        return 2
    theirs, mine = info.described["drafter"].get("dtype"), local_drafter.describe()["dtype"]
    if theirs != mine:
        print(f"remote-drafter shadow: note: the worker runs {theirs} weights, the local copy "
              f"{mine}: drafts may differ where the drafter's top two are near ties", file=sys.stderr)
    shadow = ShadowClient(remote, local)
    prompts = synthetic_prompts(args.requests, target.config.vocab_size, seed=args.seed)
    result = speculative_decode(target, shadow, prompts, args.tokens, args.temperature,
                                local_drafter.hidden_layers, seed=args.seed)
    p = shadow.parity
    report = {"rounds_compared": p.compared, "identical": p.identical, "fraction": p.fraction,
              "remote_missing": p.remote_missing, "first_difference": p.first_difference,
              "mean_accepted_length": result.mean_accepted_length,
              "temperature": args.temperature, "client": remote.counters()}
    ok = p.compared > 0 and (p.identical == p.compared or args.temperature > 0) and not p.remote_missing

    def table(r):
        print(f"shadow parity: {r['identical']}/{r['rounds_compared']} rounds identical "
              f"({100 * r['fraction']:.1f}%), remote missing {r['remote_missing']}, "
              f"mean accepted length {r['mean_accepted_length']:.2f} -> {'PASS' if ok else 'FAIL'}")
    emit_result(report, args.out, args.json, table)
    return 0 if ok else 1


# -- DeepSeek-V4.1 checkpoints ------------------------------------------------------------------
def inspect_parser(sub) -> None:
    p = sub.add_parser("inspect", help="DeepSeek-V4.1's or V4's drafter in a checkpoint folder: its tensors, "
                                       "dtypes, bytes and config, read from the headers; exit 1 "
                                       "when a tensor differs from DeepSeek's layout")
    p.add_argument("folder", help="config.json + model.safetensors.index.json and shards, or "
                                  "one model.safetensors")
    p.add_argument("--json", action="store_true", help="machine output")
    p.set_defaults(fn=cmd_inspect)


def cmd_inspect(args) -> int:
    checkpoint = worker_side("remote_drafter.models.dsv41.checkpoint", "inspect")
    d = checkpoint.describe(args.folder)
    if args.json:
        print(json.dumps(d, indent=1))
        return 1 if d["problems"] else 0
    experts: dict[str, list] = {}  # one line for each expert tensor across the experts
    for name, t in d["tensors"].items():
        row = experts.setdefault(re.sub(r"\.experts\.\d+\.", ".experts.*.", name),
                                 [t["dtype"], tuple(t["shape"]), 0, 0])
        row[2], row[3] = row[2] + 1, row[3] + t["bytes"]
    for name, (dtype, shape, count, nbytes) in experts.items():
        print(f"{name:<46} {dtype:<8} {str(shape):<14}{f' x {count}' if count > 1 else '':<7} "
              f"{nbytes:>14,} B")
    c = d["config"]
    print(f"{len(d['tensors'])} drafter tensors ({d['scales']} scales), {d['stored_bytes']:,} B stored, "
          f"{d['loaded_bytes_bf16']:,} B loaded at bfloat16; {d['trunk_tensors']} target tensors "
          "not read")
    print(f"{d['drafter']}: hidden {c['hidden_size']}, vocab {c['vocab_size']}, "
          f"{c['n_mtp_layers']} drafter layers, "
          f"taps {c['target_layer_ids']}, W {c['block_size']}, Markov rank {c['markov_rank']}, "
          f"window {c['sliding_window']}, {c['n_routed_experts']} experts "
          f"(top {c['num_experts_per_tok']}, {c['expert_dtype']}), {c['num_attention_heads']} heads "
          f"x {c['head_dim']}, fp8 blocks {c['weight_block_size']}, confidence head "
          f"{'on' if c['enable_confidence_head'] else 'off'}")
    for problem in d["problems"]:
        print(f"problem: {problem}")
    return 1 if d["problems"] else 0


def tiny_dsv41_parser(sub) -> None:
    p = sub.add_parser("tiny-dsv41", help="write a tiny random DeepSeek-V4.1 or V4 checkpoint (its "
                                          "drafter at toy width, DeepSeek's names and dtypes, "
                                          "a few target tensors) for tests")
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts-dtype", default="fp4", choices=["fp4", "fp8"],
                   help="fp4: MXFP4 experts, UE8M0 linear scales (V4.1-Flash); fp8: block-FP8 "
                        "experts, float32 scales (Flash-Base)")
    p.add_argument("--layers", type=int, default=3, help="drafter layers (mtp.0 .. mtp.N-1)")
    p.add_argument("--variant", default="v41", choices=["v41", "v4"],
                   help="v41: DeepSeek-V4.1 (config under text_config); v4: DeepSeek-V4 (flat "
                        "config, hc_head, markov_w1/w2)")
    p.add_argument("--unquantized", action="store_true",
                   help="no quantization_config: every linear and expert stored bf16")
    p.set_defaults(fn=cmd_tiny_dsv41)


def cmd_tiny_dsv41(args) -> int:
    tiny = worker_side("remote_drafter.models.dsv41.tiny", "tiny-dsv41")
    made = tiny.write_tiny(args.out, args.seed, args.experts_dtype, args.layers, args.variant,
                           quantized=not args.unquantized)
    stored = "bf16 linears and" if args.unquantized else args.experts_dtype
    print(f"remote-drafter tiny-dsv41: {args.out} ({args.variant}, {made['drafter']} drafter tensors, "
          f"{made['trunk']} target tensors, {stored} experts, {made['bytes']:,} B in "
          f"{len(made['files'])} shards); random weights: for tests, not for drafting")
    return 0


# -- EXL3 ---------------------------------------------------------------------------------------
def exl3_parser(sub) -> None:
    p = sub.add_parser("exl3", help="EXL3 weights (exllamav3) for a drafter")
    exl3_sub = p.add_subparsers(dest="exl3_cmd", required=True)
    exl3_convert_parser(exl3_sub)
    exl3_gate_parser(exl3_sub)


def exl3_convert_parser(sub) -> None:
    p = sub.add_parser("convert", help="quantise a drafter's linears with exllamav3's quantiser "
                                       "into an EXL3 pack (a drafter folder; needs CUDA)")
    p.add_argument("folder", help="a DSpark drafter folder, or DeepSeek-V4.1's / V4's checkpoint "
                                  "folder (dsv41:<folder> accepted)")
    p.add_argument("out")
    p.add_argument("--bits", type=float, required=True, help="bits per weight of the drafter's linears")
    p.add_argument("--head-bits", type=float, default=None,
                   help="DeepSeek's drafter: quantise the stored head too (default: kept as stored)")
    p.add_argument("--device", default="cuda:0")
    p.set_defaults(fn=cmd_exl3_convert)


def is_dspark_folder(folder: str) -> bool:
    """A DSpark drafter folder (its drafter.json); otherwise DeepSeek's checkpoint."""
    return os.path.exists(os.path.join(folder, "drafter.json"))


def cmd_exl3_convert(args) -> int:
    worker_side("torch", "exl3 convert")
    exl3 = worker_side("remote_drafter.models.exl3", "exl3 convert")
    exl3.require(args.device)
    exl3.load_exllamav3()
    folder, log = spec_folder(args.folder), (lambda m: print(m, flush=True))
    if is_dspark_folder(folder):
        if args.head_bits:
            raise ValueError("--head-bits: a DSpark drafter stores no head (it is the target's)")
        from remote_drafter.models.dspark import DSparkDrafter
        meta = DSparkDrafter.convert_exl3(folder, args.out, args.bits, args.device, log)
    else:
        from remote_drafter.models.dsv41.drafter import Dsv41Drafter
        meta = Dsv41Drafter.convert_exl3(folder, args.out, args.bits, args.head_bits, args.device, log)
    print(f"remote-drafter exl3 convert: {args.out} ({meta['kind']}, {len(meta['linears'])} linears "
          f"at {args.bits} bits{f', head at {args.head_bits}' if args.head_bits else ''}); serve it "
          "with --weights exl3")
    return 0


EXL3_GATE_DESCRIPTION = (
    "The fidelity gate of an EXL3 pack. The pack (the candidate) and its dense "
    "drafter (the reference,\nin --dtype) draft from the same recorded rounds "
    "of the target (--rounds: per round the\ntarget's tap rows, the tokens up to "
    "the anchor, and the target's own greedy continuation).\nMeasured: each "
    "drafter's mean accepted length under greedy verification (the longest\n"
    "prefix of its T = 0 drafts equal to the continuation); their ratio, "
    "candidate over\nreference; per position j the share of rounds whose first "
    "j drafts are identical in\nboth; the total-variation distance of the first "
    "draft's distribution at T = 1.\nPasses when the ratio is >= --goal (a "
    "reference accepting nothing measures nothing:\nno pass). Writes "
    "exl3-gate.json into the pack (with the pack's drafter and Markov-head digests and how each\n"
    "module is stored; the worker serves --weights exl3 only while that record passed for\n"
    "the weights it loads, stored as they were gated).\nExit 0 passed, 1 failed, 2 usage error. Needs CUDA and exllamav3.")


def exl3_gate_parser(sub) -> None:
    p = sub.add_parser(
        "gate", help="the fidelity gate: may this EXL3 pack be served? (the worker refuses a pack "
                     "without a passed record)",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=EXL3_GATE_DESCRIPTION)
    p.add_argument("pack", help="the EXL3 pack folder (`exl3 convert`'s OUT; dsv41:<folder> accepted)")
    p.add_argument("--reference", required=True,
                   help="the dense drafter it was converted from (DSpark folder or DeepSeek's checkpoint)")
    p.add_argument("--rounds", required=True, help="the gate rounds file (safetensors: taps.i, "
                                                   "prefix.i, continuation.i)")
    p.add_argument("--target", default=None,
                   help="the target folder (a DSpark drafter's embedding and head; checked against "
                        "the rounds file's target digest)")
    p.add_argument("--depth", type=int, default=None,
                   help="drafts per round (default: the drafters' max depth, capped by the continuations)")
    p.add_argument("--goal", type=float, default=fidelity_gate.GOAL,
                   help=f"the ratio that passes (the worker still requires {fidelity_gate.GOAL} to serve)")
    p.add_argument("--device", default="cuda:0", help="where the pack runs (a CUDA GPU)")
    p.add_argument("--reference-device", default=None,
                   help="where the dense reference runs (default: --device; e.g. cpu where it does "
                        "not fit beside the pack: DeepSeek-V4.1-Flash's is ~30 GiB in bf16)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="both drafters' dense weights (the reference's all, the pack's unquantised ones)")
    p.set_defaults(fn=cmd_exl3_gate)


def gate_spec(folder: str) -> tuple[str, dict]:
    """A drafter folder as load_drafter's spec: DSpark's (drafter.json) or DeepSeek's; the
    latter without a confidence cut-off, so the gate compares whole chains."""
    folder = spec_folder(folder)
    if is_dspark_folder(folder):
        return folder, {}
    return f"dsv41:{folder}", {"confidence_cutoff": 0.0}


def cmd_exl3_gate(args) -> int:
    torch = worker_side("torch", "exl3 gate")
    from remote_drafter.engine.identity import target_digest
    from remote_drafter.models.registry import load_drafter
    exl3 = worker_side("remote_drafter.models.exl3", "exl3 gate")
    exl3.require_pack(spec_folder(args.pack), args.device)
    pack = spec_folder(args.pack)
    if exl3.is_pack(spec_folder(args.reference)):
        raise ValueError(f"--reference {args.reference} is an EXL3 pack: the reference is the dense "
                         "drafter the pack was converted from")
    rounds, meta = fidelity_gate.read_rounds(args.rounds)
    measured_on = meta.get(fidelity_gate.TARGET_KEY)
    if args.target and measured_on and (served := target_digest(args.target)) != measured_on:
        raise ValueError(f"{args.rounds} holds rounds of target {measured_on[:12]}, --target "
                         f"{args.target} is {served[:12]}")
    dtype = load_dtype(torch, args.dtype)
    loaded = {}
    for name, folder, device in (("reference", args.reference, args.reference_device or args.device),
                                 ("candidate", pack, args.device)):
        spec, options = gate_spec(folder)
        loaded[name] = load_drafter(spec, args.target, device, dtype=dtype, **options)
    if why := fidelity_gate.taps_refusal(meta, loaded["candidate"]):
        raise ValueError(f"{args.rounds}: {why}")
    from tqdm import tqdm
    with tqdm(total=len(rounds), desc="gate", unit="round", file=sys.stderr) as bar:
        result = fidelity_gate.measure(loaded["reference"], loaded["candidate"], rounds, args.depth,
                                       args.goal, progress=bar.update)
    path = fidelity_gate.record(pack, result, fidelity_gate.weights_of(loaded["candidate"].manifest()),
                       fidelity_gate.weights_of(loaded["reference"].manifest()), args.rounds, measured_on)
    print_gate_result(result, args.goal, path)
    return 0 if result["passed"] else 1


def print_gate_result(result: dict, goal: float, path: str) -> None:
    ratio = result["acceptance_ratio"]
    print(f"{'':<10}{'accepted length':>16}   first-j agreement (j = 1..{result['depth']})")
    print(f"{'reference':<10}{result['reference_accepted']:>16.3f}")
    print(f"{'candidate':<10}{result['candidate_accepted']:>16.3f}   "
          + " ".join(f"{a:.3f}" for a in result["agreement"]))
    tv = "n/a" if result["tv"] is None else f"{result['tv']:.4f} (max {result['tv_max']:.4f})"
    few = f" (fewer than the {fidelity_gate.MIN_ROUNDS} rounds a pass needs)" if result["rounds"] < fidelity_gate.MIN_ROUNDS else ""
    print(f"remote-drafter exl3 gate: {result['rounds']} rounds{few}, ratio "
          f"{'n/a (the reference accepted nothing)' if ratio is None else f'{ratio:.1%}'} "
          f"(goal {goal:.0%}), first-draft TV at T = 1 {tv} -> "
          f"{'PASS' if result['passed'] else 'FAIL'}; recorded in {path}")


# -- env, and the whole command line ------------------------------------------------------------
def env_parser(sub) -> None:
    p = sub.add_parser("env", help="every environment variable, its default and meaning")
    p.set_defaults(fn=cmd_env)


def cmd_env(args) -> int:
    print(describe(env.ALL))
    return 0


SUBCOMMANDS = (init_parser, worker_parser, identity_parser, status_parser, shadow_parser,
               inspect_parser, tiny_dsv41_parser, exl3_parser, env_parser)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="remote-drafter", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for add_subcommand in SUBCOMMANDS:  # in this order in --help
        add_subcommand(sub)
    return ap


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    # an ordinary mistake or an unreachable peer: one clear line, no traceback, exit 2 (never
    # 1, which says a check such as `shadow` or `exl3 gate` failed)
    except (ValueError, OSError, OflError, WorkerExtraMissing) as exc:
        print(f"remote-drafter {args.cmd}: {type(exc).__name__ + ': ' if isinstance(exc, OflError) else ''}{exc}",
              file=sys.stderr)
        return 2


def run() -> None:
    """The process's entry (`remote-drafter`, `python -m remote_drafter.cli`): main(), then an
    exit that skips the interpreter's teardown. Everything the command owns is closed by
    then; what teardown would add is a daemon thread inside torch's C++ being unwound, which
    aborts the process ("terminate called without an active exception") after a clean stop."""
    try:
        code = main()
    except SystemExit as exc:  # argparse: --help, a usage error
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - said as Python would, then the same exit
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    run()
