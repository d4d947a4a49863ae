"""A small Accelerate training job, runnable in-process and under ``accelerate launch``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from accelerate_persist import PersistHook  # noqa: E402
from persist_core import Continuous, EveryNSteps  # noqa: E402

BATCHES = 12


class Counter:
    """An object registered for checkpointing."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]

    def observe(self, x: torch.Tensor) -> None:
        self.seen += len(x)


class Buffer:
    """A registered object whose state is a tensor."""

    def __init__(self) -> None:
        self.ema = torch.zeros(4)

    def state_dict(self) -> dict:
        return {"ema": self.ema.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.ema = state["ema"].clone()

    def observe(self, x: torch.Tensor) -> None:
        self.ema = 0.9 * self.ema + 0.1 * x[0, :4]


def scaled_parts(acc: Accelerator, registered):
    """A tiny model, AdamW, a shuffled loader and a GradScaler that grows every step (as fp16 on a GPU), with
    ``registered`` (a :class:`Counter` or a :class:`Buffer`) registered for checkpointing: the resume checks' app."""
    torch.manual_seed(0)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)  # as with fp16 on a GPU
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8,
                                         shuffle=True, generator=torch.Generator().manual_seed(2))
    acc.register_for_checkpointing(registered)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    return model, optimizer, loader, registered


def scaled_steps(acc: Accelerator, parts, start: int, stop: int) -> None:
    """Steps ``[start, stop)`` of :func:`scaled_parts`' app (resumed mid-epoch: the epoch's first batches skipped);
    each batch moves the registered object's state."""
    model, optimizer, loader, registered = parts
    step = start
    batches = acc.skip_first_batches(loader, start % len(loader)) if start % len(loader) else loader
    for x, y in batches:
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        registered.observe(x)
        step += 1
        if step == stop:
            return


def fresh_accelerator(**kwargs) -> Accelerator:
    """A new Accelerator in this process (Accelerate keeps its state in singletons)."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, **kwargs)


def build(accelerator: Accelerator, width: int = 64):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.8)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8 * BATCHES, 16, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    return model, optimizer, loader, scheduler, counter


def train(accelerator, model, optimizer, loader, scheduler, counter, *, start: int, stop: int, save_every: int = 0,
          on_save=None, hook=None, on_step=None, after_step=None) -> None:
    """Optimizer steps ``start+1 .. stop``, resuming mid-epoch by skipping the batches already seen.

    With a ``hook`` that has a save policy, ``hook.maybe_save()`` runs after every step and the
    loop stops once the hook is preempted. ``after_step(step)`` runs last in each step.
    """
    step, per_epoch = start, len(loader)  # batches this process sees per epoch
    while step < stop:
        batches = accelerator.skip_first_batches(loader, step % per_epoch) if step % per_epoch else loader
        for x, y in batches:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            counter.seen += len(x)
            step += 1
            if on_step is not None:
                on_step(step)
            if save_every and step % save_every == 0:
                accelerator.save_state()
                if on_save is not None:
                    on_save(step)
            if hook is not None:
                saved = hook.maybe_save()
                if saved and on_save is not None:
                    on_save(step)
                if hook.preempted:
                    return
            if after_step is not None:
                after_step(step)
            if step == stop:
                return


def weights(model) -> dict:
    sd = model.state_dict()
    return {k.removeprefix("module."): v.detach().clone() for k, v in sd.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-dir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--remote-url")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", help="torch.save the final weights here (main process)")
    parser.add_argument("--kill-after-save", type=int, help="SIGKILL right after save_state() of this step returns")
    parser.add_argument("--term-after-save", type=int, help="SIGTERM right after save_state() of this step returns")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--policy", choices=["continuous", "every4"], help="save with hook.maybe_save() instead")
    parser.add_argument("--term-at", type=int, help="SIGTERM (on the main process) during this step")
    parser.add_argument("--term-signal", default="SIGTERM", help="the signal --term-at sends (the hook takes it)")
    parser.add_argument("--decisions", help="write this process's save decisions here (JSON)")
    parser.add_argument("--node-local", action="store_true",
                        help="each process is a node of its own: local_dir is LOCAL_DIR/node<rank>")
    parser.add_argument("--memory-dir", help="memory_every_n_steps=1 in this tmpfs, hook.maybe_save() each step")
    parser.add_argument("--hold-at", type=int, help="with --memory-dir: the main process keeps each step's weights "
                        "(OUT.stepN); at this step every process says `ready <step> <pid>` and waits to be killed")
    args = parser.parse_args()
    if args.node_local:
        args.local_dir = os.path.join(args.local_dir, f"node{os.environ.get('RANK', '0')}")
    endpoint = os.environ.get("PERSIST_TEST_S3_ENDPOINT")
    options = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint and args.remote_url else None
    accelerator = Accelerator(cpu=True)
    parts = build(accelerator, args.width)
    policy = {"continuous": Continuous(), "every4": EveryNSteps(4), None: None}[args.policy]
    term_signal = getattr(signal, args.term_signal)
    hook = PersistHook(local_dir=args.local_dir, remote_url=args.remote_url, storage_options=options,
                       save_policy=policy, preemption_signals=tuple({signal.SIGTERM, term_signal}),
                       **(dict(memory_every_n_steps=1, memory_dir=args.memory_dir) if args.memory_dir else {}))
    hook.register(accelerator)
    start = hook.resume() if args.resume else 0
    if args.memory_dir and args.resume:  # what each process resumed from
        torch.save({"step": start, "weights": weights(parts[0])}, f"{args.out}.resumed{accelerator.process_index}")

    def on_save(step: int) -> None:
        if args.out and accelerator.is_main_process:
            torch.save(weights(parts[0]), f"{args.out}.step{step}")
        if step == args.kill_after_save:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.term_after_save:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice; the upload is still pending
            threading.Event().wait(120)  # training would go on here; the flush ends the process once it is done
            print("SIGTERM did not end the process", flush=True)

    decisions: list[int] = []

    def on_step(step: int) -> None:
        if step == args.term_at and accelerator.is_main_process:
            os.kill(os.getpid(), term_signal)

    def record(step: int) -> None:
        decisions.append(step)
        on_save(step)

    def after_step(step: int) -> None:
        if args.hold_at is None:
            return
        if accelerator.is_main_process:
            torch.save(weights(parts[0]), f"{args.out}.step{step}")
        if step == args.hold_at:
            sys.stdout.flush()  # the line in one write: the ranks share this pipe, and a print may write "\n" on its own
            os.write(1, f"ready {step} {os.getpid()}\n".encode())
            sys.stdin.read()  # until killed

    memory = args.memory_dir is not None
    train(accelerator, *parts, start=start, stop=args.steps, save_every=0 if policy or memory else args.save_every,
          on_save=record, hook=hook if policy or memory else None, on_step=on_step, after_step=after_step)
    if args.decisions:
        Path(f"{args.decisions}.{accelerator.process_index}").write_text(json.dumps(decisions))
    hook.close()
    if args.out and accelerator.is_main_process:
        torch.save({"start": start, "weights": weights(parts[0])}, args.out)
    accelerator.end_training()


if __name__ == "__main__":
    main()
