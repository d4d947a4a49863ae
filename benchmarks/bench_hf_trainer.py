"""The Hugging Face Trainer's own save next to ``PersistTrainerCallback``'s, with the floors of the same run.

One run, a BERT built from a config (no downloads), CPU, ``save_steps=2``, each configuration in a
fresh process, 2 interleaved rounds, medians:

* ``trainer``: the Trainer's own ``checkpoint-N/`` (synchronous ``save_pretrained`` + ``torch.save``
  of optimizer, scheduler and RNG; no fsync, so not durable when it returns);
* ``persist``: ``PersistTrainerCallback`` (the Trainer writes nothing; the engine stages, writes,
  fsyncs and commits in the background).

Per save: the stall (what the training loop waits: the gap from ``on_step_end`` to the next
``on_step_begin`` of a saving step, minus the same gap of a step that does not save), and for
persist the save→durable time (``commit_s``). The floors, measured in the same run: a plain
``copy_`` of the state into preallocated memory, and the disk's own durable write of its bytes
(``benchmarks._common.disk_gbps``).

Usage: ``python benchmarks/bench_hf_trainer.py [--hidden 768] [--layers 4] [--rounds 2] [--dir bench-out]``;
``--smoke``: a tiny BERT, one round, both configurations in this process, in seconds (CI runs it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("trainer", "persist")
STEPS, EVERY = 10, 2


def build(hidden: int, layers: int):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=8000, hidden_size=hidden, num_hidden_layers=layers,
                                                    num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden,
                                                    max_position_embeddings=64, num_labels=2))


def child(mode: str, hidden: int, layers: int, out: Path) -> dict:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    sys.path.insert(0, str(ROOT))
    from accelerate_persist import PersistTrainerCallback

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    model = build(hidden, layers)
    ids = torch.randint(1, 8000, (8 * STEPS, 32), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": ids[i], "labels": int(ids[i, 0]) % 2} for i in range(len(ids))]

    class Gaps(TrainerCallback):
        def __init__(self) -> None:
            self.ends: dict[int, float] = {}
            self.gaps: dict[int, float] = {}

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step in self.ends:
                self.gaps[state.global_step] = time.perf_counter() - self.ends[state.global_step]

        def on_train_end(self, args, state, control, **kwargs):
            if state.global_step in self.ends:
                self.gaps[state.global_step] = time.perf_counter() - self.ends[state.global_step]

    gaps = Gaps()

    class StepEnd(TrainerCallback):  # before ours in the list: our save (in on_step_end) counts as stall
        def on_step_end(self, args, state, control, **kwargs):
            gaps.ends[state.global_step] = time.perf_counter()

    callbacks = [PersistTrainerCallback(local_dir=out / "ckpt")] if mode == "persist" else []
    args = TrainingArguments(output_dir=str(out / "out"), max_steps=STEPS, save_steps=EVERY,
                             per_device_train_batch_size=8, report_to=[], use_cpu=True, logging_strategy="no",
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[StepEnd(), *callbacks, gaps])
    trainer.train()
    saving = [gaps.gaps[s] for s in gaps.gaps if s % EVERY == 0 and s != STEPS and s > EVERY]  # after a warm-up
    quiet = [gaps.gaps[s] for s in gaps.gaps if s % EVERY != 0]
    result = {"mode": mode, "stall_s": statistics.median(saving) - statistics.median(quiet)}
    if mode == "persist":
        handles = [h for h in callbacks[0]._session._saved.values() if h is not None][1:]
        result["commit_s"] = statistics.median(h.stats.commit_s for h in handles)
        result["nbytes"] = handles[-1].stats.nbytes
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default="bench-out")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, one round, each configuration in this process: a check that it runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.rounds = 32, 1, 1
        import torch

        torch.set_num_threads(1)  # tiny ops gain nothing from more; on busy cores OpenMP's waits take 100s of ms
    out = Path(args.dir).absolute() / "hf-trainer"
    if args.child:
        print(json.dumps(child(args.child, args.hidden, args.layers, out)))
        return 0
    sys.path.insert(0, str(ROOT))
    import torch

    from benchmarks._common import disk_gbps, floor_copy, print_table

    model = build(args.hidden, args.layers)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    state = {**weights, **{f"adam.{i}.{k}": torch.zeros_like(v) for k, v in weights.items() for i in (0, 1)}}
    size = sum(t.numel() * t.element_size() for t in state.values())
    print(f"HF Trainer, BERT hidden {args.hidden} x {args.layers} layers + AdamW (state {size / 1e9:.2f} GB), CPU, "
          f"save_steps={EVERY}; {args.rounds} rounds, interleaved")
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    copy_s, disk = [], []
    for _ in range(args.rounds):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        copy_s.append(floor_copy(state, repeat=3))
        disk.append(max(disk_gbps(size, out, repeat=2).values()))
        for mode in MODES:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            if args.smoke:  # one process for both: the same code, without a fresh interpreter (and transformers) each
                results[mode].append(child(mode, args.hidden, args.layers, out))
                continue
            run = subprocess.run([sys.executable, __file__, "--child", mode, "--hidden", str(args.hidden), "--layers",
                                  str(args.layers), "--dir", args.dir], capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit(f"{mode} failed:\n{run.stderr[-3000:]}")
            results[mode].append(json.loads(run.stdout.strip().splitlines()[-1]))
    shutil.rmtree(out, ignore_errors=True)
    floor, durable = statistics.median(copy_s), size / statistics.median(disk) / 1e9
    print(f"floors: copy_ of the state {floor * 1000:.0f} ms; the disk writes it durably in {durable * 1000:.0f} ms "
          f"({statistics.median(disk):.2f} GB/s)")
    trainer = statistics.median(r["stall_s"] for r in results["trainer"])
    stall = statistics.median(r["stall_s"] for r in results["persist"])
    commit = statistics.median(r["commit_s"] for r in results["persist"])
    print_table(["configuration", "stall per save", "stall / copy floor", "save→durable", "durable / disk"],
                [["Trainer's own checkpoint-N", f"{trainer * 1000:.0f} ms", f"{trainer / floor:.1f}x",
                  "not durable (no fsync)", None],
                 ["PersistTrainerCallback", f"{stall * 1000:.0f} ms", f"{stall / floor:.1f}x", f"{(stall + commit):.2f} s",
                  f"{(stall + commit) / durable:.2f}x"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
