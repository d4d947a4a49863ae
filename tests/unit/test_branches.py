"""Resuming from an older checkpoint on purpose starts a new branch: the old branch's newer checkpoints
are set aside on both tiers (kept, listed as abandoned, never the latest, never pruned); a save older than
the newest committed without such a resume is refused."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from persist_core import CheckpointEngine, CheckpointReader, ConfigError, KeepLastN
from persist_core.cli import main as cli
from persist_core.tiers.local import LocalTier
from tests.support.states import assert_state_equal
from functools import partial
from tests.support import states


state_for = partial(states.state_for, shape=(256,))


@pytest.fixture
def url(remote_url):
    return remote_url


def test_a_resume_from_an_older_checkpoint_starts_a_branch_and_retention_follows_it(tmp_path, url):
    local = tmp_path / "ckpt"
    with CheckpointEngine(local, remote_url=url, keep_local=KeepLastN(2)) as engine:
        for step in (10, 20, 30):
            engine.save(state_for(step), step=step)
    with CheckpointEngine(local, remote_url=url, keep_local=KeepLastN(2)) as engine:
        assert_state_equal(engine.load(20), state_for(20))  # back to 20 on purpose
        for step in (25, 26, 27):
            engine.save(state_for(step), step=step)
        engine.wait()
        assert [c.step for c in engine.list()] == [26, 27]  # KeepLastN(2) on the live branch
        assert [c.step for c in engine.list("remote")] == [10, 20, 25, 26, 27]
        assert [a.step for a in engine.abandoned()] == [30] and [a.step for a in engine.abandoned("remote")] == [30]
    with CheckpointReader(tmp_path / "fresh", remote_url=url) as fresh:  # a fresh machine resumes the live branch
        assert_state_equal(fresh.load(), state_for(27))
    assert_state_equal(CheckpointReader(local).load(), state_for(27))
    listing = CliRunner().invoke(cli, ["ls", str(local)], catch_exceptions=False)
    assert "abandoned" in listing.output and "30" in listing.output


def test_a_save_older_than_the_newest_without_a_resume_is_refused_and_names_the_fix(tmp_path):
    with CheckpointEngine(tmp_path, keep_local=KeepLastN(2)) as engine:
        for step in (10, 20, 30):
            engine.save(state_for(step), step=step)
    with CheckpointEngine(tmp_path, keep_local=KeepLastN(2)) as engine:
        with pytest.raises(ConfigError, match=r"step=15 is older than the newest committed checkpoint \(30\).*"
                                              r"engine.load\(step\)"):
            engine.save(state_for(15), step=15)
        assert [c.step for c in engine.list()] == [20, 30]  # nothing touched
        engine.save(state_for(31), step=31)  # going forward is fine


def test_resume_from_latest_is_not_a_branch(tmp_path):
    with CheckpointEngine(tmp_path) as engine:
        for step in (1, 2):
            engine.save(state_for(step), step=step)
    with CheckpointEngine(tmp_path) as engine:
        engine.load()
        engine.save(state_for(3), step=3)
        engine.wait()
        assert engine.abandoned() == [] and [c.step for c in engine.list()] == [1, 2, 3]


def test_a_run_killed_between_the_local_and_the_remote_set_aside_never_resumes_the_abandoned_branch(tmp_path, url):
    local = tmp_path / "ckpt"
    with CheckpointEngine(local, remote_url=url) as engine:
        for step in (10, 20, 30):
            engine.save(state_for(step), step=step)
    LocalTier(local).set_aside(30, 20)  # what the killed run did before its sync thread could follow
    with CheckpointEngine(local, remote_url=url) as restarted:
        assert restarted.load()["step"] == 20  # not the remote's 30: this directory set it aside
        restarted.save(state_for(21), step=21)
        restarted.wait()
        assert [c.step for c in restarted.list("remote")] == [10, 20, 21]
        assert [a.step for a in restarted.abandoned("remote")] == [30]
    with CheckpointReader(tmp_path / "fresh", remote_url=url) as fresh:
        assert fresh.load()["step"] == 21


def test_after_a_resume_a_snapshot_and_a_save_of_the_same_steps_set_nothing_of_this_run_aside(tmp_path, url):
    """Issue 53, item 0: the branch starts once per resume; the steps this run snapshots and saves after it are the
    live branch, however the memory tier's checks and the disk's interleave."""
    from persist_core import MemoryTier
    local, memory = tmp_path / "ckpt", MemoryTier(memory_dir=tmp_path / "shm")
    with CheckpointEngine(local, remote_url=url, memory=memory, keep_local=KeepLastN(3)) as engine:
        for step in (10, 20, 30):
            engine.save(state_for(step), step=step)
    with CheckpointEngine(local, remote_url=url, memory=memory, keep_local=KeepLastN(3)) as engine:
        engine.load(20)  # back to 20 on purpose: 30 is the abandoned branch
        for step in range(21, 27):
            engine.snapshot(state_for(step), step=step)
            engine.save(state_for(step), step=step)
        engine.wait()
        assert [a.step for a in engine.abandoned()] == [30]
        assert [a.step for a in engine.abandoned("remote")] == [30]
        assert [c.step for c in engine.list()] == [24, 25, 26]
    with CheckpointEngine(local, remote_url=url, memory=memory, keep_local=KeepLastN(3)) as engine:
        engine.load()  # from the latest: no branch, whatever the order of snapshots and saves
        for step in (27, 28):
            engine.snapshot(state_for(step), step=step)
            engine.save(state_for(step), step=step)
        engine.wait()
        assert [a.step for a in engine.abandoned()] == [30] and [c.step for c in engine.list()] == [26, 27, 28]


def test_a_second_resume_in_one_engine_starts_its_own_branch(tmp_path):
    with CheckpointEngine(tmp_path) as engine:
        for step in (10, 20, 30):
            engine.save(state_for(step), step=step)
        engine.wait()
        engine.load(20)
        for step in (21, 22):
            engine.save(state_for(step), step=step)
        engine.wait()
        engine.load(21)  # back again, within the same engine
        engine.save(state_for(22) | {"again": True}, step=22)
        engine.wait()
        assert sorted(a.step for a in engine.abandoned()) == [22, 30]
        assert [c.step for c in engine.list()] == [10, 20, 21, 22] and engine.load(22)["again"] is True


def test_a_run_that_went_back_and_dies_before_its_first_commit_leaves_the_remote_as_the_local_restart_sees_it(
        tmp_path, url):
    """Issue 53, item 8: the remote's newer checkpoints leave the live branch at the moment the local ones do (their
    manifests, at once; the rest before the next upload), so a fresh machine resumes what a local restart would."""
    from persist_core import MemoryTier
    local, memory = tmp_path / "ckpt", MemoryTier(memory_dir=tmp_path / "shm")
    with CheckpointEngine(local, remote_url=url) as engine:
        for step in (10, 20, 30):
            engine.save(state_for(step), step=step)
    engine = CheckpointEngine(local, remote_url=url, memory=memory)
    engine.load(10)  # back to 10 on purpose
    engine.snapshot(state_for(11), step=11)  # the branch starts; nothing of it committed on disk yet
    with CheckpointReader(tmp_path / "fresh", remote_url=url) as fresh:  # the run is killed here: a fresh machine
        assert fresh.load()["step"] == 10 == CheckpointReader(local).load()["step"]  # and the local disk agree
    engine.close(keep_memory=True)
    with CheckpointEngine(local, remote_url=url, memory=memory) as restarted:
        assert restarted.load()["step"] == 11  # memory
        restarted.save(state_for(12), step=12)
        restarted.wait()  # the first upload of the branch finishes the remote's set-aside first
        assert [c.step for c in restarted.list("remote")] == [10, 12]
        assert [a.step for a in restarted.abandoned("remote")] == [20, 30]
    with CheckpointReader(tmp_path / "fresh2", remote_url=url) as fresh:
        assert fresh.load()["step"] == 12
