#!/bin/bash
# The soft-RoCE tier: boot the guest (tools/softroce/run.sh) and run the verbs backend's
# real tests there with the repository's .venv. Debian's pyverbs is added alone to the
# path (its dist-packages folder also holds an older cffi that would shadow the venv's).
# The guest emulates its CPU (TCG): only the modules that hold soft-RoCE tests are collected
# there (collecting every package's tests took most of the guest's time). Connections get
# 30 s instead of ofl's 3 s: at emulated speed the first HELLO can meet a server still cold
# (seen: the first test's connect timed out once collection stopped warming the guest).
set -euo pipefail
cd "$(dirname "$0")/../.."
mapfile -t modules < <(grep -l "pytest.mark.softroce" packages/*/tests/test_*.py)
exec tools/softroce/run.sh --timeout "${SOFTROCE_TIMEOUT:-420}" -- bash -c '
  mkdir -p /tmp/pyverbs-only && ln -sf /usr/lib/python3/dist-packages/pyverbs /tmp/pyverbs-only/
  PYTHONPATH=/tmp/pyverbs-only OFL_CONNECT_TIMEOUT_MS=${OFL_CONNECT_TIMEOUT_MS:-30000} exec .venv/bin/python -m pytest -p no:cacheprovider -q --color=no \
    -m softroce "$@"' verbs-tests "${modules[@]}" "$@"
