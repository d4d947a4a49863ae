"""``Config``: one frozen, keyword-only value for every option, checked once (issue 41, step 6)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from persist_core import CheckpointEngine, KeepLastN
from persist_core.config import Config
from persist_core.errors import ConfigError


def test_defaults_come_from_the_environment_and_the_value_is_frozen(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSIST_WRITE_THREADS", "7")
    config = Config(local_dir=tmp_path / "ckpt")
    assert config.write_threads == 7 and config.chunk_bytes == 32 << 20 and config.direct_io == "auto"
    assert config.local_dir.is_absolute()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.verify = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        Config(tmp_path)  # type: ignore[misc]  # keyword-only


def test_the_adapters_flat_keywords_become_one_policy_on_both_tiers(tmp_path):
    local = Config.from_keywords(tmp_path, keep_last=3)
    assert local.keep_local == KeepLastN(3) and local.keep_remote is None  # no remote: no remote policy
    both = Config.from_keywords(tmp_path, keep_last=3, remote_url="memory://bucket/run")
    assert both.keep_local == both.keep_remote == KeepLastN(3)
    with pytest.raises(ConfigError, match="keep_lats.*the options are"):
        Config.from_keywords(tmp_path, keep_lats=3)


@pytest.mark.parametrize(("keywords", "match"), [
    ({"chunk_bytes": 1000}, "chunk_bytes=1000"),
    ({"keep_remote": KeepLastN(1)}, "keep_remote was given without remote_url"),
    ({"preemption": "sometimes"}, "preemption='sometimes'"),
    ({"replica_check": "most"}, "replica_check"),
])
def test_a_bad_value_is_named_by_the_config_and_by_the_engine(tmp_path, keywords, match):
    with pytest.raises(ConfigError, match=match):
        Config.of(tmp_path / "a", **keywords)
    with pytest.raises(ConfigError, match=match):
        CheckpointEngine(tmp_path / "b", **keywords)
    assert not (tmp_path / "b").exists()  # refused before anything was made


def test_an_engine_takes_a_whole_config_and_says_what_it_was_built_with(tmp_path):
    config = Config(local_dir=tmp_path / "ckpt", max_pending=2, keep_local=KeepLastN(1))
    with CheckpointEngine(config) as engine:
        assert engine.config is config
        for step in (1, 2):
            engine.save({"w": torch.full((4,), float(step))}, step=step).wait()
    with CheckpointEngine(config.replace(max_pending=1)) as again:
        assert [c.step for c in again.list()] == [2]
    with pytest.raises(ConfigError, match="config.replace"):
        CheckpointEngine(config, verify=False)


def test_config_is_public_and_the_engine_shows_every_option_by_name():
    import inspect

    import persist_core
    from persist_core.config import options_of

    assert persist_core.Config is Config and "Config" in persist_core.__all__
    parameters = inspect.signature(CheckpointEngine).parameters
    doc = " ".join(CheckpointEngine.__doc__.split())
    assert {o.name for o in options_of("CheckpointEngine")} == set(Config.__dataclass_fields__) - {"local_dir"}
    for option in options_of("CheckpointEngine"):
        assert parameters[option.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert parameters[option.name].default == option.default and parameters[option.name].annotation is not None
        assert " ".join(f"{option.name}: {option.doc}".split()) in doc
    config = inspect.signature(Config).parameters  # the types a caller may pass (None: from the environment)
    assert config["write_threads"].annotation == int | None and config["max_pending"].default == 1
    config_doc = " ".join(Config.__doc__.split())
    assert all(" ".join(f"{f}: {m.metadata['doc']}".split()) in config_doc
               for f, m in Config.__dataclass_fields__.items())


def test_the_adapters_memory_keywords_become_the_memory_option(tmp_path):
    from persist_core import MemoryTier

    config = Config.from_keywords(tmp_path, memory_every_n_steps=2, memory_dir=tmp_path / "shm")
    assert config.memory == MemoryTier(every_n_steps=2, memory_dir=tmp_path / "shm")
    with pytest.raises(ConfigError, match="memory_dir=.*without memory_every_n_steps"):
        Config.from_keywords(tmp_path, memory_dir=tmp_path / "shm")
