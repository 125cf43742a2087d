"""Package boundaries (torch-free tier): the proxy process loads no engine-side code."""

import json
import os
import subprocess
import sys

from async_handoff import Handoff, HandoffConfig
from remote_drafter.drafters.ngram import NgramDrafter
from remote_drafter.transport import ADAPTER
from remote_drafter.worker import Worker


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
