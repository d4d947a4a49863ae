"""Resume bugs of the kinds users reported in 2025-2026, reproduced on CPU through the real adapters: does the
automatic resume check (issue 55) name each one, and with what message?

Each scenario trains a tiny model a few steps with the adapter saving, then resumes in a fresh run with one bug
injected the way it happens in the wild (a restore that swallows a failure, a load that mutates what it loads, a
user hook that changes a value, state dropped), and collects the ``ResumeMismatchWarning``s the adapter's check
issues. A bug is *named* when a warning names the key path it damaged. The table gives, per bug, the report it is
of the kind of, the adapter, whether it was named, and the first key line of the warning.

Usage: ``python benchmarks/bench_resume_bugs.py [--dir bench-out]``; ``--smoke``: two scenarios (CI runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Bug:
    name: str
    kind_of: str  # the public report it is of the kind of
    adapter: str
    key: str | None  # the key path it damages (None: the verifier is not expected to see it)
    run: Callable[[Path, contextlib.ExitStack], str | None]  # what shows a bug the check is not expected to name


@contextlib.contextmanager
def patched(obj: object, name: str, value: object) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


# ---------------------------------------------------------------- Accelerate


def accelerate_resume(tmp: Path, stack: contextlib.ExitStack, *, during=None, after=None) -> None:
    """3 steps saved, then a fresh Accelerator resumes (``during(acc)``: patches live while it restores;
    ``after(acc, parts)``: the user's code between the restore and the first step) and trains one step."""
    from accelerate_persist import PersistHook
    from tests.support.accelerate_app import Counter, fresh_accelerator, scaled_parts, scaled_steps

    acc = fresh_accelerator()
    parts = scaled_parts(acc, Counter())
    with PersistHook(local_dir=tmp / "ckpt").register(acc):
        scaled_steps(acc, parts, 0, 3)
        acc.save_state()
    acc = fresh_accelerator()
    parts = scaled_parts(acc, Counter())
    with contextlib.ExitStack() as restoring:
        if during is not None:
            during(acc, restoring)
        hook = PersistHook(local_dir=tmp / "ckpt").register(acc)
        start = hook.resume()
    with hook:
        if after is not None:
            after(acc, parts)
        scaled_steps(acc, parts, start, start + 1)


def _rng_swallowed(acc, stack) -> None:
    from accelerate_persist import _state

    stack.enter_context(patched(_state, "_set_rng_state", lambda state: None))
    torch.manual_seed(1234)  # the fresh process's own seed stays


def _scaler_mutated_by_load(acc, stack) -> None:
    scaler = acc.scaler
    load = scaler.load_state_dict

    def load_and_mutate(state):  # a load that changes what it loads (the scale halved, as a backoff)
        load(state)
        scaler._init_scale = state["scale"] / 2  # the scale the next step uses (no step taken yet)

    stack.enter_context(patched(scaler, "load_state_dict", load_and_mutate))


def _sampler_dropped(acc, stack) -> None:
    from accelerate_persist import _state

    stack.enter_context(patched(_state, "_restore_dataloader", lambda dataloader, state: None))


def _reinitialized(acc, parts) -> None:
    torch.manual_seed(0)
    parts[0].apply(lambda m: m.reset_parameters() if isinstance(m, torch.nn.Linear) else None)  # init after load


def _registered_not_restored(acc, stack) -> None:
    obj = acc._custom_objects[0]
    stack.enter_context(patched(obj, "load_state_dict", lambda state: None))


# ---------------------------------------------------------------- Lightning


def lightning_resume(tmp: Path, stack: contextlib.ExitStack, *, module=None, callbacks=()) -> None:
    from lightning.pytorch import Trainer

    from lightning_persist import PersistCheckpointIO
    from tests.support.lightning_app import Net, checkpoint_callback

    def fit(steps: int, net, resume: bool, extra=()) -> None:
        io = PersistCheckpointIO(local_dir=tmp / "local")
        trainer = Trainer(max_steps=steps, plugins=[io], accelerator="cpu", devices=1, logger=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[checkpoint_callback(tmp / "ck"), *extra])
        trainer.fit(net, ckpt_path=io.latest_path() if resume else None)

    fit(3, Net(), False, [c() for c in callbacks])
    fit(4, (module or Net)(), True, [c(buggy=True) for c in callbacks])


def _lr_hook_module():
    from tests.support.lightning_app import Net

    class LrOnLoad(Net):
        def on_load_checkpoint(self, checkpoint):  # the user's hook changes the lr Lightning then restores
            checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] *= 0.1

    return LrOnLoad


def _counting_callback():
    from lightning.pytorch.callbacks import Callback

    class Counting(Callback):
        def __init__(self, buggy: bool = False) -> None:
            self.seen, self.buggy = 0, buggy

        def on_train_batch_end(self, *args) -> None:
            self.seen += 1

        def state_dict(self) -> dict:
            return {"seen": self.seen}

        def load_state_dict(self, state: dict) -> None:
            if not self.buggy:  # a callback whose restore forgets its state
                self.seen = state["seen"]

    Counting.__qualname__ = "Counting"
    return Counting


def wrong_run(tmp: Path, stack: contextlib.ExitStack) -> str:
    """Run ``run-a`` saves in a directory; a new run ``run-b`` reuses the directory and resumes: the state is
    restored exactly as saved (nothing for the check to name), and the lineage says whose it was."""
    from click.testing import CliRunner

    from persist_core import CheckpointEngine
    from persist_core.cli.app import main as persist

    with CheckpointEngine(tmp, direct_io="off", run_id="run-a") as engine:
        engine.save({"w": torch.ones(3), "step": 3}, 3).wait()
    with CheckpointEngine(tmp, direct_io="off", run_id="run-b") as engine:
        engine.verify_resume(engine.load())
        engine.save({"w": torch.ones(3), "step": 4}, 4).wait()
    done = CliRunner().invoke(persist, ["log", str(tmp)])
    return "persist log: " + done.output.splitlines()[-1].strip()


# ---------------------------------------------------------------- HF Trainer


def hf_resume(tmp: Path, stack: contextlib.ExitStack, *, during=None) -> None:
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

    from accelerate_persist import PersistTrainerCallback

    def model():
        torch.manual_seed(0)
        return BertForSequenceClassification(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                                        num_attention_heads=2, intermediate_size=32,
                                                        max_position_embeddings=16, num_labels=2))

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (24, 8), generator=g)
    data = [{"input_ids": ids[i], "labels": int(ids[i].sum()) % 2} for i in range(24)]

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 5
            return control

    def run(callbacks, resume=None):
        args = TrainingArguments(output_dir=str(tmp / "out"), max_steps=6, save_steps=2, per_device_train_batch_size=4,
                                 learning_rate=5e-3, report_to=[], use_cpu=True, seed=0, logging_strategy="no",
                                 disable_tqdm=True)
        trainer = Trainer(model=model(), args=args, train_dataset=data, callbacks=callbacks)
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
        trainer.train(resume_from_checkpoint=resume)

    run([PersistTrainerCallback(local_dir=tmp / "ckpt"), StopAt()])
    callback = PersistTrainerCallback(local_dir=tmp / "ckpt")
    resume = callback.resume_path()
    with contextlib.ExitStack() as restoring:
        if during is not None:
            during(restoring)
        run([callback], resume)


def _hf_rng_failed(stack) -> None:
    from transformers import Trainer

    stack.enter_context(patched(Trainer, "_load_rng_state", lambda self, checkpoint: None))


def _hf_scaler_skipped(stack) -> None:
    from transformers import Trainer

    stack.enter_context(patched(Trainer, "_load_scaler", lambda self, checkpoint: None))  # as with no scaler.pt


# ---------------------------------------------------------------- the table


BUGS = [
    Bug("RNG restore failure swallowed", "accelerate #4283", "Accelerate", "per_process/0/rng/torch",
        lambda t, s: accelerate_resume(t, s, during=_rng_swallowed)),
    Bug("GradScaler mutated by the load itself", "accelerate #4289", "Accelerate", "scaler/scale",
        lambda t, s: accelerate_resume(t, s, during=_scaler_mutated_by_load)),
    Bug("dataloader/sampler state dropped", "Megatron-Bridge #5637", "Accelerate", "dataloaders/0/generators/0",
        lambda t, s: accelerate_resume(t, s, during=_sampler_dropped)),
    Bug("registered object's restore does nothing", "(registered state)", "Accelerate", "custom/0/seen",
        lambda t, s: accelerate_resume(t, s, during=_registered_not_restored)),
    Bug("weights re-initialised after the restore", "(user code)", "Accelerate", "models/0/0.weight",
        lambda t, s: accelerate_resume(t, s, after=_reinitialized)),
    Bug("lr changed by the user's on_load_checkpoint", "(user hook)", "Lightning",
        "optimizer_states/0/param_groups/0/lr", lambda t, s: lightning_resume(t, s, module=_lr_hook_module())),
    Bug("callback state not restored", "(callback state)", "Lightning", "callbacks/Counting/seen",
        lambda t, s: lightning_resume(t, s, callbacks=[_counting_callback()])),
    Bug("another run's directory reused and loaded", "lm-resiliency #77", "engine", None, wrong_run),
    Bug("RNG restore did nothing", "accelerate #4283 (HF Trainer)", "HF Trainer", "rng/cpu",
        lambda t, s: hf_resume(t, s, during=_hf_rng_failed)),
    Bug("GradScaler not restored (no scaler.pt read)", "accelerate #4289 (HF Trainer)", "HF Trainer", "scaler/scale",
        lambda t, s: hf_resume(t, s, during=_hf_scaler_skipped)),
]
SMOKE = ("RNG restore failure swallowed", "dataloader/sampler state dropped")


def run_bug(bug: Bug, root: Path) -> tuple[bool, str, float]:
    from persist_core import ResumeMismatchWarning

    tmp = root / bug.name.replace(" ", "-").replace("/", "-").replace("'", "")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    begin = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught, contextlib.ExitStack() as stack:
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", ResumeMismatchWarning)
        evidence = bug.run(tmp, stack)
    took = time.perf_counter() - begin
    messages = [str(w.message) for w in caught if issubclass(w.category, ResumeMismatchWarning)]
    keyline = next((line.strip() for m in messages for line in m.splitlines() if bug.key and f"{bug.key}:" in line),
                   None)
    if keyline is not None:
        return True, keyline, took
    first = next((line.strip() for m in messages for line in m.splitlines()[2:3]), "no warning")
    return False, first if evidence is None else f"{first}; {evidence}", took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--smoke", action="store_true", help=f"only {', '.join(SMOKE)}")
    args = parser.parse_args(argv)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    root = Path(args.dir or tempfile.mkdtemp(prefix="resume-bugs-"))
    bugs = [b for b in BUGS if not args.smoke or b.name in SMOKE]
    rows = []
    for bug in bugs:
        named, line, took = run_bug(bug, root)
        rows.append((bug, named, line, took))
        print(f"{bug.name}: {'named' if named else 'NOT named'} ({took:.1f} s)", flush=True)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    print()
    print("| resume bug (injected) | of the kind of | adapter | named | the warning's line |")
    print("|---|---|---|---|---|")
    for bug, named, line, _ in rows:
        print(f"| {bug.name} | {bug.kind_of} | {bug.adapter} | {'yes' if named else 'no'} | `{line}` |")
    print(f"\n{sum(n for _, n, _, _ in rows)} of {len(rows)} bugs named")
    return 0


if __name__ == "__main__":
    sys.exit(main())
