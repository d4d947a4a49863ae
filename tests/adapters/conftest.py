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


@pytest.fixture
def held_until_teardown(engine_ops, monkeypatch):
    """``hold(io, step)``: step ``step``'s write waits until ``io.teardown()`` begins (a slow disk that
    only the final wait outlasts), so a Trainer whose strategy never calls it returns with that step
    uncommitted, every time. Returns the :class:`~tests.support.fakes.GatedStepOps`; afterwards the
    gate opens, the plugin tears down and a process group the Trainer started is destroyed."""
    import torch.distributed as dist

    from tests.support.fakes import GatedStepOps

    held = []

    def hold(io, step):
        ops = GatedStepOps(step)
        engine_ops(ops)
        teardown = io.teardown

        def opening_teardown():
            ops.gate.set()
            teardown()

        monkeypatch.setattr(io, "teardown", opening_teardown)
        held.append((ops, teardown))
        return ops

    yield hold
    try:
        for ops, teardown in held:
            ops.gate.set()
            teardown()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
