"""The import contracts in pyproject.toml hold, and no module imports another that imports it
back: the layers (each imports only the layers below it), the engine side of control never
importing the fleet side, and no import cycle between sibling packages or between modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[1]
ROOT_PACKAGES = ("bench", "tabletune", "twin", "producers", "controller", "fitter", "schemas")


def test_the_import_contracts_hold() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint_imports)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 kept, 0 broken" in done.stdout, done.stdout


def _import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(root: str) -> None:
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, imported = work[-1]
            for other in imported:
                if other not in index:
                    index[other] = low[other] = len(index)
                    stack.append(other)
                    on_stack.add(other)
                    work.append((other, iter(sorted(graph.find_modules_directly_imported_by(other)))))
                    break
                if other in on_stack:
                    low[module] = min(low[module], index[other])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_one_that_imports_it_back() -> None:
    sys.path.insert(0, str(REPO))
    try:
        graph = grimp.build_graph(*ROOT_PACKAGES, include_external_packages=False)
    finally:
        sys.path.remove(str(REPO))
    assert _import_cycles(graph) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(module)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert _import_cycles(graph) == [["pkg.a", "pkg.b"]]
