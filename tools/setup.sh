#!/bin/bash
# Create or update the development environment: the Debian packages the tests need, and
# .venv/ with every package of the monorepo installed in editable mode. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages: verbs headers/library for the C helper; QEMU, a stock kernel, busybox
# and rdma-core for the soft-RoCE tier; the aarch64 cross compiler and qemu-user for the
# Sparks' architecture; iproute2 for network-namespace tests.
APT_PACKAGES=(
  build-essential libibverbs-dev rdma-core ibverbs-providers ibverbs-utils python3-pyverbs
  qemu-system-x86 linux-image-amd64 busybox-static kmod cpio iproute2
  gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: missing Debian packages (run as root or install them): ${missing[*]}" >&2
    exit 1
  fi
  echo "setup: installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The root environment: every package editable, with its test extras. torch==2.13.0 is
# the CPU build that lies on these machines (a bare `torch` would pull a CUDA build).
[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -U pip
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 2>&1 \
  | grep -v "^WARNING: Location" || true
specs=(ruff)
for pkg in packages/*/ stack/; do
  [[ -f $pkg/pyproject.toml ]] && specs+=(-e "${pkg%/}[test]")
done
OFL_BUILD_VERBS=require ASYNC_HANDOFF_BUILD=require .venv/bin/python -m pip install -q --disable-pip-version-check \
  "${specs[@]}" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import ofl._verbs_cffi" || { echo "setup: the verbs helper did not build" >&2; exit 1; }
echo "setup: .venv ready ($(.venv/bin/python --version))"
