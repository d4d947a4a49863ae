"""Runs the documentation's code blocks (``tests/integration/test_docs_blocks.py`` starts it once).

Reads a JSON list of pages on stdin, ``{"page", "blocks": [{"id", "code", "runs"}]}``; writes one JSON object to
the file named by its argument: each block's id -> a list, one entry per run: ``{"error": traceback or None, "calls",
"weight", "seconds"}`` (how many times ``train_step()`` ran, ``model.weight[0, 0]`` at the end: what a resumed run
restored, and how long the run took).

The blocks of one page run in order in one namespace (a later block uses an earlier one's imports), each run of a
block starting from :data:`GIVEN`: the names of the user's own program that the docs leave out. What a block opened
and did not close (an engine, a reader, a hook) is closed after it.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

#: the user's program around a block: a model, its optimizer, a data loader, a training step (each +1 on every
#: weight, so a run's final weights say whether a resumed run restored them), and the loop's bounds
GIVEN = """
import torch

try:  # the Lightning pages fit a LightningModule; a LightningModule is a torch module for the others
    from lightning.pytorch import LightningModule as _Module
except ImportError:
    _Module = torch.nn.Module


class Model(_Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(8, 8))

    def forward(self, x):
        return x @ self.weight

    def training_step(self, batch, batch_idx):
        self.trainer.should_stop = self.global_step >= 100  # not the Trainer's default 1000 epochs
        return self(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return loader


model = Model()
opt = optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
loader = torch.utils.data.DataLoader(torch.zeros(50, 8), batch_size=1)
num_epochs = 4
total = 300
start = 0
step = 1
state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
_calls = 0


def train_step():
    global _calls
    _calls += 1
    with torch.no_grad():
        model.weight.add_(1)
"""


def _close_left_open(namespace: dict[str, Any]) -> None:
    """Close what the block opened and left open (the docs may leave an engine to the rest of the program)."""
    from persist_core import CheckpointEngine, CheckpointReader

    kinds: tuple[type, ...] = (CheckpointEngine, CheckpointReader)
    if "accelerate_persist" in sys.modules:
        from accelerate_persist import PersistHook

        kinds += (PersistHook,)
    for value in list(namespace.values()):
        if isinstance(value, kinds):
            value.close()


def main() -> None:
    pages = json.load(sys.stdin)
    results: dict[str, list[dict[str, Any]]] = {}
    for page in pages:
        namespace: dict[str, Any] = {"__name__": "__docs__"}
        for block in page["blocks"]:
            runs = results.setdefault(block["id"], [])
            for _ in range(block["runs"]):
                exec(compile(GIVEN, "<given>", "exec"), namespace)
                error, t0 = None, time.perf_counter()
                try:
                    exec(compile(block["code"], block["id"], "exec"), namespace)
                except BaseException:  # noqa: BLE001 - reported, the next block runs
                    error = traceback.format_exc()
                try:
                    _close_left_open(namespace)
                except BaseException:  # noqa: BLE001
                    error = error or traceback.format_exc()
                model = namespace["model"]
                weight = getattr(model, "weight", None)
                runs.append({"error": error, "calls": namespace["_calls"], "seconds": time.perf_counter() - t0,
                             "weight": None if weight is None else float(weight[0, 0])})
    with open(sys.argv[1], "w") as out:
        json.dump(results, out)


if __name__ == "__main__":
    main()
