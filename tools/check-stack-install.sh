#!/bin/bash
# `pip install ./stack` on a fresh venv installs the whole stack (its base: the engine hosts'
# and the offload host's extras add vLLM or torch): our packages are not on an index, so they
# are built into a wheelhouse first and found with --find-links, as stack/README.md says.
# Then the installed launcher runs from outside the repository, with its packaged templates.
set -euo pipefail
cd "$(dirname "$0")/.."
house=.artifacts/wheelhouse venv=.venv-stack
rm -rf "$house" "$venv"
for p in packages/*/ stack/; do
  OFL_BUILD_VERBS=require ASYNC_HANDOFF_BUILD=require .venv/bin/python -m pip wheel -q \
    --disable-pip-version-check --no-deps -w "$house" "$p" 2>&1 | grep -v "^WARNING: Location" || true
done
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --find-links "$house" ./stack 2>&1 \
  | grep -v "^WARNING: Location" || true
cd /tmp
"$OLDPWD/$venv/bin/dsv41-stack" template local > stack-local.env
# read whole, then searched: `| grep -q` under pipefail fails when grep closes the pipe first
offload_host=$("$OLDPWD/$venv/bin/dsv41-stack" args --env stack-local.env --role offload-host)
grep -q "remote_engram.cli serve" <<<"$offload_host"
"$OLDPWD/$venv/bin/python" -c "import dsv41_stack, ofl, remote_engram, async_handoff, longctx_bench, acceptance_ceiling"
"$OLDPWD/$venv/bin/python" -c "import torch" 2>/dev/null && { echo "the base stack pulled torch" >&2; exit 1; }
echo "stack installed alone: $("$OLDPWD/$venv/bin/python" -m pip list 2>/dev/null | grep -c -i dsv41) dsv41 packages, launcher and templates work"
rm -rf "$OLDPWD/$venv" "$OLDPWD/$house" stack-local.env  # passed: disk back (a failure keeps them)
