"""The record of saves a running engine keeps: what save decisions look at, and ``summary()``.

:class:`SaveHistory` holds the saves started (clock time, step, handle) and a
:class:`SlowdownMeter`; it turns them into the :class:`~persist_core.decisions.DecisionContext`
a save policy sees and into the engine's summary (intervals, stall share, slowdown while a save
writes, save duration, upload lag). The engine's training thread feeds it; :meth:`SaveHistory.summary`
may be called from any thread.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from persist_core.errors import ConfigError
from persist_core.handle import SaveHandle, SaveStats
from persist_core.layout import HISTORY_NAME, MAX_STEP
from persist_core.policies.save import Clock, DecisionContext
from persist_core.sidefiles import open_side_file, warn_once

log = logging.getLogger(__name__)

_RECENT = 5  # the last saves measure what a save costs now


def _quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (nearest rank), or ``None`` when empty."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


class SlowdownMeter:
    """How much slower training runs while a save is being written in the background.

    The engine calls :meth:`observe` at each decision point and :meth:`staged` when ``save()``
    returns. The time from one point to the next counts when a save was being written at both
    ends ("writing") or at neither ("idle"); gaps that straddle a commit are left out. Medians of
    the last ``window`` gaps keep an evaluation pass or a slow batch from skewing it.
    """

    def __init__(self, window: int = 64, min_samples: int = 5) -> None:
        self._writing: deque[float] = deque(maxlen=window)
        self._idle: deque[float] = deque(maxlen=window)
        self._min = min_samples
        self._mark: tuple[int | None, float, bool] | None = None  # (step, time, writing) of the last point

    def observe(self, step: int, now: float, writing: bool) -> None:
        if self._mark is not None and self._mark[0] != step:
            _, then, was_writing = self._mark
            if was_writing == writing:
                (self._writing if writing else self._idle).append(now - then)
        self._mark = (step, now, writing)

    def staged(self, step: int, now: float) -> None:
        self._mark = (step, now, True)

    def idle_needed(self) -> int:
        """Gaps with no save in flight that :meth:`slowdown` still needs."""
        return max(0, self._min - len(self._idle))

    def slowdown(self) -> float | None:
        """Median writing gap / median idle gap - 1 (never below 0), or ``None`` before enough of both."""
        if len(self._writing) < self._min or len(self._idle) < self._min:
            return None
        idle = statistics.median(self._idle)
        return max(0.0, statistics.median(self._writing) / idle - 1.0) if idle > 0 else None


@dataclass(frozen=True)
class Prior:
    """What saves cost the process that wrote ``local_dir`` before this one (:func:`recent_costs`): a
    restarted job's decisions start from it instead of from nothing, until its own saves are measured."""

    cost_s: float  # one save's cost to training: stall, plus the slowdown over its write
    commit_s: float  # from save() to committed
    slowdown: float | None  # how much slower training ran while a save was written


class SaveHistory:
    """The saves an engine started, and what they cost.

    Args:
        clock: the monotonic clock of the engine's decisions.
        maxlen: saves remembered (the oldest are forgotten first).
        prior: what saves cost the previous process on this ``local_dir`` (its history file), used until
            this process measures its own.
    """

    def __init__(self, clock: Clock, maxlen: int = 10_000, prior: Prior | None = None) -> None:
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._saves: deque[tuple[float, int, SaveHandle]] = deque(maxlen=maxlen)
        self.meter = SlowdownMeter()
        self.prior = prior
        self._resumed_at: float | None = None

    def resumed(self) -> None:
        """This process loaded the checkpoint it continues from now (an interval policy counts from here)."""
        self._resumed_at = self._clock()

    def now(self) -> float:
        """The decisions' clock now."""
        return self._clock()

    def add(self, when: float, step: int, handle: SaveHandle) -> None:
        with self._lock:
            self._saves.append((when, step, handle))

    def last_step(self) -> int | None:
        with self._lock:
            return self._saves[-1][1] if self._saves else None

    def _recent(self) -> list[tuple[float, int, SaveHandle]]:
        with self._lock:  # no copy of the whole history per decision
            n = len(self._saves)
            return [self._saves[i] for i in range(max(0, n - _RECENT), n)]

    def context(self, step: int, in_flight: bool) -> DecisionContext:
        """What a save policy sees at ``step`` now."""
        recent = self._recent()
        done = [h.stats for _, _, h in recent if h.done() and h.stats.commit_s is not None]
        prior = self.prior
        slowdown = self.meter.slowdown()
        if slowdown is None and prior is not None:  # until measured again: what the previous process measured
            slowdown = prior.slowdown
        cost = commit = None
        if done:  # a save costs training its stall, and slower steps for as long as it writes
            cost = sum(_cost(s.stall_s, s.commit_s or 0.0, slowdown) for s in done) / len(done)
            commit = sum(_duration(s) for s in done) / len(done)
        elif prior is not None:
            cost, commit = prior.cost_s, prior.commit_s
        last_time, last_step = recent[-1][:2] if recent else (None, None)
        return DecisionContext(step=step, now=self._clock(), last_step=last_step, last_time=last_time,
                               in_flight=in_flight, cost_s=cost, commit_s=commit, slowdown=slowdown,
                               idle_needed=0 if slowdown is not None else self.meter.idle_needed(),
                               resumed_time=self._resumed_at)

    def summary(self) -> dict[str, Any]:
        """See :meth:`CheckpointEngine.summary`."""
        with self._lock:
            saves = list(self._saves)
        times = [t for t, _, _ in saves]
        steps = [s for _, s, _ in saves]
        stats = [h.stats for _, _, h in saves]
        gaps = [b - a for a, b in zip(times, times[1:])]
        elapsed = self._clock() - self._started
        return {
            "saves": len(saves),
            "interval_p50_s": _quantile(gaps, 0.5),
            "interval_p90_s": _quantile(gaps, 0.9),
            "interval_p50_steps": _quantile([b - a for a, b in zip(steps, steps[1:])], 0.5),
            "stall_p50_s": _quantile([s.stall_s for s in stats], 0.5),
            "save_p50_s": _quantile([_duration(s) for s in stats if s.commit_s is not None], 0.5),
            "stall_fraction": sum(s.stall_s for s in stats) / elapsed if elapsed > 0 else None,
            "fence_wait_s": sum(s.fence_s for s in stats),
            "fence_fraction": sum(s.fence_s for s in stats) / elapsed if elapsed > 0 else None,
            "write_slowdown": self.meter.slowdown(),
            "upload_lag_p50_s": _quantile([s.lag_s for s in stats if s.lag_s is not None], 0.5),
        }


def _cost(stall_s: float, commit_s: float, slowdown: float | None) -> float:
    """What one save cost training: its stall, and slower steps for as long as it was written."""
    return stall_s + (slowdown or 0.0) * commit_s


def _duration(stats: SaveStats) -> float:
    """From the call to ``save()`` to the checkpoint committed locally."""
    return stats.stall_s + (stats.commit_s or 0.0)


def describe_summary(summary: dict[str, Any]) -> str:
    """:meth:`CheckpointEngine.summary` in one line: intervals, stall share, upload lag."""

    def sec(v: Any) -> str:
        return "-" if v is None else f"{v:.1f} s"
    stall, slow = summary["stall_fraction"], summary.get("write_slowdown")
    p50, fence = summary.get("stall_p50_s"), summary.get("fence_fraction")
    where = "" if p50 is None else f" in save() (P50 {p50 * 1e3:.1f} ms a save)"
    if fence:  # overlapped saves: what the updates waited for their background copies, apart
        where += f" and {fence:.1%} in updates waiting for a save's background copy"
    return (f"{summary['saves']} saves, interval P50 {sec(summary['interval_p50_s'])} / P90 "
            f"{sec(summary['interval_p90_s'])} ({summary['interval_p50_steps'] or '-'} steps), training stalled "
            f"{'-' if stall is None else f'{stall:.1%}'} of the time{where}"
            f"{'' if slow is None else f' and ran {slow:.0%} slower while a save was written'}, upload lag P50 "
            f"{sec(summary['upload_lag_p50_s'])}")



class HistoryLog:
    """``local_dir``'s record of what each save cost: one JSON line per event (``committed``, ``uploaded``),
    appended by rank 0's writer and sync threads, read by ``persist stats``. Best effort: a failed append is
    logged and costs nothing else. Bounded: once the file reaches ``max_bytes`` it becomes ``.history.jsonl.1``
    (replacing the one before) and a new one starts, so a job saving every second for weeks keeps the last
    ~50,000 to 100,000 records in at most 2 x ``max_bytes``.

    Args:
        root: ``local_dir``.
        max_bytes: the size at which the file is rotated.
    """

    def __init__(self, root: Path, max_bytes: int = 16 << 20) -> None:
        self._path = root / HISTORY_NAME
        self._lock = threading.Lock()
        self.max_bytes = max_bytes

    def record(self, event: str, stats: SaveStats, **extra: Any) -> None:
        line = {"event": event, "step": stats.step, "wall": time.time(), **extra}
        for name in ("stall_s", "staging_s", "write_gbps", "upload_gbps", "lag_s", "lag_steps"):
            value = getattr(stats, name)
            if value is not None:
                line[name] = value
        if event == "committed":
            line["bytes"] = stats.nbytes
            if stats.commit_s is not None:
                line["durable_s"] = stats.stall_s + stats.commit_s
        data = (json.dumps(line) + "\n").encode()
        with self._lock:
            try:
                fd = open_side_file(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            except ConfigError as e:  # a link: never appended through
                warn_once(log, str(self._path), "not recording what saves cost: %s", e)
                return
            except OSError as e:
                log.warning("could not append to %s: %s", self._path, e)
                return
            try:
                try:
                    os.write(fd, data)  # one write of one line: appends never interleave
                    full = os.fstat(fd).st_size >= self.max_bytes
                finally:
                    os.close(fd)
                if full:
                    os.replace(self._path, _rotated(self._path))
            except OSError as e:
                log.warning("could not append to %s: %s", self._path, e)


def _rotated(path: Path) -> Path:
    return path.with_name(path.name + ".1")


_REALS = ("stall_s", "staging_s", "durable_s", "lag_s", "write_gbps", "upload_gbps", "write_slowdown")
_COUNTS = ("bytes", "lag_steps")
_LATEST_TIME = 253402300799.0  # the last second of year 9999: what time.gmtime shows


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _time(value: Any) -> bool:
    return _real(value) and 0 <= value <= _LATEST_TIME


def _record(raw: bytes) -> dict[str, Any] | None:
    """One history line as :meth:`HistoryLog.record` writes it, or ``None`` for anything else: not JSON,
    not an object, no step or wall time, a value of the wrong type or out of range."""
    try:
        line = json.loads(raw)
    except ValueError:  # UnicodeDecodeError too
        return None
    if not isinstance(line, dict) or not isinstance(line.get("event"), str):
        return None
    step = line.get("step")
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        return None
    if not _time(line.get("wall")) or ("time" in line and not _time(line["time"])):
        return None
    if any(line.get(k) is not None and not _real(line[k]) for k in _REALS):
        return None
    if any(line.get(k) is not None and not (type(line[k]) is int and abs(line[k]) <= MAX_STEP) for k in _COUNTS):
        return None
    return line


def _open(path: Path) -> BinaryIO | None:
    """The history file ``path`` open for reading, or ``None`` when there is none (or a link is there: never
    followed, said once)."""
    try:
        fd = open_side_file(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except (ConfigError, OSError) as e:
        warn_once(log, str(path), "not reading what saves cost from %s: %s", path, e)
        return None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        warn_once(log, str(path), "not reading what saves cost from %s: not a regular file", path)
        return None
    return f


def recent_costs(root: Path, n: int = _RECENT, tail_bytes: int = 64 << 10) -> Prior | None:
    """What the last ``n`` saves recorded in ``root``'s history cost (read from the file's last ``tail_bytes``,
    or the rotated file's when the new one has none yet), or ``None`` without such records."""
    for path in (root / HISTORY_NAME, _rotated(root / HISTORY_NAME)):
        f = _open(path)
        if f is None:
            continue
        try:
            with f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - tail_bytes))
                lines = f.read().split(b"\n")[1 if size > tail_bytes else 0:]  # the first may be cut
        except OSError:
            continue
        rows = []
        for raw in lines:
            line = _record(raw)
            if line is not None and line["event"] == "committed" and _real(line.get("durable_s")) and \
                    _real(line.get("stall_s")) and line["durable_s"] >= line["stall_s"] >= 0:
                rows.append(line)
        if rows:
            rows = rows[-n:]
            slowdown = next((r["write_slowdown"] for r in reversed(rows) if r.get("write_slowdown") is not None), None)
            cost = statistics.fmean(_cost(r["stall_s"], r["durable_s"] - r["stall_s"], slowdown) for r in rows)
            return Prior(cost_s=cost, commit_s=statistics.fmean(r["durable_s"] for r in rows), slowdown=slowdown)
    return None


def read_history(root: Path) -> tuple[list[dict[str, Any]], int]:
    """Per step (ascending), what ``local_dir``'s history says of its save: the ``committed`` line's numbers
    and, once uploaded, the ``uploaded`` line's (``lag_s``, ``upload_gbps``); and how many lines were skipped
    as unreadable (not JSON, not an object, a missing or wrong-typed or out-of-range value)."""
    by_step: dict[int, dict[str, Any]] = {}
    lines: list[bytes] = []
    for path in (_rotated(root / HISTORY_NAME), root / HISTORY_NAME):  # the older records first
        f = _open(path)
        if f is not None:
            with f:
                lines += f.read().splitlines()
    skipped = 0
    for raw in lines:
        line = _record(raw)
        if line is None:
            skipped += bool(raw.strip())
            continue
        row = by_step.setdefault(line["step"], {"step": line["step"]})
        if line["event"] == "committed":
            row.update({k: v for k, v in line.items() if k != "event"})
        elif line["event"] == "uploaded":
            row.update({k: line[k] for k in ("lag_s", "upload_gbps", "lag_steps") if k in line})
            row["uploaded_wall"] = line["wall"]
    return [by_step[s] for s in sorted(by_step) if "wall" in by_step[s]], skipped
