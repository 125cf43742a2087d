"""The processes of the deployment, each as the exact command line and environment it gets
(`dsv41-stack args` prints them; the demo runs them). The offload host has the Engram
server and the drafter worker (one card, or drafter-tp2's pair); each engine host has vLLM
with the overlays, configured by the component variables of the env file (the overlays
read them; no flags of ours).

An engine across STACK_ENGINE_NODES hosts is vLLM's multi-node launch without Ray (vLLM
0.33: `--nnodes N --node-rank R --master-addr A --master-port P`, the same engine arguments
on every host): rank 0 is the OpenAI server, rank R > 0 `vllm serve ... --headless`, which
serves no API and runs that host's worker. Each rank's workers join torch.distributed at
A:P (rank 0's worker opens the store there; the others connect and wait for it up to the
distributed timeout, torch's default 600 s for NCCL), so either may start first; rank 0's
API answers only once every rank has joined and loaded. `up` therefore starts rank R > 0
first (ready when it has launched its executor and waits for rank 0) and then rank 0,
which it waits for until it serves. Each rank picks its own entry of ENGRAM_REMOTE (the
overlay takes entry = TP rank), serves its Engram counters on ENGRAM_METRICS_LISTEN's port
+ rank (the overlay), and its async handoff counters on ASYNC_HANDOFF_METRICS_LISTEN's
port + rank (set here, per rank)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from async_handoff import env as handoff_env
from longctx_bench.launch import ONE_PROCESS_ARGS, ONE_PROCESS_ENV
from ofl import env as ofl_env
from remote_drafter import env as drafter_env
from remote_engram import env as engram_env

from .config import ConfigError, StackConfig
from .settings import ENGINE_PREFIXES

SERVED_NAME = "dsv41"
# What the drafter worker reads of the env file: ofl, and remote_drafter's worker-side device
# locks, per-client quotas (both kinds of worker) and the DeepSeek-V4.1 drafter's confidence
# cut-off, CUDA graphs, EXL3 experts' kernels and dense copies; the TP2 pair also its own
# DRAFTER_TP2_* variables.
WORKER_PREFIXES = ("OFL_", drafter_env.REMOTE_DRAFTER_DEVICE_LOCK.name,
                   drafter_env.REMOTE_DRAFTER_LOCK_DIR.name,
                   drafter_env.REMOTE_DRAFTER_MAX_REQUESTS_PER_CLIENT.name,
                   drafter_env.REMOTE_DRAFTER_MAX_HISTORY_BYTES_PER_CLIENT.name,
                   drafter_env.REMOTE_DRAFTER_CONFIDENCE_CUTOFF.name,
                   drafter_env.REMOTE_DRAFTER_CUDA_GRAPHS.name,
                   drafter_env.REMOTE_DRAFTER_EXL3_EXPERTS.name,
                   drafter_env.REMOTE_DRAFTER_EXL3_DENSE_MIB.name,
                   drafter_env.REMOTE_DRAFTER_ATTENTION.name)
HEADLESS_READY = "headless multiproc executor"  # vLLM 0.33's line once rank R > 0 waits for rank 0
# vLLM's entry points: rank 0's OpenAI server; `vllm serve`, which honours --headless (the
# OpenAI module ignores it), for ranks > 0
API_SERVER = ["-m", "vllm.entrypoints.openai.api_server"]
HEADLESS_SERVE = ["-m", "vllm.entrypoints.cli.main", "serve"]


@dataclass
class Role:
    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # what the env file gives it
    ready_line: str | None = None  # a stdout line that says it serves
    ready_url: str | None = None   # or a URL that answers 200 once it serves
    rank: int | None = None        # an engine's node rank (None: not an engine)


# A server listening on a wildcard address is reached from this host over loopback.
WILDCARD_LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def own_peers(listens: list[str]) -> list[str]:
    """Where this host's own reads of these listeners come from: a connection to one of the
    host's addresses leaves from that address; one to a wildcard listener, over loopback."""
    peers = []
    for address in listens:
        if host := address.strip().rpartition(":")[0].strip("[]"):
            peers.append(WILDCARD_LOOPBACK.get(host, host))
    return peers


def admitted_peers(cfg: StackConfig) -> list[str]:
    """What the offload host's servers admit with STACK_ENGINE_HOSTS set: those hosts, then
    this host's own listen addresses, each once. The latter because `status` asks the
    servers for their health and counters from this host, at those addresses: so loopback
    is admitted exactly where such a read goes over it (a loopback or wildcard listener).
    ofl's HTTP endpoints honour OFL_ALLOW too, but the stack reads none on this host."""
    peers = [h.strip() for h in cfg["STACK_ENGINE_HOSTS"].split(",") if h.strip()]
    peers += own_peers([*cfg["STACK_ENGRAM_LISTEN"].split(","), cfg["STACK_DRAFTER_LISTEN"]])
    return list(dict.fromkeys(peers))


def offload_env(cfg: StackConfig, *prefixes: str) -> dict[str, str]:
    """An offload-host server's component variables, with OFL_ALLOW from STACK_ENGINE_HOSTS."""
    env = cfg.components(*prefixes)
    if cfg["STACK_ENGINE_HOSTS"]:
        if ofl_env.OFL_ALLOW.name in cfg.values:
            raise ConfigError("set STACK_ENGINE_HOSTS or OFL_ALLOW, not both (STACK_ENGINE_HOSTS "
                              "fills the offload host's OFL_ALLOW)")
        env[ofl_env.OFL_ALLOW.name] = ",".join(admitted_peers(cfg))
    return env


def engram_server(cfg: StackConfig) -> Role | None:
    links = [x.strip() for x in cfg["STACK_ENGRAM_LISTEN"].split(",") if x.strip()]
    if not links:
        return None
    cmd = [sys.executable, "-m", "remote_engram.cli", "serve", "--shards",
           cfg["STACK_ENGRAM_SHARDS"], "--backend", cfg[engram_env.ENGRAM_BACKEND]]
    for link in links:
        cmd += ["--listen", link]
    if cfg.int("STACK_INJECT_DELAY_MS"):
        cmd += ["--inject-delay-ms", cfg["STACK_INJECT_DELAY_MS"]]
    return Role("engram-server", cmd, offload_env(cfg, "OFL_"), ready_line="remote-engram serve:")


def tp2_devices(cfg: StackConfig) -> list[str]:
    """The pair's two devices (STACK_DRAFTER_DEVICES), or a ConfigError saying why not."""
    devices = [d.strip() for d in cfg["STACK_DRAFTER_DEVICES"].split(",") if d.strip()]
    if len(devices) != 2 or devices[0] == devices[1]:
        raise ConfigError(f"STACK_DRAFTER_TP2=1 needs two distinct devices in "
                          f"STACK_DRAFTER_DEVICES, rank 0's first; got {cfg['STACK_DRAFTER_DEVICES']!r}")
    return devices


def drafter_worker(cfg: StackConfig) -> Role | None:
    """The one-card worker, or with STACK_DRAFTER_TP2=1 drafter-tp2's supervised pair: the
    same drafter, target, listener and backend, so engines see the same identities."""
    if not cfg["STACK_DRAFTER"]:
        return None
    if not cfg["STACK_DRAFTER_LISTEN"]:
        raise ConfigError("STACK_DRAFTER is set but STACK_DRAFTER_LISTEN is not: the worker needs "
                          "HOST:PORT to listen on (where the engines reach it)")
    weights = cfg["STACK_DRAFTER_WEIGHTS"]  # values checked as the env files were read
    same = ["--drafter", cfg["STACK_DRAFTER"], "--target", cfg["STACK_DRAFTER_TARGET"] or cfg["STACK_MODEL"],
            "--listen", cfg["STACK_DRAFTER_LISTEN"], "--dtype", cfg["STACK_DRAFTER_DTYPE"]]
    backend = ["--backend", cfg[drafter_env.REMOTE_DRAFTER_BACKEND]]
    if cfg["STACK_DRAFTER_TP2"] == "1":
        if weights == "exl3" and not cfg["STACK_DRAFTER"].startswith("dsv41:"):
            raise ConfigError("STACK_DRAFTER_WEIGHTS=exl3 with STACK_DRAFTER_TP2=1 is for DeepSeek's "
                              "drafter (dsv41:), whose pair splits a pack's experts; a DSpark "
                              "drafter's pair shards dense weights: set STACK_DRAFTER_WEIGHTS=dense")
        if cfg.int("STACK_INJECT_DELAY_MS"):
            raise ConfigError("STACK_INJECT_DELAY_MS is the one-card worker's (the miniature's "
                              "slow link); drafter-tp2 has none: set it to 0 with STACK_DRAFTER_TP2=1")
        cmd = [sys.executable, "-m", "drafter_tp2.cli", "supervise", "--", *same,
               "--devices", ",".join(tp2_devices(cfg)), *backend]
        return Role("drafter-worker", cmd, offload_env(cfg, *WORKER_PREFIXES, "DRAFTER_TP2_"),
                    ready_line="drafter-tp2 worker:")
    cmd = [sys.executable, "-m", "remote_drafter.cli", "worker", *same,
           "--device", cfg["STACK_DRAFTER_DEVICE"], *backend]
    if weights == "exl3":  # never --ungated: the worker refuses a pack not gated for its weights
        cmd += ["--weights", "exl3"]
    if cfg.int("STACK_INJECT_DELAY_MS"):
        cmd += ["--inject-delay-ms", cfg["STACK_INJECT_DELAY_MS"]]
    return Role("drafter-worker", cmd, offload_env(cfg, *WORKER_PREFIXES),
                ready_line="remote-drafter worker:")


def speculative_config(cfg: StackConfig) -> str | None:
    """The remote proposer when a drafter is configured (remote or local), else none."""
    k = cfg.int("STACK_NUM_SPEC_TOKENS")
    drafter = cfg[drafter_env.REMOTE_DRAFTER_ADDRESS] or cfg[drafter_env.REMOTE_DRAFTER_DRAFTER]
    if not k or not drafter:
        return None
    return json.dumps({"method": "custom_class", "model": "remote_drafter.vllm.RemoteProposer",
                       "num_speculative_tokens": k})


def engine_nodes(cfg: StackConfig) -> int:
    """STACK_ENGINE_NODES, checked against STACK_TP and STACK_ENGINE_MASTER."""
    nodes, tp = cfg.int("STACK_ENGINE_NODES"), cfg.int("STACK_TP")
    if nodes < 1 or tp % nodes:
        raise ConfigError(f"STACK_ENGINE_NODES={nodes} must be at least 1 and divide STACK_TP={tp} "
                          "(vLLM gives each host the same number of ranks)")
    if nodes > 1:
        host, _, port = cfg["STACK_ENGINE_MASTER"].rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"STACK_ENGINE_NODES={nodes} needs STACK_ENGINE_MASTER=HOST:PORT on "
                              f"rank 0's host, where the ranks meet; got {cfg['STACK_ENGINE_MASTER']!r}")
    return nodes


def rank_address(listen: str, rank: int) -> str:
    """HOST:PORT + rank: where rank `rank` serves a per-rank listener (as the Engram overlay)."""
    host, _, port = listen.rpartition(":")
    return f"{host}:{int(port) + rank}"


def engine(cfg: StackConfig, rank: int = 0) -> Role:
    """vLLM with the overlays; with STACK_ENGINE_NODES > 1 node rank `rank` of it: every rank
    gets the same engine arguments, rank 0 also the API's address, ranks > 0 --headless."""
    nodes = engine_nodes(cfg)
    if not 0 <= rank < nodes:
        raise ConfigError(f"--rank {rank}: the engine has ranks 0..{nodes - 1} "
                          f"(STACK_ENGINE_NODES={nodes})")
    host, _, port = cfg["STACK_ENGINE_LISTEN"].rpartition(":")
    # what it serves, where rank 0 serves it, and how every rank runs it
    served = ["--model", cfg["STACK_MODEL"], "--served-model-name", SERVED_NAME,
              "--max-model-len", str(cfg.int("STACK_MAX_MODEL_LEN")), "--dtype", cfg["STACK_DTYPE"]]
    api = ["--host", host, "--port", str(int(port))]
    spec = speculative_config(cfg)
    runtime = ["--kv-cache-memory-bytes", str(cfg.int("STACK_KV_BYTES")),
               *(["--enforce-eager"] if cfg["STACK_ENFORCE_EAGER"] == "1" else []),
               *(["--speculative-config", spec] if spec else []),
               "--tensor-parallel-size", cfg["STACK_TP"], "--max-num-seqs", cfg["STACK_MAX_NUM_SEQS"]]
    env = {"HF_HUB_OFFLINE": "1", **cfg.components(*ENGINE_PREFIXES)}
    if cfg["STACK_ENGINE_ONE_PROCESS"] == "1":
        if cfg.int("STACK_TP") != 1:
            raise ConfigError(f"STACK_ENGINE_ONE_PROCESS=1 runs one rank; STACK_TP={cfg['STACK_TP']}")
        runtime += ONE_PROCESS_ARGS
        env.update(ONE_PROCESS_ENV)
    group = []  # vLLM's multi-node settings, none on one host
    if nodes > 1:
        master_host, _, master_port = cfg["STACK_ENGINE_MASTER"].rpartition(":")
        group = ["--nnodes", str(nodes), "--node-rank", str(rank), "--master-addr", master_host,
                 "--master-port", master_port]
        metrics = handoff_env.ASYNC_HANDOFF_METRICS_LISTEN.name
        if listen := env.get(metrics):
            env[metrics] = rank_address(listen, rank)
    python = cfg["STACK_VLLM_PYTHON"]
    if rank == 0:
        return Role("engine", [python, *API_SERVER, *served, *api, *runtime, *group], env,
                    ready_url=f"http://{host}:{port}/v1/models", rank=0)
    return Role(f"engine-rank{rank}", [python, *HEADLESS_SERVE, *served, *runtime, *group, "--headless"],
                env, ready_line=HEADLESS_READY, rank=rank)


def roles(cfg: StackConfig, role: str | None = None, rank: int | None = None) -> list[Role]:
    """This machine's roles: `offload-host` (or one of its roles, `engram-server`,
    `drafter-worker`), `engine` (rank `rank`, default 0), or all of them (None: every
    engine rank too, ranks > 0 first, the order vLLM needs)."""
    if rank is not None and role != "engine":
        raise ConfigError("--rank goes with --role engine")
    if role == "engine":  # the offload host's settings are not this host's to check
        return [engine(cfg, rank or 0)]
    host = [r for r in (engram_server(cfg) if role != "drafter-worker" else None,
                        drafter_worker(cfg) if role != "engram-server" else None) if r is not None]
    if role in ("offload-host", "engram-server", "drafter-worker"):
        return host
    return host + [engine(cfg, r) for r in [*range(1, engine_nodes(cfg)), 0]]
