"""One rank of the pair, start to finish: device lock, rendezvous, load (its part: kinds/),
pair safety, shard, capture, then serve (rank 0: the ofl endpoint, remote_drafter's Worker
and DraftService as they are) or follow (rank 1: run each round rank 0 broadcasts)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from remote_drafter.models.base import Drafter
from remote_drafter.worker.device_lock import DeviceBusy, DeviceLock, device_key, lock_dir
from remote_drafter.worker.exposure import DEFAULT_PORT
from remote_drafter.worker.server import Worker
from remote_drafter.worker.service import ServiceConfig

from .channel import Channel
from .kinds import kind_for
from .pair import describe_rank, refusals, torch_device

log = logging.getLogger("drafter_tp2.rank")
REFUSED, BROKEN = 2, 3  # exit codes: refused to start (do not restart) / stopped serving


@dataclass
class RankConfig:
    rank: int
    devices: list[str]
    master: str
    drafter: str
    target: str
    dtype: str = "float32"
    backend: str = "tcp"
    listen: str = "127.0.0.1:0"
    insecure: bool | None = None  # Worker's: None = OFL_INSECURE
    service: ServiceConfig = field(default_factory=ServiceConfig)
    graphs: bool = True
    graph_batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    timeout_s: float = 10.0
    heartbeat_s: float = 1.0
    start_timeout_s: float = 120.0
    require_p2p: bool = True

    def agreed(self, drafter_config: dict) -> dict:
        """What both ranks must agree on (the pair check compares it key by key)."""
        return {"drafter_config": drafter_config, "dtype": self.dtype,
                "devices": self.devices, "graphs": self.graphs,
                "graph_batches": self.graph_batches, "timeout_s": self.timeout_s}


def _say(rank: int, text: str) -> None:
    print(f"drafter-tp2 rank {rank}: {text}", file=sys.stderr, flush=True)


def run(cfg: RankConfig) -> int:
    dev = cfg.devices[cfg.rank]
    tdev = torch_device(dev)
    cuda = torch.device(tdev).type == "cuda"
    if cuda:
        torch.cuda.set_device(tdev)
    keys = [device_key(d) if _visible(d) else d for d in cfg.devices]
    if keys[0] == keys[1]:  # before the lock, which would otherwise be the only complaint
        _say(cfg.rank, f"refusing to serve: the same device twice: {cfg.devices} are both {keys[0]}")
        return REFUSED
    try:
        lock = DeviceLock(keys[cfg.rank], lock_dir()).acquire()
    except DeviceBusy as exc:
        _say(cfg.rank, f"refusing to serve: {exc}")
        return REFUSED
    if lock.cleared:
        _say(cfg.rank, f"cleared the stale lock record of dead pid {lock.cleared.get('pid')} on {dev}")
    stopped_cleanly = False
    try:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{cfg.master}",
                                rank=cfg.rank, world_size=2,
                                timeout=timedelta(seconds=cfg.start_timeout_s),
                                **({"device_id": torch.device(tdev)} if cuda else {}))
        # Start-up exchanges may wait for a slow peer (loading, capture); rounds may not.
        hello = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.start_timeout_s))
        ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout_s))
        # Rounds' tensors: NCCL with the round deadline on GPUs (its watchdog ends a rank
        # whose collective passes it), the control group itself on CPU.
        data = dist.new_group(backend="nccl", timeout=timedelta(seconds=cfg.timeout_s)) if cuda else ctrl
        try:  # this rank's part: a failure is told to the other rank, and both refuse
            kind = kind_for(cfg.drafter)(cfg, cfg.rank, tdev)
            said, cannot = kind.hello(), None
        except (ValueError, FileNotFoundError, KeyError) as exc:
            said, cannot = {"fingerprint": "", "config": {}}, str(exc)
        info = describe_rank(cfg.rank, cfg.devices, said["fingerprint"], cfg.drafter,
                             cfg.agreed(said["config"]), tensors=said.get("tensors"), cannot=cannot)
        infos = [None, None]
        dist.all_gather_object(infos, info, group=hello)
        why = refusals(infos, cfg.require_p2p)
        if not why and (both := kind.check(infos)):
            why = [both]
        if why:
            _say(cfg.rank, "refusing to serve: " + "; ".join(why))
            return REFUSED
        kind.shard(infos, data)
        rounds = kind.rounds(cfg.graphs, cfg.graph_batches)
        rounds.capture()
        broken = threading.Event()
        channel = Channel(cfg.rank, ctrl, data, tdev, kind.blank, on_broken=lambda why: broken.set())
        if cfg.rank == 1:
            ended = channel.follow(rounds)
            stopped_cleanly = ended == "stopped"
            if not stopped_cleanly:
                _say(1, f"stopped: {ended}")
            return 0 if stopped_cleanly else BROKEN
        topology = {"tp": 2, "devices": [i["device"] for i in infos],
                    "names": [i.get("name", "cpu") for i in infos],
                    "peer": infos[0]["peer"]["text"], "rounds": rounds.describe(),
                    "sharding": kind.sharding}
        code = serve(cfg, kind.leader(channel, rounds, topology), channel, broken)
        stopped_cleanly = code != BROKEN
        return code
    finally:
        if cuda:
            torch.cuda.synchronize(tdev)  # in-flight GPU work ends before the card is free
        lock.release()
        if stopped_cleanly and dist.is_initialized():
            dist.destroy_process_group()


def _visible(device: str) -> bool:
    d = torch.device(device)
    return d.type == "cpu" or (d.index or 0) < torch.cuda.device_count()


def serve(cfg: RankConfig, drafter: Drafter, channel: Channel, broken: threading.Event) -> int:
    """Rank 0: serve until SIGTERM (0) or until the pair breaks (BROKEN); REFUSED, with
    both ranks stopped, when it cannot listen: --listen exposed without admission, its port
    taken or its address not this host's, the backend missing (a restart would not help)."""
    from ofl.errors import BackendUnavailable, ConfigurationError
    from ofl.server import parse_address
    host, port = parse_address(cfg.listen, DEFAULT_PORT)
    term = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: term.set())
    signal.signal(signal.SIGINT, lambda *a: term.set())
    try:
        worker = Worker(drafter, cfg.backend, host, port, cfg.service,
                        identity="drafter-tp2-worker", insecure=cfg.insecure).start()
    except (ConfigurationError, BackendUnavailable, OSError) as exc:
        channel.stop()
        _say(0, f"refusing to serve on {cfg.listen}: {exc}")
        return REFUSED
    heart = threading.Thread(target=_heartbeat, args=(channel, cfg.heartbeat_s, term, broken),
                             name="tp2-heartbeat", daemon=True)
    heart.start()
    d = worker.service.describe()
    print(f"drafter-tp2 rank 0: tp 2 on {'+'.join(cfg.devices)} ({drafter.topology['peer']}; "
          f"depth {drafter.max_depth}, {d['max_requests']} requests, warm-up "
          f"{worker.warm_up_s:.2f} s) {cfg.backend} on {worker.address}", flush=True)
    while not (term.is_set() or broken.is_set()):
        term.wait(0.1)
    worker.stop()  # no new rounds
    with worker.service.device_lock:  # the round in flight, if any, has finished
        channel.stop()
    heart.join(timeout=cfg.timeout_s + 1)
    if broken.is_set() and channel.broken != "stopped":
        _say(0, f"stopped serving: {channel.broken}; clients get no drafts from here "
                "(they decode target-only) until the pair is restarted")
        return BROKEN
    return 0


def _heartbeat(channel: Channel, interval: float, term: threading.Event, broken: threading.Event) -> None:
    from .channel import PairBroken
    while not (term.wait(interval) or broken.is_set()):
        try:
            channel.ping()
        except PairBroken:
            return
