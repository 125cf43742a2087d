"""The import graph of the monorepo's distributions, read statically from every module under
packages/*/src and stack/src, and from every package's benchmarks/ and tests/
(ARCHITECTURE.md § Dependencies says why each rule holds):

* ofl is the bottom: it imports none of our packages;
* nothing imports the stack; no cycle between distributions (lazy imports count);
* a distribution's modules, benchmarks and tests import only the distributions its
  pyproject declares (base or an extra);
* only `*.vllm` modules import vLLM; only `remote_drafter.models.exl3` imports exllamav3,
  lazily;
* remote_drafter's rooms, bottom to top `env`, `engine/`, `models/`, `worker/`, `vllm/`, the
  front doors (cli, bench, testing, decode_loop): each imports only rooms below it, lazily
  too; `engine/` imports no torch, not even lazily or through what it imports;
* the torch-free distributions import no torch, directly or through any module's top-level
  imports (a lazy import inside a function is how a torch-free module reaches an optional
  torch-side feature); their `vllm` modules run inside vLLM and are exempt.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH_FREE = {"ofl", "async_handoff", "longctx_bench", "acceptance_ceiling", "remote_engram",
              "dsv41_stack"}
# remote_drafter's rooms, bottom first: a room imports only the rooms below it. `env` (every
# variable) is below them all; the front doors at the top (cli, bench, testing, decode_loop)
# are above them all.
ROOMS = ("env", "engine", "models", "worker", "vllm", "front")
TORCH_FREE_ROOMS = {"remote_drafter.engine"}


@dataclass
class Module:
    path: Path
    dist: str                     # the import name of the distribution it belongs to
    kind: str                     # "src", "benchmarks" or "tests"
    imports: list[tuple[str, bool]] = field(default_factory=list)  # (module, at top level?)


def distributions() -> dict[str, dict]:
    """import name -> {"root": src package, "folder": its distribution's folder,
    "declares": import names of our packages it lists}."""
    found = {}
    for pyproject in [*ROOT.glob("packages/*/pyproject.toml"), ROOT / "stack/pyproject.toml"]:
        meta = tomllib.loads(pyproject.read_text())["project"]
        (src,) = [p for p in (pyproject.parent / "src").iterdir() if (p / "__init__.py").exists()]
        requirements = list(meta.get("dependencies", []))
        for extra in meta.get("optional-dependencies", {}).values():
            requirements += extra
        found[src.name] = {"root": src, "folder": pyproject.parent, "dist": meta["name"],
                           "requires": {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].strip().lower()
                                        for r in requirements}}
    by_dist = {info["dist"].lower(): name for name, info in found.items()}
    for info in found.values():
        info["declares"] = {by_dist[r] for r in info["requires"] if r in by_dist}
    return found


DISTS = distributions()


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_imports(path: Path, package: str) -> list[tuple[str, bool]]:
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    for node in tree.body:  # a try/if at module level still runs at import
        if isinstance(node, (ast.Try, ast.If)):
            top |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.append((target, id(node) in top))
            found += [(f"{target}.{a.name}", id(node) in top) for a in node.names]
    return found


@cache
def modules() -> dict[str, Module]:
    """Every module of ours: src modules by dotted name, benchmarks and tests by path."""
    table = {}
    for dist, info in DISTS.items():
        for path in info["root"].rglob("*.py"):
            name = module_name(path, info["root"])
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            table[name] = Module(path, dist, "src", read_imports(path, package))
        for kind in ("benchmarks", "tests"):
            for path in (info["folder"] / kind).rglob("*.py"):
                table[str(path.relative_to(ROOT))] = Module(path, dist, kind, read_imports(path, ""))
    return table


def dist_of(module: str) -> str | None:
    head = module.split(".")[0]
    return head if head in DISTS else None


def known(module: str) -> str | None:
    """The nearest of our source modules: the module itself, or its package when
    `from pkg import name` named an attribute or a built extension (cffi)."""
    while module and module not in modules():
        module = module.rpartition(".")[0]
    return module or None


def where(module: str) -> str:
    return str(modules()[module].path.relative_to(ROOT))


def cross_imports(kinds=("src", "benchmarks", "tests")):
    for name, m in modules().items():
        if m.kind in kinds:
            for target, at_top in m.imports:
                dst = dist_of(target)
                if dst and dst != m.dist:
                    yield name, target, at_top


def room_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "remote_drafter":
        return None
    return parts[1] if parts[1] in ROOMS else "front"


def test_ofl_is_the_bottom():
    bad = [f"{where(m)}: {t}" for m, t, _ in cross_imports() if modules()[m].dist == "ofl"]
    assert not bad, bad


def test_nothing_imports_the_stack():
    bad = [f"{where(m)}: {t}" for m, t, _ in cross_imports() if dist_of(t) == "dsv41_stack"]
    assert not bad, bad


def test_every_import_of_ours_is_declared():
    """Benchmarks and tests too: what they import must install with their distribution."""
    bad = sorted({f"{where(m)} imports {dist_of(t)}: add {DISTS[dist_of(t)]['dist']} to "
                  f"{DISTS[modules()[m].dist]['dist']}'s pyproject (an extra will do)"
                  for m, t, _ in cross_imports()
                  if dist_of(t) not in DISTS[modules()[m].dist]["declares"]})
    assert not bad, "\n".join(bad)


def test_no_cycle_between_distributions():
    edges: dict[str, set[str]] = {d: set() for d in DISTS}
    for m, t, _ in cross_imports():
        edges[modules()[m].dist].add(dist_of(t))
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for d in sorted(DISTS):
        if d not in state:
            cycle = visit(d, [])
            assert cycle is None, " -> ".join(cycle)


def test_only_vllm_modules_import_vllm():
    bad = [f"{where(name)}: {t}" for name, m in modules().items() if m.kind == "src"
           for t, _ in m.imports if t.split(".")[0] == "vllm" and "vllm" not in name.split(".")]
    assert not bad, bad


def test_only_the_exl3_module_imports_exllamav3_and_lazily():
    found = [(name, at_top) for name, m in modules().items() if m.kind == "src"
             for t, at_top in m.imports if t.split(".")[0] == "exllamav3"]
    assert found, "remote_drafter.models.exl3 imports exllamav3 (the rule reads nothing)"
    bad = [f"{where(name)}{' (at top level)' if at_top else ''}" for name, at_top in found
           if name != "remote_drafter.models.exl3" or at_top]
    assert not bad, bad


def test_remote_drafter_rooms_import_only_rooms_below_them():
    """Lazy imports count: a room that reaches up at run time still depends on it."""
    bad = []
    for name, m in modules().items():
        mine = room_of(name)
        if m.kind != "src" or mine is None:
            continue
        for target, _ in m.imports:
            theirs = room_of(target)
            if theirs and ROOMS.index(theirs) > ROOMS.index(mine):
                bad.append(f"{where(name)} ({mine}/) imports {target} ({theirs}/)")
    assert not bad, "\n".join(bad)


def torch_chains(module: str, top_level_only: bool) -> list[str]:
    """Every import chain from `module` through our modules (any distribution) that ends in
    torch; lazy imports inside functions followed too unless `top_level_only`."""
    bad, seen, stack, chain = [], {module}, [module], {module: [module]}
    while stack:
        current = stack.pop()
        for target, at_top in modules()[current].imports:
            if top_level_only and not at_top:
                continue
            if target.split(".")[0] == "torch":
                bad.append(" -> ".join(chain[current] + [target]))
                continue
            nxt = known(target) if dist_of(target) else None
            if nxt and nxt not in seen:
                seen.add(nxt)
                chain[nxt] = chain[current] + [nxt]
                stack.append(nxt)
    return bad


def test_the_engine_room_imports_no_torch_at_all():
    """Not even lazily, and not through any module it imports (ours, of any distribution)."""
    bad = [c for n in sorted(modules()) if any(n == r or n.startswith(r + ".") for r in TORCH_FREE_ROOMS)
           for c in torch_chains(n, top_level_only=False)]
    assert not bad, "\n".join(sorted(set(bad)))


def torch_free(name: str) -> bool:
    m = modules()[name]
    return m.kind == "src" and m.dist in TORCH_FREE and "vllm" not in name.split(".")[1:]


@pytest.mark.parametrize("dist", sorted(TORCH_FREE))
def test_torch_free_distributions_import_no_torch(dist):
    """Follows top-level imports through our modules, into other distributions too: a
    torch-free module importing a module that imports torch at its top is as bad as
    importing torch itself."""
    assert dist in DISTS
    bad = [c for n in sorted(modules()) if modules()[n].dist == dist and torch_free(n)
           for c in torch_chains(n, top_level_only=True)]
    assert not bad, "\n".join(sorted(set(bad)))


def test_the_rules_see_the_code():
    """Not vacuous: every distribution, benchmark and test folder was read; known edges,
    rooms and torch imports are found."""
    assert {"ofl", "remote_engram", "remote_drafter", "dsv41_stack"} <= set(DISTS)
    assert any(dist_of(t) == "ofl" for _, t, _ in cross_imports())
    assert {m.kind for m in modules().values()} == {"src", "benchmarks", "tests"}
    assert any(m.kind == "tests" and dist_of(t) for m in modules().values() for t, _ in m.imports)
    assert {room_of(n) for n in modules()} >= set(ROOMS)
    assert room_of("remote_drafter.cli") == "front" and room_of("remote_drafter.env") == "env"
    assert any(room_of(t) == "engine" for n, m in modules().items() if room_of(n) == "models"
               for t, _ in m.imports)
    assert any(t.split(".")[0] == "torch" for n, m in modules().items()
               if room_of(n) == "models" for t, _ in m.imports)
