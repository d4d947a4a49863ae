"""Every option once (issue 54, item 2): the engine and the three adapters show each option they take as a named,
keyword-only, annotated parameter whose default and doc come from the one definition in ``persist_core.config``."""

from __future__ import annotations

import importlib
import inspect
import signal
from pathlib import Path

import pytest

from persist_core import Config, KeepLastN
from persist_core.config import options_of

ROOT = Path(__file__).parents[2]

#: entry point -> (its module, the file that defines it)
ENTRY_POINTS = {
    "CheckpointEngine": ("persist_core", "persist_core/engine.py"),
    "PersistCheckpointIO": ("lightning_persist", "lightning_persist/checkpoint_io.py"),
    "PersistHook": ("accelerate_persist", "accelerate_persist/hook.py"),
    "PersistTrainerCallback": ("accelerate_persist", "accelerate_persist/trainer.py"),
}

_ADAPTERS = {"remote_url", "storage_options", "keep_last", "keep_every_n_steps", "keep_every_n_seconds", "retention",
             "verify", "max_pending", "preemption_grace_s", "remote_timeout_s", "start_over", "memory_every_n_steps",
             "memory_dir", "incremental", "full_every", "verify_resume", "verify_resume_ignore",
             "remote_concurrency", "remote_compression", "remote_encryption_key"}  # issue 56
#: the keywords each entry point took before (besides local_dir): every call that worked keeps working
TAKEN_BEFORE = {
    "CheckpointEngine": {f for f in Config.__dataclass_fields__ if f != "local_dir"}
                        | {"collectives", "clock", "wall_clock", "file_ops"},
    "PersistCheckpointIO": _ADAPTERS | {"write_threads", "exit_after_sigterm"},
    "PersistHook": _ADAPTERS | {"save_policy", "preemption_signals", "overlap"},
    "PersistTrainerCallback": _ADAPTERS,
}


def _entry(name: str) -> type:
    module = ENTRY_POINTS[name][0]
    if module != "persist_core":
        pytest.importorskip({"lightning_persist": "lightning", "accelerate_persist": "transformers"}[module])
    return getattr(importlib.import_module(module), name)


def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_option_is_a_named_annotated_keyword_with_the_definitions_default_and_doc(name):
    cls = _entry(name)
    parameters = inspect.signature(cls).parameters
    assert set(parameters) - {"local_dir"} == TAKEN_BEFORE[name]
    assert not [p for p in parameters.values() if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    assert all(p.annotation is not p.empty for p in parameters.values())
    doc = _words(cls.__doc__)
    for option in options_of(name):
        p = parameters[option.name]
        assert p.kind is p.KEYWORD_ONLY, option.name
        assert p.default == option.default, option.name
        assert p.annotation == option.annotation, option.name
        assert _words(f"{option.name}: {option.doc}") in doc, option.name
    for own in TAKEN_BEFORE[name] - {o.name for o in options_of(name)}:  # the adapter's own keywords: documented too
        assert f"{own}: " in doc, own


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_no_option_is_documented_in_an_entry_points_module(name):
    source = _words((ROOT / ENTRY_POINTS[name][1]).read_text())
    for option in options_of(name):
        assert _words(option.doc)[:60] not in source, option.name


def test_the_adapters_defaults_are_the_configs():
    pytest.importorskip("accelerate")
    from accelerate_persist import PersistHook

    assert inspect.signature(PersistHook).parameters["preemption_signals"].default == (signal.SIGTERM,)
    assert inspect.signature(PersistHook).parameters["max_pending"].default == Config.__dataclass_fields__[
        "max_pending"].default == 1


@pytest.mark.parametrize("name", ["PersistCheckpointIO", "PersistHook", "PersistTrainerCallback"])
def test_an_adapter_refuses_a_keyword_it_does_not_take_by_name_with_the_fix(tmp_path, name):
    cls = _entry(name)
    with pytest.raises(TypeError, match="keep_lats.*keep_last"):
        cls(tmp_path / "ckpt", keep_lats=3)
    with pytest.raises(TypeError, match="keep_local"):
        cls(tmp_path / "ckpt", keep_local=KeepLastN(2))  # an engine option no adapter takes (keep_last is theirs)
    with pytest.raises(TypeError):
        cls(tmp_path / "ckpt", "s3://bucket/run")  # keyword-only, as before
