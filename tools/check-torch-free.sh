#!/bin/bash
# Prove the torch-free packages install alone (a plain, non-editable `pip install
# packages/<name>`) into a fresh venv that has no torch, import without it, and pass their
# own tests there. Then the engine side of remote-drafter: the package without its extras,
# its torch-free tests (its torch-side test modules skip).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_FREE=(ofl-transport longctx-bench remote-engram async-handoff acceptance-ceiling)  # in dependency order: ours are not on an index

venv=.venv-torchfree
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -U pip
for pkg in "${TORCH_FREE[@]}"; do
  OFL_BUILD_VERBS=require ASYNC_HANDOFF_BUILD=require "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    "packages/$pkg[test]" 2>&1 | grep -v "^WARNING: Location" || true
done
no_torch() {
  if "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "check-torch-free: torch got installed into $venv" >&2
    exit 1
  fi
}
no_torch
for pkg in "${TORCH_FREE[@]}"; do
  # Run from the tests folder so the package comes from site-packages, not src/.
  (cd "packages/$pkg/tests" && "../../../$venv/bin/python" -m pytest -p no:cacheprovider -q .)
done
# remote-drafter without extras (its test extra would bring the worker's torch); pytest and
# hypothesis are here from the others' test extras.
"$venv/bin/python" -m pip install -q --disable-pip-version-check packages/remote-drafter 2>&1 \
  | grep -v "^WARNING: Location" || true
no_torch
(cd packages/remote-drafter/tests && "../../../$venv/bin/python" -m pytest -p no:cacheprovider -q .)
"$venv/bin/python" - <<'PY'
import sys
import ofl  # noqa: F401
import remote_engram, remote_engram.server, remote_engram.client, remote_engram.cli  # noqa: F401,E401
import async_handoff, async_handoff.proxy, async_handoff.handoff  # noqa: F401,E401
import longctx_bench.cli, acceptance_ceiling.cli  # noqa: F401,E401
import importlib, pkgutil  # noqa: E401
import remote_drafter.engine
for info in pkgutil.iter_modules(remote_drafter.engine.__path__, "remote_drafter.engine."):
    importlib.import_module(info.name)  # the whole engine room
import remote_drafter.vllm.client_factory, remote_drafter.vllm, remote_drafter.cli  # noqa: F401,E401
import remote_drafter.worker.server, remote_drafter.models.ngram  # noqa: F401,E401
assert "torch" not in sys.modules, "a torch-free package imported torch"
print("check-torch-free: ok, no torch imported")
PY
rm -rf "$venv"  # passed: its disk back (a CI disk may be small; a failure keeps it to be read)
