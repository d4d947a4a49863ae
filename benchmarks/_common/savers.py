"""Ways to checkpoint a training loop, ours and the peers', behind one interface (:class:`Method`).

:class:`Persist` (torch-persist unguarded, guarded, continuous), :class:`LightningAsync` (Lightning's
``AsyncCheckpointIO`` around ``TorchCheckpointIO``, used directly), :class:`DcpAsync` (DCP ``async_save``, with its
default stager or a ``DefaultStager``), :class:`TorchSave`. Each records per save a :class:`Save`: how long the call
blocked, the time from the call to durable on disk (peers that do not fsync are fsynced), and how long the next
update waited for the save's background copy. The loop they save is any object with ``state(step)``, ``opt`` (the
optimizer) and ``device``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks._common.floors import fsync_tree
from benchmarks._common.models import tree_map
from persist_core import AnyOf, CheckpointEngine, CheckpointReader, Continuous, KeepLastN, KeepSteps

State = dict[str, Any]


@dataclass
class Save:
    """One save: its step, how long the call blocked, the time from the call to durable, and the next update's wait."""

    step: int
    blocking_s: float
    durable_s: float | None = None
    waited_s: float = 0.0


class Method:
    """One way to checkpoint. The harness calls ``open``, then per step ``before_update`` (from the loop's step)
    and ``save`` (the fixed-interval ones when due, a continuous one every step), then ``drain``, ``load`` (the
    snapshot check, the restore) and ``close``."""

    key = ""
    name = ""
    continuous = False

    def open(self, root: Path, loop: Any, first: int) -> None:
        self.root, self.loop = root, loop
        root.mkdir(parents=True, exist_ok=True)

    def save(self, make_state: Callable[[], State], step: int) -> Save | None:
        raise NotImplementedError

    def before_update(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def load(self, step: int, device: torch.device, like: State) -> Any:
        raise NotImplementedError

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}.pt"

    def close(self) -> None:
        pass


class Persist(Method):
    def __init__(self, key: str, name: str, *, guard: bool, continuous: bool = False) -> None:
        self.key, self.name, self._guard, self.continuous = key, name, guard, continuous
        self._saves: list[tuple[Save, Any]] = []

    def open(self, root: Path, loop: Any, first: int) -> None:
        super().open(root, loop, first)
        self.engine = CheckpointEngine(root, keep_local=AnyOf(KeepLastN(1), KeepSteps({first})), preemption=None,
                                       save_policy=Continuous() if self.continuous else None)
        self.engine.save(loop.state(first - 1), step=first - 1).wait()  # its staging buffer, allocated
        self.guard = self.engine.guard(loop.opt) if self._guard else None

    def save(self, make_state: Callable[[], State], step: int) -> Save | None:
        t0 = time.perf_counter()
        if self.continuous:
            handle = self.engine.maybe_save(make_state, step)
        else:
            handle = self.engine.save(make_state(), step)
        if handle is None:
            return None
        record = Save(step, time.perf_counter() - t0)
        self._saves.append((record, handle))
        return record

    def drain(self) -> None:
        if self.guard is not None:
            self.guard.remove()
        self.engine.wait()
        for record, handle in self._saves:
            record.durable_s = record.blocking_s + handle.stats.commit_s
            record.waited_s = handle.stats.fence_s

    def load(self, step: int, device: torch.device, like: State) -> Any:
        return CheckpointReader(self.root).load(step, map_location=device)

    def path(self, step: int) -> Path:
        return Path({c.step: c.path for c in CheckpointReader(self.root).list()}[step])

    def close(self) -> None:
        self.engine.close()


class LightningAsync(Method):
    key, name = "lightning", "Lightning AsyncCheckpointIO"

    def open(self, root: Path, loop: Any, first: int) -> None:
        super().open(root, loop, first)
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        done: dict[str, float] = {}

        class Durable(TorchCheckpointIO):  # the worker's save, fsynced: durable when this returns
            def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
                super().save_checkpoint(checkpoint, path, storage_options=storage_options)
                fsync_tree(Path(path))
                done[str(path)] = time.perf_counter()

        self._done, self.io = done, AsyncCheckpointIO(Durable())
        self._saves: list[tuple[Save, float]] = []

    def save(self, make_state: Callable[[], State], step: int) -> Save:
        t0 = time.perf_counter()
        self.io.save_checkpoint(make_state(), self.path(step))
        record = Save(step, time.perf_counter() - t0)
        self._saves.append((record, t0))
        return record

    def drain(self) -> None:
        self.io.teardown()  # waits for the worker; raises what it raised
        for record, t0 in self._saves:
            record.durable_s = self._done[str(self.path(record.step))] - t0

    def load(self, step: int, device: torch.device, like: State) -> Any:
        return torch.load(self.path(step), map_location=device, weights_only=True)


class TorchSave(Method):
    key, name = "torch-save", "torch.save"

    def save(self, make_state: Callable[[], State], step: int) -> Save:
        t0 = time.perf_counter()
        torch.save(make_state(), self.path(step))
        fsync_tree(self.path(step))
        took = time.perf_counter() - t0
        return Save(step, took, durable_s=took)

    def load(self, step: int, device: torch.device, like: State) -> Any:
        return torch.load(self.path(step), map_location=device, weights_only=True)


class DcpAsync(Method):
    """DCP ``async_save``; one save at a time (the next waits for the previous, as DCP's docs ask). With a
    stager, its staging runs in the background and the next update waits for it."""

    def __init__(self, key: str, name: str, *, stager: bool) -> None:
        self.key, self.name, self._with_stager = key, name, stager
        self._reuse = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)  # pytorch #183413 before

    def open(self, root: Path, loop: Any, first: int) -> None:
        super().open(root, loop, first)
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self._stager = self._new_stager() if self._with_stager and self._reuse else None
        self._fresh: list[Any] = []  # stagers made for one save, closed once it is done
        self._uploads: list[Future] = []
        self._staging: tuple[Save, Future] | None = None
        if self._stager is not None:  # its pinned buffers, allocated
            self.save(lambda: loop.state(first - 1), first - 1)
            self.before_update()
            self.drain()

    def _new_stager(self) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = self.loop.device.type == "cuda"
        return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                                            use_non_blocking_copy=cuda))

    def save(self, make_state: Callable[[], State], step: int) -> Save:
        t0 = time.perf_counter()
        if self._uploads:
            self._uploads[-1].result()  # the previous save: done before the next one starts
            self._close_fresh()
        stager = None
        if self._with_stager:
            stager = self._stager or self._new_stager()
            if self._stager is None:
                self._fresh.append(stager)
        response = self.dcp.async_save(make_state(), checkpoint_id=str(self.path(step)), async_stager=stager)
        upload = response if isinstance(response, Future) else response.upload_completion
        record = Save(step, time.perf_counter() - t0)
        if not isinstance(response, Future):
            self._staging = (record, response.staging_completion)
        upload.add_done_callback(lambda f: setattr(record, "durable_s", time.perf_counter() - t0))
        self._uploads.append(upload)
        return record

    def before_update(self) -> None:
        if self._staging is not None:  # the update must not change what is still being staged
            record, staging = self._staging
            t0 = time.perf_counter()
            staging.result()
            record.waited_s += time.perf_counter() - t0
            self._staging = None

    def drain(self) -> None:
        self.before_update()
        for upload in self._uploads:
            upload.result()
        self._uploads = []
        self._close_fresh()

    def _close_fresh(self) -> None:
        for stager in self._fresh:
            stager.close()
        self._fresh = []

    def load(self, step: int, device: torch.device, like: State) -> Any:
        target = tree_map(lambda t: torch.empty_like(t, device=device), like)
        self.dcp.load(target, checkpoint_id=str(self.path(step)))
        return target

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def close(self) -> None:
        self._close_fresh()
        if self._stager is not None:
            self._stager.close()


def all_methods() -> list[Method]:
    return [
        Persist("unguarded", "torch-persist unguarded", guard=False),
        Persist("guarded", "torch-persist guarded", guard=True),
        Persist("continuous", "torch-persist guarded continuous", guard=True, continuous=True),
        LightningAsync(),
        DcpAsync("dcp", "DCP async_save", stager=False),
        DcpAsync("dcp-stager", "DCP async_save + DefaultStager", stager=True),
        TorchSave(),
    ]
