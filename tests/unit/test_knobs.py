"""Every tunable is checked in one place: a bad environment value is a ConfigError naming the variable."""

from __future__ import annotations

import pytest

from persist_core import CheckpointEngine, ConfigError


@pytest.mark.parametrize(("name", "value", "rule"), [
    ("PERSIST_REMOTE_RETRIES", "0", ">= 1"),
    ("PERSIST_REMOTE_CONCURRENCY", "0", ">= 1"),
    ("PERSIST_REMOTE_PART_BYTES", "1024", ">= 5242880"),
    ("PERSIST_REMOTE_BACKOFF_MS", "-5", ">= 0"),
    ("PERSIST_WRITE_THREADS", "0", ">= 1"),
    ("PERSIST_WRITE_THREADS", "four", "an integer"),
    ("PERSIST_CHUNK_BYTES", "5000", "multiple of 4096"),
    ("PERSIST_DIRECT_IO", "maybe", "'auto', 'on' or 'off'"),
])
def test_a_bad_environment_value_is_a_config_error_naming_the_variable_and_its_range(tmp_path, monkeypatch, name,
                                                                                       value, rule):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        CheckpointEngine(tmp_path / "a", remote_url="memory://knobs")
    assert name in str(info.value) and rule in str(info.value) and repr(value) in str(info.value)
    assert not isinstance(info.value, AssertionError)


def test_good_environment_values_are_taken(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSIST_REMOTE_RETRIES", "2")
    monkeypatch.setenv("PERSIST_REMOTE_CONCURRENCY", "3")
    with CheckpointEngine(tmp_path / "a", remote_url="memory://knobs-ok") as engine:
        assert (engine._parts.tier.retries, engine._parts.tier.concurrency) == (2, 3)
