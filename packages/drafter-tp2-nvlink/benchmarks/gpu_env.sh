# Sourced by benchmarks/gpu.sh: the GPU machine has no registry, so cffi/pycparser come as
# wheels carried in .whl/ (python 3.12), our packages from their src/ folders, and the two C
# helpers (async-handoff's host flags, ofl's gather) are compiled in place. The same steps
# as packages/remote-drafter/benchmarks/gpu.sh, which could source this file too.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site$(printf ':%s' packages/*/src)
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
