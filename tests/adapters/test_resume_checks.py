"""The automatic resume check of each adapter (issue 55 item 3): an exact resume logs "resume verified" and warns
nothing; a resume whose state was changed after the restore names exactly the changed key."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_persist import PersistCheckpointIO
from persist_core import ResumeMismatchWarning
from tests.support.lightning_app import Net, make_trainer


class _Mutate(Callback):
    """Changes one key of the restored state in the user's ``on_train_start`` (after Lightning's restore)."""

    def __init__(self, change) -> None:
        self.change = change

    def on_train_start(self, trainer, pl_module) -> None:
        self.change(trainer)


def _lr(trainer) -> None:
    trainer.optimizers[0].param_groups[0]["lr"] = 0.5


def _weight(trainer) -> None:
    with torch.no_grad():
        trainer.lightning_module.net[0].weight[0, 0] += 1


def _scheduler(trainer) -> None:
    trainer.lr_scheduler_configs[0].scheduler.gamma = 0.5


def _resumed_fit(tmp_path, callbacks=(), **options) -> list[warnings.WarningMessage]:
    io = PersistCheckpointIO(local_dir=tmp_path / "local", **options)
    make_trainer(io, tmp_path / "ck", 3).fit(Net())
    io = PersistCheckpointIO(local_dir=tmp_path / "local", **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResumeMismatchWarning)
        make_trainer(io, tmp_path / "ck", 4, callbacks=list(callbacks)).fit(Net(), ckpt_path=io.latest_path())
    return [w for w in caught if issubclass(w.category, ResumeMismatchWarning)]


def test_lightning_an_exact_resume_is_verified_without_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="persist_core.load.verify"):
        assert _resumed_fit(tmp_path) == []
    lines = [r.getMessage() for r in caplog.records if "resume verified" in r.getMessage()]
    assert len(lines) == 1 and "equal step 3" in lines[0]


LIGHTNING_MUTATIONS = [(_lr, "optimizer_states/0/param_groups/0/lr"), (_weight, "state_dict/net.0.weight"),
                       (_scheduler, "lr_schedulers/0/gamma")]


@pytest.mark.parametrize("change, key", LIGHTNING_MUTATIONS, ids=[k for _, k in LIGHTNING_MUTATIONS])
def test_lightning_one_key_changed_after_the_restore_is_named_alone(tmp_path, change, key):
    caught = _resumed_fit(tmp_path, [_Mutate(change)])
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"{key}:" in message and "in 1 key(s)" in message


def test_lightning_an_intended_change_is_ignored_by_glob(tmp_path):
    assert _resumed_fit(tmp_path, [_Mutate(_lr)], verify_resume_ignore=["optimizer_states/*/lr"]) == []


# ---------------------------------------------------------------- Accelerate


def _accelerate_resume(tmp_path, change=None, **options) -> tuple[list[warnings.WarningMessage], int]:
    """Train 3 steps saving each, then resume in a fresh Accelerator, ``change(parts)`` after the restore, and train
    a step; the ResumeMismatchWarnings and the step resumed from."""
    from accelerate_persist import PersistHook
    from tests.support.accelerate_app import build, fresh_accelerator, train

    acc = fresh_accelerator()
    parts = build(acc)
    with PersistHook(local_dir=tmp_path / "ckpt", **options).register(acc):
        train(acc, *parts, start=0, stop=3, save_every=1)
    acc = fresh_accelerator()
    parts = build(acc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResumeMismatchWarning)
        with PersistHook(local_dir=tmp_path / "ckpt", **options).register(acc) as hook:
            start = hook.resume()
            if change is not None:
                change(parts)
            train(acc, *parts, start=start, stop=start + 1)
    return [w for w in caught if issubclass(w.category, ResumeMismatchWarning)], start


def test_accelerate_an_exact_resume_is_verified_without_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="persist_core.load.verify"):
        caught, start = _accelerate_resume(tmp_path)
    assert caught == [] and start == 3
    lines = [r.getMessage() for r in caplog.records if "resume verified" in r.getMessage()]
    assert len(lines) == 2 and all("equal step 3" in line for line in lines)  # the RNG and data, then the rest


def _acc_lr(parts) -> None:
    parts[1].param_groups[0]["lr"] = 0.5


def _acc_weight(parts) -> None:
    with torch.no_grad():
        parts[0][0].weight[0, 0] += 1


def _acc_counter(parts) -> None:
    parts[4].seen += 1


def _acc_rng(parts) -> None:
    torch.rand(1)  # a draw between the restore and the first forward: the RNG moved


ACCELERATE_MUTATIONS = [(_acc_lr, "optimizers/0/param_groups/0/lr"), (_acc_weight, "models/0/0.weight"),
                        (_acc_counter, "custom/0/seen")]


@pytest.mark.parametrize("change, key", ACCELERATE_MUTATIONS, ids=[k for _, k in ACCELERATE_MUTATIONS])
def test_accelerate_one_key_changed_after_the_restore_is_named_alone(tmp_path, change, key):
    caught, _ = _accelerate_resume(tmp_path, change)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"{key}:" in message and "in 1 key(s)" in message


def test_accelerate_an_rng_restore_that_failed_is_named_right_after_it(tmp_path, monkeypatch):
    from accelerate_persist import _state

    monkeypatch.setattr(_state, "_set_rng_state", lambda state: None)  # swallowed, as Accelerate's loader does
    torch.manual_seed(123)
    caught, _ = _accelerate_resume(tmp_path)
    assert len(caught) == 1 and "per_process/0/rng/torch:" in str(caught[0].message)


# ---------------------------------------------------------------- HF Trainer


class _HFMutate:
    """Changes one key of the restored state in ``on_train_begin`` (after the Trainer's restore)."""

    def __new__(cls, change):
        from transformers import TrainerCallback

        class Mutate(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                change(kwargs)

        return Mutate()


def _hf_resume(tmp_path, stop: int, changes=(), **options) -> tuple[list[warnings.WarningMessage], str]:
    """Train with the callback until ``stop`` (saving every 2 steps), then resume from the newest checkpoint with
    ``changes`` applied after the restore; the ResumeMismatchWarnings and the checkpoint resumed from."""
    pytest.importorskip("transformers")
    from accelerate_persist import PersistTrainerCallback
    from tests.adapters.test_hf_trainer import StopAt, run

    run(tmp_path / "out", [PersistTrainerCallback(local_dir=tmp_path / "ckpt", **options), StopAt(stop)])
    callback = PersistTrainerCallback(local_dir=tmp_path / "ckpt", **options)
    resume = callback.resume_path()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResumeMismatchWarning)
        run(tmp_path / "out", [callback, *(_HFMutate(c) for c in changes)], resume=resume)
    return [w for w in caught if issubclass(w.category, ResumeMismatchWarning)], resume


@pytest.mark.parametrize("stop, step", [(5, 4), (7, 6)], ids=["within-an-epoch", "at-an-epoch-boundary"])
def test_hf_an_exact_resume_is_verified_without_a_warning(tmp_path, caplog, stop, step):
    with caplog.at_level(logging.INFO, logger="persist_core.load.verify"):
        caught, resume = _hf_resume(tmp_path, stop)
    assert caught == [] and resume.endswith(f"checkpoint-{step}")
    lines = [r.getMessage() for r in caplog.records if "resume verified" in r.getMessage()]
    assert len(lines) == 2 and all(f"equal step {step}" in line for line in lines)  # the RNG, then the rest


def _hf_lr(kwargs) -> None:
    kwargs["optimizer"].param_groups[0]["lr"] = 0.5


def _hf_weight(kwargs) -> None:
    with torch.no_grad():
        kwargs["model"].classifier.weight[0, 0] += 1


HF_MUTATIONS = [(_hf_lr, "optimizer/param_groups/0/lr"), (_hf_weight, "model/classifier.weight")]


@pytest.mark.parametrize("change, key", HF_MUTATIONS, ids=[k for _, k in HF_MUTATIONS])
def test_hf_one_key_changed_after_the_restore_is_named_alone(tmp_path, change, key):
    caught, _ = _hf_resume(tmp_path, 5, [change])
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"{key}:" in message and "in 1 key(s)" in message


@pytest.mark.parametrize("stop", [5, 7], ids=["within-an-epoch", "at-an-epoch-boundary"])
def test_hf_an_rng_restore_that_failed_is_named_before_the_data_draws(tmp_path, monkeypatch, stop):
    from transformers import Trainer

    monkeypatch.setattr(Trainer, "_load_rng_state", lambda self, checkpoint: None)  # a restore that did nothing
    caught, _ = _hf_resume(tmp_path, stop)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "rng/cpu:" in message and "\n  rng:" in message and "trainer_state" not in message
