"""`dsv41-stack preflight`: is this machine ready for its roles? Each check prints PASS,
WARN or FAIL with the reason; any FAIL exits non-zero (a WARN does not). Run it on the
offload host first, then on each engine host (the links and the qualify sample need the
offload host serving); an engine across hosts: rank 1's host before rank 0 is up (rank 0's
rendezvous not answering yet is a WARN there), then rank 0's."""

from __future__ import annotations

import errno
import importlib.metadata as metadata
import importlib.util
import math
import os
import re
import resource
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from async_handoff import env as handoff_env
from ofl import admission
from ofl import env as ofl_env
from remote_drafter import env as drafter_env
from remote_drafter.models.fidelity_gate import read_record, summary
from remote_drafter.models.registry import spec_folder
from remote_drafter.worker.exl3_admission import refusal as gate_refusal
from remote_engram import env as engram_env

from .config import StackConfig
from .roles import Role, admitted_peers, engine_nodes, own_peers, roles, tp2_devices

GIB = 1 << 30
QUALIFY_SAMPLE = 2000  # rows per shard compared over each link (qualify --all is the full check)
ROUND_BATCH, ROUND_SAMPLES = 4, 5  # drafter rounds timed: four sequences, the production batch
WAIT_HEADROOM = 1.25  # the wait suggested over the rounds measured: room for a slower round


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    warn: bool = False  # passed, but with something the operator should know (not a FAIL)


def pins() -> dict[str, str]:
    """Our components and the versions this stack pins them to (from its own metadata)."""
    out = {}
    for req in metadata.requires("dsv41-stack") or []:
        match = re.match(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([\w.]+)", req.split(";")[0].strip())
        if match:
            out[match.group(1)] = match.group(2)
    return out


def check_versions(wanted: set[str]) -> list[Check]:
    out = []
    for dist, version in sorted(pins().items()):
        if dist not in wanted:
            continue
        try:
            have = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out.append(Check(f"version {dist}", False, f"not installed (pinned {version})"))
            continue
        out.append(Check(f"version {dist}", have == version, f"{have} (pinned {version})"))
    return out


def endpoints(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def check_port_free(address: str, role: str) -> Check:
    host, _, port = address.rpartition(":")
    if port == "0":
        return Check(f"port {role}", True, f"{address}: any free port")
    host = host.strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, int(port)))
        except OSError as exc:
            why = {errno.EADDRINUSE: "is in use",
                   errno.EADDRNOTAVAIL: f"cannot be bound here: {host} is not an address of this host"}
            return Check(f"port {role}", False, f"{address} {why.get(exc.errno, f'cannot be bound ({exc})')}")
    return Check(f"port {role}", True, f"{address} free")


def check_reachable(address: str, what: str, timeout_s: float = 2.0) -> Check:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return Check(f"link {what}", True, f"{address} answers")
    except OSError as exc:
        return Check(f"link {what}", False, f"{address} unreachable ({exc.strerror or exc})")


def check_qualify(address: str, shard_dir: str, rank: int, backend: str, host: str = "") -> Check:
    """Rank `rank`'s rows on the offload host at `address` (`host`: which, when there are
    several) equal its local shards (a sample)."""
    from remote_engram.qualify import qualify_link
    name = f"qualify rank {rank}{host}"
    paths = sorted(str(p) for p in Path(shard_dir).glob(f"*-r{rank}of*.bin"))
    try:
        report = qualify_link(address, backend, paths, sample=QUALIFY_SAMPLE, link=f"rank{rank}")
    except Exception as exc:  # noqa: BLE001 - any failure to qualify is a FAIL with its reason
        return Check(name, False, f"{address}: {type(exc).__name__}: {exc}")
    bad = [s["shard"] for s in report["shards"] if s["mismatched_rows"] or not s["digest_equal"]
           or "error" in s]
    rows = sum(s["rows_compared"] for s in report["shards"])
    return Check(name, report["ok"] and bool(paths),
                 f"{address}: {rows:,} rows compared over {len(paths)} shards"
                 + (f", differ: {bad}" if bad else "") + ("" if paths else ", no local shards"))


KEY_FILE_HOWTO = ("create it once with `openssl rand -hex 32 > {0} && chmod 600 {0}` and "
                  "copy the same file to every host")


def loopback(host: str) -> bool:
    try:
        return admission.peer_address(host.strip("[]")).is_loopback
    except ValueError:  # a name, not an address
        return host == "localhost"


def exposed_listeners(cfg: StackConfig) -> list[str]:
    """The offload host's server addresses (Engram links, drafter worker) that other hosts
    can reach: with any, this env is a production one, which needs an allow-list and a key."""
    drafter = [cfg["STACK_DRAFTER_LISTEN"]] if cfg["STACK_DRAFTER"] else []
    return [a for a in [*endpoints(cfg["STACK_ENGRAM_LISTEN"]), *drafter]
            if not loopback(a.rpartition(":")[0])]


def check_key(cfg: StackConfig, exposed: list[str], offload_host: bool) -> Check | None:
    """The shared key (OFL_AUTH_KEY, or the file OFL_AUTH_KEY_FILE names) usable: its length
    shown, never its value. Missing: a FAIL when the servers are `exposed` (on every host: a
    keyless client is refused by a keyed server), else a PASS on the offload host."""
    path = cfg[ofl_env.OFL_AUTH_KEY_FILE]
    if path and not os.path.exists(path):
        return Check("shared key", False, f"OFL_AUTH_KEY_FILE {path} does not exist: "
                     + KEY_FILE_HOWTO.format(path))
    try:
        with cfg.link_client():  # the key as the servers and clients of these env files read it
            key = admission.configured_key()
    except ValueError as exc:
        unreadable = path and not os.access(path, os.R_OK)
        return Check("shared key", False, str(exc) + (
            f" (run preflight as the user the servers run as; keep {path} chmod 600)"
            if unreadable else ""))
    if key is None:
        if exposed:
            return Check("shared key", False, f"none, while {', '.join(exposed)} can be reached "
                         "from other hosts: any peer the allow-list admits needs no proof; set "
                         "OFL_AUTH_KEY_FILE=/etc/dsv41/ofl.key in every host's env file; "
                         + KEY_FILE_HOWTO.format("/etc/dsv41/ofl.key"))
        return Check("shared key", True, "none needed: the servers listen on loopback "
                     "only") if offload_host else None
    if path:
        return Check("shared key", True, f"OFL_AUTH_KEY_FILE {path} ({len(key)} characters, "
                     "owner-only, not shown)")
    return Check("shared key", True, f"OFL_AUTH_KEY set ({len(key)} characters, not shown)")


def check_allow_list(allow: str, exposed: list[str]) -> Check:
    """The OFL_ALLOW the offload host's servers get: valid, and set when they are `exposed`."""
    try:
        networks = admission.parse_allow(allow)
    except ValueError as exc:
        return Check("allow-list", False, f"{exc} (STACK_ENGINE_HOSTS or OFL_ALLOW)")
    if networks:
        return Check("allow-list", True, f"the servers admit {allow}")
    if exposed:
        return Check("allow-list", False, f"empty, while {', '.join(exposed)} can be reached "
                     "from other hosts: any peer that reaches them is admitted; set "
                     "STACK_ENGINE_HOSTS to the addresses the engine hosts connect from")
    return Check("allow-list", True, "empty: the servers listen on loopback only, which only "
                 "this host reaches")


# An engine's HTTP endpoints: its Engram client's, drafter client's and async proxy's counters
ENGINE_ENDPOINTS = (engram_env.ENGRAM_METRICS_LISTEN, drafter_env.REMOTE_DRAFTER_METRICS_LISTEN,
                    handoff_env.ASYNC_HANDOFF_METRICS_LISTEN)


def check_own_reads(engine: Role) -> Check | None:
    """With OFL_ALLOW in the engine's environment its HTTP endpoints admit only those peers
    (403 to others), and `status` and the canary read them from this host: the addresses
    those reads come from must be listed."""
    allow = engine.env.get(ofl_env.OFL_ALLOW.name, "")
    listens = [engine.env[v.name] for v in ENGINE_ENDPOINTS if engine.env.get(v.name)]
    if not allow or not listens:
        return None
    try:
        networks = admission.parse_allow(allow)
    except ValueError as exc:
        return Check("admission of this host's reads", False, str(exc))
    readers = list(dict.fromkeys(own_peers(listens)))
    refused = [p for p in readers if not admission.admitted(p, networks)]
    if refused:
        return Check("admission of this host's reads", False, f"OFL_ALLOW refuses "
                     f"{', '.join(refused)}, where status and the canary read the engine's "
                     f"counters from (403): add {', '.join(refused)} to OFL_ALLOW")
    return Check("admission of this host's reads", True, f"OFL_ALLOW admits {', '.join(readers)}, "
                 "where status and the canary read the engine's counters from")


def source_address(address: str) -> str:
    """The address this host connects to `address` from (a UDP connect picks the route and
    sends nothing)."""
    host, _, port = address.rpartition(":")
    family, _, _, _, where = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(where)
        return s.getsockname()[0]


def check_admitted(address: str, what: str, cfg: StackConfig) -> Check | None:
    """With STACK_ENGINE_HOSTS set: would the offload host admit this host on that link?"""
    if not cfg["STACK_ENGINE_HOSTS"]:
        return None
    try:
        source = source_address(address)
        ok = admission.admitted(source, admission.parse_allow(",".join(admitted_peers(cfg))))
    except (OSError, ValueError) as exc:
        return Check(f"admission {what}", False, f"{address}: {exc}")
    return Check(f"admission {what}", ok, f"this host reaches {address} from {source}" + (
        "" if ok else ", which STACK_ENGINE_HOSTS does not list: the offload host will refuse it"))


def check_master(address: str, rank: int) -> Check:
    """Rank 0 opens vLLM's rendezvous at STACK_ENGINE_MASTER (the port must be free there);
    another rank connects to it, and waits for it when rank 0 is not up yet (a WARN: the
    order is rank 1 first, then rank 0)."""
    if rank == 0:
        check = check_port_free(address, "engine master")
        return Check(check.name, check.ok, check.detail + " (rank 0 opens vLLM's rendezvous here)")
    check = check_reachable(address, "engine master")
    if check.ok:
        return check
    return Check(check.name, True, f"{check.detail}: expected while rank 0 is not up yet (rank "
                 f"{rank} starts first and waits for it); start rank 0 next", warn=True)


def check_tp2_pair(devices: list[str]) -> Check:
    """The two-card worker's devices are two distinct cards: on CUDA, their GPU UUIDs differ
    (the same card under two indices is caught); on CPU a gloo pair, nothing to compare."""
    name = "drafter tp2 devices"
    if not all(d.startswith("cuda") for d in devices):
        return Check(name, True, f"{', '.join(devices)}: a CPU pair (gloo), no GPUs to compare")
    if not shutil.which("nvidia-smi"):
        return Check(name, True, f"{', '.join(devices)}: two distinct names; UUID comparison "
                     "skipped: no nvidia-smi (no GPUs on this machine)", warn=True)
    indices = [d.partition(":")[2] or "0" for d in devices]
    query = subprocess.run(["nvidia-smi", "-i", ",".join(indices), "--query-gpu=index,uuid",
                            "--format=csv,noheader"], capture_output=True, text=True)
    if query.returncode:
        return Check(name, False, query.stderr.strip() or "nvidia-smi failed")
    uuids = dict(line.split(", ", 1) for line in query.stdout.strip().splitlines())
    found = [uuids.get(i, "") for i in indices]
    ok = len(found) == 2 and all(found) and found[0] != found[1]
    return Check(name, ok, ", ".join(f"{d} = {u or 'not found'}" for d, u in zip(devices, found))
                 + ("" if ok else " (the pair needs two distinct cards)"))


def check_drafter_fits(folder: str, dtype: str, devices: list[str]) -> Check:
    """DeepSeek's drafter on the worker's cards: split by experts over a pair, or whole on
    one card (the one-card worker, also after `rollback tp2-worker`): each card's weights
    (from the checkpoint's headers) plus the working allowance against its memory."""
    name = "drafter tp2 memory per card" if len(devices) == 2 else "drafter memory on its card"
    try:
        from drafter_tp2.kinds.dsv41 import WORKING_BYTES, card_bytes
    except ImportError:  # the pair's package holds the estimate; one card does not need it installed
        return Check(name, len(devices) == 1, "drafter-tp2 is not installed here: the card's memory "
                     "is not checked", warn=True)
    try:
        need = card_bytes(folder, 4 if dtype == "float32" else 2, len(devices))
    except (OSError, ValueError, KeyError) as exc:
        return Check(name, False, f"{folder}: {type(exc).__name__}: {exc}")
    said = ", ".join(f"rank {r} {b / GIB:.1f} GiB" for r, b in enumerate(need))
    if not all(d.startswith("cuda") for d in devices):
        return Check(name, True, f"{said} of weights (on the CPU: no card to hold them against)")
    if not shutil.which("nvidia-smi"):
        return Check(name, True, f"{said} of weights; no nvidia-smi to read the cards' memory", warn=True)
    indices = [d.partition(":")[2] or "0" for d in devices]
    query = subprocess.run(["nvidia-smi", "-i", ",".join(indices), "--query-gpu=index,memory.total",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True)
    if query.returncode:
        return Check(name, False, query.stderr.strip() or "nvidia-smi failed")
    total = {i: int(m) << 20 for i, m in (line.split(", ") for line in query.stdout.strip().splitlines())}
    short = [f"{d} holds {total.get(i, 0) / GIB:.1f} GiB, rank {r} needs {(need[r] + WORKING_BYTES) / GIB:.1f}"
             for r, (d, i) in enumerate(zip(devices, indices)) if need[r] + WORKING_BYTES > total.get(i, 0)]
    return Check(name, not short, f"{said} of weights, {WORKING_BYTES / GIB:.0f} GiB beside each"
                 + (": " + "; ".join(short) if short else ": fits"))


def drafter_transport(address: str, cfg: StackConfig):
    """A link to the worker expecting the identities this engine expects
    (REMOTE_DRAFTER_TARGET / _MANIFEST), as the engine's client makes it."""
    from remote_drafter.engine.identity import expectation
    from remote_drafter.engine.transport import RemoteTransport
    return RemoteTransport(address, cfg[drafter_env.REMOTE_DRAFTER_BACKEND],
                           expectation(cfg[drafter_env.REMOTE_DRAFTER_TARGET],
                                       cfg[drafter_env.REMOTE_DRAFTER_MANIFEST]))


def check_drafter_identity(address: str, cfg: StackConfig, worker: str = "drafter") -> Check:
    """The worker's identities (target, tokenizer, drafter, Markov digests) against what this
    engine expects: the handshake the engine will make."""
    try:
        transport = drafter_transport(address, cfg)
        try:
            info = transport.info(5.0)
        finally:
            transport.close()
    except Exception as exc:  # noqa: BLE001 - a refused or failed handshake is the FAIL
        return Check(f"{worker} identity", False, f"{address}: {exc}")
    return Check(f"{worker} identity", True, f"{address}: {info.manifest.kind} drafter, target "
                 f"{info.manifest.target[:12]}, drafter {info.manifest.drafter[:12]}")


def check_drafter_round(address: str, cfg: StackConfig, rounds: int = ROUND_SAMPLES,
                        worker: str = "drafter") -> Check:
    """Rounds as the engine will see them, the link included: ROUND_BATCH throwaway requests
    (the production batch, their windows of zero rows) drafted `rounds` times by a client
    like the engine's, against what the engine waits for one: ASYNC_HANDOFF_MAX_WAIT_MS
    through the proxy, REMOTE_DRAFTER_DEADLINE_MS for synchronous rounds. Two figures must
    fit: the slowest of those rounds, and the worker's own round p99 (its status, over every
    round it served) plus the link's round trip. Longer is a WARN naming the value to set
    (wait_for_rounds): those rounds come too late to be drafts."""
    from remote_drafter.engine.client import DrafterClient
    from remote_drafter.engine.transport import worker_stats
    wait = handoff_env.ASYNC_HANDOFF_MAX_WAIT_MS if handoff_env.async_enabled(cfg.values) \
        else drafter_env.REMOTE_DRAFTER_DEADLINE_MS
    allowed = float(cfg[wait])
    try:
        client = DrafterClient(drafter_transport(address, cfg), deadline_s=max(5.0, 2 * allowed / 1e3))
        info = client.worker_info(5.0)
    except Exception as exc:  # noqa: BLE001 - the identity check says why
        return Check(f"{worker} round", True, f"{address}: not measured ({exc})", warn=True)
    try:
        n = min(info.window + 1, info.history_tokens, 64)
        rows = np.zeros((n - 1, info.feature), np.float32) if info.feature else None
        for rid in range(ROUND_BATCH):
            client.add_request(rid, np.arange(n, dtype=np.int32) % info.vocab, rows)
        seconds = []
        for _ in range(rounds + 1):  # the first opens the requests
            t0 = time.perf_counter()
            client.propose()
            seconds.append(time.perf_counter() - t0)
        failed = client.counters()["rounds_failed"]
    finally:
        for rid in range(ROUND_BATCH):  # one more round hands the throwaway requests back
            client.release(rid)
        client.propose()
        client.close()
    if failed:
        return Check(f"{worker} round", True, f"{address}: {failed:g} of {rounds + 1} rounds failed", warn=True)
    slowest = 1e3 * max(seconds[1:])
    try:
        stats = worker_stats(address, cfg[drafter_env.REMOTE_DRAFTER_BACKEND], pings=ROUND_SAMPLES)
        p99, rtt = float(stats["round_p99_ms"]), float(stats["link_rtt_ms"])
    except Exception as exc:  # noqa: BLE001 - the timed rounds stand alone then
        return Check(f"{worker} round", True, f"{address}: slowest of {rounds} rounds {slowest:.1f} ms; the "
                     f"worker's round p99 unreadable ({exc})", warn=True)
    detail = (f"{address}: slowest of {rounds} rounds of {ROUND_BATCH} requests {slowest:.1f} ms (link "
              f"included); the worker's round p99 {p99:.1f} ms over {stats['round_count']:g} rounds + the "
              f"link's round trip {rtt:.2f} ms; {wait.name}={allowed:g}")
    if max(slowest, p99 + rtt) <= allowed:
        return Check(f"{worker} round", True, detail)
    return Check(f"{worker} round", True, detail + f": rounds arrive too late to draft; set {wait.name}="
                 f"{wait_for_rounds(slowest, p99, rtt)} or serve a faster drafter", warn=True)


def wait_for_rounds(slowest_ms: float, p99_ms: float, rtt_ms: float) -> int:
    """What the engine should wait for a round (ms): the longer of the slowest round timed
    and the worker's p99 plus the link's round trip, with WAIT_HEADROOM over it."""
    return math.ceil(WAIT_HEADROOM * max(slowest_ms, p99_ms + rtt_ms))


def check_exl3_installed() -> Check:
    """exllamav3 where the worker imports it (found, not imported: its first import builds
    its CUDA extension)."""
    found = importlib.util.find_spec("exllamav3") is not None
    return Check("exllamav3", found, "installed" if found else "not installed, and the worker needs "
                 "it for an EXL3 pack: pip install 'dsv41-stack[offload-host,exl3]'")


def check_exl3_gate(spec: str) -> Check:
    """An EXL3 pack is served only once its fidelity gate passed (remote_drafter.worker.exl3_admission):
    the record alone here, the worker compares its weights' digest once it has loaded them."""
    pack = spec_folder(spec)
    why = gate_refusal(pack, None)
    return Check("exl3 gate", why is None, why or f"{pack}: {summary(read_record(pack))}")


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def check_memory(need: int, what: str) -> Check:
    have = mem_available()
    return Check(f"memory {what}", have >= need, f"MemAvailable {have / GIB:.1f} GiB, "
                 f"needs {need / GIB:.2f} GiB")


def check_mlock(need: int) -> Check:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    ok = soft == resource.RLIM_INFINITY or soft >= need
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.0f} MiB"
    return Check("mlock limit", ok, f"{limit}, the tables need {need / 2**30:.2f} GiB locked"
                 + ("" if ok else " (systemd: LimitMEMLOCK=infinity; shell: ulimit -l unlimited)"))


def check_hugepages() -> Check:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = re.search(r"\[(\w+)\]", path.read_text()).group(1) if path.exists() else "unknown"
    return Check("transparent huge pages", mode != "never", f"{mode} (serve --hugepages needs "
                 "madvise or always)")


def check_shm_room(engines: list[Role]) -> Check | None:
    """Room in /dev/shm for the async handoff's region of each engine rank here that drafts
    through the proxy (a container's /dev/shm is its --shm-size: 64 MB by default in
    Docker); None where none does."""
    from async_handoff.hostflags import region_size
    from ofl import region
    slots, slot_bytes = handoff_env.ASYNC_HANDOFF_SLOTS, handoff_env.ASYNC_HANDOFF_SLOT_BYTES
    need = sum(region_size(int(e.env.get(slots.name, slots.default)),
                           int(e.env.get(slot_bytes.name, slot_bytes.default)))
               for e in engines if handoff_env.async_enabled(e.env))
    if not need:
        return None
    st = os.statvfs(region.SHM_DIR)
    free = st.f_bavail * st.f_frsize
    return Check("/dev/shm room", free >= need, f"{free / 2**20:.1f} MiB free in {region.SHM_DIR}, the "
                 f"async handoff's region needs {need / 2**20:.1f} MiB ({slots.name} x {slot_bytes.name})"
                 + ("" if free >= need else "; without it the engine decodes without remote drafts "
                    "(a container: raise --shm-size)"))


def check_gpu(device: str) -> Check:
    if not shutil.which("nvidia-smi"):
        return Check(f"gpu {device}", False, "no nvidia-smi: no NVIDIA driver on this machine")
    index = device.partition(":")[2] or "0"
    query = subprocess.run(["nvidia-smi", "-i", index, "--query-gpu=name,utilization.gpu,memory.used",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True)
    if query.returncode:
        return Check(f"gpu {device}", False, query.stderr.strip() or "nvidia-smi failed")
    name, busy, used = [x.strip() for x in query.stdout.split(",")]
    return Check(f"gpu {device}", int(busy) < 5 and int(used) < 1024,
                 f"{name}: {busy}% busy, {used} MiB used (a worker wants it idle)")


def run(cfg: StackConfig, role: str | None, rank: int | None = None) -> list[Check]:
    mine = roles(cfg, role, rank)
    names = {r.name for r in mine}
    engines = [r for r in mine if r.rank is not None]
    tp2 = cfg["STACK_DRAFTER_TP2"] == "1"
    checks: list[Check] = []
    wanted = {"ofl-transport", "dsv41-async-handoff", "dsv41-remote-engram", "dsv41-longctx-bench",
              "dsv41-acceptance-ceiling"}
    if "drafter-worker" in names or engines:
        wanted.add("dsv41-remote-drafter")
    if "drafter-worker" in names and tp2:
        wanted.add("dsv41-drafter-tp2-nvlink")
    checks += check_versions(wanted)
    servers = [r for r in mine if r.name in ("engram-server", "drafter-worker")]
    exposed = exposed_listeners(cfg)
    if key := check_key(cfg, exposed, offload_host=bool(servers)):
        checks.append(key)
    if servers:
        checks.append(check_allow_list(servers[0].env.get(ofl_env.OFL_ALLOW.name, ""), exposed))
    if "engram-server" in names:
        shards = list(Path(cfg["STACK_ENGRAM_SHARDS"]).glob("*.bin"))
        total = sum(p.stat().st_size for p in shards)
        checks.append(Check("engram shards", bool(shards), f"{len(shards)} in "
                            f"{cfg['STACK_ENGRAM_SHARDS']!r} ({total / 2**30:.2f} GiB)"))
        checks += [check_port_free(a, "engram-server") for a in endpoints(cfg["STACK_ENGRAM_LISTEN"])]
        checks += [check_memory(total, "for the tables"), check_mlock(total), check_hugepages()]
    if "drafter-worker" in names:
        checks.append(check_port_free(cfg["STACK_DRAFTER_LISTEN"], "drafter-worker"))
        devices = tp2_devices(cfg) if tp2 else [cfg["STACK_DRAFTER_DEVICE"]]
        if tp2:
            checks.append(check_tp2_pair(devices))
        if cfg["STACK_DRAFTER"].startswith("dsv41:") and (tp2 or devices[0].startswith("cuda")):
            checks.append(check_drafter_fits(cfg["STACK_DRAFTER"].removeprefix("dsv41:"),
                                             cfg["STACK_DRAFTER_DTYPE"], devices))
        checks += [check_gpu(d) for d in devices if d.startswith("cuda")]
        if cfg["STACK_DRAFTER_WEIGHTS"] == "exl3":
            checks += [check_exl3_installed(), check_exl3_gate(cfg["STACK_DRAFTER"])]
    if shm := check_shm_room(engines):
        checks.append(shm)
    for engine in engines:
        model = Path(cfg["STACK_MODEL"])
        checks.append(Check("target checkpoint", (model / "config.json").exists(), str(model)))
        if engine.rank == 0:  # the API server (a headless rank serves none)
            checks.append(check_port_free(cfg["STACK_ENGINE_LISTEN"], "engine"))
        if engine_nodes(cfg) > 1:
            checks.append(check_master(cfg["STACK_ENGINE_MASTER"], engine.rank))
        checks.append(check_memory(cfg.int("STACK_KV_BYTES"), "for the KV pool"))
        if own_reads := check_own_reads(engine):
            checks.append(own_reads)
        if role == "engine":  # the offload host serves by now (reference order)
            checks += offload_links(cfg, engine.rank)
    return checks


def host_name(index: int, hosts: int) -> str:
    """' host I' in a check's name when ENGRAM_HOSTS lists several offload hosts."""
    return f" host {index}" if hosts > 1 else ""


def offload_links(cfg: StackConfig, rank: int = 0) -> list[Check]:
    """What an engine needs of the offload host before it starts: each Engram link of this
    host's ranks (all of them on one host; with STACK_ENGINE_NODES > 1 rank `rank`'s only)
    answers and its rows equal the local shards (a sample); the drafter worker answers with
    the identities this engine expects."""
    checks = []
    backend = cfg[engram_env.ENGRAM_BACKEND]
    per_host = cfg.int("STACK_TP") // engine_nodes(cfg)  # with more hosts, this host's ranks only
    ranks = range(cfg.int("STACK_TP")) if engine_nodes(cfg) == 1 else \
        range(rank * per_host, (rank + 1) * per_host)
    remote, hosts = cfg[engram_env.ENGRAM_REMOTE], cfg[engram_env.ENGRAM_HOSTS]
    links = []
    for r in ranks:  # each rank's own entry on every offload host, as the engine picks it
        try:
            addresses = engram_env.hosts_for_rank(r, remote, hosts)
        except ValueError as exc:
            checks.append(Check("engram hosts", False, str(exc)))
            break
        links += [(f"engram rank {r}{host_name(i, len(addresses))}", a, r) for i, a in enumerate(addresses)]
    if address := cfg[drafter_env.REMOTE_DRAFTER_ADDRESS]:
        links.append(("drafter worker", address, None))
        standbys = [a.strip() for a in cfg[drafter_env.REMOTE_DRAFTER_STANDBYS].split(",") if a.strip()]
        links += [(f"drafter standby {i}", a, None) for i, a in enumerate(standbys, 1)]
    with cfg.link_client():  # the offload host may ask for the key
        for what, address, link_rank in links:
            if admitted := check_admitted(address, what, cfg):
                checks.append(admitted)
            checks.append(reachable := check_reachable(address, what))
            if not reachable.ok:
                continue
            if link_rank is None:  # the primary: "drafter ..."; a standby: "drafter standby I ..."
                worker = what.removesuffix(" worker")
                checks.append(identity := check_drafter_identity(address, cfg, worker))
                if identity.ok:
                    checks.append(check_drafter_round(address, cfg, worker=worker))
            elif shard_dir := cfg[engram_env.ENGRAM_SHARD_DIR]:
                checks.append(check_qualify(address, shard_dir, link_rank, backend,
                                            what.removeprefix(f"engram rank {link_rank}")))
    return checks


def report(checks: list[Check]) -> str:
    return "\n".join(f"{'FAIL' if not c.ok else 'WARN' if c.warn else 'PASS'}  {c.name}: {c.detail}"
                     for c in checks)
