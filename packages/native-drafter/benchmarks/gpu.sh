#!/bin/bash
# The GPU tier of native-drafter on an H200 machine, over four calls made right after each
# other (the machine stays warm ~30 s between calls; $HOME keeps what came): the SmolLM2
# GGUF and the token ids are over one call's 64 MiB, so benchmarks/xfer.sh cuts them into
# .artifacts/native-drafter/xfer0..3, one carried per call:
#   device run (carry xfer0): bash packages/native-drafter/benchmarks/gpu.sh keep
#   device run (carry xfer1): bash packages/native-drafter/benchmarks/gpu.sh keep
#   device run (carry xfer2): bash packages/native-drafter/benchmarks/gpu.sh keep
#   device run (carry xfer3): bash packages/native-drafter/benchmarks/gpu.sh run
# keep:     only keep the carried parts.
# stage:    keep, then throughput and the gate at the real shapes, random teacher (MINUTES=1).
# run:      the training run (gate, MINUTES=7 of training, gate, checkpoint) and its exact
#           evaluation (PER_CLASS=160; the measured loop does not fit the call: PROMPTS=0);
#           the checkpoint comes back in 15 MiB parts, the JSON in results.tar.
# evaluate: the committed checkpoint's evaluation, exact and measured (PER_CLASS=160,
#           PROMPTS=12, NEW_TOKENS=48).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/native-drafter-gpu}; mkdir -p "$OUT"
KEEP=$HOME/native-drafter
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20
mkdir -p "$KEEP"
for x in .artifacts/native-drafter/xfer*/; do [[ -d $x ]] && cp "$x"* "$KEEP"/; done
ls -la "$KEEP"
[[ ${1:-run} == keep ]] && exit 0
source tools/gpu-env.sh "$KEEP"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [[ $1 == stage ]]; then
  python3 -m pytest -q -p no:cacheprovider packages/native-drafter/tests/test_training_gate.py -k cuda 2>&1 | tail -3
  python3 packages/native-drafter/benchmarks/throughput.py --minutes "${MINUTES:-1}" \
    --out "$OUT/throughput.json" 2>&1 | tee "$OUT/stage.log"
  exit 0
fi
cat "$KEEP"/gguf.part* > /tmp/smollm2.gguf
(cd /tmp && sha256sum -c "$KEEP/gguf.sha256") || { echo "GGUF parts missing or wrong (the machine went cold?): start again with xfer0" >&2; exit 3; }
mkdir -p /tmp/tokens
python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" \
  "$KEEP/train.npz.xz" /tmp/tokens/train.npz
cp "$KEEP/validation.npz" "$KEEP/tokens.json" /tmp/tokens/
evaluate() {  # checkpoint, out json, measured prompts per class
  python3 -m native_drafter.cli evaluate --checkpoint "$1" --gguf /tmp/smollm2.gguf --tokens /tmp/tokens \
    --device cuda --per-class "${PER_CLASS:-160}" --measured-prompts "${PROMPTS:-$3}" \
    --new-tokens "${NEW_TOKENS:-48}" --out "$2"
}
rc=0
if [[ $1 == evaluate ]]; then
  evaluate packages/native-drafter/checkpoints/smollm2-135m-dspark "$OUT/eval.json" 12 2>&1 | tee "$OUT/eval.log" || rc=$?
  exit $rc
fi
python3 -m native_drafter.cli train --gguf /tmp/smollm2.gguf --tokens /tmp/tokens \
  --identity "$KEEP/identity.json" --out /tmp/run --minutes "${MINUTES:-7}" --device cuda \
  2>&1 | tee "$OUT/train.log" || rc=$?
if [[ -f /tmp/run/checkpoint/drafter.safetensors ]]; then
  evaluate /tmp/run/checkpoint /tmp/run/eval.json 0 2>&1 | tee "$OUT/eval.log" || rc=$?
  split -b 15M -d -a 1 /tmp/run/checkpoint/drafter.safetensors "$OUT/drafter.safetensors.part"
fi
tar -C /tmp/run -cf "$OUT/results.tar" --exclude='*.safetensors' .
exit $rc
