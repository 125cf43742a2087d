#!/bin/bash
# exllamav3's CUDA extension, built once on a GPU machine and carried to later ones, so a call
# that times EXL3 spends its minutes on the timing and not on the extension's build (4-5 min).
#
#   device run (carry .whl):  bash tools/exl3-ext.sh pack   -> $OUT/exl3ext.json, $OUT/exl3ext.so.xz.*
#   here, from the reply's files_at:  mkdir -p .exl3ext && cp <files_at>/exl3ext.* .exl3ext/
#   later calls: carry .exl3ext beside .whl; tools/gpu-env.sh installs it where it fits
#   here or there:            bash tools/exl3-ext.sh check  (does the carried build fit this machine?)
#
# A build fits a machine whose torch, CUDA and Python are those it was built against and whose
# GPU it was compiled for (exl3ext.json records them); anything else builds its own, as before.
set -uo pipefail
cd "$(dirname "$0")/.."
EXT=.exl3ext

machine() {  # this machine as a build records it: torch, CUDA, Python, the GPU's architecture
  python3 -c 'import json, sys, torch
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
                  "arch": "%d.%d" % torch.cuda.get_device_capability() if torch.cuda.is_available() else None}))'
}

fits() {  # exit 0 when $EXT's build fits this machine; the reason on stderr when not
  [[ -f $EXT/exl3ext.json ]] || { echo "exl3-ext: no carried build to use (no $EXT/exl3ext.json)" >&2; return 1; }
  here=$(machine 2>/dev/null) || { echo "exl3-ext: no carried build to use (no torch here)" >&2; return 1; }
  python3 - "$EXT/exl3ext.json" "$here" <<'PY'
import json, sys
with open(sys.argv[1]) as f:
    built = json.load(f)
differ = {k: (built.get(k), v) for k, v in json.loads(sys.argv[2]).items() if built.get(k) != v}
if differ:
    sys.exit("exl3-ext: the carried build does not fit this machine (built, here): " +
             ", ".join(f"{k} {b} / {h}" for k, (b, h) in differ.items()))
PY
}

case ${1:-} in
  pack)
    source tools/gpu-env.sh "${GPU_WHEELS:-.whl}" > /dev/null || exit 3
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
    python3 -c "from remote_drafter.models import exl3; exl3.load_exllamav3(print)" || exit 3
    so=$(python3 -c "from exllamav3.ext import exllamav3_ext as e; print(e.__file__)" | tail -n 1) || exit 3
    machine > "${OUT:?}/exl3ext.json" || exit 3
    # parts under the 16 MiB a file that comes back from the device machine
    xz -T8 -6 -c "$so" | split -b 15M - "$OUT/exl3ext.so.xz." || exit 3
    ls -la "$OUT"; cat "$OUT/exl3ext.json" ;;
  check)
    fits && echo "exl3-ext: the carried build fits this machine" ;;
  install)  # tools/gpu-env.sh: into $2 (on the path), once
    [[ -f $2/exllamav3_ext.so ]] && exit 0
    fits || exit 0
    cat $(ls "$EXT"/exl3ext.so.xz.* | sort) | xz -dc > "$2/exllamav3_ext.so.partial" \
      && mv "$2/exllamav3_ext.so.partial" "$2/exllamav3_ext.so" || { rm -f "$2"/exllamav3_ext.so*; exit 0; }
    # it must load beside this torch, else exllamav3 would fail where it would have built its own
    if ! PYTHONPATH="$2" python3 -c "import torch, exllamav3_ext" 2> "$2/exllamav3_ext.err"; then
      echo "exl3-ext: the carried build does not load here ($(tail -n 1 "$2/exllamav3_ext.err")): exllamav3 builds its own" >&2
      rm -f "$2/exllamav3_ext.so" "$2/exllamav3_ext.err"; exit 0
    fi
    echo "exl3-ext: exllamav3's extension from $EXT installed (no build)" ;;
  *)
    sed -n 2,11p "$0"; exit 2 ;;
esac
