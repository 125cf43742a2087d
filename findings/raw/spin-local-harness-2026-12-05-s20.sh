#!/bin/bash
# Session 20's trial: with --spin-us, worker_cost.py's in-process figure (no link at all) ran
# up to 1.8x faster on an H100 machine's host. Which part of the spin does that: worker_cost.py
# with --spin-us 20000, against a thread of the same process looping on zero-timeout select()
# (system calls, the GIL released in each), against neither; in turn, a line each as it ends.
# The thread runs in the client's process only: worker_cost.py's own worker process (its
# tcp_process row) is a fresh interpreter without it.
# From the repository root on the device: bash findings/raw/spin-local-harness-2026-12-05-s20.sh
set -euo pipefail
OUT=${OUT:-/tmp/spin-local}; mkdir -p "$OUT"
source tools/gpu-env.sh "${GPU_WHEELS:-.whl-small}" > /dev/null 2>&1
args="--batches 16 --rounds 60 --row-dtypes bfloat16 --ages in_service"
for pass in 1 2; do
  for side in spin thread none; do
    case $side in
      spin) cmd=(python3 packages/remote-drafter/benchmarks/worker_cost.py $args --spin-us 20000) ;;
      none) cmd=(python3 packages/remote-drafter/benchmarks/worker_cost.py $args) ;;
      thread) cmd=(python3 -c "import runpy, select, sys, threading
def loop():
    while True:
        select.select([], [], [], 0)
threading.Thread(target=loop, daemon=True).start()
sys.argv = ['worker_cost.py', *sys.argv[1:]]
runpy.run_path('packages/remote-drafter/benchmarks/worker_cost.py', run_name='__main__')" $args) ;;
    esac
    "${cmd[@]}" --out "$OUT/worker-cost-$side-$pass.json" 2>&1 | grep "^bfloat16 rows.*in_service" \
      | sed "s/^/$side, pass $pass: /" | tee -a "$OUT/lines.txt"
  done
done
