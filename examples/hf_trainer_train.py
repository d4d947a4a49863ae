"""The Hugging Face ``Trainer`` with ``PersistTrainerCallback``: killed mid-run, resumed on a fresh machine.

The training script is a plain ``Trainer``; the callback is one line, and the resume one more::

    callback = PersistTrainerCallback(local_dir=..., remote_url="s3://demo/run-9", keep_last=2)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])
    trainer.train(resume_from_checkpoint=callback.resume_path())   # None on a first run

1. machine 1 trains (a tiny BERT built from a config, saving every 4 steps through the callback:
   the Trainer writes no checkpoint-N of its own) and is SIGKILLed right after step 10;
2. machine 2 starts with an empty ``local_dir``: ``resume_path()`` downloads and verifies the newest
   checkpoint on the remote and writes it out as the Trainer's own files; the Trainer resumes;
3. an uninterrupted reference run shows the resumed weights are bit-identical.

The remote is a local moto S3 server when ``moto`` is installed (``make demo``), else a ``file://``
directory. Usage: ``python examples/hf_trainer_train.py``.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples._common import child_options, finish, kill_and_resume, preempt, storage_options  # noqa: E402

TOTAL_STEPS, EVERY, KILL_AT = 16, 4, 10


def train(local_dir: str | None, remote: str, endpoint: str | None, kill_at: int | None, out: str) -> None:
    """One machine's training process (no ``local_dir``: no checkpoints); prints one JSON line at the end."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from accelerate_persist import PersistTrainerCallback

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64,
                                                     max_position_embeddings=32, num_labels=2))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (64, 16), generator=g)
    data = [{"input_ids": ids[i], "labels": int(ids[i].sum()) % 2} for i in range(64)]

    class KillAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == kill_at - 1:
                callback.wait()  # the checkpoints so far are on the remote: the kill lands mid-run, not mid-upload
            if state.global_step == kill_at:
                preempt()

    callbacks, resume = [], None
    if local_dir is not None:
        callback = PersistTrainerCallback(local_dir=local_dir, remote_url=remote, storage_options=storage_options(endpoint),
                                          keep_last=2)
        callbacks.append(callback)
        resume = callback.resume_path()
    if kill_at:
        callbacks.append(KillAt())
    args = TrainingArguments(output_dir=out, max_steps=TOTAL_STEPS, save_steps=EVERY, per_device_train_batch_size=8,
                             learning_rate=3e-3, report_to=[], use_cpu=True, seed=0, logging_strategy="no",
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    own = sorted(p.name for p in Path(out).glob("checkpoint-*"))
    finish(model, resumed_from=resume and int(resume.rsplit("-", 1)[1]), own=own)


def resumed(r: dict) -> str:
    if r["resumed_from"] is None:  # killed before its first upload committed: the same run starts over
        return (f"  nothing on the remote yet: the same run (PERSIST_RUN_ID) started over and finished at step "
                f"{TOTAL_STEPS}")
    return (f"  resumed from step {r['resumed_from']} (downloaded, verified, written as the Trainer's files) and "
            f"finished at step {TOTAL_STEPS}")


def own_checkpoints(out: Path) -> str:
    own = sorted(p.name for p in (out / "machine-1-out").glob("checkpoint-*"))
    return f"; the Trainer's own checkpoints: {own or 'none'}"


def main() -> int:
    return kill_and_resume(
        __file__, "hf-trainer", "run-9", kill_at=KILL_AT,
        intro=(f"== HF Trainer: machine 1 trains {TOTAL_STEPS} steps, save_steps={EVERY} through "
               f"PersistTrainerCallback (keep 2), synced to {{remote}}; SIGKILL after step {KILL_AT}"),
        machine_2=("== machine 2: empty local_dir, same script: "
                   "trainer.train(resume_from_checkpoint=callback.resume_path())"),
        resumed=resumed, after_kill=own_checkpoints, show_machine_2=False)


if __name__ == "__main__":
    args = child_options()
    if args.child:
        train(args.local_dir, args.remote, args.endpoint, args.kill_at, args.out)
    else:
        sys.exit(main())
