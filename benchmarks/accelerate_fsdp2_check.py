"""The Accelerate hook with FSDP2 on CUDA: save sharded, restore into a fresh run, compare. For a GPU machine.

Run with ``accelerate launch --num_processes N benchmarks/accelerate_fsdp2_check.py`` (or plain
``python`` for one GPU; without a GPU it runs on the CPU). Exits non-zero when the restored model or optimizer
differs from the saved. ``--smoke`` runs the same (it is already small): CI runs it, in a process of its own (it
starts a process group).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(local_dir: str, seed: int, steps: int) -> tuple[dict, dict]:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from accelerate_persist import PersistHook

    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 257), torch.nn.ReLU(), torch.nn.Linear(257, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    hook = PersistHook(local_dir=local_dir).register(acc)
    if steps:
        for _ in range(steps):
            loss = model(torch.randn(16, 64, device=acc.device)).pow(2).mean()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        acc.save_state()
        hook.wait()
    else:
        assert hook.resume() == 3, "restored at the wrong step"
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=full)
    hook.close()
    return msd, osd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the same check (it is small already)")
    parser.parse_args(argv)
    from accelerate import PartialState

    state = PartialState()
    local_dir = tempfile.mkdtemp(prefix="persist-fsdp2-") if state.num_processes == 1 else "/tmp/persist-fsdp2-check"
    saved = run(local_dir, seed=1, steps=3)
    restored = run(local_dir, seed=2, steps=0)
    if state.is_main_process:
        for name, a, b in (("model", saved[0], restored[0]), ("optim", saved[1]["state"], restored[1]["state"])):
            flat_a, flat_b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
            same = len(flat_a) == len(flat_b) and all(torch.equal(x, y) for x, y in zip(flat_a, flat_b))
            print(f"accelerate FSDP2 {name}: {'bit-exact' if same else 'DIFFERS'} after save_state/load_state")
            if not same:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
