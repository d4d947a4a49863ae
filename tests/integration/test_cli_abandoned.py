"""Set-aside branches are never silent (issue 53, item 2): ``persist ls`` lists them with their size on each tier,
``persist gc --abandoned`` removes them (never a live checkpoint, nor one a live checkpoint references).

The branch is the engine's own: a run saves 10, 20, 30, 40, then a run loads 20 and saves 25, which sets 30 and 40
aside in the local directory and on a ``file://`` remote."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from persist_core import CheckpointEngine, CheckpointReader
from persist_core.cli import main
from persist_core.cli.app import human_size
from persist_core.tiers.local import checkpoint_dir, read_manifest
from tests.support import states
from tests.support.states import assert_state_equal

state_for = partial(states.state_for, shape=(128, 128), random=True)


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def inc_state(step: int) -> dict:
    """A state of which one tensor never changes: an incremental save references it."""
    return state_for(step, frozen=torch.ones(64, 64))


def _branched(tmp_path: Path, *, incremental: bool = False) -> tuple[Path, str]:
    """A local directory and a file:// remote, each with live 10, 20, 25 and 30, 40 set aside (the branch at 20)."""
    local, url = tmp_path / "ckpt", (tmp_path / "remote" / "run").as_uri()
    make = inc_state if incremental else state_for
    with CheckpointEngine(local, remote_url=url, incremental=incremental) as engine:
        for step in (10, 20, 30, 40):
            engine.save(make(step), step=step)
    with CheckpointEngine(local, remote_url=url, incremental=incremental) as engine:
        assert_state_equal(engine.load(20), make(20))  # back to 20 on purpose
        engine.save(make(25), step=25)
    return local, url


def _rows(location: str) -> list[tuple[int, bool, int]]:
    out = run("ls", location, "--json")
    assert out.exit_code == 0, out.output
    return [(r["step"], r["abandoned"], r["bytes"]) for r in json.loads(out.output)]


@pytest.mark.parametrize("where", ["local", "remote"])
def test_ls_lists_the_set_aside_checkpoints_with_their_size_on_each_tier(tmp_path, where):
    local, url = _branched(tmp_path)
    location = str(local) if where == "local" else url
    rows = _rows(location)
    assert [(s, a) for s, a, _ in rows] == [(10, False), (20, False), (25, False), (30, True), (40, True)]
    assert all(n > 128 * 128 * 4 for _, _, n in rows)  # the size of each, abandoned ones too
    table = run("ls", location).output
    aside = table.split("│   30 │")[1].splitlines()[0]  # the table's row of step 30
    assert table.count("abandoned") == 2 and "abandoned" in aside and human_size(rows[3][2]) in aside


@pytest.mark.parametrize("where", ["local", "remote"])
def test_gc_abandoned_removes_the_set_aside_branch_and_nothing_live(tmp_path, where):
    local, url = _branched(tmp_path)
    location = str(local) if where == "local" else url
    dry = run("gc", location, "--abandoned", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "would remove abandoned step 30" in dry.output and "would remove abandoned step 40" in dry.output
    assert [s for s, a, _ in _rows(location) if a] == [30, 40]  # a dry run removes nothing
    done = run("gc", location, "--abandoned", "--json")
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    assert [r["step"] for r in report["abandoned_removed"]] == [30, 40] and report["removed"] == []
    assert _rows(location) == [(s, False, n) for s, a, n in _rows(location)]  # no abandoned row left
    assert [s for s, _, _ in _rows(location)] == [10, 20, 25]
    assert "no abandoned checkpoints" in run("gc", location, "--abandoned").output
    with CheckpointReader(tmp_path / "fresh" if where == "remote" else local,
                          remote_url=url if where == "remote" else None) as reader:
        assert_state_equal(reader.load(), state_for(25))
        assert_state_equal(reader.load(10), state_for(10))


def test_gc_abandoned_with_a_policy_keeps_what_the_live_incremental_checkpoints_reference(tmp_path):
    local, url = _branched(tmp_path, incremental=True)
    referenced = read_manifest(checkpoint_dir(local, 25)).depends_on()
    assert referenced and max(referenced) <= 20  # the live branch references only live, older checkpoints
    for location in (str(local), url):
        done = run("gc", location, "--abandoned", "--keep-last", "1", "--no-verify")
        assert done.exit_code == 0, done.output
        assert "removed abandoned step 30" in done.output and "removed abandoned step 40" in done.output
        assert [s for s, _, _ in _rows(location)] == sorted({*referenced, 25})  # the policy spares what 25 needs
    for reader in (CheckpointReader(local), CheckpointReader(tmp_path / "fresh", remote_url=url)):
        with reader:
            assert_state_equal(reader.load(), inc_state(25))
