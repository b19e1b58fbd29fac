"""Import layering (style.md R16), checked two ways.

By subprocess: the gateway never imports torch, the protocol and process plumbing stay torch-free at
import, and building the ``dartree`` parser imports no torch.

By an ``ast`` import graph of ``services/``, ``gateway/`` and ``benchmarks/`` (every import
statement, function-level ones included, resolved to the module file it loads): no import cycle,
``services.tree`` imports nothing of ours, the product never imports the tests, the gateway never
imports the workers, the drafter and verifier packages do not import each other, and the lower-layer
top-level modules (weight formats, process plumbing, the wire protocol) import neither. Known
exceptions are listed below with their reason; a fixed one must leave the list, and nothing may join
it without a reason.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("services", "gateway", "benchmarks")
FORBIDDEN_IN_GATEWAY = ("torch", "transformers", "services.tree", "services.drafter", "services.verifier")

# Import cycles allowed, each a set of modules (a strongly connected component) with its reason above
# it; none today.
ALLOWED_CYCLES: set[frozenset[str]] = set()
# Edges the rules below forbid, allowed with a reason.
ALLOWED_EDGES = {
    # `dartree bench`: the command line dispatches to the benchmarks (imported only when chosen)
    ("services.cli", "benchmarks.bench"),
}


# ---------------------------------------------------------------------------------------- subprocess

def _imported_after(stmt: str) -> set[str]:
    code = f"import sys; {stmt}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         cwd=REPO)
    return set(out.stdout.split())


def test_gateway_imports_no_torch():
    mods = _imported_after("import gateway.app, gateway.engine_client, gateway.text, gateway.schemas, "
                           "gateway.requests, gateway.handlers, gateway.server")
    bad = sorted(m for m in mods if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_IN_GATEWAY))
    assert not bad, f"gateway pulled in {bad}"


@pytest.mark.parametrize("module", ["services.protocol", "services.wire", "services.metrics", "services.ipc_pool",
                                    "services.runtime", "services.spec", "services.config_cli",
                                    "services.serve", "services.serve_plan", "services.transport_config",
                                    "services.verifier.worker", "services.verifier.process", "services.drafter.worker",
                                    "services.verifier.remote_drafter", "services.colocated",
                                    "services.verifier.config", "services.weight_formats"])
def test_service_plumbing_is_torch_free_at_import(module):
    assert "torch" not in _imported_after(f"import {module}")


def test_building_the_cli_parser_imports_no_torch():
    """``dartree gateway`` (and every ``--help``) must work on a machine without torch."""
    mods = _imported_after("import services.cli as c; c.build_parser()")
    assert "torch" not in mods
    assert not any(m.startswith("benchmarks") for m in mods)


# ---------------------------------------------------------------------------------------- ast graph

def _module_files() -> dict[str, Path]:
    out = {}
    for pkg in (*PACKAGES, "tests"):
        for path in (REPO / pkg).rglob("*.py"):
            rel = path.relative_to(REPO).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict) -> str | None:
    """The module file ``import name`` loads last: ``a.b.c`` -> ``a.b`` when ``c`` is an attribute."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path, modules: dict) -> set[str]:
    """Modules of ours that ``module`` imports anywhere (``if TYPE_CHECKING:`` blocks excepted)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
            for n in ast.walk(node)}
    names: list[str] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            names += [f"{source}.{a.name}" for a in node.names]
    return {t for n in names if (t := _resolve(n, modules)) and t != module}


@cache
def import_graph() -> dict[str, frozenset[str]]:
    """``module -> modules it imports`` over the product packages (tests are targets only)."""
    modules = _module_files()
    return {m: frozenset(_imports(m, p, modules)) for m, p in modules.items() if not m.startswith("tests")}


def _cycles(graph: dict[str, frozenset[str]]) -> set[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next((c for c in children if c in graph), None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        x = stack.pop()
                        on_stack.discard(x)
                        comp.add(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        found.add(frozenset(comp))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return found


def test_cycle_finder_on_a_toy_graph():
    graph = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a", "d"}), "d": frozenset(),
             "e": frozenset({"f"}), "f": frozenset({"e"}), "g": frozenset({"g"})}
    assert _cycles(graph) == {frozenset("abc"), frozenset("ef")}


def test_import_graph_resolves_relative_and_attribute_imports():
    graph = import_graph()
    assert "services.protocol" in graph["services.wire"]
    assert "services.spec" in graph["services.protocol"]
    assert "services.tree" in graph["services.drafter.tree_builders"]


def test_no_import_cycles_beyond_the_known_ones():
    cycles = _cycles(import_graph())
    new = [sorted(c) for c in cycles - ALLOWED_CYCLES]
    assert not new, f"import cycles: {new}"
    gone = [sorted(c) for c in ALLOWED_CYCLES - cycles]
    assert not gone, f"these cycles are gone: remove them from ALLOWED_CYCLES: {gone}"


def _edges(source: str, *targets: str) -> set[tuple[str, str]]:
    """Edges from modules under ``source`` to modules under any of ``targets``."""
    def under(m: str, p: str) -> bool:
        return m == p or m.startswith(p + ".")

    return {(m, t) for m, ts in import_graph().items() if under(m, source)
            for t in ts if any(under(t, p) for p in targets)}


# Lower-layer top-level modules (the weight formats, process plumbing, the wire protocol): the worker
# packages are built on them, never the other way round.
LOWER_LAYER = ("services.weights", "services.weight_formats", "services.q4_weights", "services.int8_head",
               "services.gguf_blocks", "services.pack_cache", "services.runtime", "services.protocol")


@pytest.mark.parametrize("source, targets", [
    ("services", ("tests", "benchmarks")),
    ("benchmarks", ("tests",)),
    ("gateway", ("services.verifier", "services.drafter", "services.serve", "services.serve_plan", "services.tree",
                 "tests")),
    ("services.drafter", ("services.verifier",)),
    ("services.verifier", ("services.drafter",)),
    *((low, ("services.verifier", "services.drafter")) for low in LOWER_LAYER),
])
def test_forbidden_imports(source, targets):
    bad = sorted(_edges(source, *targets) - ALLOWED_EDGES)
    assert not bad, f"{source} must not import {', '.join(targets)}: {bad}"


def test_the_lower_layer_modules_exist():
    """Each module :data:`LOWER_LAYER` names is in the graph (a rename must update the list, not
    silently check nothing)."""
    graph = import_graph()
    assert all(m in graph for m in LOWER_LAYER), [m for m in LOWER_LAYER if m not in graph]


def test_tree_imports_nothing_of_ours():
    """``services.tree`` is the pure algorithm layer: torch only."""
    bad = sorted((m, t) for m, t in _edges("services.tree", *PACKAGES) if not t.startswith("services.tree"))
    assert not bad, bad


def test_tree_imports_only_torch_and_the_standard_library():
    third_party = set()
    for path in (REPO / "services" / "tree").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            third_party |= {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {*PACKAGES, "torch"}
    assert not third_party, sorted(third_party)


def test_allowed_edges_still_exist():
    graph = import_graph()
    gone = sorted(e for e in ALLOWED_EDGES if e[1] not in graph.get(e[0], ()))
    assert not gone, f"these edges are gone: remove them from ALLOWED_EDGES: {gone}"
