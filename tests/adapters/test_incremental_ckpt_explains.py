"""A referencing ``.ckpt`` explains itself (issue 53, item 7): with ``incremental=True`` under Lightning, the files the
plugin links for a checkpoint that references an earlier one hold only what changed. ``torch.load`` of such a file
fails naming what it is — with ``weights_only=True`` (the default) torch's own error shows our global's dotted name,
which says the fix; with ``weights_only=False`` our error names ``lightning_persist.load_from_checkpoint`` and
``persist export`` — never "invalid load key". A file of a full checkpoint still loads in full."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_persist import PersistCheckpointIO, load_from_checkpoint
from persist_core import CheckpointReader, PersistError
from persist_core.layout import MANIFEST_NAME
from tests.support.lightning_app import Net, linked, make_trainer
from tests.support.lightning_app import weights as lightning_weights
from tests.support.states import assert_state_equal

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

GLOBAL = "persist_core.format.torch_zip.incremental_checkpoint__load_with_lightning_persist_load_from_checkpoint"


class FrozenFirst(Net):
    """``Net`` whose first layer is frozen: every checkpoint after the first references its bytes."""

    def __init__(self, width: int = 256) -> None:
        super().__init__(width)
        self.net[0].requires_grad_(False)


def _references(ckpt_dir: Path) -> set[int]:
    manifest = json.loads((ckpt_dir / MANIFEST_NAME).read_text())
    return {r["step"] for r in manifest["tensors"] if r and "step" in r}


def test_torch_load_of_a_referencing_ckpt_names_what_it_is_and_a_full_one_loads(tmp_path):
    d = tmp_path / "run"
    make_trainer(PersistCheckpointIO(local_dir=d, incremental=True), d, 3).fit(FrozenFirst())
    linked_files = sorted(d.glob("*.ckpt"))
    assert any(p.name == "last.ckpt" for p in linked_files) and len(linked_files) >= 2, linked_files
    assert not _references(d / f"step-{1:012d}")  # the first save is full
    for path in linked_files:  # last.ckpt and ModelCheckpoint's top-k: steps 2 and 3, both referencing step 1
        step_dir = d / linked(path)
        step = int(step_dir.name.split("-")[1])
        assert _references(step_dir) == {1}, path
        with pytest.raises(Exception) as safe:
            torch.load(path)  # weights_only=True, torch's default
        assert GLOBAL in str(safe.value) and "invalid load key" not in str(safe.value), safe.value
        with pytest.raises(PersistError) as full:
            torch.load(path, weights_only=False)
        text = str(full.value)
        assert "lightning_persist.load_from_checkpoint(" in text and "persist export" in text, text
        assert f"step {step}'s" in text and "step 1 " in text, text
        model = load_from_checkpoint(FrozenFirst, path)  # the way the errors name: the whole checkpoint, verified
        assert_state_equal(lightning_weights(model), CheckpointReader(d).load(step)["state_dict"])

    full_ckpt = torch.load(d / f"step-{1:012d}" / "rank-00000.ckpt")  # a full checkpoint's file: torch.load as ever
    assert full_ckpt["global_step"] == 1
    assert_state_equal(full_ckpt["state_dict"], CheckpointReader(d).load(1)["state_dict"])

