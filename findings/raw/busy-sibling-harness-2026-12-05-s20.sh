#!/bin/bash
# Session 20's trial: is the stub's own cost on a GPU machine's host a property of how busy its
# CPUs are? worker_cost.py at batch 16 (bf16 rows, requests in service), alone and beside a
# sibling process that keeps one core busy: a pure Python loop (no system calls) or a loop of
# zero-timeout select() calls (a system call each, as the link's spinning waits make), in turn.
# From the repository root on the device: bash findings/raw/busy-sibling-harness-2026-12-05-s20.sh
set -euo pipefail
OUT=${OUT:-/tmp/busy-sibling}; mkdir -p "$OUT"
source tools/gpu-env.sh "${GPU_WHEELS:-.whl-small}" > /dev/null 2>&1
pid=
trap '[[ -n $pid ]] && kill "$pid"' EXIT  # a failed run must not leave a sibling spinning
for pass in 1 2; do
  for sibling in none python select; do
    case $sibling in
      none) pid= ;;
      python) python3 -c "while True: pass" & pid=$! ;;
      select) python3 -c "import select
while True: select.select([], [], [], 0)" & pid=$! ;;
    esac
    python3 packages/remote-drafter/benchmarks/worker_cost.py --batches 16 --rounds 60 --row-dtypes bfloat16 \
      --ages in_service --out "$OUT/worker-cost-sibling-$sibling-$pass.json" 2>&1 | grep "^bfloat16 rows.*in_service" \
      | sed "s/^/$sibling, pass $pass: /"
    [[ -n $pid ]] && kill "$pid"
    pid=
  done
done
