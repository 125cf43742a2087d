#!/bin/bash
# The GPU tier of native-drafter on an H200 machine, in two calls: the SmolLM2 GGUF (94 MiB)
# is over one call's 64 MiB, so it travels in two parts kept in $HOME while the machine is
# warm. Make the parts with benchmarks/xfer.sh stage|run, then, right after each other:
#   device run --carry .artifacts/native-drafter/xfer: bash packages/native-drafter/benchmarks/gpu.sh stage
#   device run --carry .artifacts/native-drafter/xfer: bash packages/native-drafter/benchmarks/gpu.sh run
# stage: throughput and the gate at the real shapes with a random teacher (MINUTES=1).
# run:   the training run (gate, MINUTES=5.5 of training, gate, checkpoint), then the
#        evaluation; the checkpoint comes back in two parts (16 MiB per file), the JSON in
#        results.tar.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/native-drafter-gpu}; mkdir -p "$OUT"
XFER=.artifacts/native-drafter/xfer
KEEP=$HOME/native-drafter
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20
mkdir -p "$KEEP"; cp "$XFER"/* "$KEEP"/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$KEEP"/*.whl
export PYTHONPATH=/tmp/site$(printf ':%s' packages/*/src)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
case ${1:-run} in
stage)
  python3 packages/native-drafter/benchmarks/throughput.py --minutes "${MINUTES:-1}" \
    --out "$OUT/throughput.json" 2>&1 | tee "$OUT/stage.log"
  ;;
run)
  cat "$KEEP"/gguf.part0 "$KEEP"/gguf.part1 > /tmp/smollm2.gguf
  (cd /tmp && sha256sum -c "$KEEP/gguf.sha256") || { echo "GGUF parts missing or wrong (machine went cold?): run stage again" >&2; exit 3; }
  mkdir -p /tmp/tokens
  python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" \
    "$KEEP/train.npz.xz" /tmp/tokens/train.npz
  cp "$KEEP/validation.npz" "$KEEP/tokens.json" /tmp/tokens/
  (cd /tmp/tokens && sha256sum train.npz validation.npz)
  # the reference loop's client imports the host-flags helper (cffi, built here as remote-drafter's gpu.sh does)
  for builder in packages/async-handoff/src/async_handoff/_hostflags_build.py packages/ofl-transport/src/ofl/_gather_build.py; do
    python3 - "$builder" <<'PY'
import importlib.util, pathlib, shutil, sys, tempfile
path = pathlib.Path(sys.argv[1])
spec = importlib.util.spec_from_file_location(path.stem, path)
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
so = pathlib.Path(mod.builder().compile(tmpdir=tempfile.mkdtemp(), verbose=False))
shutil.copy2(so, path.parent / so.name)
PY
  done
  rc=0
  python3 -m native_drafter.cli train --gguf /tmp/smollm2.gguf --tokens /tmp/tokens \
    --identity "$KEEP/identity.json" --out /tmp/run --minutes "${MINUTES:-5.5}" --device cuda \
    2>&1 | tee "$OUT/train.log" || rc=$?
  if [[ -f /tmp/run/checkpoint/drafter.safetensors ]]; then
    python3 -m native_drafter.cli evaluate --checkpoint /tmp/run/checkpoint --gguf /tmp/smollm2.gguf \
      --tokens /tmp/tokens --device cuda --per-class "${PER_CLASS:-48}" --measured-prompts "${PROMPTS:-8}" \
      --out /tmp/run/eval.json 2>&1 | tee "$OUT/eval.log" || rc=$?
    split -b 15M -d -a 1 /tmp/run/checkpoint/drafter.safetensors "$OUT/drafter.safetensors.part"
  fi
  tar -C /tmp/run -cf "$OUT/results.tar" --exclude='*.safetensors' .
  exit $rc
  ;;
esac
