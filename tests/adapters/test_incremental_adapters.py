"""Incremental saves through the adapters (issue 43): ``incremental=True`` on the Lightning plugin, the Accelerate hook
and the HF Trainer callback; a frozen base (a frozen submodule, a PEFT LoRA model) is written once, then referenced;
a run stopped midway resumes exactly from a referencing checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule

from accelerate_persist import PersistHook
from lightning_persist import PersistCheckpointIO, load_from_checkpoint
from persist_core import CheckpointReader
from persist_core.layout import MANIFEST_NAME
from tests.support.accelerate_app import fresh_accelerator, weights
from tests.support.lightning_app import CrashAt, linked, make_trainer
from tests.support.lightning_app import weights as lightning_weights
from tests.support.states import assert_state_equal

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")


def _manifests(local_dir: Path) -> dict[int, dict]:
    """Each committed checkpoint's manifest, by step."""
    out = {}
    for d in sorted(local_dir.glob("step-*")):
        if (d / MANIFEST_NAME).is_file():
            out[int(d.name.split("-")[1])] = json.loads((d / MANIFEST_NAME).read_text())
    return out


def _own_bytes(local_dir: Path, step: int) -> int:
    """The bytes of the shard files checkpoint ``step`` holds itself."""
    d = local_dir / f"step-{step:012d}"
    return sum(p.stat().st_size for p in d.iterdir() if p.name != MANIFEST_NAME)


def _depends_on(manifest: dict) -> set[int]:
    return {r["step"] for r in manifest["tensors"] if r and "step" in r}


def _lora(base: torch.nn.Module) -> torch.nn.Module:
    return peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"]))


class FrozenBaseNet(LightningModule):
    """A wide base, frozen (``lora``: wrapped by PEFT's LoRA, only the adapters train; else only the head trains)."""

    def __init__(self, lora: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1))
            if lora:
                net = _lora(net)  # its adapters' initial values too: the same in every run
            else:
                net[0].requires_grad_(False)
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(48, 64, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)


@pytest.mark.parametrize("lora", [False, True], ids=["frozen-submodule", "peft-lora"])
def test_lightning_incremental_writes_the_frozen_base_once_and_resumes_exactly(tmp_path, lora):
    straight = FrozenBaseNet(lora)
    make_trainer(PersistCheckpointIO(local_dir=tmp_path / "a"), tmp_path / "a", 9).fit(straight)

    d = tmp_path / "b"
    with pytest.raises(RuntimeError, match="illegal memory access"):
        make_trainer(PersistCheckpointIO(local_dir=d, incremental=True), d, 9, [CrashAt(7)]).fit(FrozenBaseNet(lora))
    manifests = _manifests(d)
    assert 1 in manifests and not _depends_on(manifests[1])  # the first save is full
    referencing = [s for s, m in manifests.items() if _depends_on(m)]
    assert referencing and all(_depends_on(manifests[s]) == {1} for s in referencing)
    # save_top_k=2 removed step 1's path, but the checkpoints kept reference it: it stays
    assert (d / f"step-{1:012d}" / MANIFEST_NAME).is_file()
    full = _own_bytes(d, 1)
    assert all(_own_bytes(d, s) < full / 5 for s in referencing)  # the frozen base is not written again
    # a full checkpoint stays the zip torch.load reads; a referencing one loads through torch-persist
    assert torch.load(d / f"step-{1:012d}" / "rank-00000.ckpt", weights_only=False)["global_step"] == 1
    last = d / "last.ckpt"
    assert linked(last) == f"step-{6:012d}" and 6 in referencing  # an epoch ends at 6: Lightning resumes exactly there
    loaded = load_from_checkpoint(FrozenBaseNet, last)
    reader_state = CheckpointReader(d).load(6)["state_dict"]
    assert_state_equal(lightning_weights(loaded), reader_state)

    io = PersistCheckpointIO(local_dir=d, incremental=True)  # a restarted process
    resumed = FrozenBaseNet(lora)
    make_trainer(io, d, 9).fit(resumed, ckpt_path=str(last))
    assert_state_equal(lightning_weights(resumed), lightning_weights(straight))


def _build_lora(accelerator):
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1))
    model = _lora(base)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)
    return accelerator.prepare(model, optimizer, loader)


def _steps(accelerator, model, optimizer, loader, *, start: int, stop: int, hook=None) -> None:
    for i, (x, y) in enumerate(loader):
        if i < start:
            continue
        if i == stop:
            return
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if hook is not None:
            accelerator.save_state()


def test_accelerate_incremental_save_state_of_a_peft_model_references_the_base_and_resumes_exactly(tmp_path):
    acc = fresh_accelerator()
    parts = _build_lora(acc)
    _steps(acc, *parts, start=0, stop=6)
    reference = weights(parts[0])

    d = tmp_path / "ckpt"
    acc = fresh_accelerator(project_dir=str(tmp_path / "project"))
    parts = _build_lora(acc)
    with PersistHook(local_dir=d, incremental=True).register(acc) as hook:
        _steps(acc, *parts, start=0, stop=4, hook=hook)  # save_state after steps 1..4; then the process "dies"
    manifests = _manifests(d)
    assert sorted(manifests) == [1, 2, 3, 4]
    assert not _depends_on(manifests[1]) and all(_depends_on(manifests[s]) == {1} for s in (2, 3, 4))
    assert all(_own_bytes(d, s) < _own_bytes(d, 1) / 5 for s in (2, 3, 4))

    acc = fresh_accelerator(project_dir=str(tmp_path / "project"))
    parts = _build_lora(acc)
    with PersistHook(local_dir=d, incremental=True).register(acc) as hook:
        assert hook.resume() == 4
        _steps(acc, *parts, start=4, stop=6)
    assert_state_equal(weights(parts[0]), reference)


def test_accelerate_incremental_with_a_remote_uploads_only_the_adapter_and_a_fresh_machine_resumes_exactly(tmp_path):
    acc = fresh_accelerator()
    parts = _build_lora(acc)
    _steps(acc, *parts, start=0, stop=6)
    reference = weights(parts[0])

    remote = tmp_path / "remote"
    acc = fresh_accelerator(project_dir=str(tmp_path / "project"))
    parts = _build_lora(acc)
    with PersistHook(local_dir=tmp_path / "a", remote_url=remote.as_uri(), incremental=True).register(acc) as hook:
        _steps(acc, *parts, start=0, stop=4, hook=hook)  # then this machine is gone
    uploaded = _manifests(remote)
    assert sorted(uploaded) == [1, 2, 3, 4] and all(_depends_on(uploaded[s]) == {1} for s in (2, 3, 4))
    assert all(_own_bytes(remote, s) < _own_bytes(remote, 1) / 5 for s in (2, 3, 4))  # the base went up once

    acc = fresh_accelerator(project_dir=str(tmp_path / "project-b"))
    parts = _build_lora(acc)
    with PersistHook(local_dir=tmp_path / "b", remote_url=remote.as_uri(), incremental=True).register(acc) as hook:
        assert hook.resume() == 4  # from the remote: ranged reads of step 1's base
        _steps(acc, *parts, start=4, stop=6)
    assert_state_equal(weights(parts[0]), reference)


def test_the_adapters_check_incremental_and_full_every(tmp_path):
    from persist_core import ConfigError

    with pytest.raises(ConfigError, match="incremental"):
        PersistHook(local_dir=tmp_path, incremental="yes")
    with pytest.raises(ConfigError, match="full_every"):
        PersistCheckpointIO(local_dir=tmp_path, incremental=True, full_every=0)


def test_hf_trainer_callback_incremental_with_a_peft_model_resumes_exactly(tmp_path):
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

    from accelerate_persist import PersistTrainerCallback

    def model():
        torch.manual_seed(0)
        config = BertConfig(vocab_size=40, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=256, max_position_embeddings=16, num_labels=2)
        base = BertForSequenceClassification(config)
        return peft.get_peft_model(base, peft.LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query", "value"]))

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (24, 8), generator=g)
    data = [{"input_ids": ids[i], "labels": int(ids[i].sum()) % 2} for i in range(24)]

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                control.should_training_stop = True
            return control

    def run(out, callbacks, resume=None):
        args = TrainingArguments(output_dir=str(out), max_steps=8, save_steps=2, per_device_train_batch_size=4,
                                 learning_rate=5e-3, report_to=[], use_cpu=True, seed=0, logging_strategy="no",
                                 disable_tqdm=True)
        trainer = Trainer(model=model(), args=args, train_dataset=data, callbacks=callbacks)
        trainer.train(resume_from_checkpoint=resume)
        return trainer.model

    straight = run(tmp_path / "straight", [])
    d = tmp_path / "ckpt"
    callback = PersistTrainerCallback(local_dir=d, incremental=True)
    run(tmp_path / "ours", [callback, StopAt()])
    assert callback.saved_steps == [2, 4]
    manifests = _manifests(d)
    assert not _depends_on(manifests[2]) and _depends_on(manifests[4]) == {2}
    assert _own_bytes(d, 4) < _own_bytes(d, 2) / 4  # the base (and its adapters' frozen siblings) once
    fresh = PersistTrainerCallback(local_dir=d, incremental=True)
    resume = fresh.resume_path()
    assert resume is not None and resume.endswith("checkpoint-4")
    ours = run(tmp_path / "ours2", [fresh], resume=resume)
    assert_state_equal(ours.state_dict(), straight.state_dict())
    assert os.path.isdir(resume)
