"""``PersistTrainerCallback`` with the real Hugging Face ``Trainer`` (a tiny model built from a config)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from accelerate_persist import PersistTrainerCallback  # noqa: E402
from persist_core import CheckpointReader, ConfigError  # noqa: E402
from tests.support.states import assert_state_equal  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")


def model() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=2)
    return BertForSequenceClassification(config)


def data() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (24, 8), generator=g)
    return [{"input_ids": ids[i], "labels": int(ids[i].sum()) % 2} for i in range(24)]


class StopAt(TrainerCallback):
    """Ends training after ``step`` (a kill after it, as far as the checkpoints know)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def train(out, callbacks, resume=None, eval_dataset=None, **overrides) -> Trainer:
    options = dict(output_dir=str(out), max_steps=8, save_steps=2, per_device_train_batch_size=4, learning_rate=5e-3,
                   report_to=[], use_cpu=True, seed=0, logging_strategy="no", disable_tqdm=True)
    options.update(overrides)
    trainer = Trainer(model=model(), args=TrainingArguments(**options), train_dataset=data(), eval_dataset=eval_dataset,
                      callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def run(out, callbacks, resume=None, **overrides) -> BertForSequenceClassification:
    return train(out, callbacks, resume, **overrides).model


def test_the_callback_takes_over_the_trainers_saves_and_resumes_exactly_as_the_trainer_would(tmp_path):
    straight = run(tmp_path / "straight", [])
    # the Trainer's own saves, killed after step 5 and resumed from its checkpoint-4
    run(tmp_path / "native", [StopAt(5)])
    native = run(tmp_path / "native", [], resume=str(tmp_path / "native" / "checkpoint-4"))
    # the same through the callback, synced to a remote, resumed on a fresh machine
    url = (tmp_path / "remote").as_uri()
    callback = PersistTrainerCallback(local_dir=tmp_path / "ckpt", remote_url=url, keep_last=2)
    run(tmp_path / "ours", [callback, StopAt(5)])
    assert callback.saved_steps == [2, 4]
    assert not list((tmp_path / "ours").glob("checkpoint-*"))  # the Trainer wrote nothing of its own
    fresh = PersistTrainerCallback(local_dir=tmp_path / "fresh", remote_url=url, keep_last=2)
    resume = fresh.resume_path()
    assert resume is not None and resume.endswith("checkpoint-4")
    assert sorted(p.name for p in (tmp_path / "fresh" / ".trainer" / "checkpoint-4").iterdir()) == [
        "config.json", "model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt", "trainer_state.json"]
    ours = run(tmp_path / "ours2", [fresh], resume=resume)
    assert_state_equal(ours.state_dict(), native.state_dict())  # every file the Trainer reads was right
    assert_state_equal(ours.state_dict(), straight.state_dict())  # and that is the uninterrupted run
    assert PersistTrainerCallback(local_dir=tmp_path / "empty").resume_path() is None  # a first run


@pytest.mark.parametrize("option, value", [("save_total_limit", 2), ("load_best_model_at_end", True)])
def test_options_that_need_the_trainers_own_directories_are_refused_when_the_trainer_is_built(tmp_path, option, value):
    extra = {"eval_strategy": "steps", "eval_steps": 2} if option == "load_best_model_at_end" else {}
    args = TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=2, save_steps=2, report_to=[], use_cpu=True,
                             **{option: value}, **extra)
    with pytest.raises(ConfigError, match=option):
        Trainer(model=model(), args=args, train_dataset=data(), eval_dataset=data(),
                callbacks=[PersistTrainerCallback(local_dir=tmp_path / "ckpt")])


def test_each_file_resume_path_writes_is_one_the_trainer_uses(tmp_path):
    straight = run(tmp_path / "straight", [])
    run(tmp_path / "ours", [PersistTrainerCallback(local_dir=tmp_path / "ckpt"), StopAt(5)])
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        callback = PersistTrainerCallback(local_dir=tmp_path / "ckpt")
        resume = callback.resume_path()
        (tmp_path / "ckpt" / ".trainer" / "checkpoint-4" / name).rename(tmp_path / name)  # the Trainer skips it
        other = run(tmp_path / f"without-{name}", [PersistTrainerCallback(local_dir=tmp_path / f"c-{name}")],
                    resume=resume)
        (tmp_path / name).rename(tmp_path / "ckpt" / ".trainer" / "checkpoint-4" / name)
        assert any(not torch.equal(a, b) for a, b in zip(other.state_dict().values(), straight.state_dict().values())), name


def timeless(state: dict) -> dict:
    """``state`` with the log entries' wall-clock fields (``eval_runtime``, ``*_per_second``) left out."""
    wall_clock = ("_runtime", "_per_second")
    entries = [{k: v for k, v in e.items() if not k.endswith(wall_clock)} for e in state["log_history"]]
    return {**state, "log_history": entries}


@pytest.mark.parametrize("evaluated", [False, True], ids=["logged", "logged-and-evaluated"])
def test_the_checkpoints_trainer_state_is_the_trainers_own_log_history_included(tmp_path, evaluated):
    """The Trainer logs (and evaluates) a step after ``on_step_end`` and saves after that: the checkpoint holds
    the step's entries, and a run resumed from it has the uninterrupted run's log history entry for entry."""
    options = dict(logging_strategy="steps", logging_steps=1)
    if evaluated:
        options.update(eval_strategy="steps", eval_steps=2, eval_dataset=data()[:8])
    straight = train(tmp_path / "straight", [], **options)
    train(tmp_path / "native", [StopAt(5)], **options)  # the Trainer's own saves, killed after step 5
    native = json.loads((tmp_path / "native" / "checkpoint-4" / "trainer_state.json").read_text())
    train(tmp_path / "ours", [PersistTrainerCallback(local_dir=tmp_path / "ckpt"), StopAt(5)], **options)
    resume = PersistTrainerCallback(local_dir=tmp_path / "ckpt").resume_path()
    assert resume is not None and resume.endswith("checkpoint-4")
    ours = json.loads((Path(resume) / "trainer_state.json").read_text())
    logged_steps = [1, 2, 2, 3, 4, 4] if evaluated else [1, 2, 3, 4]
    assert [entry["step"] for entry in ours["log_history"]] == logged_steps  # the saved step's entries included
    assert timeless(ours) == timeless(native)  # every other field bit for bit: what the Trainer writes at that save
    resumed = train(tmp_path / "ours2", [PersistTrainerCallback(local_dir=tmp_path / "ckpt2")], resume=resume,
                    **options)
    *entries, summary = timeless(dataclasses.asdict(resumed.state))["log_history"]
    *straight_entries, straight_summary = timeless(dataclasses.asdict(straight.state))["log_history"]
    assert [entry["step"] for entry in entries] == [entry["step"] for entry in straight_entries]
    assert entries == straight_entries  # entry for entry: loss, grad norm, learning rate, eval loss, epoch, step
    assert summary.keys() == straight_summary.keys() and summary["step"] == straight_summary["step"] == 8


def test_a_fresh_machine_that_does_not_resume_is_refused_and_start_over_sets_the_remote_aside(tmp_path):
    url = f"file://{tmp_path}/remote/run"
    run(tmp_path / "out1", [PersistTrainerCallback(tmp_path / "m1", remote_url=url)], max_steps=4)
    remote = Path(f"{tmp_path}/remote/run")
    before = {p.relative_to(remote): p.read_bytes() for p in remote.rglob("*") if p.is_file() and p.name != ".lease.json"}
    with pytest.raises(ConfigError, match=r"newest step 4.*resume_from_checkpoint=callback\.resume_path\(\).*start_over"):
        run(tmp_path / "out2", [PersistTrainerCallback(tmp_path / "m2", remote_url=url)], max_steps=4)
    assert {p.relative_to(remote): p.read_bytes() for p in remote.rglob("*")
            if p.is_file() and p.name != ".lease.json"} == before
    callback = PersistTrainerCallback(tmp_path / "m3", remote_url=url)
    run(tmp_path / "out3", [callback], resume=callback.resume_path(), max_steps=6)  # resumed: goes on
    run(tmp_path / "out4", [PersistTrainerCallback(tmp_path / "m4", remote_url=url, start_over=True)], max_steps=2)
    with CheckpointReader(tmp_path / "r", remote_url=url) as reader:
        assert [c.step for c in reader.list("remote")] == [2]
        assert [c.step for c in reader.abandoned("remote")] == [2, 4, 6]
