"""Named links (persist_core/links.py): one name -> the newest committed step saved for it, kept by retention;
and the session wiring both adapters use (PersistSession.link, the retention the links add)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from persist_core import KeepLastN, PersistError
from persist_core.config import Config
from persist_core.layout import FULL, WEIGHTS_ONLY, checkpoint_dirname, kind_subdir
from persist_core.links import Links
from persist_core.session import PersistSession
from tests.support.states import state_for


def committed(local: Path, *steps: int, kind: str = FULL) -> None:
    """Checkpoint directories as a commit leaves them (Links looks at nothing inside but ``file_name``)."""
    for step in steps:
        (local / kind_subdir(kind) / checkpoint_dirname(step)).mkdir(parents=True)


def names(path: Path) -> str:
    return os.path.basename(os.path.realpath(path))


def test_a_name_links_to_its_newest_committed_request_whatever_order_commits_land_in(tmp_path):
    local, name = tmp_path / "ckpt", str(tmp_path / "out" / "last.ckpt")
    committed(local, 1, 2)
    links = Links(local)
    links.intend(name, 1)
    links.intend(name, 2)
    assert links.intended(name) == (FULL, 2) and links.steps() == {1, 2}
    links.on_committed(name, 2, True)
    links.on_committed(name, 1, True)  # older, committed later: the link stays on 2
    assert names(Path(name)) == checkpoint_dirname(2) and os.path.islink(name)
    assert links.steps() == {2} and links.intended(name) == (FULL, 2)


def test_a_save_that_did_not_commit_links_nothing_and_keeps_nothing(tmp_path):
    local, name = tmp_path / "ckpt", str(tmp_path / "mine")
    links = Links(local)
    links.intend(name, 3)
    links.on_committed(name, 3, False)
    assert not os.path.lexists(name) and links.steps() == set() and links.intended(name) is None


def test_kinds_are_kept_apart_and_a_file_name_is_linked_when_the_checkpoint_has_it(tmp_path):
    local = tmp_path / "ckpt"
    committed(local, 4)
    committed(local, 4, kind=WEIGHTS_ONLY)
    (local / checkpoint_dirname(4) / "rank-00000.ckpt").write_bytes(b"x")
    links = Links(local, file_name="rank-00000.ckpt")
    full, weights = str(tmp_path / "full.ckpt"), str(tmp_path / "weights.ckpt")
    links.intend(full, 4)
    links.intend(weights, 4, WEIGHTS_ONLY)
    links.on_committed(full, 4, True)
    links.on_committed(weights, 4, True, WEIGHTS_ONLY)
    assert os.path.realpath(full) == str((local / checkpoint_dirname(4) / "rank-00000.ckpt").resolve())
    assert os.path.realpath(weights) == str((local / WEIGHTS_ONLY / checkpoint_dirname(4)).resolve())
    assert links.steps(FULL) == {4} and links.steps(WEIGHTS_ONLY) == {4}
    assert links.checkpoint_named(full) == ((FULL, 4), (local / checkpoint_dirname(4)).resolve())


def test_a_link_removed_by_hand_or_by_remove_keeps_its_step_no_longer(tmp_path):
    local = tmp_path / "ckpt"
    committed(local, 1, 2)
    links = Links(local)
    mine, theirs = str(tmp_path / "a"), str(tmp_path / "b")
    for name, step in ((mine, 1), (theirs, 2)):
        links.intend(name, step)
        links.on_committed(name, step, True)
    os.unlink(mine)
    links.remove(theirs)
    assert links.steps() == set() and not os.path.lexists(theirs)


def test_automatic_names_are_not_kept_and_sweep_the_links_beside_them_to_removed_checkpoints(tmp_path):
    local, auto = tmp_path / "ckpt", tmp_path / "proj" / "checkpoints"
    committed(local, 2, 4)
    links = Links(local)
    for i, step in enumerate((2, 4)):
        links.intend(str(auto / f"checkpoint_{i}"), step, automatic=True)
        links.on_committed(str(auto / f"checkpoint_{i}"), step, True)
    os.symlink(tmp_path / "elsewhere", auto / "not-ours")  # dangling, but not a link to local_dir: left alone
    assert links.steps() == set()
    (local / checkpoint_dirname(2)).rmdir()  # retention removed it
    committed(local, 6)
    links.intend(str(auto / "checkpoint_2"), 6, automatic=True)
    links.on_committed(str(auto / "checkpoint_2"), 6, True)
    assert sorted(p.name for p in auto.iterdir()) == ["checkpoint_1", "checkpoint_2", "not-ours"]


def test_adopt_keeps_an_earlier_runs_links_and_removes_dead_ones_sweep_removes_those_that_died_since(tmp_path):
    local, out = tmp_path / "ckpt", tmp_path / "out"
    committed(local, 1, 2, 3)
    out.mkdir()
    for step in (1, 2, 3):
        os.symlink(local / checkpoint_dirname(step), out / f"s{step}")
    (local / checkpoint_dirname(1)).rmdir()
    links = Links(local)
    links.adopt(str(out))
    assert links.steps() == {2, 3} and not os.path.lexists(out / "s1")
    (local / checkpoint_dirname(2)).rmdir()  # set aside by a branch, or `persist gc`
    links.sweep()
    assert sorted(p.name for p in out.iterdir()) == ["s3"] and links.steps() == {3}


def test_a_link_that_fails_is_raised_once(tmp_path):
    local = tmp_path / "ckpt"
    committed(local, 1)
    (tmp_path / "file").write_text("not a directory")
    links = Links(local)
    name = str(tmp_path / "file" / "last.ckpt")
    links.intend(name, 1)
    links.on_committed(name, 1, True)  # the writer thread's callback does not raise
    with pytest.raises(PersistError, match="linking"):
        links.raise_errors()
    links.raise_errors()


def steps_in(local: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in local.iterdir() if p.name.startswith("step-"))


@pytest.mark.parametrize("retain_only_linked, retention, kept", [
    (True, None, [1, 3]),  # Lightning without a policy: what a name links to, and the newest
    (False, None, [1, 2, 3]),  # Accelerate without a policy: everything
    (False, KeepLastN(1), [1, 3]),  # a policy: the newest one, and what a name links to
])
def test_the_session_links_names_and_keeps_what_they_link_to(tmp_path, retain_only_linked, retention, kept):
    local = tmp_path / "ckpt"
    links = Links(local, retain_only_linked=retain_only_linked)
    session = PersistSession(Config(local_dir=local, keep_local=retention), resume_hint="resume", links=links)
    try:
        for step in (1, 2, 3):
            handle = session.save(state_for(step, (4,)), step)
            if step == 1:
                session.link(str(tmp_path / "mine"), step, handle)
            session.wait()
    finally:
        session.close()
    assert steps_in(local) == kept and names(tmp_path / "mine") == checkpoint_dirname(1)
    session.link(str(tmp_path / "restored"), 2 if 2 in kept else 3, None)  # no handle (restored from it): now
    assert os.path.islink(tmp_path / "restored")
