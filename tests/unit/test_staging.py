"""GPU paths: pinned staging buffers and the side-stream copy. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from persist_core import CheckpointEngine
from tests.support.states import assert_state_equal

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_state_round_trips_through_pinned_buffers(ckpt_dir):
    base = torch.randn(256, 256, device="cuda")
    state = {"w": base, "view": base[3:7], "h": torch.randn(1000, device="cuda").half(), "cpu": torch.arange(5), "n": 3}
    with CheckpointEngine(ckpt_dir) as engine:
        handle = engine.save(state, step=1)
        base.add_(1)  # after save() returns the device tensors may change
        handle.wait()
        (buffer,) = engine._pool._free
        assert buffer.pinned and buffer.tensor.is_pinned()
        on_cpu = engine.load()
        on_gpu = engine.load(map_location="cuda")
    base.sub_(1)
    assert on_cpu["w"].device.type == "cpu" and on_gpu["w"].device.type == "cuda"
    assert torch.equal(on_cpu["w"], base.cpu()) and torch.equal(on_gpu["view"], base[3:7])
    assert on_gpu["view"].untyped_storage().data_ptr() == on_gpu["w"].untyped_storage().data_ptr()
    assert_state_equal(on_gpu, {**state, "w": base, "view": base[3:7], "cpu": state["cpu"].cuda()})


def test_copy_waits_for_work_queued_on_the_current_stream(ckpt_dir):
    x = torch.zeros(4096, 4096, device="cuda")
    with CheckpointEngine(ckpt_dir) as engine:
        torch.cuda._sleep(50_000_000)  # keep the current stream busy ...
        x.fill_(2.0)  # ... so this fill is still queued when save() starts
        engine.save({"x": x}, step=1).wait()
        assert torch.equal(engine.load()["x"], torch.full((4096, 4096), 2.0))
