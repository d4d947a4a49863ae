"""The load flow's layering (issue 41, step 4): ``tiers/`` moves bytes only and knows neither the state
tree (``planning/``) nor the load flow (``load/``); ``planning/`` and ``format/`` sit below ``load/``."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "persist_core"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize(("folder", "forbidden"), [
    ("tiers", ("persist_core.planning", "persist_core.load")),
    ("planning", ("persist_core.load", "persist_core.tiers")),
    ("format", ("persist_core.load", "persist_core.tiers", "persist_core.planning")),
])
def test_a_lower_layer_imports_no_higher_one(folder, forbidden):
    found = {f"{path.name}: {name}" for path in sorted((PACKAGE / folder).glob("*.py")) for name in _imports(path)
             if name.startswith(forbidden)}
    assert not found
