"""What the benchmarks share and their figures rest on: the one table printer (``benchmarks/_common/tables.py``), the
one kill-trial driver (``benchmarks/_common/kills.py``), which counts the steps each SIGKILL lost, and the one
interleaved-blocks loop (``benchmarks/_common/blocks.py``)."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from benchmarks._common.blocks import Block, Nothing, Saving, by_kind, cost_per_save, run_blocks
from benchmarks._common.kills import kill_series, kill_trial, kill_when_ready
from benchmarks._common.tables import table

#: a job as the driver expects one: resumes from the step in ``ckpt`` (saved every 3 steps, before the step is
#: said), says ``start``, then says each step; after ``stop`` steps past its start it waits to be killed, so where
#: a kill lands is known. Two processes of one job: the first waits for the FIFO ``after`` before its steps, which
#: the second opens and closes after its own.
JOB = textwrap.dedent("""
    import json, os, sys, threading
    ckpt, stop, after = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None
    start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
    print(json.dumps({"event": "start", "step": start, "load_s": 0.0}), flush=True)
    print("a line a library printed", flush=True)
    if after and after.startswith("wait:"):
        open(after[5:]).read()  # a FIFO: until the other process wrote it and closed it
    for step in range(start + 1, start + stop + 1):
        if step % 3 == 0:
            with open(ckpt + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(ckpt + ".tmp", ckpt)
        print(json.dumps({"event": "step", "step": step}), flush=True)
    if after and after.startswith("touch:"):
        open(after[6:], "w").close()
    threading.Event().wait()
""")


def test_table_prints_markdown_rows_under_the_header():
    assert table(["method", "stall (ms)", "note"], [["ours", "12", None], ["", 3, "x"]], align="lrl") == [
        "| method | stall (ms) | note |",
        "|---|---:|---|",
        "| ours | 12 | - |",
        "| | 3 | x |",
    ]
    assert table(["a", "b"], [])[1] == "|---|---:|"  # the first column left, the figures right


def test_table_refuses_a_row_that_does_not_fit_the_header():
    with pytest.raises(ValueError, match="a row of 3 cells under 2 columns"):
        table(["a", "b"], [[1, 2, 3]])
    with pytest.raises(ValueError, match="align='lx'"):
        table(["a", "b"], [], align="lx")


@pytest.mark.slow  # starts processes
def test_kill_series_counts_the_steps_each_kill_lost(tmp_path):
    ckpt = tmp_path / "ckpt"
    command = [sys.executable, "-c", JOB, str(ckpt), "4"]
    seen = []
    series = kill_series([command], 2, lambda: 4, cwd=tmp_path, between=lambda killed: seen.append(killed.last))
    # 0 -> 4 (saved at 3), resumed at 3 -> 7 (saved at 6), resumed at 6: each kill lost the step after the save
    assert [(k.killed.resumed, k.killed.last, k.restart.resumed, k.lost) for k in series] == [(0, 4, 3, 1),
                                                                                               (3, 7, 6, 1)]
    assert seen == [4, 7]  # between ran after each kill, before the restart
    assert series[-1].restart.starts == [{"event": "start", "step": 6, "load_s": 0.0}]


@pytest.mark.slow  # starts processes
def test_kill_trial_takes_the_newest_step_any_process_finished(tmp_path):
    (tmp_path / "a").write_text("3")
    (tmp_path / "b").write_text("6")
    done = tmp_path / "done"
    os.mkfifo(done)
    trial = kill_trial([[sys.executable, "-c", JOB, str(tmp_path / "a"), "2", f"wait:{done}"],
                        [sys.executable, "-c", JOB, str(tmp_path / "b"), "3", f"touch:{done}"]], 2, cwd=tmp_path)
    assert (trial.resumed, [s["step"] for s in trial.starts]) == (3, [3, 6])
    assert trial.last == 9  # process 1 finished step 9 before process 0 began (and waits there); process 0 step 5


@pytest.mark.slow  # starts processes
def test_kill_when_ready_kills_once_the_run_left_its_file_and_says_when_it_never_did(tmp_path):
    mark = tmp_path / "mark"
    leaves = [sys.executable, "-c", f"import threading; open({str(mark)!r}, 'w').close(); threading.Event().wait()"]
    assert kill_when_ready(leaves, mark.exists, 0.0, cwd=tmp_path) is None  # a process that never ends: killed
    ends = [sys.executable, "-c", "pass"]
    assert "ended (exit code 0) before it was ready" in kill_when_ready(ends, lambda: False, 0.0, cwd=tmp_path)


class _Engine:
    """An engine's calls as the blocks loop makes them: a save every second step, each said in its summary."""

    def __init__(self) -> None:
        self.saves, self.calls = 0, []

    def guard(self, opt):
        self.calls.append(("guard", opt))
        return self

    def remove(self) -> None:
        self.calls.append(("remove",))

    def summary(self) -> dict:
        return {"saves": self.saves}

    def maybe_save(self, state, *, step: int) -> None:
        self.saves += step % 2 == 0
        self.calls.append(("maybe_save", step, state()))

    def wait(self) -> None:
        self.calls.append(("wait",))


def test_run_blocks_interleaves_the_kinds_and_counts_each_blocks_saves():
    engine, steps = _Engine(), []
    beside = {"none": Nothing(), "saving": Saving(engine, lambda: "state", guard="opt")}
    runs = run_blocks(beside, rounds=2, block=3, compute=lambda: steps.append(len(steps)), update=None)
    assert [(b.kind, b.done) for b in runs] == [("none", 0), ("saving", 2), ("none", 0), ("saving", 2)]  # 4, 6; 10, 12
    assert len(steps) == 12 and all(b.step_s >= 0 and b.took_s >= 0 for b in runs)
    assert engine.calls[:5] == [("guard", "opt"), ("maybe_save", 4, "state"), ("maybe_save", 5, "state"),
                                ("maybe_save", 6, "state"), ("wait",)]
    assert engine.calls[5] == ("remove",)
    assert list(by_kind(runs)) == ["none", "saving"]


def test_cost_per_save_is_the_median_over_the_rounds_with_a_save():
    runs = [Block("none", 0.010, 0, 0, 0, 0), Block("saving", 0.012, 0, 0, 2, 0),
            Block("none", 0.010, 0, 0, 0, 0), Block("saving", 0.020, 0, 0, 0, 0),  # no save: not counted
            Block("none", 0.011, 0, 0, 0, 0), Block("saving", 0.015, 0, 0, 1, 0)]
    assert cost_per_save(runs, "saving", "none", block=10) == pytest.approx((0.002 * 10 / 2 + 0.004 * 10) / 2)
    assert cost_per_save(runs[:2], "none", "none", block=10) is None
