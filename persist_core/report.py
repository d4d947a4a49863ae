"""What checkpoints cost, for people: a one-line verdict, sparklines and a plot of each save's numbers over
time (``persist stats`` builds the rows from the manifests and ``local_dir``'s save history).

Each row: ``step``, ``time`` (the save's wall time), ``interval_s`` (since the previous one, ``None`` for the
first) and, where the history has them, ``stall_s``, ``durable_s`` (save() -> committed), ``bytes``, ``lag_s``.
"""

from __future__ import annotations

import statistics
from typing import Any

def verdict(rows: list[dict[str, Any]]) -> str:
    """One line: how often it saves, what a save costs, and whether that is too often for this state."""
    intervals = [r["interval_s"] for r in rows if r["interval_s"] is not None]
    durable = [r["durable_s"] for r in rows if r.get("durable_s") is not None]
    stalls = [r["stall_s"] for r in rows if r.get("stall_s") is not None]
    if not intervals:
        return f"{len(rows)} checkpoint: nothing to compare yet"
    every = statistics.median(intervals)
    text = f"{len(rows)} checkpoints, one every {every:.1f} s (median)"
    if durable:
        d = statistics.median(durable)
        text += f"; a save takes {d:.2f} s to be durable"
        if stalls:
            text += f" and stalls training {statistics.median(stalls) * 1e3:.0f} ms"
        if every < 2 * d:
            return text + (f". Saves are too frequent for this state: a new one starts before the last is "
                           f"{every / d:.1f}x its own duration old, so writes overlap most steps; save at most every "
                           f"{2 * d:.1f} s, or use OptimalInterval(mtbf_s=...) to let the measured cost decide")
        share = statistics.median(stalls) / every if stalls else 0.0
        return text + (f": stalls take {share:.1%} of training time" + (
            ", well under 1%: saving more often would lose less work per failure" if share < 0.01 else ""))
    return text + " (no save history here: run stats on the job's local_dir for stall and durability)"


SPARKS = "▁▂▃▄▅▆▇█"


def spark(values: list[float | None]) -> str:
    """``values`` as one line of block characters (the last 60), blank where missing."""
    values = values[-60:]
    known = [v for v in values if v is not None]
    top = max(known) if known else 0.0
    return "".join(" " if v is None else SPARKS[min(7, int(v / top * 7.999))] if top > 0 else SPARKS[0]
                   for v in values)


def plot(rows: list[dict[str, Any]], path: str, *, title: str) -> None:
    """Interval, stall, save -> durable and upload lag against step, into ``path`` (PNG)."""
    import matplotlib  # the plot extra; ImportError without it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    steps = [r["step"] for r in rows]
    for key, label in (("interval_s", "interval"), ("durable_s", "save -> durable"), ("stall_s", "stall"),
                       ("lag_s", "upload lag")):
        points = [(s, r[key]) for s, r in zip(steps, rows) if r.get(key) is not None]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title(f"what checkpoints cost: {title}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
