"""Package boundaries (torch-free tier): the proxy process loads no engine-side code, local
mode serves the n-gram drafter without torch, and a neural drafter or the worker names the
extra it needs. The static rules (declared dependencies, no cycle, which modules are torch
side) are tests/test_import_graph.py's."""

import json
import os
import subprocess
import sys

from async_handoff import Handoff, HandoffConfig
from remote_drafter.engine.transport import ADAPTER
from remote_drafter.models.ngram import NgramDrafter
from remote_drafter.worker.server import Worker

NO_TORCH = ("import sys\n"
            "sys.modules['torch'] = sys.modules['safetensors'] = None  # importing them fails\n")


def python(code: str, env: dict | None = None) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_proxy_loads_no_engine_side_code():
    """The proxy the engine starts for async rounds, with the drafter's adapter connected to a
    worker: beyond what the interpreter loads at start-up, it imports ofl (and its numpy and
    cffi), async_handoff and remote_drafter (and the protocol's ml_dtypes), nothing else (no prometheus_client: neither the
    Handoff nor the client, transport or metrics modules)."""
    at_startup = set(json.loads(python(
        "import json, sys; print(json.dumps([m.partition('.')[0] for m in sys.modules]))")))
    worker = Worker(NgramDrafter(vocab_size=96)).start()
    handoff = Handoff(HandoffConfig(startup_timeout_s=60), ADAPTER,
                      {"address": worker.address, "identity": "boundary-test",
                       "expect": worker.service.manifest.to_json()}).start()
    try:
        assert handoff.enabled, handoff.proxy_status
        loaded = set(handoff.proxy_status["imports"]) - at_startup
    finally:
        handoff.close()
        worker.stop()
    assert loaded == {"_cffi_backend", "numpy", "ml_dtypes", "ofl", "async_handoff", "remote_drafter"}


def test_the_proxy_side_of_each_package():
    """What the proxy imports of async_handoff and remote_drafter, module by module: the
    host flags and the adapter's protocol-only modules."""
    ours = json.loads(python(
        "import json, sys\n"
        "import async_handoff.hostflags\n"
        "from async_handoff.proxy import load_adapter\n"
        "load_adapter('remote_drafter.engine.proxy_adapter:DrafterProxyAdapter', {'address': '127.0.0.1:1'})\n"
        "print(json.dumps(sorted(m for m in sys.modules\n"
        "                        if m.partition('.')[0] in ('async_handoff', 'remote_drafter'))))"))
    assert set(ours) == {
        "async_handoff", "async_handoff.proxy", "async_handoff.hostflags", "async_handoff._hostflags",
        "async_handoff._hostflags.lib", "async_handoff.adapters", "async_handoff.env",
        "remote_drafter", "remote_drafter.engine", "remote_drafter.engine.proxy_adapter", "remote_drafter.engine.identity", "remote_drafter.engine.protocol",
        "remote_drafter.engine.rows"}


def test_local_mode_serves_ngram_without_torch_and_names_the_extra_for_neural_drafters(tmp_path):
    ngram = python(NO_TORCH + (
        "from remote_drafter.vllm.client_factory import make_client\n"
        "client = make_client()\n"
        "client.add_request(1, [1, 2, 3, 1, 2])\n"
        "print(client.propose()[1].tokens.tolist())"), {"REMOTE_DRAFTER_DRAFTER": "ngram"})
    assert json.loads(ngram) == [3, 1, 2]  # what followed the earlier [1, 2]
    refused = python(NO_TORCH + (
        "from remote_drafter.models.registry import WorkerExtraMissing\n"
        "from remote_drafter.vllm.client_factory import make_client\n"
        "try:\n"
        "    make_client()\n"
        "except WorkerExtraMissing as exc:\n"
        "    print(exc)"), {"REMOTE_DRAFTER_DRAFTER": str(tmp_path)})  # a checkpoint folder
    assert "remote_drafter.models.dspark needs torch" in refused
    assert "pip install 'dsv41-remote-drafter[worker]'" in refused


def test_the_cli_names_the_extra_in_one_line_without_torch():
    done = subprocess.run([sys.executable, "-c", NO_TORCH + (
        "from remote_drafter.cli import main\n"
        "sys.exit(main(['worker', '--drafter', 'ngram']))")], capture_output=True, text=True,
        timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("remote-drafter worker: the worker needs torch")
    assert "pip install 'dsv41-remote-drafter[worker]'" in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
