"""``persist gc`` plans with the Retainer the engine applies (issue 54 item 3): one decision per checkpoint with a
typed reason, said by ``--dry-run`` and written by ``--json``, and what the engine's own retention removes.

The checkpoints are an incremental run's: steps 1 (full) to 5, each referencing bytes of step 1, in a local directory
and uploaded to a ``memory://`` remote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from persist_core import AnyOf, CheckpointEngine, KeepEveryNSteps, KeepLastN
from persist_core.cli import main
from persist_core.sync.record import write_unsynced
from persist_core.tiers.local import committed_steps, read_manifest

KEEP = ["--keep-last", "1", "--keep-every-n-steps", "2"]


def _state(step: int) -> dict:
    base = torch.randn(1 << 14, generator=torch.Generator().manual_seed(7))
    return {"base": base, "head": torch.full((16,), float(step)), "step": step}


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def saved(tmp_path, memory_url) -> tuple[Path, str]:
    local = tmp_path / "ckpt"
    with CheckpointEngine(local, remote_url=memory_url, incremental=True, direct_io="off") as engine:
        for step in (1, 2, 3, 4, 5):
            engine.save(_state(step), step=step)
    assert {s: read_manifest(local / f"step-{s:012d}").depends_on() for s in (2, 3, 4, 5)} == {
        s: {1} for s in (2, 3, 4, 5)}
    # every step is uploaded; the record a fast upload races (the writer thread's rewrite after the commit of 5 may
    # land after the sync thread's after the upload of 5, naming 5) says so, as a clean close should leave it
    write_unsynced(local, memory_url, set(), through=5)
    return local, memory_url


@pytest.mark.parametrize("where", ["local", "remote"])
def test_dry_run_json_is_the_plan_with_a_typed_reason_per_checkpoint(saved, where):
    location = str(saved[0]) if where == "local" else saved[1]
    out = run("gc", location, *KEEP, "--dry-run", "--json")
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert [(d["step"], d["reason"]) for d in report["plan"]] == [
        (1, "referenced"), (2, "kept_by_policy"), (3, "prune"), (4, "kept_by_policy"), (5, "newest")]
    assert report["plan"][0] == {"step": 1, "reason": "referenced", "policy_keeps": False, "referenced_by": [2, 4, 5]}
    assert report["removed"] == [3]
    assert report["kept"] == [{"step": 1, "why": "referenced by step(s) [2, 4, 5] (incremental checkpoints)"}]
    text = run("gc", location, *KEEP, "--dry-run").output
    assert "would remove step 3 " in text and "kept step 1: referenced by step(s) [2, 4, 5]" in text
    assert "removed step" not in text
    done = json.loads(run("gc", location, *KEEP, "--json").output)
    assert done["removed"] == [3] and done["plan"] == report["plan"]
    assert [r["step"] for r in json.loads(run("ls", location, "--json").output)] == [1, 2, 4, 5]


def test_gc_plans_what_the_engine_removes(saved, tmp_path):
    """The dry run over the local directory names exactly what the engine's own retention then removes."""
    local, _ = saved
    plan = json.loads(run("gc", str(local), *KEEP, "--dry-run", "--json").output)["plan"]
    with CheckpointEngine(local, keep_local=AnyOf(KeepLastN(1), KeepEveryNSteps(2)), incremental=True,
                          direct_io="off") as engine:
        engine.prune()
    assert committed_steps(local) == [d["step"] for d in plan if d["reason"] != "prune"] == [1, 2, 4, 5]


def test_unsynced_checkpoints_are_planned_as_such(saved):
    """A local checkpoint not uploaded yet (the engine's record says so) stays, said with its remote."""
    local, url = saved
    write_unsynced(local, url, {3})  # what a job in an outage leaves
    report = json.loads(run("gc", str(local), *KEEP, "--dry-run", "--json").output)
    assert [(d["step"], d["reason"]) for d in report["plan"]] == [
        (1, "referenced"), (2, "kept_by_policy"), (3, "unsynced"), (4, "kept_by_policy"), (5, "newest")]
    assert report["removed"] == []
    assert {"step": 3, "why": f"not yet uploaded to {url}"} in report["kept"]
    assert f"kept step 3: not yet uploaded to {url}" in run("gc", str(local), *KEEP, "--dry-run").output
