"""Several ranks write one checkpoint: real gloo process groups, two processes."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from persist_core import CheckpointReader
from tests.support.states import assert_state_equal
from tests.support.multirank_child import replicated_state, run_all


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SCENARIOS = ("ok", "fail", "mismatch", "steps")


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> Path:
    """Every scenario of :func:`tests.support.multirank_child.run` in one start of the two ranks, one after the other,
    each in a directory of its own (``<scenario>/ckpt``, its results in ``<scenario>/out``): each start of the ranks
    imports torch twice."""
    base = tmp_path_factory.mktemp("multirank")
    for scenario in SCENARIOS:
        (base / scenario / "out").mkdir(parents=True)
    mp.spawn(run_all, args=(2, free_port(), [(str(base / s / "ckpt"), s, str(base / s / "out")) for s in SCENARIOS]),
             nprocs=2, join=True)
    return base


def spawn(scenarios: Path, scenario: str) -> tuple[Path, list[list]]:
    """The directory of ``scenario``'s run and each rank's results."""
    return scenarios / scenario, [torch.load(scenarios / scenario / "out" / f"rank{r}.pt") for r in range(2)]


def test_two_ranks_each_write_half_and_restore_on_two_and_on_one(scenarios):
    tmp_path, results = spawn(scenarios, "ok")
    ckpt = tmp_path / "ckpt" / "step-000000000010"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    sizes = {f["name"]: f["size"] for f in manifest["files"]}
    assert set(sizes) == {"rank-00000.safetensors", "rank-00001.safetensors"}
    total = sum(sizes.values())
    assert all(0.3 < s / total < 0.7 for s in sizes.values()), sizes  # about half each
    assert {t["file"] for t in manifest["tensors"]} == set(sizes)
    for r in range(2):  # restored on two ranks, aliasing kept
        assert results[r][-1] == ("loaded", 10, True, True)
    loaded = CheckpointReader(tmp_path / "ckpt").load()  # and on one
    assert_state_equal(loaded, replicated_state(10))


def test_a_failure_on_one_rank_commits_nothing_and_every_rank_hears(scenarios):
    tmp_path, results = spawn(scenarios, "fail")
    outcome0, outcome1 = results[0][1], results[1][1]
    assert outcome1[:2] == ("failed", "WriteError")
    assert outcome0[0] == "failed" and "rank 1" in outcome0[2] and "No space left" in outcome0[2]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith((".lock-", ".history"))) == ["step-000000000010"]  # no manifest, no tmp
    for r in range(2):
        assert results[r][-1] == ("loaded", 10, True, True)


def test_ranks_with_different_state_structure_commit_nothing(scenarios):
    tmp_path, results = spawn(scenarios, "mismatch")
    for r in range(2):
        assert results[r][1][0] == "failed" and "different structure" in results[r][1][2]
        assert results[r][-1][:2] == ("loaded", 10)


def test_ranks_that_save_different_steps_commit_nothing(scenarios):
    tmp_path, results = spawn(scenarios, "steps")
    for r in range(2):
        assert results[r][1][0] == "failed" and "different steps ([40, 41], by rank)" in results[r][1][2]
        assert results[r][-1][:2] == ("loaded", 10)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith((".lock-", ".history"))) == ["step-000000000010"]


def test_ranks_agree_on_every_save_decision_and_on_a_preemption_seen_by_one(tmp_path):
    from tests.support.multirank_child import run_decisions

    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(run_decisions, args=(2, free_port(), str(tmp_path / "ckpt"), str(out)), nprocs=2, join=True)
    r0, r1 = (torch.load(out / f"rank{r}.pt") for r in range(2))
    # alone, rank 1's faster clock would have saved at other steps (should_save is the local view)
    assert r0["local"] != r1["local"]
    # rank 0's EveryNSeconds(3) on its clock (t = step) for all, then step 17: the notice rank 1 got
    assert r0["saved"] == r1["saved"] == [1, 4, 7, 10, 13, 16, 17]
    assert r0["preempted"] and r1["preempted"]
    assert r0["committed"] == [1, 4, 7, 10, 13, 16, 17]
    assert "different steps" in r0["mismatch"] and "[50, 51]" in r1["mismatch"]
    manifest = json.loads((tmp_path / "ckpt" / "step-000000000017" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
