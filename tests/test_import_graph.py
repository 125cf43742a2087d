"""The import graph of the monorepo's distributions, read statically from every module under
packages/*/src and stack/src (ARCHITECTURE.md § Dependencies says why each rule holds):

* ofl is the bottom: it imports none of our packages;
* nothing imports the stack; no cycle between distributions (lazy imports count);
* a distribution imports only the distributions its pyproject declares (base or an extra);
* only `*.vllm` modules import vLLM; only `remote_drafter.exl3` imports exllamav3, lazily;
* torch-free modules import no torch, directly or through our modules' top-level imports
  (a lazy import inside a function is how a torch-free module reaches an optional
  torch-side feature, and is allowed).
"""

from __future__ import annotations

import ast
import re
import tomllib
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Distributions whose every module runs without torch, but for these torch-side modules
# (a prefix covers a module and everything under it).
TORCH_FREE = {"ofl", "async_handoff", "longctx_bench", "acceptance_ceiling", "remote_engram",
              "remote_drafter", "dsv41_stack"}
TORCH_SIDE = (
    "remote_engram.vllm",
    "remote_drafter.bench", "remote_drafter.drafters.dspark", "remote_drafter.drafters.dsv41",
    "remote_drafter.drafters.lm", "remote_drafter.drafters.pick", "remote_drafter.drafters.window",
    "remote_drafter.layers", "remote_drafter.reference", "remote_drafter.target",
    "remote_drafter.testing",
    "remote_drafter.dsv41.quant", "remote_drafter.dsv41.checkpoint", "remote_drafter.dsv41.tiny",
    "remote_drafter.dsv41.model", "remote_drafter.exl3", "remote_drafter.drafters.graphs", "remote_drafter.exl3",
)


def distributions() -> dict[str, dict]:
    """import name -> {"root": src folder, "declares": import names of our packages it lists}."""
    found = {}
    for pyproject in [*ROOT.glob("packages/*/pyproject.toml"), ROOT / "stack/pyproject.toml"]:
        meta = tomllib.loads(pyproject.read_text())["project"]
        (src,) = [p for p in (pyproject.parent / "src").iterdir() if (p / "__init__.py").exists()]
        requirements = list(meta.get("dependencies", []))
        for extra in meta.get("optional-dependencies", {}).values():
            requirements += extra
        found[src.name] = {"root": src, "dist": meta["name"],
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


@cache
def modules() -> dict[str, tuple[Path, list[tuple[str, bool]]]]:
    """module -> (file, [(imported module, at top level?)]), relative imports resolved."""
    table = {}
    for info in DISTS.values():
        for path in info["root"].rglob("*.py"):
            name = module_name(path, info["root"])
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
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
            table[name] = (path, found)
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
    return str(modules()[module][0].relative_to(ROOT))


def cross_imports():
    for module, (_, imports) in modules().items():
        for target, at_top in imports:
            src, dst = dist_of(module), dist_of(target)
            if dst and dst != src:
                yield module, target, at_top


def test_ofl_is_the_bottom():
    bad = [f"{where(m)}: {t}" for m, t, _ in cross_imports() if dist_of(m) == "ofl"]
    assert not bad, bad


def test_nothing_imports_the_stack():
    bad = [f"{where(m)}: {t}" for m, t, _ in cross_imports() if dist_of(t) == "dsv41_stack"]
    assert not bad, bad


def test_every_import_of_ours_is_declared():
    bad = sorted({f"{where(m)} imports {dist_of(t)}: add {DISTS[dist_of(t)]['dist']} to "
                  f"{DISTS[dist_of(m)]['dist']}'s pyproject"
                  for m, t, _ in cross_imports() if dist_of(t) not in DISTS[dist_of(m)]["declares"]})
    assert not bad, "\n".join(bad)


def test_no_cycle_between_distributions():
    edges: dict[str, set[str]] = {d: set() for d in DISTS}
    for m, t, _ in cross_imports():
        edges[dist_of(m)].add(dist_of(t))
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
    bad = [f"{where(m)}: {t}" for m, (_, imports) in modules().items() for t, _ in imports
           if t.split(".")[0] == "vllm" and "vllm" not in m.split(".")]
    assert not bad, bad


def test_only_remote_drafter_exl3_imports_exllamav3_and_lazily():
    found = [(m, at_top) for m, (_, imports) in modules().items() for t, at_top in imports
             if t.split(".")[0] == "exllamav3"]
    assert found, "remote_drafter.exl3 imports exllamav3 (the rule reads nothing)"
    bad = [f"{where(m)}{' (at top level)' if at_top else ''}" for m, at_top in found
           if m != "remote_drafter.exl3" or at_top]
    assert not bad, bad


def torch_side(module: str) -> bool:
    return dist_of(module) not in TORCH_FREE or any(
        module == p or module.startswith(p + ".") for p in TORCH_SIDE)


@pytest.mark.parametrize("dist", sorted(TORCH_FREE))
def test_torch_free_modules_import_no_torch(dist):
    """Follows top-level imports through our modules: one torch-free module importing a
    torch-side one at its top is as bad as importing torch itself."""
    assert dist in DISTS
    bad = []
    for module in sorted(m for m in modules() if dist_of(m) == dist and not torch_side(m)):
        seen, stack, chain = {module}, [module], {module: [module]}
        while stack:
            current = stack.pop()
            for target, at_top in modules()[current][1]:
                if not at_top:
                    continue
                if target.split(".")[0] == "torch" or (dist_of(target) and torch_side(target)):
                    bad.append(" -> ".join(chain[current] + [target]))
                    continue
                nxt = known(target) if dist_of(target) else None
                if nxt and nxt not in seen:
                    seen.add(nxt)
                    chain[nxt] = chain[current] + [nxt]
                    stack.append(nxt)
    assert not bad, "\n".join(sorted(set(bad)))


def test_the_rules_see_the_code():
    """Not vacuous: every distribution was read, and known edges and torch imports are found."""
    assert {"ofl", "remote_engram", "remote_drafter", "dsv41_stack"} <= set(DISTS)
    assert any(dist_of(t) == "ofl" for _, t, _ in cross_imports())
    assert any(t.split(".")[0] == "torch" for m, (_, imports) in modules().items()
               for t, _ in imports if torch_side(m))
