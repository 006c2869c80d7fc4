"""Dependencies point down only: every import in ``src/fedgalore`` — at module level or
inside a function — goes from a package to a package strictly below it, the package graph has no
cycle, and no module imports itself through others (e.g. two task modules importing each other).

A *package* is a subpackage of ``fedgalore`` (``engine``, ``methods``, ...) or a top-level
module (``cli``, ``compare``, ...; ``fedgalore/__init__.py`` is ``fedgalore``). The order, bottom
first (a package may import only packages on lower levels; packages on one level do not import
each other):

====  ======================================  ===========================================
level packages                                what they are
====  ======================================  ===========================================
0     protocol, typed, jsonl                  wire and state types; typed config values;
                                              JSON-lines files
1     optim, sync, privacy                    GaLore optimizer and projector; moment sync;
                                              DP-SGD (Opacus) and its accounting
2     tasks                                   models, data, offline assets, metrics
3     federated                               partitions, seeding, local training,
                                              checkpoints, diagnostics
4     methods                                 T / A / S of every method, the registry
5     job, compat                             the run's config, what it means here, its
                                              clients and partition files; which features
                                              combine with which method
6     records                                 a run's directory, identity and liveness
7     engine                                  runtime, backends, validation, the round
                                              loop and its stages, run / resume
8     trained                                 a run's global model: evaluate, predict,
                                              export, model card
9     fedgalore, report, hub, memory          the public facade, reports, hub access,
                                              memory model
10    progress, compare, plan, experiments    progress display, grids, plans, experiments
11    tune                                    choosing rates and ranks on validation data
12    cli                                     the command line
13    flower, __main__                        the Flower apps (reuse the CLI's messages);
                                              ``python -m fedgalore``
====  ======================================  ===========================================
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest


SRC = Path(__file__).resolve().parents[2] / "src" / "fedgalore"

LEVELS: list[set[str]] = [
    {"protocol", "typed", "jsonl"},
    {"optim", "sync", "privacy"},
    {"tasks"},
    {"federated"},
    {"methods"},
    {"job", "compat"},
    {"records"},
    {"engine"},
    {"trained"},
    {"fedgalore", "report", "hub", "memory"},
    {"progress", "compare", "plan", "experiments"},
    {"tune"},
    {"cli"},
    {"flower", "__main__"},
]
LEVEL = {pkg: i for i, names in enumerate(LEVELS) for pkg in names}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str | None:
    """The package a ``fedgalore...`` module belongs to (None outside fedgalore)."""
    parts = module.split(".")
    if parts[0] != "fedgalore":
        return None
    if len(parts) == 1:
        return "fedgalore"
    head = parts[1]
    return head if (SRC / head).is_dir() or (SRC / f"{head}.py").is_file() else "fedgalore"


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every imported ``fedgalore`` module of one file, with its line (function bodies included)."""
    module = _module_name(path)
    package_of_file = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_of_file.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from fedgalore import cli` imports the module fedgalore.cli
            out += [(f"{target}.{alias.name}" if target == "fedgalore" else target, node.lineno) for alias in node.names]
    return out


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the import sites ``file:line``."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        src = _package(_module_name(path))
        for target, line in _imports(path):
            dst = _package(target)
            if dst is not None and dst != src:
                edges.setdefault((src, dst), []).append(f"{path.relative_to(SRC.parent)}:{line}")
    return edges


def module_edges() -> dict[tuple[str, str], list[str]]:
    """(importing module, imported module) -> the import sites, over all modules of ``src/fedgalore``."""
    files = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}
    edges: dict[tuple[str, str], list[str]] = {}
    for module, path in files.items():
        for target, line in _imports(path):
            while target and target not in files:  # `from fedgalore.x import name`: the module fedgalore.x
                target = target.rpartition(".")[0]
            if target and target != module:
                edges.setdefault((module, target), []).append(f"{path.relative_to(SRC.parent)}:{line}")
    return edges


def upward_edges(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """Edges that do not go strictly down the order (and packages the order does not place)."""
    bad = []
    for (src, dst), sites in sorted(edges.items()):
        for pkg in (src, dst):
            if pkg not in LEVEL:
                bad.append(f"{pkg} is not placed in LEVELS (tests/project/test_layering.py); imported at {sites[0]}")
        if src in LEVEL and dst in LEVEL and LEVEL[dst] >= LEVEL[src]:
            bad.append(f"{src} (level {LEVEL[src]}) imports {dst} (level {LEVEL[dst]}) at {', '.join(sites)}")
    return bad


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The package-level cycles (one per strongly connected component of more than one package)."""
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)
        graph.setdefault(dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_package_is_placed() -> None:
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    packages |= {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"} | {"fedgalore"}
    assert sorted(packages - set(LEVEL)) == []
    assert sorted(set(LEVEL) - packages) == []


def test_imports_point_down_only() -> None:
    edges = package_edges()
    assert edges, "no imports found: the parser is broken"
    assert upward_edges(edges) == []


def test_no_package_cycle() -> None:
    assert cycles(package_edges()) == []


def test_no_module_cycle() -> None:
    assert cycles(module_edges()) == []


def test_the_checks_catch_an_upward_edge_and_a_cycle() -> None:
    edges = package_edges()
    edges[("optim", "engine")] = ["optim/example.py:1"]
    assert any(e.startswith("optim (level 1) imports engine (level 7)") for e in upward_edges(edges))
    assert any({"engine", "optim"} <= set(c) for c in cycles(edges))  # the cycle the injected edge closes
    modules = module_edges()
    modules[("fedgalore.tasks.mnist", "fedgalore.tasks.pretrain_vit")] = ["fedgalore/tasks/mnist.py:1"]
    assert ["fedgalore.tasks.mnist", "fedgalore.tasks.pretrain_vit"] in cycles(modules)


@pytest.mark.parametrize("code, expected", [
    ("from fedgalore.engine.loop import Federation", "fedgalore.engine.loop"),
    ("from fedgalore import cli", "fedgalore.cli"),
    ("def f():\n    import fedgalore.methods.base", "fedgalore.methods.base"),
    ("from ..protocol import payload", "fedgalore.protocol"),
])
def test_import_parser(monkeypatch, code, expected) -> None:
    path = SRC / "optim" / "_layering_probe.py"  # parsed, never written: read_text is patched
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: code)
    assert [t for t, _ in _imports(path)] == [expected]
