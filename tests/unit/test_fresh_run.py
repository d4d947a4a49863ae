"""A run that loaded nothing never overwrites another run's remote checkpoints: its first save is refused
(naming the remote's newest step, the resume call and ``start_over=True``), or, with ``start_over=True``,
every committed checkpoint of both tiers is set aside as an abandoned branch (kept, listed, never pruned)."""

from __future__ import annotations

import fsspec
import pytest

from persist_core import CheckpointEngine, CheckpointReader, ConfigError, KeepLastN
from tests.support.states import assert_state_equal
from functools import partial
from tests.support import states


state_for = partial(states.state_for, shape=(256,))


def remote_bytes(url: str) -> dict[str, bytes]:
    """Every object under ``url`` (but the lease) by its path below it, with its bytes."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return {path[len(root.rstrip("/")):]: fs.cat_file(path) for path in fs.find(root) if not path.endswith(".lease.json")}


def machine_one(tmp_path, url) -> dict[str, bytes]:
    with CheckpointEngine(tmp_path / "m1", remote_url=url) as engine:
        for step in (8, 16):
            engine.save(state_for(step), step=step)
    return remote_bytes(url)


def test_a_fresh_machine_that_does_not_resume_is_refused_and_the_remote_keeps_every_byte(tmp_path, remote_url):
    before = machine_one(tmp_path, remote_url)
    with CheckpointEngine(tmp_path / "m2", remote_url=remote_url) as engine:
        for step in (8, 24):  # the same step as machine 1's, and a newer one: both refused
            with pytest.raises(ConfigError, match=r"newest step 16.*engine\.load\(\).*start_over=True"):
                engine.save(state_for(step, seed=0.5), step=step)
        engine.wait()
        assert engine.list() == []  # nothing of this run was written
    assert remote_bytes(remote_url) == before


def test_start_over_sets_every_committed_checkpoint_of_both_tiers_aside(tmp_path, remote_url):
    before = machine_one(tmp_path, remote_url)
    with CheckpointEngine(tmp_path / "m1", remote_url=remote_url, start_over=True, keep_local=KeepLastN(1)) as engine:
        engine.save(state_for(8, seed=0.5), step=8)
        engine.save(state_for(9, seed=0.5), step=9)
        engine.wait()
        assert [c.step for c in engine.list("remote")] == [8, 9]
        assert [a.step for a in engine.abandoned()] == [8, 16]
        assert [a.step for a in engine.abandoned("remote")] == [8, 16]
        assert [c.step for c in engine.list()] == [9]  # retention sees the live branch only
    kept = {name.split("/", 2)[-1]: data for name, data in remote_bytes(remote_url).items() if "abandoned-" in name}
    assert kept == {name.split("/", 2)[-1]: data for name, data in before.items()}  # every byte, set aside
    with CheckpointReader(tmp_path / "fresh", remote_url=remote_url) as fresh:
        assert_state_equal(fresh.load(), state_for(9, seed=0.5))


def test_a_run_that_resumed_saves_as_before_and_an_empty_remote_needs_no_resume(tmp_path, remote_url):
    machine_one(tmp_path, remote_url)
    with CheckpointEngine(tmp_path / "m2", remote_url=remote_url) as engine:
        assert engine.load()["step"] == 16
        engine.save(state_for(24), step=24)
        engine.wait()
        assert [c.step for c in engine.list("remote")] == [8, 16, 24]
    with CheckpointEngine(tmp_path / "other", remote_url=remote_url + "-empty") as engine:
        engine.save(state_for(1), step=1)
        engine.wait()
        assert [c.step for c in engine.list("remote")] == [1]


def test_start_over_must_be_a_bool(tmp_path):
    with pytest.raises(ConfigError, match="start_over='yes'"):
        CheckpointEngine(tmp_path, start_over="yes")
