"""The import rules of ARCHITECTURE.md, read from the source with `ast`: every import counts, at module level,
inside functions and under TYPE_CHECKING alike."""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "deepinfer"
MAX_LINES = 420  # STYLE.md: split a file when it passes ~400 lines

# (importing package prefix, forbidden imported prefixes, why)
RULES = [
    ("deepinfer.core", ("torch", "deepinfer.models", "deepinfer.layers", "deepinfer.worker", "deepinfer.ops"),
     "core/ is pure-Python bookkeeping, testable without a model"),
    ("deepinfer.ops", ("deepinfer.layers", "deepinfer.models"), "kernels sit below layers"),
    ("deepinfer.layers", ("deepinfer.models", "deepinfer.worker", "deepinfer.engine"), "layers sit below models"),
    ("deepinfer.kvstore", ("deepinfer.core.plan", "deepinfer.worker"), "the store knows keys and bytes, not plans"),
    ("deepinfer.server", ("deepinfer.cli",), "the server does not import the command line"),
]


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Every module `name` imports; `from pkg import sub` counts as importing pkg.sub when that is a module."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.mark.parametrize("owner,forbidden,why", RULES, ids=[r[0] for r in RULES])
def test_no_forbidden_imports(graph, owner, forbidden, why):
    bad = sorted(f"{m} imports {i}" for m, imports in graph.items() if _under(m, owner)
                 for i in imports if any(_under(i, f) for f in forbidden))
    assert not bad, f"{why}:\n" + "\n".join(bad)


def test_core_does_not_reach_torch_through_other_modules(graph):
    """core/ may use shared plain modules (config, sampling_params, kvstore's scheduler half), and none of what they
    import may pull in torch either."""
    seen, stack, path = set(), [m for m in graph if _under(m, "deepinfer.core")], {}
    while stack:
        module = stack.pop()
        for imported in graph.get(module, ()):
            if imported == "torch" or imported.startswith("torch."):
                chain = [module]
                while chain[-1] in path:
                    chain.append(path[chain[-1]])
                pytest.fail("core/ reaches torch: " + " <- ".join(chain))
            if imported in graph and imported not in seen:
                seen.add(imported)
                path[imported] = module
                stack.append(imported)


def test_no_import_cycles(graph):
    internal = {m: {i for i in imports if i in graph and i != m} for m, imports in graph.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(internal[module]):
            if state.get(nxt) == 1:
                cycles.append(trail[trail.index(nxt):] + [module, nxt] if nxt in trail else [module, nxt])
            elif nxt not in state:
                visit(nxt, trail + [module])
        state[module] = 2

    for module in sorted(internal):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_files_stay_small():
    big = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"files over {MAX_LINES} lines (split them by concept): {big}"


def test_the_checker_sees_function_level_and_type_checking_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import deepinfer.worker.runner\n"
                      "def f():\n    from deepinfer.models import base\n")
    found = _imports("deepinfer.core.m", source, {"deepinfer.models.base"})
    assert {"deepinfer.worker.runner", "deepinfer.models.base"} <= found
