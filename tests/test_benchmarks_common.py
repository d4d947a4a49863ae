"""What the benchmarks share and their figures rest on: the one table printer (``benchmarks/_common/tables.py``) and
the one kill-trial driver (``benchmarks/_common/kills.py``), which counts the steps each SIGKILL lost."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from benchmarks._common.kills import kill_series, kill_trial
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
