"""Ranks as plain processes, for the tests that SIGKILL one of them (``torch.multiprocessing.spawn`` would
tear the others down as soon as one dies)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

from tests.support.moto_server import free_port


def exit_codes(target: Callable[..., None], world: int, *args: Any, timeout: float = 120) -> list[int | None]:
    """Start ``target(rank, world, port, *args)`` for every rank (spawned), wait for all; their exit codes."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    return [p.exitcode for p in procs]
