"""Incremental saves with a remote (issue 43, step c) on fsspec's memory file system: only the files holding new
bytes go up, a referenced checkpoint before its dependents and its dependents' manifests after it; remote retention
keeps what a kept checkpoint references and removes the newest first; a fresh machine restores a referencing
checkpoint bit-exact by ranged reads of the referenced files; a whole remote load that leaves no local copy makes the
next save full; a restart uploads exactly what the un-synced record says was not uploaded."""

from __future__ import annotations

import json

import fsspec
import pytest
import torch

from persist_core import CheckpointEngine, CheckpointReader, KeepLastN
from persist_core.format.manifest import Manifest
from persist_core.tiers.remote import RemoteTier
from tests.support.states import assert_state_equal

BASE = 1 << 18  # float32 elements of the frozen base: 1 MiB


def _state(step: int, base: torch.Tensor) -> dict:
    """A frozen base and a small trainable adapter with Adam-like state, the adapter's bytes saying the step."""
    adapter = torch.randn(64, 16, generator=torch.Generator().manual_seed(step))
    return {"model": {"base.weight": base, "tied": base[:8], "adapter": adapter},
            "optim": {"exp_avg": adapter * 0.1, "exp_avg_sq": adapter * adapter, "lr": 1e-3}, "step": step}


def _frozen() -> torch.Tensor:
    return torch.randn(BASE, generator=torch.Generator().manual_seed(1234))


@pytest.fixture
def url(memory_url):
    return memory_url


@pytest.fixture
def uploads(monkeypatch):
    """Every upload the remote tier makes, in order: ``(step, [file names], manifest-last)``."""
    seen: list[tuple[int, list[str]]] = []
    real = RemoteTier.upload

    def spy(self, local_ckpt, manifest, *, files=None):
        names = [f.name for f in (manifest.held() if files is None else files)]
        missing = manifest.depends_on() - set(self.committed_steps())
        assert not missing, f"step {manifest.step} went up before the steps it references: {missing}"
        seen.append((manifest.step, names))
        real(self, local_ckpt, manifest, files=files)

    monkeypatch.setattr(RemoteTier, "upload", spy)
    return seen


def _remote_manifest(url: str, step: int) -> Manifest:
    fs, root = fsspec.core.url_to_fs(url)
    return Manifest.from_bytes(fs.cat_file(f"{root}/step-{step:012d}/manifest.json"), where="remote")


def _remote_bytes(url: str, step: int) -> int:
    fs, root = fsspec.core.url_to_fs(url)
    return sum(fs.size(p) for p in fs.find(f"{root}/step-{step:012d}") if not p.endswith("manifest.json"))


def test_only_new_bytes_go_up_referenced_first_and_a_fresh_machine_restores_bit_exact(tmp_path, url, uploads):
    base = _frozen()
    states = {step: _state(step, base) for step in range(1, 6)}
    with CheckpointEngine(tmp_path / "a", remote_url=url, incremental=True, full_every=10, direct_io="off") as engine:
        for step, state in states.items():
            engine.save(state, step=step)
        engine.wait()
    assert [s for s, _ in uploads] == [1, 2, 3, 4, 5]
    assert _remote_bytes(url, 1) > 4 * BASE  # the full one
    for step in range(2, 6):  # the referencing ones: their own small shard, no referenced file again
        assert _remote_manifest(url, step).depends_on() == {1}
        assert _remote_bytes(url, step) < 64 * 1024, step
        assert _remote_bytes(url, step) == sum(f.size for f in _remote_manifest(url, step).files)
    with CheckpointReader(tmp_path / "fresh", tier=RemoteTier(url)) as reader:  # a fresh machine, whole loads
        for step, state in states.items():
            assert_state_equal(reader.load(step=step), state)
            assert reader.loaded_from_remote
        into = _state(0, torch.zeros(BASE))
        into["model"]["tied"] = torch.zeros(8)
        loaded = reader.load(step=4, into=into)  # into targets: ranged reads of the referenced file's entries
        assert_state_equal(loaded, states[4])
        assert loaded["model"]["base.weight"] is into["model"]["base.weight"]
        assert reader.last_load.remote_bytes < 4 * BASE + 64 * 1024 + 2 * (256 << 10)


def test_a_fresh_machine_resumes_from_a_referencing_checkpoint_and_its_next_save_is_full(tmp_path, url):
    base = _frozen()
    with CheckpointEngine(tmp_path / "a", remote_url=url, incremental=True, direct_io="off") as engine:
        for step in (1, 2, 3):
            engine.save(_state(step, base), step=step)
    with CheckpointEngine(tmp_path / "b", remote_url=url, incremental=True, direct_io="off") as engine:
        assert_state_equal(engine.load(), _state(3, base))  # step 3 references step 1, which is not local
        engine._reader.wait_copies()
        assert not (tmp_path / "b" / f"step-{3:012d}").exists()  # no local copy that would reference missing bytes
        engine.save(_state(4, base), step=4).wait()
        assert Manifest.from_bytes((tmp_path / "b" / f"step-{4:012d}" / "manifest.json").read_bytes(),
                                   where="m").depends_on() == set()  # full: nothing local to reference
        engine.save(_state(5, base), step=5).wait()
    assert _remote_manifest(url, 5).depends_on() == {4}
    with CheckpointReader(tmp_path / "c", tier=RemoteTier(url)) as reader:
        assert_state_equal(reader.load(), _state(5, base))


def test_remote_retention_keeps_what_a_kept_checkpoint_references_and_removes_the_newest_first(tmp_path, url,
                                                                                               monkeypatch):
    removed: list[int] = []
    real = RemoteTier.remove
    monkeypatch.setattr(RemoteTier, "remove", lambda self, step: (removed.append(step), real(self, step))[1])
    base = _frozen()
    with CheckpointEngine(tmp_path / "a", remote_url=url, incremental=True, full_every=4, keep_remote=KeepLastN(2),
                          direct_io="off") as engine:
        for step in range(1, 8):
            engine.save(_state(step, base), step=step).wait()
    remote = sorted(RemoteTier(url).committed_steps())
    assert remote == [5, 6, 7]  # 5 (full) is referenced by 6 and 7
    assert removed == [2, 3, 4, 1]  # 4 and 1 in one pass: the newest first (a kill between leaves no dangling one)
    with CheckpointReader(tmp_path / "fresh", tier=RemoteTier(url)) as reader:
        for step in remote:
            assert_state_equal(reader.load(step=step), _state(step, base))


def test_a_referenced_checkpoint_is_never_superseded_in_the_upload_queue(tmp_path, url, uploads):
    """The remote is behind (its first upload held): the queued ones that the policy would drop are superseded,
    except one that a queued checkpoint references."""
    import threading

    gate, started = threading.Event(), threading.Event()
    real = RemoteTier.upload_files

    def held(self, local_ckpt, step, files):
        started.set()
        assert gate.wait(30)
        real(self, local_ckpt, step, files)

    base = _frozen()
    engine = CheckpointEngine(tmp_path / "a", remote_url=url, incremental=True, full_every=3, keep_remote=KeepLastN(1),
                              direct_io="off", remote_timeout_s=20)  # a regression fails in 20 s, not 300
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(RemoteTier, "upload_files", held)
            handles = [engine.save(_state(1, base), step=1)]
            assert started.wait(30)
            for step in range(2, 7):  # 4 is full; 5 and 6 reference it
                handles.append(engine.save(_state(step, base), step=step))
                handles[-1].wait_local()
            gate.set()
            engine.wait()
        superseded = [h.step for h in handles if h.stats.superseded]
    finally:
        engine.close()
    assert superseded == [2, 3, 5]
    assert [s for s, _ in uploads] == [1, 4, 6]
    assert _remote_manifest(url, 6).depends_on() == {4}
    with CheckpointReader(tmp_path / "fresh", tier=RemoteTier(url)) as reader:
        assert_state_equal(reader.load(), _state(6, base))


def test_a_restart_uploads_exactly_what_was_not_uploaded(tmp_path, url, uploads):
    """Remote retention removed steps 1-2 that the local disk keeps: a restart does not upload them again; a step
    committed after the record was written (a kill in between) is uploaded."""
    base = _frozen()
    root = tmp_path / "a"
    with CheckpointEngine(root, remote_url=url, keep_remote=KeepLastN(1), incremental=True, direct_io="off") as engine:
        for step in (1, 2, 3):
            engine.save(_state(step, base), step=step).wait()
    assert sorted(RemoteTier(url).committed_steps()) == [1, 3]  # 3 references 1
    record = json.loads((root / ".unsynced.json").read_text())
    assert record["steps"] == [] and record["through"] == 3
    uploads.clear()
    with CheckpointEngine(root, remote_url=url, keep_remote=KeepLastN(1), incremental=True, direct_io="off") as engine:
        engine.wait()
    assert uploads == []  # step 2 is on the local disk only, and was uploaded once already
    # a kill after committing step 4 and before the record said so: step 4 is newer than the record and goes up
    with CheckpointEngine(root, incremental=True, direct_io="off") as engine:  # no remote: the record stays
        engine.load(step=3)
        engine.save(_state(4, base), step=4).wait()
    with CheckpointEngine(root, remote_url=url, keep_remote=KeepLastN(1), incremental=True, direct_io="off") as engine:
        engine.wait()
    assert [s for s, _ in uploads] == [4]
    with CheckpointReader(tmp_path / "fresh", tier=RemoteTier(url)) as reader:
        assert_state_equal(reader.load(), _state(4, base))


def test_a_dependency_the_remote_lost_is_uploaded_again_before_its_dependent(tmp_path, url, uploads):
    """A referenced checkpoint that is not on the remote (removed there by hand) goes up again from the local disk
    before the checkpoint that references it, at the next engine's start."""
    base = _frozen()
    root = tmp_path / "a"
    with CheckpointEngine(root, incremental=True, direct_io="off") as engine:  # saved before there was a remote
        for step in (1, 2):
            engine.save(_state(step, base), step=step).wait()
    (root / ".unsynced.json").write_text(json.dumps({"remote": url, "steps": [2], "updated": 0.0, "through": 2}))
    with CheckpointEngine(root, remote_url=url, incremental=True, direct_io="off") as engine:
        engine.wait()
    assert [s for s, _ in uploads] == [1, 2]
    with CheckpointReader(tmp_path / "fresh", tier=RemoteTier(url)) as reader:
        assert_state_equal(reader.load(), _state(2, base))


def test_remote_retention_keeps_what_a_set_aside_branch_references(tmp_path, url):
    """A resume from step 1 sets step 2 (which references 1) aside, on the remote too; the new branch's saves reference
    1 no more, yet remote retention keeps it: the set-aside copy there still needs its bytes."""
    base = _frozen()
    root = tmp_path / "a"
    options = dict(remote_url=url, incremental=True, full_every=2, keep_remote=KeepLastN(1), direct_io="off")
    with CheckpointEngine(root, **options) as engine:
        for step in (1, 2):
            engine.save(_state(step, base), step=step).wait()
    with CheckpointEngine(root, **options) as engine:
        engine.load(step=1)
        for step in (2, 3, 4, 5):  # 2 references 1; 3 is full, 4 references 3, 5 is full
            engine.save(_state(100 + step, base), step=step).wait()
    assert _remote_manifest(url, 5).depends_on() == set()
    assert sorted(RemoteTier(url).committed_steps()) == [1, 5]  # 1: the set-aside step 2 references it
    aside = [c for c in RemoteTier(url).abandoned() if c.step == 2]
    assert len(aside) == 1


def test_after_a_remote_load_that_left_no_local_copy_the_next_save_is_full_not_referencing_an_older_local_one(
        tmp_path, url):
    base = _frozen()
    with CheckpointEngine(tmp_path / "a", remote_url=url, incremental=True, full_every=2, direct_io="off") as engine:
        for step in (1, 2, 3, 4):  # 1 full, 2 references 1, 3 full, 4 references 3
            engine.save(_state(step, base), step=step)
    b = tmp_path / "b"
    with CheckpointReader(b, tier=RemoteTier(url)) as reader:
        reader.fetch(2)  # this machine holds 1 and 2 (an older pull)
    with CheckpointEngine(b, remote_url=url, incremental=True, direct_io="off") as engine:  # full_every=10
        assert_state_equal(engine.load(), _state(4, base))  # from the remote; 3 is not here: no local copy of 4
        assert engine._reader.loaded_from_remote
        engine._reader.wait_copies()
        engine.save(_state(5, base), step=5).wait()
        engine.save(_state(6, base), step=6).wait()
    assert _remote_manifest(url, 5).depends_on() == set()  # full: not a reference to step 1 the run went past
    assert _remote_manifest(url, 6).depends_on() == {5}
    with CheckpointReader(tmp_path / "c", tier=RemoteTier(url)) as reader:
        assert_state_equal(reader.load(), _state(6, base))
