"""The body of each rank in the sharded-state tests: FSDP2 ``fully_shard`` and DTensors on gloo CPU meshes.

Every rank saves with one engine (``TorchCollectives``); later jobs of another size load with
``into=`` targets on their own mesh. Results go to ``out/<name>-rank<R>.pt`` for the test to judge.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))  # uneven over 2, 3, 4


def two_d(rank_values: bool = False) -> dict[str, torch.Tensor]:
    """Plain values of the 2-D mesh tensors (the same on every rank)."""
    return {"a": torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6),
            "b": torch.arange(7 * 3, dtype=torch.float64).reshape(7, 3) * -1,
            "c": torch.arange(6, dtype=torch.int64),
            "s": torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) + 1000}


def _strided(full: torch.Tensor, mesh2):
    """``full`` as FSDP2 lays a parameter out under tensor parallel: ``_StridedShard(0)`` over dp, ``Shard(0)`` over tp."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = [_StridedShard(0, split_factor=mesh2.shape[1]), Shard(0)]
    rows = full.shape[0] // (mesh2.shape[0] * mesh2.shape[1])
    probe = DTensor.from_local(torch.empty(rows, full.shape[1]), mesh2, placements, run_check=False)
    (box,) = probe.__create_chunk_list__()
    part = full[box.offsets[0] : box.offsets[0] + box.sizes[0]].clone()
    return DTensor.from_local(part, mesh2, placements, run_check=False)


def _fsdp(seed: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = model(seed)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(m, mesh=mesh)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    return m, opt, mesh


def _train(m, opt, steps: int) -> None:
    g = torch.Generator().manual_seed(99)
    for _ in range(steps):
        x = torch.randn(4, 5, generator=g)
        m(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _full(m, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(m, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def save(rank: int, world: int, port: int, root: str, remote: str, out: str, two_dims: bool) -> None:
    """Train an FSDP2 model two steps on ``world`` ranks and save it sharded (and what it should load as)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from persist_core import CheckpointEngine, PerRank, PersistError, TorchCollectives

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    coll = TorchCollectives.new_group(timeout_s=60)
    m, opt, _ = _fsdp(1, world)
    _train(m, opt, 2)
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optim": osd, "step": 2, "rng": PerRank(torch.tensor([rank * 10]))}
    if two_dims:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        plain = two_d()
        state["grid"] = {"a": distribute_tensor(plain["a"], mesh2, [Shard(0), Shard(1)]),
                         "b": distribute_tensor(plain["b"], mesh2, [Replicate(), Shard(0)]),
                         "c": distribute_tensor(plain["c"], mesh2, [Shard(0), Replicate()]),
                         "s": _strided(plain["s"], mesh2)}
    results: dict = {}
    with CheckpointEngine(root, collectives=coll, remote_url=remote or None) as engine:
        handle = engine.save(state, step=2)
        handle.wait()
        results["nbytes"] = handle.stats.nbytes
        # the workaround the old error suggested: every rank's local part as a plain tensor
        mixed = {"model": {"w": torch.full((4, 4), float(rank))}}  # like two even .to_local() parts
        try:
            engine.save(mixed, step=3).wait()
            results["mixed"] = "committed"
        except PersistError as e:
            results["mixed"] = str(e)
    results["full"] = _full(m, opt)  # a collective: every rank gathers
    torch.save(results, Path(out) / f"save-rank{rank}.pt")
    dist.barrier()  # every rank done before any tears its groups down (gloo aborts otherwise, at times)
    dist.destroy_process_group()


def load(rank: int, world: int, port: int, root: str, remote: str, out: str, two_dims: bool, plain_root: str) -> None:
    """A job of ``world`` ranks (another size than saved) loads into fresh FSDP2 targets on its own mesh."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state, get_state_dict, set_state_dict

    from persist_core import CheckpointEngine, TorchCollectives

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    coll = TorchCollectives.new_group(timeout_s=60)
    m, opt, mesh = _fsdp(2, world)  # other initial values: everything must come from the checkpoint
    _init_optim_state(opt)
    msd, osd = get_state_dict(m, opt)
    into = {"model": msd, "optim": osd}
    results: dict = {}
    if two_dims:
        from torch.distributed.tensor import Shard, distribute_tensor

        zeros = {k: torch.zeros_like(v) for k, v in two_d().items()}
        into["grid"] = {"a": distribute_tensor(zeros["a"], mesh, [Shard(1)]),
                        "b": distribute_tensor(zeros["b"], mesh, [Shard(0)]),
                        "c": distribute_tensor(zeros["c"], mesh, [Shard(0)]),
                        "s": distribute_tensor(zeros["s"], mesh, [Shard(0)])}
    with CheckpointEngine(root, collectives=coll, remote_url=remote or None) as engine:
        state = engine.load(into=into)
        stats = engine._reader.last_load
        results["stats"] = (stats.needed_bytes, stats.read_bytes)
        results["rng"] = state["rng"]
        results["step"] = state["step"]
        results["same_objects"] = state["model"]["0.weight"] is msd["0.weight"]
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    results["full"] = _full(m, opt)
    if two_dims:
        results["grid"] = {k: v.full_tensor() for k, v in state["grid"].items()}
    if plain_root:  # a checkpoint one process saved (plain tensors) into this job's sharded targets
        m2, opt2, _ = _fsdp(3, world)
        msd2, _ = get_state_dict(m2, opt2)
        with CheckpointEngine(plain_root, collectives=coll) as engine:
            engine.load(into={"model": msd2})
        results["from_one"] = {k: v.full_tensor() for k, v in msd2.items()}
    torch.save(results, Path(out) / f"load-rank{rank}.pt")
    dist.barrier()  # every rank done before any tears its groups down (gloo aborts otherwise, at times)
    dist.destroy_process_group()


class FSDP2AcceleratorStandIn:
    """What ``accelerate_persist._state`` reads of an ``Accelerator`` training FSDP2 models.

    Accelerate's FSDP plugin needs GPUs; on CPU the path the hook shares with it (sharded state dicts
    of ``fully_shard``-ed models through the engine, loaded into targets in place) runs with these
    attributes, as ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))`` has them.
    """

    is_fsdp2 = True

    def __init__(self, model, optimizer, rank: int, world: int) -> None:
        from types import SimpleNamespace

        self._models, self._optimizers = [model], [optimizer]
        self._schedulers, self._dataloaders, self._custom_objects = [], [], []
        self.scaler, self.step, self.process_index, self.num_processes = None, 0, rank, world
        self.project_configuration = SimpleNamespace(iteration=0)


def accelerate_round_trip(rank: int, world: int, port: int, root: str, out: str, phase: str) -> None:
    """``phase="save"``: capture and save on ``world`` ranks; ``"load"``: load into fresh models, apply."""
    from accelerate_persist import _state
    from persist_core import CheckpointEngine, TorchCollectives

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    coll = TorchCollectives.new_group(timeout_s=60)
    m, opt, _ = _fsdp(1 if phase == "save" else 2, world)
    acc = FSDP2AcceleratorStandIn(m, opt, rank, world)
    with CheckpointEngine(root, collectives=coll) as engine:
        if phase == "save":
            _train(m, opt, 2)
            engine.save(_state.capture(acc, optimizer_steps=2), step=2).wait()
        else:
            state = engine.load(into=_state.load_targets(acc))
            assert _state.apply(acc, state) == 2
    torch.save({"full": _full(m, opt)}, Path(out) / f"{phase}-rank{rank}.pt")
    dist.barrier()  # every rank done before any tears its groups down (gloo aborts otherwise, at times)
    dist.destroy_process_group()


def kill_mid_write(rank: int, world: int, port: int, root: str, out: str) -> None:
    """Both ranks save step 1; in step 2 rank 1 is SIGKILLed inside its shard write. Rank 0 records
    what its save raised (it must not hang)."""
    import os
    import signal

    from torch.distributed.checkpoint.state_dict import get_state_dict

    from persist_core import CheckpointEngine, TorchCollectives
    from persist_core.fileio import OsFileOps

    class KillOnWrite(OsFileOps):
        armed = False

        def pwrite(self, fd, data, offset):
            if self.armed:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().pwrite(fd, data, offset)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    coll = TorchCollectives.new_group(timeout_s=60)
    m, opt, _ = _fsdp(1, world)
    _train(m, opt, 1)
    ops = KillOnWrite()
    engine = CheckpointEngine(root, collectives=coll, file_ops=ops, direct_io="off")
    msd, osd = get_state_dict(m, opt)
    engine.save({"model": msd, "optim": osd}, step=1).wait()
    ops.armed = rank == 1
    _train(m, opt, 1)
    msd, osd = get_state_dict(m, opt)
    outcome = "committed"
    try:
        engine.save({"model": msd, "optim": osd}, step=2).wait()
    except Exception as e:  # whatever the dead peer makes the commit raise: recorded for the test
        outcome = f"{type(e).__name__}: {e}"
    torch.save({"outcome": outcome}, Path(out) / f"kill-rank{rank}.pt")
    os._exit(0)  # the group is broken: no orderly shutdown
