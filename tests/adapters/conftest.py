"""Fixtures the adapter tests share."""

from __future__ import annotations

import functools

import pytest

import persist_core.session as session_module
from persist_core import CheckpointEngine


@pytest.fixture
def engine_ops(monkeypatch):
    """Make the engines the adapters open (through their session) use the given FileOps."""

    def use(ops):
        monkeypatch.setattr(session_module, "CheckpointEngine", functools.partial(CheckpointEngine, file_ops=ops))

    return use
