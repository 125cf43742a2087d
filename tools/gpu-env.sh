# Sourced by every package's GPU script (benchmarks/gpu.sh), from the repository root:
#   source tools/gpu-env.sh [WHEEL_DIR]      (default .whl)
# The GPU machine has no registry, so cffi/pycparser come as Python 3.12 wheels carried in
# WHEEL_DIR, our packages from their src/ folders (PYTHONPATH), and the two C helpers
# (async-handoff's host flags, ofl's gather) are compiled in place.
# Installed once per machine (a warm machine keeps /tmp/site): reinstalling rewrites every
# file, and exllamav3's JIT-built CUDA extension then rebuilds (~5 min) on its sources' new
# modification times, though nothing changed (seen on the H200).
if ! compgen -G "${1:-.whl}/*.whl" > /dev/null; then
  echo "gpu-env.sh: no wheels in ${1:-.whl}/ (carry the folder: see the package's benchmarks/gpu.sh)" >&2
  return 1
fi
stamp=$(sha256sum "${1:-.whl}"/*.whl | sha256sum | cut -c1-16)
if [[ "$(cat /tmp/site/.wheels-stamp 2>/dev/null)" != "$stamp" ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${1:-.whl}"/*.whl && echo "$stamp" > /tmp/site/.wheels-stamp
fi
export PYTHONPATH=/tmp/site$(printf ':%s' packages/*/src)
# exllamav3's CUDA extension built on an earlier machine, where carried and fitting (tools/exl3-ext.sh)
[[ -d .exl3ext ]] && bash tools/exl3-ext.sh install /tmp/site
for builder in packages/async-handoff/src/async_handoff/_hostflags_build.py \
               packages/ofl-transport/src/ofl/_gather_build.py; do
  python3 - "$builder" <<'PY'
import importlib.util, pathlib, shutil, sys, tempfile
path = pathlib.Path(sys.argv[1])
spec = importlib.util.spec_from_file_location(path.stem, path)
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
so = pathlib.Path(mod.builder().compile(tmpdir=tempfile.mkdtemp(), verbose=False))
shutil.copy2(so, path.parent / so.name)
print("built", so.name)
PY
done
