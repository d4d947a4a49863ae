"""The body of each rank in the multi-rank engine tests (spawned with torch.multiprocessing)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import torch
import torch.distributed as dist

from persist_core import CheckpointEngine, PersistError, TorchCollectives
from persist_core.fileio import OsFileOps


def replicated_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    w = torch.randn(64, 64, generator=g)
    return {"model": {"w": w, "tied": w, "b": torch.randn(64, generator=g), "emb": torch.randn(300, 32, generator=g)},
            "optim": [torch.randn(64, 64, generator=g), torch.randn(100, generator=g).double()],
            "step": step, "name": "run-7"}


class FailOnRank(OsFileOps):
    def pwrite(self, fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def attempt(engine: CheckpointEngine, state: dict, step: int) -> tuple:
    """Save and wait, then close: ``("committed", step)`` or ``("failed", error type, message)``."""
    try:
        engine.save(state, step=step).wait()
        return ("committed", step)
    except PersistError as e:
        return ("failed", type(e).__name__, str(e))
    finally:
        engine.close()


def run(rank: int, world: int, port: int, root: str, scenario: str, out: str) -> None:
    run_all(rank, world, port, [(root, scenario, out)])


def run_all(rank: int, world: int, port: int, scenarios: list[tuple[str, str, str]]) -> None:
    """:func:`run`'s scenarios (``(root, scenario, out)`` each, each its own ``root``) one after the other in one
    process group, each on a collectives group of its own (one start of the ranks for several independent runs)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for root, scenario, out in scenarios:
        torch.save(_scenario(rank, TorchCollectives.new_group(timeout_s=60), root, scenario), Path(out) / f"rank{rank}.pt")
        dist.barrier()  # every rank's scenario done before the next begins
    dist.barrier()  # every rank done before any tears its groups down (gloo aborts otherwise, at times)
    dist.destroy_process_group()


def _scenario(rank: int, coll: TorchCollectives, root: str, scenario: str) -> list:
    results = []
    ops = FailOnRank() if scenario == "fail" and rank == 1 else None
    with CheckpointEngine(root, collectives=coll, file_ops=ops if scenario != "fail" else None) as engine:
        engine.save(replicated_state(10), step=10).wait()
        nbytes = engine.list()[-1].nbytes
        results.append(("saved", 10, nbytes))
    if scenario == "fail":
        results.append(attempt(CheckpointEngine(root, collectives=coll, file_ops=ops), replicated_state(20), 20))
    if scenario == "mismatch":
        state = replicated_state(30)
        if rank == 1:
            state["model"]["extra"] = torch.zeros(3)
        results.append(attempt(CheckpointEngine(root, collectives=coll), state, 30))
    if scenario == "steps":  # rank 1 saves another step: its shard must not end up in rank 0's checkpoint
        results.append(attempt(CheckpointEngine(root, collectives=coll), replicated_state(40 + rank), 40 + rank))
    # every rank restores the newest committed checkpoint
    with CheckpointEngine(root, collectives=coll) as engine:
        loaded = engine.load()
    results.append(("loaded", loaded["step"], all(torch.equal(a, b) for a, b in zip(
        [loaded["model"]["w"], loaded["model"]["emb"], *loaded["optim"]],
        [replicated_state(loaded["step"])["model"]["w"], replicated_state(loaded["step"])["model"]["emb"],
         *replicated_state(loaded["step"])["optim"]])), loaded["model"]["w"].data_ptr() == loaded["model"]["tied"].data_ptr()))
    return results


def run_decisions(rank: int, world: int, port: int, root: str, out: str) -> None:
    """Each rank's clock runs at its own pace, so alone they would decide differently."""
    from persist_core import ConfigError, EveryNSeconds, PreemptionNotice

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    coll = TorchCollectives.new_group(timeout_s=60)
    now = [0.0]
    notice = PreemptionNotice(signals=()) if rank == 1 else None  # a notice that reaches rank 1 only
    results: dict = {"saved": [], "local": []}
    engine = CheckpointEngine(root, collectives=coll, save_policy=EveryNSeconds(3), preemption=notice,
                              clock=lambda: now[0] * (1.0 + 0.7 * rank))
    for step in range(1, 40):
        now[0] = float(step)
        if step == 17 and notice is not None:
            notice.trigger()
        results["local"].append(engine.should_save(step))
        if engine.maybe_save(lambda: replicated_state(step), step=step) is not None:
            results["saved"].append(step)
        if engine.preempted:
            break
    results["preempted"] = engine.preempted
    results["committed"] = [c.step for c in engine.list()]
    try:  # the ranks disagree on the step: a clear error on every rank, no hang
        engine.maybe_save(lambda: replicated_state(50), step=50 + rank)
    except ConfigError as e:
        results["mismatch"] = str(e)
    engine.close()
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.barrier()  # every rank done before any tears its groups down (gloo aborts otherwise, at times)
    dist.destroy_process_group()
