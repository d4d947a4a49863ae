"""Is it good, what did it cost: ``persist verify`` and ``stats``."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import click

from persist_core.errors import PersistError
from persist_core.tiers.codec import EncryptionKeyError
from persist_core.load.references import resolve
from persist_core import report
from persist_core.cli.app import CommandError, human_size, main, open_location, progress, took


@main.command()
@click.argument("location")
@click.option("--step", type=click.IntRange(min=0), default=None, help="default: every committed checkpoint")
@click.option("--quiet", is_flag=True)
@click.option("--json", "as_json", is_flag=True, help="one JSON report: each checkpoint, bytes, seconds")
@click.option("--remote", "store", is_flag=True,
              help="a remote URL's objects against the checksums the store reported at upload: HEAD requests only, "
                   "nothing downloaded (S3; other stores record none)")
@click.pass_context
def verify(ctx: click.Context, location: str, step: int | None, quiet: bool, as_json: bool, store: bool) -> None:
    """Read every byte and check every checksum of every directory that holds a manifest; exit 1 naming what is bad.
    An incremental checkpoint is bad when what it references is (--step: those are verified too).

    With --remote (LOCATION a URL): read nothing but the store's own checksum of each object (S3 computed it from the
    bytes it received, and refused them had they not matched what the client sent), compared with the one recorded
    when it was uploaded: an object replaced or damaged since is named. Fast; the full verify reads every byte.

    \b
    Example:
      persist verify /nvme/ckpt --step 1200
      persist verify s3://bucket/run-7 --remote
    """
    loc = open_location(ctx, location)
    if store:
        _verify_store(ctx, loc, location, step, quiet, as_json)
        return
    claimed = loc.tier.committed_steps()  # not list(): that skips the very checkpoints verify must name
    if step is not None and step not in claimed:
        raise CommandError(f"no committed checkpoint for step {step} in {location}; steps: {claimed}")
    steps = [step] if step is not None else claimed
    if step is not None:  # what it references first: it is only as good as they are
        with contextlib.suppress(PersistError):
            steps = sorted(set(loc.manifest(step).depends_on()) & set(claimed)) + steps
    if not steps:
        raise CommandError(f"no committed checkpoint in {location}")
    bad: list[str] = []
    report = []
    nbytes, t0 = 0, time.perf_counter()
    for s in steps:
        elsewhere: list[str] = []
        try:
            manifest = loc.manifest(s)
            total = sum(f.size for f in manifest.held())
            elsewhere = [f.name for f in manifest.elsewhere()]
        except EncryptionKeyError:  # no key, or another: one error naming remote_encryption_key, not "BAD"
            raise
        except PersistError as e:  # an unreadable manifest, a missing or short file
            total, problems = 0, [str(e)]
        else:
            with progress(total, f"verify step {s}", quiet or as_json) as advance:
                problems = loc.tier.verify(s, advance)
            problems += _references(loc, s, manifest, location)
        nbytes += total
        bad.extend(problems)
        report.append({"step": s, "ok": not problems, "bytes": total, "problems": problems,
                       "held_elsewhere": elsewhere})
        if not quiet and not as_json:
            also = (f" (this node's files; {len(elsewhere)} held on other nodes and the remote: "
                    f"{', '.join(elsewhere[:4])}{' ...' if len(elsewhere) > 4 else ''})") if elsewhere else ""
            click.echo(f"step {s}: {'OK' if not problems else 'BAD'}{also}")
    elapsed = time.perf_counter() - t0
    failed = sum(1 for r in report if not r["ok"])
    if as_json:
        click.echo(json.dumps({"location": location, "checkpoints": report, "bad": failed, "bytes": nbytes,
                               "seconds": round(elapsed, 3)}))
    else:
        for p in bad:
            click.echo(f"bad: {p}", err=True)
        good = len(report) - failed
        click.echo(f"{good} checkpoint{'s' * (good != 1)} verified, {failed} bad: {took(nbytes, elapsed)}")
    ctx.exit(1 if bad else 0)


def _verify_store(ctx: click.Context, loc: Any, location: str, step: int | None, quiet: bool, as_json: bool) -> None:
    """``verify --remote``: each committed checkpoint's objects against the store's checksums recorded at upload."""
    if loc.remote is None:
        raise CommandError(f"--remote compares a remote's objects with the store's checksums; {location} is a local "
                           "directory: pass the remote URL (s3://bucket/run), or drop --remote to read every byte")
    claimed = loc.remote.committed_steps()
    if step is not None and step not in claimed:
        raise CommandError(f"no committed checkpoint for step {step} in {location}; steps: {claimed}")
    steps = [step] if step is not None else claimed
    if not steps:
        raise CommandError(f"no committed checkpoint in {location}")
    report, bad, t0 = [], [], time.perf_counter()
    for s in steps:
        try:
            found = loc.remote.store_checksums(s)
        except PersistError as e:
            raise CommandError(f"step {s}: the store could not be asked: {e}") from e
        bad += found.problems
        report.append({"step": s, "ok": not found.problems, "objects": found.checked, "problems": found.problems,
                       "note": found.note})
        if not quiet and not as_json:
            verdict = "BAD" if found.problems else found.note or f"OK ({found.checked} objects, store checksums match)"
            click.echo(f"step {s}: {verdict}")
    failed = sum(1 for r in report if not r["ok"])
    elapsed = time.perf_counter() - t0
    if as_json:
        click.echo(json.dumps({"location": location, "store_checksums": True, "checkpoints": report, "bad": failed,
                               "seconds": round(elapsed, 3)}))
    else:
        for p in bad:
            click.echo(f"bad: {p}", err=True)
        checked = sum(1 for r in report if r["note"] is None)
        click.echo(f"{checked} checkpoint{'s' * (checked != 1)} compared with the store's checksums, {failed} bad "
                   f"({elapsed:.2f} s, nothing downloaded)")
    ctx.exit(1 if bad else 0)


def _references(loc: Any, step: int, manifest: Any, location: str) -> list[str]:
    """The problems with what checkpoint ``step`` references (missing, or not holding the bytes it names)."""
    if not manifest.depends_on():
        return []
    try:
        resolve(manifest, loc.tier.read_manifest, where=f"{location} step {step}")
    except PersistError as e:
        return [str(e)]
    return []


@main.command()
@click.argument("location")
@click.option("--json", "as_json", is_flag=True, help="one JSON object: every checkpoint's numbers and the verdict")
@click.option("--plot", "plot_to", default=None, help="draw the series into this PNG (needs matplotlib: "
                                                      "pip install 'torch-persist[plot]')")
@click.option("--last", type=click.IntRange(min=1), default=20, show_default=True,
              help="rows of the table (the plot shows all)")
@click.pass_context
def stats(ctx: click.Context, location: str, as_json: bool, plot_to: str | None, last: int) -> None:
    """What the checkpoints cost, over time: interval, stall, save -> durable, bytes, upload lag, and a verdict.

    A local directory has the engine's record of each save (.history.jsonl); a remote URL has its
    manifests only (when each was saved, its bytes).

    \b
    Example:
      persist stats /nvme/ckpt --plot ckpt.png
    """
    rows, skipped = _stats_rows(ctx, location)
    if skipped:  # once, on stderr: --json stays one JSON object
        click.echo(f"skipped {skipped} unreadable lines of {location}'s save history (.history.jsonl)", err=True)
    if not rows:
        raise CommandError(f"no checkpoints (nor a save history) under {location}")
    verdict = report.verdict(rows)
    if plot_to:
        try:
            report.plot(rows, plot_to, title=location)
        except ImportError:
            raise CommandError("--plot needs matplotlib: pip install 'torch-persist[plot]'") from None
    if as_json:
        click.echo(json.dumps({"location": location, "checkpoints": rows, "verdict": verdict}))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=location)
    for col in ("step", "saved (UTC)", "interval", "stall", "save -> durable", "size", "upload lag"):
        table.add_column(col, justify="left" if col == "saved (UTC)" else "right")

    def sec(v: Any) -> str:
        return "" if v is None else f"{v:.3f} s" if v < 10 else f"{v:.0f} s"

    for r in rows[-last:]:
        table.add_row(str(r["step"]), time.strftime("%m-%d %H:%M:%S", time.gmtime(r["time"])), sec(r["interval_s"]),
                      sec(r.get("stall_s")), sec(r.get("durable_s")), human_size(r["bytes"]) if r.get("bytes") else "",
                      sec(r.get("lag_s")))
    console = Console()
    console.print(table)
    for name, key in (("interval", "interval_s"), ("stall", "stall_s"), ("save -> durable", "durable_s"),
                      ("upload lag", "lag_s")):
        values = [r.get(key) for r in rows]
        if any(v is not None for v in values):
            console.print(f"{name:>16} {report.spark(values)}  (max {max(v for v in values if v is not None):.3f} s)")
    click.echo(verdict)
    if plot_to:
        click.echo(f"plot: {plot_to}")


def _stats_rows(ctx: click.Context, location: str) -> tuple[list[dict[str, Any]], int]:
    """Per committed checkpoint (and per save the history remembers), oldest first: its numbers; and how
    many lines of the history were unreadable."""
    from persist_core.history import read_history

    loc = open_location(ctx, location)
    by_step: dict[int, dict[str, Any]] = {}
    for info in loc.list():
        by_step[info.step] = {"step": info.step, "time": info.time, "bytes": info.nbytes}
    history, skipped = read_history(loc.root) if loc.root is not None else ([], 0)
    for h in history:
        row = by_step.setdefault(h["step"], {"step": h["step"], "time": h.get("time", h["wall"]), "bytes": None})
        row.update({k: h[k] for k in ("stall_s", "durable_s", "lag_s", "write_gbps", "upload_gbps", "bytes") if k in h})
    rows = [by_step[s] for s in sorted(by_step)]
    for prev, row in zip([None, *rows], rows):
        row["interval_s"] = None if prev is None else row["time"] - prev["time"]
    return rows, skipped
