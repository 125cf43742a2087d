#!/bin/bash
# Session 22's device call: the window's attention as one kernel (kernels.attend), its GPU
# tests, then the bf16 Flash round (drafter_round.py --variants bf16: no exllamav3) by this
# tree and by BEFORE's sources (2c8b2e5), each in a process of its own. From the repository
# root, carry .whl-small and .before4, made by
#   mkdir -p .before4 && git archive 2c8b2e5 packages/remote-drafter/src packages/ofl-transport/src | tar -x -C .before4
# then (about 3 minutes on the GPU machine, not yet run: session 22 had no device time left):
#   BEFORE=.before4 bash findings/raw/round-attention-before-after-2026-12-05-s22.sh
set -uo pipefail
OUT=${OUT:-/tmp/s22}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source tools/gpu-env.sh .whl-small > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
path() { if [[ $1 == before ]]; then printf '%s:' "$BEFORE"/packages/*/src; fi; printf '%s' "$PYTHONPATH"; }
for so in packages/*/src/*/_*_cffi*.so; do [[ -d $BEFORE/$(dirname "$so") ]] && cp "$so" "$BEFORE/$so"; done
timeout 50 python3 -m pytest -q -p no:cacheprovider packages/remote-drafter/tests/test_dsv41_kernels.py \
  > "$OUT/gpu-pytest.txt" 2>&1; tail -3 "$OUT/gpu-pytest.txt"
for side in after before; do
  echo "== bf16 round, $side, at $SECONDS s"
  PYTHONPATH=$(path $side) timeout 70 python3 packages/remote-drafter/benchmarks/drafter_round.py --variants bf16 \
    --out "$OUT/round-bf16-$side.json" 2>&1 | grep "batch\|==" | head -8
done
echo "== done at $SECONDS s"
