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

import argparse
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOTAL_STEPS, EVERY, KILL_AT = 16, 4, 10


def train(local_dir: str | None, remote: str, endpoint: str | None, kill_at: int | None, out: str) -> None:
    """One machine's training process; prints one JSON line at the end."""
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
                os.kill(os.getpid(), signal.SIGKILL)

    callbacks, resume = [], None
    if local_dir is not None:
        options = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else None
        callback = PersistTrainerCallback(local_dir=local_dir, remote_url=remote, storage_options=options, keep_last=2)
        callbacks.append(callback)
        resume = callback.resume_path()
    if kill_at:
        callbacks.append(KillAt())
    args = TrainingArguments(output_dir=out, max_steps=TOTAL_STEPS, save_steps=EVERY, per_device_train_batch_size=8,
                             learning_rate=3e-3, report_to=[], use_cpu=True, seed=0, logging_strategy="no",
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    own = sorted(p.name for p in Path(out).glob("checkpoint-*"))
    print(json.dumps({"resumed_from": resume and int(resume.rsplit("-", 1)[1]), "digest": digest, "own": own}),
          flush=True)


def machine(local_dir: Path | None, remote: str, endpoint: str | None, out: Path, kill_at: int | None = None):
    cmd = [sys.executable, __file__, "--child", "--remote", remote, "--out", str(out)]
    cmd += (["--local-dir", str(local_dir)] if local_dir else []) + (["--endpoint", endpoint] if endpoint else [])
    cmd += ["--kill-at", str(kill_at)] if kill_at else []
    from examples._common import run_machine

    return run_machine(cmd, run_id='demo-run-9' if local_dir is not None else None)


def main() -> None:
    from examples._common import listing, remote_steps, remote_storage

    out = ROOT / "demo-out" / "hf-trainer"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with remote_storage(out, "run-9") as (remote, endpoint):
        print(f"== HF Trainer: machine 1 trains {TOTAL_STEPS} steps, save_steps={EVERY} through "
              f"PersistTrainerCallback (keep 2), synced to {remote}; SIGKILL after step {KILL_AT}")
        assert machine(out / "machine-1", remote, endpoint, out / "out-1", kill_at=KILL_AT) is None
        own = sorted(p.name for p in (out / "out-1").glob("checkpoint-*"))
        print(f"  killed. machine 1's local_dir: {listing(out / 'machine-1')}; the Trainer's own checkpoints: "
              f"{own or 'none'}")
        print(f"  on the remote: steps {remote_steps(out / 'peek', remote, endpoint)}")
        print("== machine 2: empty local_dir, same script: trainer.train(resume_from_checkpoint=callback.resume_path())")
        resumed = machine(out / "machine-2", remote, endpoint, out / "out-2")
        if resumed["resumed_from"] is None:  # killed before its first upload committed: the same run starts over
            print(f"  nothing on the remote yet: the same run (PERSIST_RUN_ID) started over and finished at step "
                  f"{TOTAL_STEPS}")
        else:
            print(f"  resumed from step {resumed['resumed_from']} (downloaded, verified, written as the Trainer's "
                  f"files) and finished at step {TOTAL_STEPS}")
        reference = machine(None, remote, endpoint, out / "out-ref")
        same = resumed["digest"] == reference["digest"]
        print(f"== resumed weights bit-identical to an uninterrupted run: {same}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--local-dir")
    parser.add_argument("--remote")
    parser.add_argument("--endpoint")
    parser.add_argument("--out")
    parser.add_argument("--kill-at", type=int)
    a = parser.parse_args()
    if a.child:
        train(a.local_dir, a.remote, a.endpoint, a.kill_at, a.out)
    else:
        main()
