#!/bin/bash
# The native kernels on an H200: the gate (random cases at batch 1/4/16 x width 3/5/8 and
# the trained checkpoint on 16 real states), the worker with --kernels native against
# --kernels torch on those states, then round latency for every variant and the bandwidth
# floor; a table last, JSON and logs under $OUT.
#
# The target's embedding (56.6 MB as bf16) and the states do not fit one call beside the
# committed checkpoint, so they travel in two calls made right after each other (the
# machine stays warm ~30 s; $HOME keeps what came). Here, once (the corpus and its token ids
# first, if .artifacts/corpus/tokens is missing: `native-drafter corpus`, then `native-drafter
# tokens --target .artifacts/smollm2-135m`, about a minute):
#   .venv/bin/native-drafter states --checkpoint packages/native-drafter/checkpoints/smollm2-135m-dspark \
#       --target .artifacts/smollm2-135m --out .artifacts/native-drafter/kernels/states.pt
#   .venv/bin/python packages/native-drafter/benchmarks/kernels.py pack     # -> .artifacts/native-drafter/kx0, kx1
# then:
#   device run (carry .artifacts/native-drafter/kx0): bash packages/native-drafter/benchmarks/kernels.sh keep
#   device run (carry .artifacts/native-drafter/kx1): bash packages/native-drafter/benchmarks/kernels.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/native-kernels}; mkdir -p "$OUT"
KEEP=$HOME/native-kernels; mkdir -p "$KEEP"
for x in .artifacts/native-drafter/kx*/; do [[ -d $x ]] && cp "$x"* "$KEEP"/; done
if [[ ${1:-run} == keep ]]; then ls -la "$KEEP"; exit 0; fi
source tools/gpu-env.sh "$KEEP" || exit 3
export PYTHONUNBUFFERED=1 NATIVE_DRAFTER_STATE=/tmp/nk/state
nvidia-smi --query-gpu=name,uuid,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
B=packages/native-drafter/benchmarks/kernels.py
CK=/tmp/nk/drafter; T=/tmp/nk/target; S=$KEEP/states.pt
python3 $B unpack --keep "$KEEP" --checkpoint packages/native-drafter/checkpoints/smollm2-135m-dspark --out /tmp/nk || exit 3
rc=0
PHASES=${PHASES:-gate,worker,latency}   # the gate always runs: the worker needs its pass
timeout ${GATE_S:-300} python3 -m native_drafter.cli gate --checkpoint $CK --target $T --states $S --device cuda \
  --out "$OUT/gate.json" 2>&1 | tee "$OUT/gate.log" || rc=$?
[[ $PHASES == *worker* ]] && { timeout ${WORKER_S:-300} python3 $B worker --checkpoint $CK --target $T --states $S \
  --device cuda:0 --out "$OUT/worker.json" 2>&1 | tee "$OUT/worker.log" || rc=$?; }
[[ $PHASES == *latency* ]] && { timeout ${LATENCY_S:-600} python3 $B latency --checkpoint $CK --target $T --device cuda \
  --compile-budget-s ${COMPILE_BUDGET_S:-240} --rep ${REP_MS:-200} --out "$OUT/latency.json" 2>&1 | tee "$OUT/latency.log" || rc=$?; }
echo "== gate"; tail -n 27 "$OUT/gate.log"; [[ -f $OUT/worker.log ]] && { echo "== worker"; tail -n 1 "$OUT/worker.log"; }
exit $rc
