"""``persist export --format safetensors --prefix``: the model's keys as ``load_state_dict`` takes them (issue 53,
item 8). A Lightning checkpoint keeps the weights under ``state_dict``, PersistHook's under ``models/0``; without
``--prefix`` the file's keys are the checkpoint's key paths (``state_dict/net.0.weight``)."""

from __future__ import annotations

import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from lightning_persist import PersistCheckpointIO
from persist_core.cli import main
from tests.support.lightning_app import Net, make_trainer


def test_a_lightning_checkpoint_exports_as_the_models_state_dict(tmp_path):
    model = Net()
    make_trainer(PersistCheckpointIO(local_dir=tmp_path / "ckpt"), tmp_path / "ckpt", max_steps=2).fit(model)
    out = tmp_path / "model.safetensors"
    result = CliRunner().invoke(main, ["export", str(tmp_path / "ckpt"), "--format", "safetensors",
                                       "--prefix", "state_dict", "--to", str(out)])
    assert result.exit_code == 0, result.output
    fresh = Net(width=32)
    fresh.load_state_dict(load_file(out))  # strict: every key the model has, and no other
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key

    wrong = CliRunner().invoke(main, ["export", str(tmp_path / "ckpt"), "--format", "safetensors",
                                      "--prefix", "model", "--to", str(tmp_path / "wrong.safetensors")])
    assert wrong.exit_code == 2 and "--prefix model" in wrong.output and "state_dict" in wrong.output, wrong.output
    assert not (tmp_path / "wrong.safetensors").exists()
