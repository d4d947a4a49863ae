"""The body of each rank in the several-nodes tests: 4 gloo ranks on this machine, 2 simulated nodes.

Ranks ``2n`` and ``2n+1`` are node ``n``: they see ``base/node<n>`` as ``local_dir`` and nothing of the
other node's directory (different ``local_dir`` s are different nodes: the engine finds out which ranks
share one at the first save). Results go to ``out/<phase>-rank<R>.pt`` for the test to judge.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from persist_core.fileio import OsFileOps

ROWS, COLS = 4096, 64  # the sharded tensor: 1 MiB, 256 KiB (one checksum block) per rank on 4 ranks
KEY = bytes(range(32))  # the remote_encryption_key of the runs with a codec


def key() -> bytes:
    """The key as a callable (what a secrets manager would hand each rank)."""
    return KEY


def node_dir(base: str, rank: int) -> str:
    return os.path.join(base, f"node{rank // 2}")


def full_values(step: int) -> dict[str, torch.Tensor]:
    """Every tensor of the state, whole, as it is at ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(step)
    return {"fsdp": torch.randn(ROWS, COLS, generator=g),
            **{f"w{i}": torch.randn(64, 64, generator=g) for i in range(4)}}


def state(step: int, rank: int, mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    from persist_core import PerRank

    full = full_values(step)
    return {"fsdp": distribute_tensor(full["fsdp"], mesh, [Shard(0)]),
            "w": {k: v for k, v in full.items() if k != "fsdp"},  # replicated: split between the ranks
            "step": step, "rng": PerRank(torch.tensor([rank * 10 + step]))}


class Ops(OsFileOps):
    """Fails (``"fail"``) or SIGKILLs this process (``"kill"``) on its next shard write, once armed."""

    mode = ""

    def pwrite(self, fd, data, offset):
        if self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "fail":
            import errno

            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().pwrite(fd, data, offset)


def _init(rank: int, world: int, port: int):
    from torch.distributed.device_mesh import init_device_mesh

    from persist_core import TorchCollectives

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return TorchCollectives.new_group(timeout_s=60), init_device_mesh("cpu", (world,))


def _done(rank: int) -> None:
    dist.barrier()  # every rank done before any tears its groups down (gloo aborts otherwise, at times)
    dist.destroy_process_group()


def run(rank: int, world: int, port: int, base: str, remote: str, out: str, phase: str, shared: bool,
        codec: bool = False) -> None:
    """``phase="save"``: steps 10, 20, 30 with keep_last=1, then every rank restores (agreed, whole).
    ``"resume"``: every rank restores into DTensor/tensor targets (its own node's files from disk when
    they are there, the rest from the remote). ``"fail"``: steps 10, then 20 with rank 3 failing its write.
    ``shared``: every rank uses ``base/node0`` (one shared directory). ``codec``: the remote compressed (zstd) and
    encrypted under :data:`KEY`."""
    runs(rank, world, port, [(base, remote, out, phase, shared)], codec)


def runs(rank: int, world: int, port: int, phases: list[tuple[str, str, str, str, bool]], codec: bool = False) -> None:
    """:func:`run`'s phases one after the other in one process group (``(base, remote, out, phase, shared)``
    each, with its own ``base``): each phase's engine its own, on a collectives group of its own, closed before
    the next opens (one start of the 4 ranks for several independent runs: each start imports torch 4 times)."""
    coll, mesh = _init(rank, world, port)
    for i, (base, remote, out, phase, shared) in enumerate(phases):
        if i:
            from persist_core import TorchCollectives

            coll = TorchCollectives.new_group(timeout_s=60)
        torch.save(_phase(rank, coll, mesh, base, remote, phase, shared, codec), Path(out) / f"{phase}-rank{rank}.pt")
        dist.barrier()  # every rank's phase done before the next begins
    _done(rank)


def _phase(rank: int, coll, mesh, base: str, remote: str, phase: str, shared: bool, codec: bool = False) -> dict:
    from persist_core import CheckpointEngine, KeepLastN, PersistError

    root = node_dir(base, 0 if shared else rank)
    options = {"client_kwargs": {"endpoint_url": os.environ["PERSIST_TEST_S3"]}} if remote.startswith("s3://") else None
    results: dict = {}
    ops = Ops()
    codec_options = {"remote_compression": "zstd", "remote_encryption_key": key} if codec else {}
    with CheckpointEngine(root, collectives=coll, remote_url=remote or None, storage_options=options,
                          keep_local=KeepLastN(1), file_ops=ops, direct_io="off", **codec_options) as engine:
        if phase in ("save", "fail"):
            engine.save(state(10, rank, mesh), step=10).wait()
            if phase == "fail":
                ops.mode = "fail" if rank == 3 else ""
                try:
                    engine.save(state(20, rank, mesh), step=20).wait()
                    results["outcome"] = "committed"
                except PersistError as e:
                    results["outcome"] = f"{type(e).__name__}: {e}"
            else:
                for step in (20, 30):
                    engine.save(state(step, rank, mesh), step=step).wait()
                engine.wait()
                loaded = engine.load()
                results["remote_bytes"] = engine.reader.last_load.remote_bytes
                full = full_values(30)
                results["equal"] = all(torch.equal(loaded["w"][k], full[k]) for k in loaded["w"]) and torch.equal(
                    loaded["fsdp"], full["fsdp"])
                results["step"], results["rng"] = loaded["step"], loaded["rng"]
        if phase == "resume":
            from torch.distributed.tensor import Shard, distribute_tensor

            into = {"fsdp": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]),
                    "w": {f"w{i}": torch.zeros(64, 64) for i in range(4)}}
            loaded = engine.load(into=into)
            results["remote_bytes"] = engine.reader.last_load.remote_bytes
            results["remote_files"] = dict(engine.reader.last_load.remote_files)
            full = full_values(loaded["step"])
            results["equal"] = torch.equal(loaded["fsdp"].full_tensor(), full["fsdp"]) and all(
                torch.equal(into["w"][k], full[k]) for k in into["w"])
            results["in_place"] = loaded["fsdp"] is into["fsdp"]
            results["step"], results["rng"] = loaded["step"], loaded["rng"]
    return results


def kill(rank: int, world: int, port: int, base: str, out: str) -> None:
    """Step 10 commits; in step 20 rank 3 is SIGKILLed inside its shard write. The others record what
    their save raised (they must not hang)."""
    from persist_core import CheckpointEngine

    coll, mesh = _init(rank, world, port)
    ops = Ops()
    engine = CheckpointEngine(node_dir(base, rank), collectives=coll, file_ops=ops, direct_io="off")
    engine.save(state(10, rank, mesh), step=10).wait()
    ops.mode = "kill" if rank == 3 else ""
    outcome = "committed"
    try:
        engine.save(state(20, rank, mesh), step=20).wait()
    except Exception as e:  # whatever the dead peer makes the commit raise: recorded for the test
        outcome = f"{type(e).__name__}: {e}"
    torch.save({"outcome": outcome}, Path(out) / f"kill-rank{rank}.pt")
    os._exit(0)  # the group is broken: no orderly shutdown
