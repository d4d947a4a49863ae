"""Ranks as plain processes, for the tests that SIGKILL one of them (``torch.multiprocessing.spawn`` would
tear the others down as soon as one dies)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import tempfile
from collections.abc import Callable, Sequence
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


def launched(command: Sequence[str], world: int, env: dict[str, str] | None = None,
             timeout: float = 240) -> subprocess.CompletedProcess:
    """A Lightning script on ``world`` devices with every rank started at once, as a job scheduler or ``torchrun``
    starts them: each with the environment Lightning's own launcher gives its ranks (``MASTER_ADDR``,
    ``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``), so Lightning starts no process itself (its
    ``LightningEnvironment`` sees ``LOCAL_RANK``); the same Trainer, strategy and gloo group as a run that Lightning
    launches, the ranks' imports side by side instead of one after the other. The return code is the first nonzero
    one; stdout and stderr are the ranks' own, rank 0's first."""
    base = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "NODE_RANK": "0", "WORLD_SIZE": str(world)}
    with tempfile.TemporaryDirectory() as logs:  # files, not pipes: a rank blocked on a full pipe would hang all
        files = [(open(f"{logs}/{r}.out", "w+"), open(f"{logs}/{r}.err", "w+")) for r in range(world)]
        procs = [subprocess.Popen(list(command), stdout=out, stderr=err, text=True, env={**base, "LOCAL_RANK": str(r)})
                 for r, (out, err) in enumerate(files)]
        try:
            codes = [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        texts = []
        for out, err in files:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
            out.close()
            err.close()
    return subprocess.CompletedProcess(list(command), next((c for c in codes if c), 0),
                                       "".join(t[0] for t in texts), "".join(t[1] for t in texts))
