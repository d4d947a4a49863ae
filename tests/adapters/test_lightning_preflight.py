"""What PersistCheckpointIO checks before the first training batch (a callback Lightning adds by entry point).

A fresh machine on another run's remote, with Lightning's usual ``fit(ckpt_path="last")`` or no ``ckpt_path``:
refused before the first training batch, naming ``ckpt_path=io.latest_path()`` and ``start_over=True``, and every
byte of the first machine's remote checkpoints stays where it was. ``start_over=True`` trains and sets them aside.
A ``ModelCheckpoint(dirpath="s3://...")`` is refused before the first batch too."""

from __future__ import annotations

import fsspec
import pytest
from lightning.pytorch.callbacks import Callback

from lightning_persist import PersistCheckpointIO
from persist_core import CheckpointReader, ConfigError
from tests.support.lightning_app import Net, make_trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class CountBatches(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, *args) -> None:
        self.batches += 1


def remote_bytes(url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    return {p[len(root):]: fs.cat_file(p) for p in fs.find(root) if not p.endswith(".lease.json")}


@pytest.fixture
def first_machine(tmp_path):
    url = f"file://{tmp_path}/remote/run"
    make_trainer(PersistCheckpointIO(tmp_path / "m1", remote_url=url), tmp_path / "m1", max_steps=12).fit(Net())
    before = remote_bytes(url)
    assert {p.split("/")[1] for p in before} >= {"step-000000000012"}
    return url, before


@pytest.mark.parametrize("ckpt_path", ["last", None])
def test_a_fresh_machine_that_does_not_resume_is_refused_before_any_batch(tmp_path, first_machine, ckpt_path):
    url, before = first_machine
    io = PersistCheckpointIO(tmp_path / "m2", remote_url=url)
    batches = CountBatches()
    trainer = make_trainer(io, tmp_path / "m2", max_steps=24, callbacks=[batches])
    with pytest.raises(ConfigError, match=r"newest step 12.*ckpt_path=io\.latest_path\(\).*start_over=True"):
        trainer.fit(Net(), ckpt_path=ckpt_path)
    assert batches.batches == 0
    assert remote_bytes(url) == before  # every file of machine 1's checkpoints, at its place, with its bytes


def test_the_fresh_machine_resumes_with_latest_path_or_starts_over(tmp_path, first_machine):
    url, before = first_machine
    io = PersistCheckpointIO(tmp_path / "m2", remote_url=url)
    assert io.latest_path() == f"{url}/step-000000000012"
    make_trainer(io, tmp_path / "m2", max_steps=14).fit(Net(), ckpt_path=io.latest_path())
    assert [c.step for c in CheckpointReader(tmp_path / "r", remote_url=url).list("remote")][-2:] == [13, 14]

    over = PersistCheckpointIO(tmp_path / "m3", remote_url=url, start_over=True)
    make_trainer(over, tmp_path / "m3", max_steps=3).fit(Net())
    with CheckpointReader(tmp_path / "r2", remote_url=url) as reader:
        assert [c.step for c in reader.list("remote")] == [1, 2, 3]
        assert {c.step for c in reader.abandoned("remote")} >= {12, 13, 14}
        assert reader.load()["global_step"] == 3


def test_a_model_checkpoint_dirpath_on_s3_is_refused_before_any_batch(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    batches = CountBatches()
    trainer = Trainer(max_steps=4, plugins=[PersistCheckpointIO(tmp_path / "ckpt")], accelerator="cpu", devices=1,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath="s3://bucket/ckpts", every_n_train_steps=2), batches])
    with pytest.raises(ConfigError, match=r"s3://bucket/ckpts.*is remote.*remote_url"):
        trainer.fit(Net())
    assert batches.batches == 0


def test_the_preflight_is_inert_without_the_plugin(tmp_path):
    from lightning_persist.preflight import PersistPreflight

    trainer = make_trainer(None, tmp_path / "plain", max_steps=2)
    assert any(isinstance(c, PersistPreflight) for c in trainer.callbacks)  # added by the entry point
    trainer.fit(Net())
    assert (tmp_path / "plain" / "last.ckpt").is_file()
