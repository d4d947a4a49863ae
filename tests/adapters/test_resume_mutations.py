"""More of issue 55's mutation tests, one per compared key group the first set left out: change exactly one key
during or after the restore, and the warning names exactly that key. Lightning: a callback's state, the
datamodule's, the precision plugin's GradScaler. Accelerate: the GradScaler, a dataloader's sampler generator, a
registered object's tensor. HF Trainer: the GradScaler, which the callback now saves, restores and checks."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.callbacks import Callback

from lightning_persist import PersistCheckpointIO
from persist_core import ResumeMismatchWarning
from tests.support.lightning_app import Net, checkpoint_callback

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


def _named_alone(caught: list[warnings.WarningMessage], key: str) -> None:
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert f"{key}:" in message and "in 1 key(s)" in message, message


def _mismatches(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, ResumeMismatchWarning)]


# ---------------------------------------------------------------- Lightning


class Counting(Callback):
    """A callback with state: the batches it saw."""

    def __init__(self) -> None:
        self.seen = 0

    def on_train_batch_end(self, *args) -> None:
        self.seen += 1

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


class Data(LightningDataModule):
    """A datamodule with state (a fresh one's differs from the saved one's until the restore)."""

    def __init__(self, handed: int = 0) -> None:
        super().__init__()
        self.handed = handed

    def train_dataloader(self):
        return Net().train_dataloader()

    def state_dict(self) -> dict:
        return {"handed": self.handed}

    def load_state_dict(self, state: dict) -> None:
        self.handed = state["handed"]


class _Change(Callback):
    """Changes one key in the user's ``on_train_start`` (after Lightning's restore)."""

    def __init__(self, change) -> None:
        self.change = change

    def on_train_start(self, trainer, pl_module) -> None:
        if self.change is not None:
            self.change(trainer)


def _precision():
    from lightning.pytorch.plugins.precision import MixedPrecision

    # a GradScaler on the CPU, as on a GPU with fp16 (bf16 autocast: the CPU's)
    plugin = MixedPrecision("bf16-mixed", device="cpu")
    plugin.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    return plugin


def _lightning(tmp_path, change=None) -> list[warnings.WarningMessage]:
    def fit(steps: int, ckpt_path=None, extra=()):
        io = PersistCheckpointIO(local_dir=tmp_path / "local")
        trainer = Trainer(max_steps=steps, plugins=[io, _precision()], accelerator="cpu", devices=1, logger=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[checkpoint_callback(tmp_path / "ck"), Counting(), *extra])
        trainer.fit(Net(), datamodule=Data(0 if ckpt_path else 7), ckpt_path=ckpt_path(io) if ckpt_path else None)
        return trainer

    fit(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResumeMismatchWarning)
        trainer = fit(4, ckpt_path=lambda io: io.latest_path(), extra=[_Change(change)])
    assert trainer.global_step == 4
    return _mismatches(caught)


def _callback_state(trainer) -> None:
    next(cb for cb in trainer.callbacks if isinstance(cb, Counting)).seen += 10


def _datamodule_state(trainer) -> None:
    trainer.datamodule.handed += 10


def _scaler_state(trainer) -> None:
    trainer.precision_plugin.scaler.set_growth_factor(3.0)


LIGHTNING = [(None, None), (_callback_state, "callbacks/Counting/seen"), (_datamodule_state, "Data/handed"),
             (_scaler_state, "MixedPrecision/growth_factor")]


@pytest.mark.parametrize("change, key", LIGHTNING, ids=["exact", *(k for _, k in LIGHTNING[1:])])
def test_lightning_callback_datamodule_and_scaler_state_each_named_alone(tmp_path, change, key):
    caught = _lightning(tmp_path, change)
    if key is None:
        assert caught == [], [str(w.message) for w in caught]
    else:
        _named_alone(caught, key)


# ---------------------------------------------------------------- Accelerate


def _accelerate(tmp_path, change=None, during=None, monkeypatch=None) -> list[warnings.WarningMessage]:
    from accelerate_persist import PersistHook
    from tests.support.accelerate_app import Buffer, fresh_accelerator, scaled_parts, scaled_steps

    acc = fresh_accelerator()
    parts = scaled_parts(acc, Buffer())
    with PersistHook(local_dir=tmp_path / "ckpt").register(acc) as hook:
        scaled_steps(acc, parts, 0, 3)
        acc.save_state()
    acc = fresh_accelerator()
    parts = scaled_parts(acc, Buffer())
    if during is not None:
        during(monkeypatch, acc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResumeMismatchWarning)
        with PersistHook(local_dir=tmp_path / "ckpt").register(acc) as hook:
            start = hook.resume()
            assert start == 3
            if change is not None:
                change(acc, parts)
            scaled_steps(acc, parts, start, start + 1)
    return _mismatches(caught)


def _acc_scaler(acc, parts) -> None:
    acc.scaler.set_growth_factor(3.0)


def _acc_registered(acc, parts) -> None:
    parts[3].ema[1] += 1


def _sampler_dropped(monkeypatch, acc) -> None:
    from accelerate_persist import _state

    monkeypatch.setattr(_state, "_restore_dataloader", lambda dataloader, state: None)  # the data state dropped


ACCELERATE = [(None, None, None), (_acc_scaler, None, "scaler/growth_factor"),
              (_acc_registered, None, "custom/0/ema"), (None, _sampler_dropped, "dataloaders/0/generators/0")]


@pytest.mark.parametrize("change, during, key", ACCELERATE, ids=["exact", *(k for *_, k in ACCELERATE[1:])])
def test_accelerate_scaler_sampler_and_registered_state_each_named_alone(tmp_path, monkeypatch, change, during, key):
    caught = _accelerate(tmp_path, change, during, monkeypatch)
    if key is None:
        assert caught == [], [str(w.message) for w in caught]
    else:
        _named_alone(caught, key)


# ---------------------------------------------------------------- HF Trainer


def _hf_run(out, callbacks, resume=None, stop=None):
    from transformers import Trainer, TrainingArguments

    from tests.adapters.test_hf_trainer import StopAt, data, model

    args = TrainingArguments(output_dir=str(out), max_steps=6, save_steps=2, per_device_train_batch_size=4,
                             learning_rate=5e-3, report_to=[], use_cpu=True, seed=0, logging_strategy="no",
                             disable_tqdm=True)
    trainer = Trainer(model=model(), args=args, train_dataset=data(),
                      callbacks=[*callbacks, *([StopAt(stop)] if stop else [])])
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)  # as fp16 on GPU
    trainer.train(resume_from_checkpoint=resume)
    return trainer


class _HFChange:
    def __new__(cls, change):
        from transformers import TrainerCallback

        class Change(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                change(kwargs)

        return Change()


@pytest.mark.slow
def test_hf_the_grad_scaler_is_saved_restored_and_checked(tmp_path):
    pytest.importorskip("transformers")
    from accelerate_persist import PersistTrainerCallback

    straight = _hf_run(tmp_path / "straight", []).accelerator.scaler.state_dict()
    _hf_run(tmp_path / "out", [PersistTrainerCallback(local_dir=tmp_path / "ckpt")], stop=5)
    callback = PersistTrainerCallback(local_dir=tmp_path / "ckpt")
    resume = callback.resume_path()
    assert resume.endswith("checkpoint-4") and (tmp_path / "ckpt" / ".trainer" / "checkpoint-4" / "scaler.pt").is_file()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResumeMismatchWarning)
        resumed = _hf_run(tmp_path / "out", [callback], resume=resume).accelerator.scaler.state_dict()
    assert _mismatches(caught) == []
    assert resumed == straight  # the scale grew on from step 4's, as in the uninterrupted run
    # the same resume with the scaler changed after the restore: named alone
    callback = PersistTrainerCallback(local_dir=tmp_path / "ckpt")  # the resumed run saved step 6: resume from 4
    callback._check.loaded(4, callback._session.reader.load(step=4)["trainer_state"])  # as resume_path() does
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResumeMismatchWarning)
        _hf_run(tmp_path / "out2", [callback, _HFChange(lambda kw: kw["optimizer"].scaler.set_growth_factor(3.0))],
                resume=resume)
    _named_alone(_mismatches(caught), "scaler/growth_factor")


def test_accelerate_a_resume_on_fewer_processes_says_whose_rng_it_could_not_restore(tmp_path, monkeypatch, caplog):
    import logging

    from accelerate_persist import PersistHook, _state
    from tests.support.accelerate_app import Buffer, fresh_accelerator, scaled_parts, scaled_steps

    acc = fresh_accelerator()
    parts = scaled_parts(acc, Buffer())
    with PersistHook(local_dir=tmp_path / "ckpt").register(acc):
        scaled_steps(acc, parts, 0, 3)
        gather = _state._gather
        with monkeypatch.context() as m:  # as if two processes saved: process 1's RNG drew once more
            m.setattr(_state, "_gather", lambda a, value: [value, {**value, "step": value["step"] + 1}])
            acc.save_state()
    assert _state._gather is gather
    acc = fresh_accelerator()
    parts = scaled_parts(acc, Buffer())
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always", ResumeMismatchWarning)
        with PersistHook(local_dir=tmp_path / "ckpt").register(acc) as hook:
            scaled_steps(acc, parts, hook.resume(), 4)
    assert _mismatches(caught) == []  # process 0's state is compared and equal; process 1's is said, not a mismatch
    said = [r.getMessage() for r in caplog.records]
    lost = [s for s in said if "restored on no process" in s]
    assert len(lost) == 1 and "resumed on 1 process(es) from a checkpoint 2 process(es) wrote" in lost[0]
    assert "RNG states and step of process(es) 1 " in lost[0] and "dataloaders' positions" in lost[0]
    assert any("per_process/1 not verified (resharded" in s for s in said)
    assert sum("resume verified" in s for s in said) == 2


def test_accelerate_not_restored_names_the_processes_that_took_process_0s_state():
    from accelerate_persist._verify import not_restored

    said = not_restored(2, 4)
    assert "process(es) 2..3 took process 0's RNG states and step" in said and "repeat process 0's" in said
