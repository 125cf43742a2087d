#!/bin/bash
# The GPU tier of drafter-tp2-nvlink, in one call on an nvidia-h200-x2 machine (the whole
# tier) or an nvidia-h200 (its one-GPU half):
#   device run (kind nvidia-h200-x2, carry .whl): bash packages/drafter-tp2-nvlink/benchmarks/gpu.sh
# 1. the package's tests under that torch: CPU tiers plus tests/test_tp2_gpu.py (one GPU:
#    graph capture on an owned stream, the card's UUID lock against both kinds of worker, the
#    same GPU twice; two GPUs: pair check, P2P status, TP2 vs one-card drafts on CUDA);
# 2. benchmarks/gpu_tp2.py: one-card vs TP2 (graphs, eager) round latency at batch 1/4/16 at
#    the SmolLM2 width and a production-like width, memory per card, parity, the fault drill
#    (one GPU: the one-card half).
# Writes pytest.txt, tp2.json and tp2.txt under $OUT (WIDTHS=smollm2 or large splits the run
# over two calls if one passes its 10 minutes). The two-GPU half has not run yet.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/drafter-tp2-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source tools/gpu-env.sh .whl
nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m | tee "$OUT/topo.txt"
if [[ -n ${ONLY_DSV41:-} ]]; then  # ONLY_DSV41=1 (one GPU): DeepSeek's drafter split by
  # experts, each rank's shard alone at the Flash width (dsv41_rank_gpu.py)
  python3 packages/drafter-tp2-nvlink/benchmarks/dsv41_rank_gpu.py --out "$OUT/dsv41-rank.json" 2>&1 | tee "$OUT/dsv41-rank.txt"
  exit
fi
# SKIP_TESTS=1: only the measurements; TESTS=PATHS: those tests only
if [[ -z ${SKIP_TESTS:-} ]]; then
  echo "== drafter-tp2 tests under this torch (CPU tiers + the GPU tests)"
  python3 -m pytest -q -p no:cacheprovider -rs ${TESTS:-packages/drafter-tp2-nvlink/tests} 2>&1 | tail -12 | tee "$OUT/pytest.txt"
fi
echo "== one-card vs TP2 rounds, memory, parity, fault drill"
python3 packages/drafter-tp2-nvlink/benchmarks/gpu_tp2.py --rounds "${ROUNDS:-100}" --widths "${WIDTHS:-smollm2,large}" \
  --out "$OUT/tp2.json" | tee "$OUT/tp2.txt"
