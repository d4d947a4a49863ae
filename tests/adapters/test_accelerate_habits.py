"""Accelerate habits with the hook, with the real ``Accelerator``: ``save_state(dir)`` /
``load_state(dir)``, ``ProjectConfiguration``'s automatic naming, switching a running project to
the hook, and a launcher that started processes that do not know of each other."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from accelerate.utils import ProjectConfiguration

from accelerate_persist import PersistHook
from persist_core import ConfigError
from tests.support.accelerate_app import build, fresh_accelerator, train, weights
from tests.support.states import assert_state_equal


def test_save_state_into_a_named_directory_loads_with_load_state_of_it(tmp_path):
    acc = fresh_accelerator()
    model, optimizer, *_ = parts = build(acc)
    with PersistHook(local_dir=tmp_path / "ckpt").register(acc) as hook:
        train(acc, *parts, start=0, stop=4)
        saved = weights(model), copy.deepcopy(optimizer.state_dict())
        mine = tmp_path / "my_ckpt"
        assert acc.save_state(str(mine)) == str(mine)
        hook.wait()
        assert mine.is_dir()  # a link to the committed checkpoint, made once it is committed
        train(acc, *parts, start=4, stop=7)
        acc.load_state(str(mine))
        assert hook.step == 4
        assert_state_equal(weights(model), saved[0])
        assert_state_equal(optimizer.state_dict(), saved[1])
    assert (tmp_path / "my_ckpt").is_dir()  # a directory the user named stays


def test_automatic_checkpoint_naming_and_total_limit_keep_working(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path / "proj"), automatic_checkpoint_naming=True, total_limit=2)
    acc = fresh_accelerator(project_config=config)
    model, *_ = parts = build(acc)
    with PersistHook(local_dir=tmp_path / "ckpt").register(acc) as hook:
        for stop in (2, 4, 6):
            train(acc, *parts, start=stop - 2, stop=stop)
            acc.save_state()
        hook.wait()
        names = sorted(p.name for p in (tmp_path / "proj" / "checkpoints").iterdir())
        assert names == ["checkpoint_1", "checkpoint_2"]  # the newest two, as Accelerate names and limits them
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-")) == [
            "step-000000000004", "step-000000000006"]
        at_six = weights(model)
        train(acc, *parts, start=6, stop=8)
        acc.load_state()  # the newest
        assert hook.step == 6
        assert_state_equal(weights(model), at_six)


def test_a_plain_accelerate_checkpoint_from_before_the_hook_loads_and_the_run_goes_on(tmp_path):
    acc = fresh_accelerator()
    model, *_ = parts = build(acc)
    train(acc, *parts, start=0, stop=5)
    acc.save_state(str(tmp_path / "plain"))  # Accelerate's own, before switching
    at_five = weights(model)

    acc = fresh_accelerator()
    model, *_ = parts = build(acc)
    with PersistHook(local_dir=tmp_path / "ckpt").register(acc) as hook:
        acc.load_state(str(tmp_path / "plain"))  # through Accelerate's own loader
        assert_state_equal(weights(model), at_five)
        assert hook.step == 5  # optimizer steps, read from the restored optimizer
        train(acc, *parts, start=5, stop=7)
        acc.save_state()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-")) == ["step-000000000007"]


def test_processes_a_launcher_started_without_a_process_group_are_refused(tmp_path, monkeypatch):
    acc = fresh_accelerator()
    build(acc)
    monkeypatch.setenv("WORLD_SIZE", "2")  # what `accelerate launch --num_processes 2` without cpu=True leaves
    with pytest.raises(ConfigError, match="WORLD_SIZE=2.*1 process"):
        PersistHook(local_dir=tmp_path / "ckpt").register(acc)
    assert not os.path.exists(tmp_path / "ckpt" / ".lock-rank-00000")


def shuffled(acc, *, seedable: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.arange(48 * 4, dtype=torch.float32).reshape(48, 4) / 100
    data = torch.utils.data.TensorDataset(x, torch.arange(48))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    return model, optimizer, loader


def epoch(acc, model, optimizer, loader) -> list[int]:
    order = []
    for x, idx in loader:
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        order += idx.tolist()
    return order


@pytest.mark.parametrize("seedable", [False, True])
def test_a_run_resumed_at_an_epoch_boundary_replays_neither_the_data_order_nor_the_dropout(tmp_path, seedable):
    from accelerate import DataLoaderConfiguration

    config = {"dataloader_config": DataLoaderConfiguration(use_seedable_sampler=True)} if seedable else {}
    acc = fresh_accelerator(**config)
    parts = shuffled(acc)
    straight = [epoch(acc, *parts) for _ in range(3)]
    reference = weights(parts[0])

    acc = fresh_accelerator(**config)
    parts = shuffled(acc)
    with PersistHook(local_dir=tmp_path / "ckpt").register(acc):
        first = epoch(acc, *parts)
        acc.save_state()
    acc = fresh_accelerator(**config)  # a new process: a new loader, its generator seeded as in the script
    parts = shuffled(acc)
    with PersistHook(local_dir=tmp_path / "ckpt").register(acc) as hook:
        hook.resume()
        rest = [epoch(acc, *parts) for _ in range(2)]
    assert [first, *rest] == straight  # epoch 2 is not epoch 1's permutation again
    assert_state_equal(weights(parts[0]), reference)


def test_close_logs_the_summary_once_everything_is_committed_and_uploaded(tmp_path, caplog):
    import logging

    acc = fresh_accelerator()
    parts = build(acc)
    with caplog.at_level(logging.INFO):
        with PersistHook(local_dir=tmp_path / "ckpt", remote_url=(tmp_path / "remote").as_uri()).register(acc):
            train(acc, *parts, start=0, stop=4, save_every=2)
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("persist_core")]
    summaries = [m for m in ours if m.startswith("torch-persist:")]
    assert len(summaries) == 1 and ours[-1] == summaries[0], ours
    assert "upload lag P50 -" not in summaries[0]  # measured: the uploads were done before it was written


def test_overlapped_save_state_holds_the_same_state_as_a_plain_one_step_for_step(tmp_path):
    from persist_core import CheckpointReader

    def run(d, overlap: bool) -> tuple[dict, int]:
        acc = fresh_accelerator()
        parts = build(acc)
        hook = PersistHook(local_dir=d, overlap=overlap).register(acc)
        engine = hook._session.open()
        train(acc, *parts, start=0, stop=5, save_every=1)  # each save_state() is followed by the next step at once
        runs = engine.summary()["overlapped_saves"]
        hook.close()
        with CheckpointReader(d) as reader:
            return {c.step: reader.load(c.step) for c in reader.list()}, runs

    (plain, _), (overlapped, runs) = run(tmp_path / "plain", False), run(tmp_path / "overlap", True)
    assert sorted(plain) == sorted(overlapped) == [1, 2, 3, 4, 5] and runs == 5
    for step in plain:
        assert_state_equal(overlapped[step]["models"], plain[step]["models"])
        assert_state_equal(overlapped[step]["optimizers"], plain[step]["optimizers"])
