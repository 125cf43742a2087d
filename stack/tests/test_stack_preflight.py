"""`dsv41-stack preflight`: a ready machine passes; each check, made to fail on purpose,
fails with its reason and the exit code says so."""

import importlib.metadata
import json
import re
import resource
import shutil
import socket
import subprocess

import pytest

from async_handoff.hostflags import region_size
from dsv41_stack import preflight
from dsv41_stack.cli import main
from dsv41_stack.config import StackConfig
from ofl.testing import small_shm
from remote_engram.geometry import EngramGeometry
from remote_engram.server import EngramServer
from remote_engram.synth import write_shards

SMALL = EngramGeometry(layers=(1, 14), vocab=500, prime_start=211)


@pytest.fixture
def ready(tmp_path, monkeypatch):
    """A machine with everything the roles need (ports: any free; mlock: unlimited)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    write_shards(str(tmp_path / "shards"), SMALL, nranks=1)
    write_shards(str(tmp_path / "other"), SMALL, nranks=1, seed=1)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,) * 2)
    values = {"STACK_MODEL": str(tmp_path / "model"), "STACK_ENGRAM_SHARDS": str(tmp_path / "shards"),
              "STACK_ENGRAM_LISTEN": "127.0.0.1:0", "STACK_DRAFTER": "ngram",
              "STACK_DRAFTER_LISTEN": "127.0.0.1:0", "STACK_ENGINE_LISTEN": "127.0.0.1:0",
              "STACK_KV_BYTES": str(1 << 20), "ENGRAM_BACKEND": "tcp",
              "ENGRAM_SHARD_DIR": str(tmp_path / "shards")}
    return StackConfig(values), tmp_path


def failed(cfg, role=None) -> dict:
    return {c.name: c.detail for c in preflight.run(cfg, role) if not c.ok}


def test_a_ready_machine_passes(ready, tmp_path, capsys):
    cfg, _ = ready
    assert failed(cfg) == {}
    env = tmp_path / "ready.env"
    env.write_text("\n".join(f"{k}={v}" for k, v in cfg.values.items()))
    assert main(["preflight", "--env", str(env)]) == 0
    assert "0 failed" in capsys.readouterr().out


def test_a_version_other_than_the_pin(ready, monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda d: "9.9" if d == "dsv41-remote-engram" else real(d))
    assert failed(ready[0]) == {"version dsv41-remote-engram": "9.9 (pinned 0.1.0)"}


def test_missing_shards_and_checkpoint(ready, tmp_path):
    cfg = ready[0].with_values(STACK_ENGRAM_SHARDS=str(tmp_path / "none"),
                               STACK_MODEL=str(tmp_path / "none"))
    assert set(failed(cfg)) == {"engram shards", "target checkpoint"}


def test_a_port_in_use(ready):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        address = "127.0.0.1:%d" % s.getsockname()[1]
        assert "in use" in failed(ready[0].with_values(STACK_ENGINE_LISTEN=address))["port engine"]
    # TEST-NET-1: an address no host here has is not a port in use
    elsewhere = failed(ready[0].with_values(STACK_ENGINE_LISTEN="192.0.2.1:8000"))["port engine"]
    assert elsewhere == "192.0.2.1:8000 cannot be bound here: 192.0.2.1 is not an address of this host"


def test_not_enough_memory_or_mlock(ready, monkeypatch):
    assert "memory for the KV pool" in failed(ready[0].with_values(STACK_KV_BYTES=str(1 << 50)))
    monkeypatch.setattr(resource, "getrlimit", lambda which: (64 << 10, 64 << 10))
    assert "LimitMEMLOCK=infinity" in failed(ready[0])["mlock limit"]


def test_no_room_in_dev_shm_for_the_async_handoff(ready, tmp_path):
    """Where the engine drafts through the proxy, /dev/shm must hold the handoff's region (a
    1 MiB tmpfs stands for a container's small /dev/shm)."""
    cfg = ready[0]
    assert "/dev/shm room" not in {c.name for c in preflight.run(cfg, "engine")}  # sync: no region
    with small_shm(tmp_path) as folder:
        small = cfg.with_values(VLLM_DSPARK_REMOTE_ASYNC="1", ASYNC_HANDOFF_SLOTS="2",
                                ASYNC_HANDOFF_SLOT_BYTES=str(128 << 10))
        room = {c.name: c for c in preflight.run(small, "engine")}["/dev/shm room"]
        assert room.ok and f"free in {folder}" in room.detail, room
        big = failed(small.with_values(ASYNC_HANDOFF_SLOTS="4", ASYNC_HANDOFF_SLOT_BYTES=str(1 << 20)), "engine")
        need = region_size(4, 1 << 20) / 2**20  # a request and a reply a slot
        assert f"needs {need:.1f} MiB" in big["/dev/shm room"] and "--shm-size" in big["/dev/shm room"], big


def test_a_worker_gpu_without_a_driver(ready, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    cfg = ready[0].with_values(STACK_DRAFTER_DEVICE="cuda:0")
    assert failed(cfg) == {"gpu cuda:0": "no nvidia-smi: no NVIDIA driver on this machine"}


def test_links_and_qualify_on_the_engine_host(ready, tmp_path):
    cfg, _ = ready
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = "127.0.0.1:%d" % s.getsockname()[1]
    down = cfg.with_values(ENGRAM_REMOTE=closed, REMOTE_DRAFTER_ADDRESS=closed)
    assert set(failed(down, "engine")) == {"link engram rank 0", "link drafter worker"}
    for tables, ok in (("shards", True), ("other", False)):  # the host's rows vs ours
        server = EngramServer(sorted(str(p) for p in (tmp_path / tables).glob("*.bin")),
                              backend="tcp", listen=["127.0.0.1:0"], mlock=False).start()
        try:
            address = server.health()["links"][0]
            checks = {c.name: c for c in preflight.run(cfg.with_values(ENGRAM_REMOTE=address), "engine")}
        finally:
            server.stop()
        assert checks["link engram rank 0"].ok
        assert checks["qualify rank 0"].ok is ok, json.dumps(checks["qualify rank 0"].detail)


def test_one_engram_entry_serves_and_is_checked_for_every_rank(ready):
    """ENGRAM_REMOTE with one entry serves both ranks of a TP2 engine on one host (the
    engine's own rule, remote_engram.env.remote_for_rank): preflight checks it for each."""
    cfg = ready[0].with_values(STACK_TP="2", ENGRAM_REMOTE=closed_port(), REMOTE_DRAFTER_ADDRESS="")
    assert set(failed(cfg, "engine")) == {"link engram rank 0", "link engram rank 1"}


def test_every_engram_host_is_checked_and_qualified(ready, tmp_path):
    """ENGRAM_HOSTS: each offload host's link and rows, by name; one with other tables fails
    its qualification, the other passes."""
    servers = [EngramServer(sorted(str(p) for p in (tmp_path / tables).glob("*.bin")), backend="tcp",
                            listen=["127.0.0.1:0"], mlock=False).start() for tables in ("shards", "other")]
    try:
        hosts = ";".join(s.health()["links"][0] for s in servers)
        cfg = ready[0].with_values(ENGRAM_HOSTS=hosts, ENGRAM_REMOTE=None, REMOTE_DRAFTER_ADDRESS="")
        checks = {c.name: c for c in preflight.run(cfg, "engine")}
    finally:
        for s in servers:
            s.stop()
    assert checks["link engram rank 0 host 0"].ok and checks["link engram rank 0 host 1"].ok
    assert checks["qualify rank 0 host 0"].ok
    assert not checks["qualify rank 0 host 1"].ok and "differ" in checks["qualify rank 0 host 1"].detail
    both = ready[0].with_values(ENGRAM_HOSTS=hosts, ENGRAM_REMOTE=hosts.split(";")[0])
    assert "both ENGRAM_REMOTE and ENGRAM_HOSTS" in failed(both, "engine")["engram hosts"]


def test_the_drafter_workers_identity(ready, tmp_path):
    """The worker serves target A; an engine of target A passes, an engine of B fails."""
    from remote_drafter.engine.transport import worker_stats
    from remote_drafter.models.llama import LlamaConfig, random_llama
    from remote_drafter.worker.server import spawn_worker
    tiny = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, intermediate_size=64)
    for name, seed in (("a", 0), ("b", 1)):
        random_llama(tiny, seed).save(str(tmp_path / name))
    proc, address = spawn_worker(["--drafter", "ngram", "--target", str(tmp_path / "a"),
                                  "--listen", "127.0.0.1:0"])
    try:
        for target, ok in (("a", True), ("b", False)):
            cfg = ready[0].with_values(REMOTE_DRAFTER_ADDRESS=address,
                                       REMOTE_DRAFTER_TARGET=str(tmp_path / target))
            checks = {c.name: c for c in preflight.run(cfg, "engine")}
            assert checks["link drafter worker"].ok
            assert checks["drafter identity"].ok is ok, checks["drafter identity"].detail
            assert ("drafter round" in checks) is ok  # timed once the identities agree
        other, other_address = spawn_worker(["--drafter", "ngram", "--target", str(tmp_path / "b"),
                                             "--listen", "127.0.0.1:0"])
        try:  # standbys are checked like the primary, each by name
            cfg = ready[0].with_values(REMOTE_DRAFTER_ADDRESS=address, REMOTE_DRAFTER_TARGET=str(tmp_path / "a"),
                                       REMOTE_DRAFTER_STANDBYS=f"{other_address},{address}")
            checks = {c.name: c for c in preflight.run(cfg, "engine")}
        finally:
            other.kill()
            other.wait()
        assert checks["drafter identity"].ok and checks["drafter standby 2 identity"].ok
        assert not checks["drafter standby 1 identity"].ok, checks["drafter standby 1 identity"].detail
        assert "drafter standby 2 round" in checks and "drafter standby 1 round" not in checks
        # the worker's timed round plus the link against the engine's wait: synchronous rounds'
        # deadline, or the proxy's wait; too short is a WARN that says what to raise
        engine = ready[0].with_values(REMOTE_DRAFTER_ADDRESS=address, REMOTE_DRAFTER_TARGET=str(tmp_path / "a"))
        for values, name, warned in (({"REMOTE_DRAFTER_DEADLINE_MS": "5000"}, "REMOTE_DRAFTER_DEADLINE_MS", False),
                                     ({"VLLM_DSPARK_REMOTE_ASYNC": "1", "ASYNC_HANDOFF_MAX_WAIT_MS": "5000"},
                                      "ASYNC_HANDOFF_MAX_WAIT_MS", False),
                                     ({"VLLM_DSPARK_REMOTE_ASYNC": "1", "ASYNC_HANDOFF_MAX_WAIT_MS": "0.0001"},
                                      "ASYNC_HANDOFF_MAX_WAIT_MS", True)):
            check = preflight.check_drafter_round(address, engine.with_values(**values))
            assert check.ok and check.warn is warned and f"{name}=" in check.detail, check.detail
            assert "rounds of 4 requests" in check.detail and "the worker's round p99" in check.detail, check.detail
            assert (f"set {name}=" in check.detail) is warned, check.detail
            stats = worker_stats(address, pings=3)  # the figures preflight read: the worker's status
            assert stats["open_requests"] == 0  # its throwaway requests handed back
            assert 0 < stats["round_p50_ms"] <= stats["round_p99_ms"] and stats["link_rtt_ms"] > 0
        suggested = int(check.detail.rpartition("ASYNC_HANDOFF_MAX_WAIT_MS=")[2].split()[0])
        slowest, p99, rtt = map(float, re.findall(r"4 requests ([\d.]+) ms.*p99 ([\d.]+) ms.*round trip ([\d.]+) ms",
                                                  check.detail)[0])
        assert suggested >= max(slowest, p99 + rtt)  # the value it names covers what it measured
    finally:
        proc.kill()
        proc.wait()
    assert preflight.check_drafter_round(address, engine).warn  # gone: said, not measured


def closed_port() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return "127.0.0.1:%d" % s.getsockname()[1]


def test_the_two_card_worker_on_a_cpu_pair(ready):
    cfg = ready[0].with_values(STACK_DRAFTER_TP2="1", STACK_DRAFTER_DEVICES="cpu:0,cpu:1")
    checks = {c.name: c for c in preflight.run(cfg, "offload-host")}
    assert all(c.ok for c in checks.values()), preflight.report(list(checks.values()))
    assert "a CPU pair (gloo)" in checks["drafter tp2 devices"].detail
    assert checks["version dsv41-drafter-tp2-nvlink"].detail == "0.1.0 (pinned 0.1.0)"
    assert not [n for n in checks if n.startswith("gpu")]


def test_the_two_card_worker_without_gpus_says_the_comparison_is_skipped(ready, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    cfg = ready[0].with_values(STACK_DRAFTER_TP2="1", STACK_DRAFTER_DEVICES="cuda:0,cuda:1")
    checks = {c.name: c for c in preflight.run(cfg, "offload-host")}
    pair = checks["drafter tp2 devices"]
    assert pair.ok and pair.warn and "UUID comparison skipped: no nvidia-smi" in pair.detail
    assert failed(cfg, "offload-host") == {f"gpu cuda:{i}": "no nvidia-smi: no NVIDIA driver on "
                                           "this machine" for i in (0, 1)}
    assert "WARN  drafter tp2 devices" in preflight.report(list(checks.values()))


@pytest.mark.parametrize("uuids, ok", [(("GPU-a", "GPU-b"), True), (("GPU-a", "GPU-a"), False)])
def test_the_two_card_worker_on_one_card_twice_fails(ready, monkeypatch, uuids, ok):
    """nvidia-smi (faked) names the UUID behind each index: the same card twice fails."""
    def nvidia_smi(cmd, **kw):
        text = ("0, %s\n1, %s\n" % uuids) if "--query-gpu=index,uuid" in cmd else "RTX 3090, 0, 10\n"
        return subprocess.CompletedProcess(cmd, 0, text, "")
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(subprocess, "run", nvidia_smi)
    cfg = ready[0].with_values(STACK_DRAFTER_TP2="1", STACK_DRAFTER_DEVICES="cuda:0,cuda:1")
    checks = {c.name: c for c in preflight.run(cfg, "offload-host")}
    assert checks["drafter tp2 devices"].ok is ok, checks["drafter tp2 devices"].detail
    assert checks["gpu cuda:0"].ok and checks["gpu cuda:1"].ok
    if not ok:
        assert "the pair needs two distinct cards" in checks["drafter tp2 devices"].detail


def test_deepseeks_pair_is_held_against_each_cards_memory(ready, tmp_path, monkeypatch):
    """STACK_DRAFTER_TP2=1 with DeepSeek's drafter: each rank's weights (its half of the
    experts, half the embedding and head, from the checkpoint's headers) plus the pair's
    working allowance against its card (nvidia-smi, faked): a 24 GiB card fits the tiny
    drafter, a 1 MiB one fails naming the rank; a CPU pair has no card to hold them against."""
    from drafter_tp2.kinds.dsv41 import card_bytes
    from remote_drafter.models.dsv41 import tiny
    folder = str(tmp_path / "dsv41")
    tiny.write_tiny(folder)
    cfg = ready[0].with_values(STACK_DRAFTER=f"dsv41:{folder}", STACK_DRAFTER_TP2="1",
                               STACK_DRAFTER_DEVICES="cpu:0,cpu:1", STACK_DRAFTER_DTYPE="bfloat16")
    ranks = card_bytes(folder, 2)
    assert len(ranks) == 2 and all(b > 0 for b in ranks)
    check = {c.name: c for c in preflight.run(cfg, "offload-host")}["drafter tp2 memory per card"]
    assert check.ok and "on the CPU" in check.detail and f"rank 0 {ranks[0] / 2**30:.1f} GiB" in check.detail
    for mib, ok in ((24576, True), (1, False)):
        def nvidia_smi(cmd, mib=mib, **kw):
            if "--query-gpu=index,memory.total" in cmd:
                return subprocess.CompletedProcess(cmd, 0, f"0, {mib}\n1, {mib}\n", "")
            text = "0, GPU-a\n1, GPU-b\n" if "--query-gpu=index,uuid" in cmd else "RTX 3090, 0, 10\n"
            return subprocess.CompletedProcess(cmd, 0, text, "")
        monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi")
        monkeypatch.setattr(subprocess, "run", nvidia_smi)
        on_cards = cfg.with_values(STACK_DRAFTER_DEVICES="cuda:0,cuda:1")
        check = {c.name: c for c in preflight.run(on_cards, "offload-host")}["drafter tp2 memory per card"]
        assert check.ok is ok, check.detail
        assert ok or "cuda:1 holds 0.0 GiB, rank 1 needs" in check.detail
        # the one-card worker (also what `rollback tp2-worker` leaves): the whole drafter on one card
        one = cfg.with_values(STACK_DRAFTER_TP2="0", STACK_DRAFTER_DEVICE="cuda:0")
        check = {c.name: c for c in preflight.run(one, "offload-host")}["drafter memory on its card"]
        whole, = card_bytes(folder, 2, 1)
        assert whole > max(ranks) and f"rank 0 {whole / 2**30:.1f} GiB" in check.detail
        assert check.ok is ok, check.detail


def test_an_engine_across_two_hosts(ready, tmp_path, capsys):
    """Rank 1 checks its own link only, and rank 0 not up yet is a WARN there (it starts
    first); rank 0 needs the master port free (it opens the rendezvous)."""
    links = f"{closed_port()},{closed_port()}"
    cfg = ready[0].with_values(STACK_TP="2", STACK_ENGINE_NODES="2", STACK_ENGINE_MASTER=closed_port(),
                               ENGRAM_REMOTE=links)
    one = {c.name: c for c in preflight.run(cfg, "engine", 1)}
    assert {n for n, c in one.items() if not c.ok} == {"link engram rank 1"}  # not rank 0's link
    assert "port engine" not in one  # a headless rank serves no API
    master = one["link engine master"]
    assert master.ok and master.warn and "expected while rank 0 is not up yet" in master.detail
    zero = {c.name: c for c in preflight.run(cfg, "engine", 0)}
    assert {n for n, c in zero.items() if not c.ok} == {"link engram rank 0"}
    assert zero["port engine master"].ok and not zero["port engine master"].warn
    with socket.socket() as s:  # rank 1 sees rank 0's rendezvous: a plain PASS
        s.bind(("127.0.0.1", 0))
        s.listen()
        up = cfg.with_values(STACK_ENGINE_MASTER="127.0.0.1:%d" % s.getsockname()[1])
        answered = {c.name: c for c in preflight.run(up, "engine", 1)}["link engine master"]
        assert answered.ok and not answered.warn
        assert "in use" in failed(up, "engine")["port engine master"]  # rank 0: taken
    env = tmp_path / "two.env"
    env.write_text("\n".join(f"{k}={v}" for k, v in cfg.with_values(ENGRAM_REMOTE=None).values.items()))
    assert main(["preflight", "--env", str(env), "--role", "engine", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "WARN  link engine master" in out and "1 warnings, 0 failed" in out


def test_an_exl3_pack_without_a_passed_gate_fails(ready, tmp_path):
    """STACK_DRAFTER_WEIGHTS=exl3: the pack's fidelity gate record must say it passed (the
    worker would refuse to start; preflight says so first)."""
    from remote_drafter.models import fidelity_gate
    cfg, _ = ready
    pack = tmp_path / "pack"
    pack.mkdir()
    cfg = StackConfig({**cfg.values, "STACK_DRAFTER": f"dsv41:{pack}", "STACK_DRAFTER_WEIGHTS": "exl3"})
    assert "no fidelity gate record" in failed(cfg, "offload-host")["exl3 gate"]
    result = {"rounds": 64, "depth": 5, "reference_accepted": 0.75, "candidate_accepted": 0.70,
              "acceptance_ratio": 0.70 / 0.75, "agreement": [1.0] * 5, "tv": 0.04, "tv_max": 0.09,
              "goal": 0.97, "passed": False}
    rounds = tmp_path / "rounds.safetensors"
    rounds.write_bytes(b"rounds")
    fidelity_gate.record(str(pack), result, "d" * 64, "r" * 64, str(rounds), None)
    assert "failed the fidelity gate" in failed(cfg, "offload-host")["exl3 gate"]
    fidelity_gate.record(str(pack), {**result, "candidate_accepted": 0.74, "acceptance_ratio": 0.74 / 0.75,
                            "passed": True}, "d" * 64, "r" * 64, str(rounds), None)
    assert "exl3 gate" not in failed(cfg, "offload-host")
    assert any(c.name == "exl3 gate" and c.ok for c in preflight.run(cfg, "offload-host"))


def test_an_exl3_pack_needs_exllamav3_installed(ready, monkeypatch):
    import importlib.util
    cfg = ready[0].with_values(STACK_DRAFTER_WEIGHTS="exl3")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "exllamav3" else real(name, *a))
    assert "pip install 'dsv41-stack[offload-host,exl3]'" in failed(cfg, "offload-host")["exllamav3"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "exllamav3" else real(name, *a))
    assert "exllamav3" not in failed(cfg, "offload-host")


def test_the_wait_named_covers_the_slower_of_the_two_figures_with_headroom():
    assert preflight.wait_for_rounds(10.0, 12.0, 0.5) == 16  # 1.25 x (12 + 0.5), rounded up
    assert preflight.wait_for_rounds(30.0, 12.0, 0.5) == 38  # the timed rounds were slower
