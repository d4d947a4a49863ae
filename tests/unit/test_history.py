"""local_dir's save record (.history.jsonl, what ``persist stats`` reads) stays bounded for a job that saves
every second for weeks, and what is kept reads back in order."""

from __future__ import annotations

import dataclasses

import pytest

from persist_core.handle import SaveStats
from persist_core.history import HistoryLog, read_history, recent_costs
from persist_core.layout import HISTORY_NAME


def test_the_history_rotates_at_its_limit_and_reads_back_the_newest_records(tmp_path):
    log = HistoryLog(tmp_path, max_bytes=4000)
    for step in range(1, 201):
        stats = SaveStats(step=step, nbytes=1 << 20, stall_s=0.001, commit_s=0.2, write_gbps=1.0)
        log.record("committed", stats)
        log.record("uploaded", dataclasses.replace(stats, lag_s=0.5))
    files = [tmp_path / HISTORY_NAME, tmp_path / (HISTORY_NAME + ".1")]
    assert all(f.exists() for f in files)
    assert sum(f.stat().st_size for f in files) < 2 * 4000 + 400  # two files at most, each about the limit
    rows, skipped = read_history(tmp_path)
    assert skipped == 0
    steps = [r["step"] for r in rows]
    assert steps[-1] == 200 and steps == list(range(steps[0], 201))  # the newest, contiguous, in order
    assert 1 not in steps  # the oldest were dropped
    assert rows[-1]["durable_s"] > 0.2 and rows[-1]["lag_s"] == 0.5


def test_recent_costs_come_from_the_last_committed_records_of_the_file_tail(tmp_path):
    log = HistoryLog(tmp_path)
    for step in range(1, 40):
        stats = SaveStats(step=step, nbytes=10, stall_s=0.01 * step, commit_s=1.0)
        log.record("committed", stats, time=float(step), write_slowdown=0.25)
        log.record("uploaded", dataclasses.replace(stats, lag_s=2.0))
    with open(tmp_path / HISTORY_NAME, "a") as f:
        f.write('{"event": "committed", "step": 40, "stall_s": 9\n')  # a line cut by a crash
        f.write("not json\n")
    prior = recent_costs(tmp_path, n=5, tail_bytes=2048)  # the tail starts inside some line
    stalls = [0.01 * s for s in range(35, 40)]
    assert prior.slowdown == 0.25
    assert prior.commit_s == pytest.approx(sum(s + 1.0 for s in stalls) / 5)
    assert prior.cost_s == pytest.approx(sum(s + 0.25 * 1.0 for s in stalls) / 5)
    assert recent_costs(tmp_path / "nothing-here") is None


def test_the_closing_line_shows_the_fence_waits_apart_from_the_stall():
    from persist_core.history import describe_summary

    summary = {"saves": 4, "interval_p50_s": 0.2, "interval_p90_s": 0.3, "interval_p50_steps": 1, "stall_p50_s": 0.004,
               "stall_fraction": 0.02, "fence_wait_s": 0.3, "fence_fraction": 0.31, "write_slowdown": None,
               "upload_lag_p50_s": None}
    line = describe_summary(summary)
    assert "stalled 2.0% of the time in save() (P50 4.0 ms a save) and 31.0% in updates waiting for" in line
    assert "waiting" not in describe_summary({**summary, "fence_wait_s": 0.0, "fence_fraction": 0.0})
