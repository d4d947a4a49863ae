"""Resume verification (issue 55): the state a run resumes with against the checkpoint it loaded, each mutation
named by its key path, and the lineage every manifest carries."""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from persist_core import CheckpointEngine, PersistError, ResumeMismatchError, ResumeMismatchWarning
from persist_core.cli.app import main
from persist_core.format.manifest import Manifest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    groups = [{"params": list(model[0].parameters()), "lr": 0.1}, {"params": list(model[1].parameters()), "lr": 0.01}]
    optim = torch.optim.Adam(groups)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "loop": {"step": 7, "epoch": 1},
            "rng": {"torch": torch.get_rng_state()}, "view": torch.arange(12.0).reshape(3, 4)[:, ::2]}


def _resumed(tmp_path: Path, **options) -> tuple[CheckpointEngine, dict]:
    with CheckpointEngine(tmp_path, direct_io="off") as engine:
        engine.save(_state(), step=7, metadata={"note": "mine"}).wait()
    engine = CheckpointEngine(tmp_path, direct_io="off", **options)
    return engine, engine.load()


def test_an_exact_resume_returns_nothing_and_logs_one_line(tmp_path, caplog):
    engine, state = _resumed(tmp_path)
    with engine, caplog.at_level(logging.INFO, logger="persist_core.load.verify"), warnings.catch_warnings():
        warnings.simplefilter("error", ResumeMismatchWarning)
        assert engine.verify_resume(state) == []
        assert engine.verify_resume(_state()) == []  # the live objects, rebuilt the same way
    lines = [r.getMessage() for r in caplog.records if "resume verified" in r.getMessage()]
    assert lines and "equal step 7" in lines[0]
    assert "tensors and" in lines[0] and " values " in lines[0]


def _set_weight(s):
    s["model"]["0.weight"][0, 0] += 1


def _set_lr(s):
    s["optim"]["param_groups"][1]["lr"] = 0.5


def _set_step(s):
    s["loop"]["step"] = 8


def _set_rng(s):
    s["rng"]["torch"] = torch.Generator().manual_seed(1).get_state()


def _set_adam_step(s):
    s["optim"]["state"][0]["step"] += 1


MUTATIONS = [(_set_weight, "model/0.weight"), (_set_lr, "optim/param_groups/1/lr"), (_set_step, "loop/step"),
             (_set_rng, "rng/torch"), (_set_adam_step, "optim/state/0/step")]


@pytest.mark.parametrize("mutate, key", MUTATIONS, ids=[k for _, k in MUTATIONS])
def test_one_changed_key_is_named_alone_warned_raised_or_off(tmp_path, mutate, key):
    engine, state = _resumed(tmp_path)
    with engine:
        mutate(state)
        with pytest.warns(ResumeMismatchWarning, match=key.replace(".", r"\.")) as caught:
            assert engine.verify_resume(state) == [key]
        assert len(caught) == 1 and key.split("/")[0] + ":" in str(caught[0].message)
    for mode, result in (("raise", None), ("off", [])):
        engine = CheckpointEngine(tmp_path, direct_io="off", verify_resume=mode)
        with engine:
            state = engine.load()
            mutate(state)
            if mode == "raise":
                with pytest.raises(ResumeMismatchError, match=key.replace(".", r"\.")) as raised:
                    engine.verify_resume(state)
                assert raised.value.keys == [key] and isinstance(raised.value, PersistError)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    assert engine.verify_resume(state) == result


def test_a_scalar_difference_says_saved_and_now(tmp_path):
    engine, state = _resumed(tmp_path, verify_resume="raise")
    with engine:
        state["optim"]["param_groups"][0]["lr"] = 0.2
        state["optim"]["param_groups"][1]["lr"] = 0.2
        with pytest.raises(ResumeMismatchError) as raised:
            engine.verify_resume(state)
    message = str(raised.value)
    assert "saved 0.1, now 0.2" in message and "saved 0.01, now 0.2" in message
    assert "optim: lr of 2 entries" in message


def test_ignored_globs_are_skipped_and_missing_and_new_keys_named(tmp_path):
    engine, state = _resumed(tmp_path, verify_resume_ignore=["optim/param_groups/*/lr", "extra"])
    with engine:
        _set_lr(state)
        state["extra"] = 1  # ignored too
        assert engine.verify_resume(state) == []
        del state["loop"]["epoch"]
        state["loop"]["new"] = 3
        with pytest.warns(ResumeMismatchWarning, match="missing"):
            assert engine.verify_resume(state) == ["loop/epoch", "loop/new"]


def test_an_engine_that_loaded_nothing_verifies_nothing(tmp_path):
    with CheckpointEngine(tmp_path, direct_io="off") as engine:
        assert engine.verify_resume(_state()) == []


def test_an_old_format_checkpoint_is_not_verified(tmp_path, caplog):
    ckpt = tmp_path / "step-000000000012"
    ckpt.mkdir()
    shutil.copy(GOLDEN / "v5-manifest.json", ckpt / "manifest.json")
    shutil.copy(GOLDEN / "v5-rank-00000.safetensors", ckpt / "rank-00000.safetensors")
    with CheckpointEngine(tmp_path, direct_io="off", verify_resume="raise") as engine, \
            caplog.at_level(logging.INFO, logger="persist_core.load.verify"):
        state = engine.load()
        state["step"] = 99
        assert engine.verify_resume(state) == []
    said = [r.getMessage() for r in caplog.records if "not verified" in r.getMessage()]
    assert len(said) == 1 and "no digests: checkpoint format v5" in said[0]


def test_every_manifest_carries_its_lineage_and_inspect_shows_it(tmp_path):
    import persist_core

    with CheckpointEngine(tmp_path, direct_io="off", run_id="run-a") as engine:
        engine.save(_state(), step=7, metadata={"note": "mine"}).wait()
        engine.save(_state(), step=9).wait()
    with CheckpointEngine(tmp_path, direct_io="off", run_id="run-a") as engine:
        engine.load(step=7)
        engine.save(_state(), step=8).wait()
    fresh = Manifest.from_bytes((tmp_path / "step-000000000007" / "manifest.json").read_bytes(), where="7")
    resumed = Manifest.from_bytes((tmp_path / "step-000000000008" / "manifest.json").read_bytes(), where="8")
    assert fresh.version == 7 and fresh.lineage is not None and resumed.lineage is not None
    assert fresh.lineage["run"] == "run-a" and fresh.lineage["resumed_from"] is None
    assert fresh.lineage["branch_from"] is None and fresh.lineage["world_size"] == 1
    assert fresh.lineage["versions"]["torch"] == torch.__version__ and "torch-persist" in fresh.lineage["versions"]
    assert "git_commit" in fresh.lineage and fresh.metadata == {"note": "mine"}
    assert resumed.lineage["resumed_from"] == {"step": 7, "run": "run-a"} and resumed.lineage["branch_from"] == 7
    assert all(t.digest is not None for t in fresh.tensors)
    done = CliRunner().invoke(main, ["inspect", "--json", "--step", "8", str(tmp_path)], catch_exceptions=False)
    assert json.loads(done.output)["lineage"]["resumed_from"] == {"step": 7, "run": "run-a"}
    done = CliRunner().invoke(main, ["inspect", "--step", "7", str(tmp_path)], catch_exceptions=False)
    assert "run-a" in done.output and "fresh start" in done.output and torch.__version__ in done.output
    assert persist_core.ResumeMismatchWarning.__mro__[1] is UserWarning
