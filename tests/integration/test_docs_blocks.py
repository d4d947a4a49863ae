"""Every code block of README.md and docs/*.md that claims to run does (issue 53, item 8).

The convention, for whoever writes the docs: a ```python block runs, unless the line right before its fence is
``<!-- not run: the reason -->`` (an HTML comment: neither GitHub nor MkDocs shows it). Mark only what cannot run
here: a real GPU, several processes or machines, a real bucket, a fragment whose ``...`` stands for the user's own
arguments. A block is run as the user's program would run it:

- around it, the names the docs leave to the user's program (``model``, ``opt``, ``loader``, ``train_step()``,
  ``total``, ...: :data:`tests.support.docs_child.GIVEN`); the blocks of one page run in order in one namespace;
- the paths adapted by :data:`SUBSTITUTIONS` (each block its own directory under ``tmp_path``);
- all of them in one fresh interpreter (:mod:`tests.support.docs_child`), from ``tmp_path``;
- the blocks in :data:`RESUMED` twice over the same directories: the second run must resume (fewer training steps)
  and restore the weights (the same final weights as the first run, which started from zero).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LIMIT_S = 120

#: what the docs name -> what the test uses ({d}: the block's own directory)
SUBSTITUTIONS = {
    "/nvme/": "{d}/nvme/",                 # local_dir: the block's directory
    "s3://bucket/": "file://{d}/bucket/",  # remote_url: a file:// remote beside it
}

#: blocks that claim a restart resumes: run twice, the second must restore the weights ("page#heading")
RESUMED = {"README.md#The engine", "docs/memory.md#Recovery from memory"}

_NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->")


def blocks() -> list[tuple[str, str, str | None]]:
    """``(id, code, why not run)`` of every ```python block; the id is ``page#heading`` (``#2``... after the first
    block under one heading)."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        heading, seen, code, before, other = page.stem, {}, None, "", False
        marked: re.Match[str] | None = None
        for line in lines:
            if other:  # inside another block (bash, text): its lines are neither headings nor markers
                other = not line.startswith("```")
                continue
            if code is not None:  # inside a python block
                if line.startswith("```"):
                    key = f"{page.relative_to(ROOT)}#{heading}"
                    seen[key] = seen.get(key, 0) + 1
                    found.append((key if seen[key] == 1 else f"{key}#{seen[key]}", "\n".join(code),
                                  marked.group(1) if marked else None))
                    code = None
                else:
                    code.append(line)
            elif line.startswith("```python"):
                code, marked = [], _NOT_RUN.fullmatch(before.strip())
            elif line.startswith("```"):
                other = True
            elif line.startswith("#"):
                heading = line.lstrip("#").strip()
            if line.strip():
                before = line
    return found


BLOCKS = blocks()
RUN = [(key, code) for key, code, why in BLOCKS if why is None]


def test_every_block_runs_or_says_why_not():
    assert len(BLOCKS) >= 10 and len(RUN) >= 6  # the parser found them
    for key, _, why in BLOCKS:
        assert why is None or len(why) > 10, f"{key}: <!-- not run: ... --> needs a reason"
    assert RESUMED <= {key for key, _ in RUN}


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, list[dict]]:
    """Every block that runs, in one fresh interpreter: block id -> one result per run."""
    tmp = tmp_path_factory.mktemp("docs")
    pages: dict[str, list[dict]] = {}
    for i, (key, code) in enumerate(RUN):
        d = tmp / f"block-{i}"
        for name, to in SUBSTITUTIONS.items():
            code = code.replace(name, to.format(d=d))
        pages.setdefault(key.split("#")[0], []).append({"id": key, "code": code, "runs": 1 + (key in RESUMED)})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = tmp / "results.json"
    done = subprocess.run([sys.executable, "-m", "tests.support.docs_child", str(out)], cwd=tmp, env=env,
                          input=json.dumps([{"page": p, "blocks": b} for p, b in pages.items()]), text=True,
                          capture_output=True, timeout=LIMIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("key", [key for key, _ in RUN])
def test_the_block_runs(key, ran):
    for package in ("lightning", "accelerate"):  # the adapters' pages need their framework (the dev extras)
        if f"from {package}" in dict(RUN)[key]:
            pytest.importorskip(package)
    runs = ran[key]
    for n, result in enumerate(runs, 1):
        assert result["error"] is None, f"{key} (run {n}) failed:\n{result['error']}"
    if key in RESUMED:
        first, second = runs
        assert first["calls"] > 0 and second["calls"] < first["calls"], f"{key}: the second run did not resume"
        assert second["weight"] == first["weight"], f"{key}: the second run did not restore the weights"
