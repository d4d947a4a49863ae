"""The shape of ``persist_core`` (issues 41 and 54): each module imports only its own layer or the layers below it,
as DESIGN.md lists them; the four flows (save/, load/, sync/, memory/) never reach one another, directly or through
any other module; ``tiers/`` moves bytes only (no state tree, no flow); ``planning/`` and ``format/`` do no I/O; no
import cycle; no framework."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "persist_core"

#: lowest first; a module's layer is that of the longest prefix naming it (DESIGN.md, "Layers")
LAYERS: list[tuple[str, ...]] = [
    ("errors", "layout", "_knobs", "_link_knobs", "sidefiles", "run_ids", "lineage", "report", "distributed", "handle", "preemption"),
    ("format", "fileio", "ownership", "turn", "hostmem", "tiers.tier", "tiers._retry", "tiers._s3", "tiers._fsspec",
     "policies.save"),
    ("planning", "tiers", "policies", "history", "staging", "assembly"),
    ("save", "load", "sync", "memory", "timeline"),
    ("scheduler", "pipeline", "config", "links", "resumption"),
    ("_build",),
    ("engine",),
    ("session", ""),  # "": the package's __init__
    ("cli",),
]
FLOWS = ("save", "load", "sync", "memory")
NO_IO = ("fileio", "tiers", "ownership", "sidefiles", "hostmem", "staging", "assembly", "load", "save", "sync",
         "memory")


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    """The persist_core modules ``path`` imports (without the prefix), leaving out ``if TYPE_CHECKING:`` blocks;
    with ``top_level_only``, also the imports inside functions (those run later: they make no cycle)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "persist_core":
                module = node.module.removeprefix("persist_core").lstrip(".")
                found.update(f"{module}.{a.name}".lstrip(".") if _is_module(f"{module}.{a.name}".lstrip("."))
                             else module for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name.removeprefix("persist_core").lstrip(".") for a in node.names
                             if a.name.split(".")[0] == "persist_core")
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list) and not (top_level_only and isinstance(node, (ast.FunctionDef,
                                                                                         ast.AsyncFunctionDef))):
                    visit([n for n in inner if isinstance(n, ast.stmt)] +
                          [s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body])

    visit(ast.parse(path.read_text()).body)
    return found


def _is_module(name: str) -> bool:
    path = PACKAGE.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _layer(module: str) -> int:
    best, layer = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".") or prefix == "") and len(prefix) > best:
                best, layer = len(prefix), i
    assert layer is not None, f"persist_core.{module} is in no layer: add it to LAYERS and DESIGN.md"
    return layer


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_import_goes_to_the_same_layer_or_below():
    upward = [f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
              for m, path in MODULES.items() for d in sorted(_imports(path, top_level_only=False))
              if _layer(d) > _layer(m)]
    assert not upward


def test_the_flows_do_not_import_one_another():
    sideways = [f"{m} imports {d}" for m, path in MODULES.items() for d in _imports(path, top_level_only=False)
                if m.split(".")[0] in FLOWS and d.split(".")[0] in FLOWS and d.split(".")[0] != m.split(".")[0]]
    assert not sideways


def test_no_flow_reaches_another_through_a_third():
    """Transitively: from any module of a flow, following imports (those inside functions too) never leads into
    another flow, whatever modules lie between."""
    graph = {m: {d for d in _imports(p, top_level_only=False) if d in MODULES} for m, p in MODULES.items()}
    reached = []
    for flow in FLOWS:
        seen: dict[str, str] = {}  # module -> the module it was first reached from
        todo = [m for m in graph if m.split(".")[0] == flow]
        for m in todo:
            seen.setdefault(m, m)
        while todo:
            m = todo.pop()
            for d in graph[m]:
                if d not in seen:
                    seen[d] = m
                    todo.append(d)
        for m in seen:
            top = m.split(".")[0]
            if top in FLOWS and top != flow:
                path = [m]
                while seen[path[-1]] != path[-1]:
                    path.append(seen[path[-1]])
                reached.append(f"{flow} reaches {m}: {' <- '.join(path)}")
    assert not reached


@pytest.mark.parametrize(("package", "forbidden"), [
    ("tiers", ("planning", "load", "save", "sync", "memory", "staging", "assembly", "format.tree")),
    ("staging", ("load", "save", "sync", "memory", "assembly")),
    ("assembly", ("load", "save", "sync", "memory", "staging")),
    ("planning", NO_IO),
    ("format", NO_IO + ("planning",)),
])
def test_a_lower_package_knows_nothing_above_it(package, forbidden):
    found = [f"{m} imports {d}" for m, path in MODULES.items() if m.split(".")[0] == package
             for d in _imports(path, top_level_only=False) if d.split(".")[0] in forbidden or d in forbidden]
    assert not found


def test_no_import_cycle():
    graph = {m: {d for d in _imports(p, top_level_only=True) if d in MODULES} for m, p in MODULES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            strong(v)
    assert not cycles


def test_the_engine_imports_no_framework():
    frameworks = ("lightning", "pytorch_lightning", "accelerate", "transformers")
    found = [f"{_name(p)} imports {n}" for p in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(p.read_text()))
             for n in ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
             if n.split(".")[0] in frameworks]
    assert not found


def test_design_md_lists_the_layers():
    text = (ROOT / "DESIGN.md").read_text()
    missing = [p for layer in LAYERS for p in layer if p and f"`{p}`" not in text and f"{p}/" not in text
               and f"{p}.py" not in text]
    assert not missing
