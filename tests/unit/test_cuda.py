"""The GPU paths, through the public API: pinned staging buffers, the side-stream copy of a guarded save, saves
after kernels still queued. Marked ``cuda`` and skipped without a CUDA device (``benchmarks/gpu_check.sh`` runs
them on a GPU machine); each compares against a clone taken at the moment the checkpoint must capture."""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest
import torch

from persist_core import CheckpointEngine
from tests.support.states import assert_state_equal

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUSY_CYCLES = 200_000_000  # torch.cuda._sleep: keeps the current stream busy for some 100 ms


def mapped(tree: Any, fn: Any) -> Any:
    """``tree`` with ``fn`` applied to each tensor, its containers of the same types."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return type(tree)((k, mapped(v, fn)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(mapped(v, fn) for v in tree)
    return tree


def cloned(tree: Any) -> Any:
    """A deep copy of ``tree``'s tensors, queued on the current stream: the values as of now, in stream order."""
    return mapped(tree, lambda t: t.detach().clone())


def on_host(tree: Any) -> Any:
    return mapped(tree, lambda t: t.cpu())


def test_cuda_state_round_trips_through_pinned_buffers(ckpt_dir):
    base = torch.randn(256, 256, device="cuda")
    state = {"w": base, "view": base[3:7], "h": torch.randn(1000, device="cuda").half(), "cpu": torch.arange(5), "n": 3}
    before = cloned(state)  # {"view"} is a clone of its own there; the loaded one shares "w"'s storage again
    with CheckpointEngine(ckpt_dir) as engine:
        handle = engine.save(state, step=1)
        base.add_(1)  # once save() has returned, the device tensors may change
        handle.wait()
        on_cpu = engine.load()
        on_gpu = engine.load(map_location="cuda")
    assert on_cpu["w"].device.type == "cpu" and on_gpu["w"].device.type == "cuda"
    assert on_gpu["view"].untyped_storage().data_ptr() == on_gpu["w"].untyped_storage().data_ptr()
    assert_state_equal(on_gpu, {**before, "cpu": before["cpu"].cuda()})
    assert_state_equal(on_cpu, on_host(before))


def test_guarded_save_is_the_state_at_save_while_the_next_step_runs_at_once(ckpt_dir):
    """The guarded path: save() returns before the parameters and optimizer state are copied; the copy runs on a
    side stream from the moment of save() (the update queued before it included), and the optimizer's next
    step(), called right away, waits for it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(512, 1024, device="cuda")

    def forward_backward() -> None:
        model(x).pow(2).mean().backward()

    forward_backward()
    opt.step()
    opt.zero_grad()
    with CheckpointEngine(ckpt_dir) as engine, engine.guard(opt):
        forward_backward()
        torch.cuda._sleep(BUSY_CYCLES)  # the device is busy ...
        opt.step()  # ... so this update is still queued when save() is called
        opt.zero_grad()
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        expected = cloned(state)  # queued behind the update: the values at save()
        handle = engine.save(state, step=1)
        forward_backward()
        opt.step()  # right away: waits (the guard's step pre-hook) for the background copy
        opt.zero_grad()
        handle.wait()
        assert engine.summary()["overlapped_saves"] == 1  # the copy did run in the background
        loaded = engine.load()  # on the host: the optimizer's step counters were host tensors
    assert_state_equal(loaded, on_host(expected))
    assert not torch.equal(model[0].weight, expected["model"]["0.weight"])  # the step after save() changed it


def test_pinned_staging_buffer_is_reused_across_saves(ckpt_dir):
    """By what the handles' stats say: after the first save no save allocates a buffer (the part of the stall
    that is neither copying nor waiting shrinks to the planning), and every copy runs at about the speed of a
    device-to-host copy into pinned memory measured here (a pageable one is several times slower)."""
    state = {f"t{i}": torch.randn(16 << 20, device="cuda") for i in range(4)}  # 4 x 64 MB
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in state.values()]

    def pinned_copy() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for dst, src in zip(pinned, state.values()):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    pinned_copy()
    floor = statistics.median(pinned_copy() for _ in range(3))
    stats = []
    with CheckpointEngine(ckpt_dir) as engine:
        for step in range(1, 5):
            for t in state.values():
                t.add_(1)
            before = cloned(state)
            handle = engine.save(state, step=step)
            handle.wait()
            stats.append(handle.stats)
            assert_state_equal(engine.load(step, map_location="cuda"), before)

    def setup_s(s: Any) -> float:  # planning, and allocating a buffer when there is none to reuse
        return s.stall_s - s.staging_s - s.wait_s

    first, later = stats[0], stats[1:]
    for s in later:
        assert setup_s(s) < max(setup_s(first) / 4, 0.010), (setup_s(first), [setup_s(t) for t in later])
        assert s.staging_s < 3 * floor + 0.005, (s.staging_s, floor)


def test_unguarded_save_waits_for_kernels_queued_before_it(ckpt_dir):
    x = torch.zeros(4096, 4096, device="cuda")
    with CheckpointEngine(ckpt_dir) as engine:
        torch.cuda._sleep(BUSY_CYCLES)  # keep the current stream busy ...
        x.fill_(2.0)  # ... so these are still queued when save() starts
        x[0].mul_(3)
        expected = x.clone()
        handle = engine.save({"x": x}, step=1)
        x.fill_(-1.0)  # after save() returns: not in the checkpoint
        handle.wait()
        loaded = engine.load(map_location="cuda")["x"]
    assert torch.equal(loaded, expected)
    assert loaded[0, 0].item() == 6.0 and loaded[1, 0].item() == 2.0
