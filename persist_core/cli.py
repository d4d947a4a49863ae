"""The ``persist`` command: see, verify, move and prune checkpoints on any tier.

A LOCATION is a local directory (a ``local_dir``) or any fsspec URL (``s3://bucket/run-7``);
``--storage-options`` takes fsspec options as JSON (or set the variables s3fs reads, e.g.
``AWS_ENDPOINT_URL``). Exit codes: 0 ok, 1 verification failed, 2 usage or other error (one
line; ``--debug`` shows the traceback).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from persist_core.errors import PersistError
from persist_core.format.shard_file import dtype_from_name
from persist_core.layout import (FULL, KINDS, MANIFEST_NAME, checkpoint_dirname, kind_subdir, parse_checkpoint_dirname,
                                 parse_tmp_dirname)
from persist_core.ownership import describe, owner_of, read_unsynced, remove_dead
from persist_core.format.manifest import Manifest
from persist_core.reader import CheckpointReader
from persist_core.tiers import CheckpointInfo, LocalTier, RemoteTier, Tier
from persist_core import report
from persist_core.tiers.local import discover, read_manifest
from persist_core.policies.anyof import policy_from_keywords
from persist_core.policies.retention import RetentionContext, to_delete


def _exporters() -> dict[str, Any]:
    """Export formats the installed adapters offer (entry point group ``persist.exporters``)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group="persist.exporters")}


class _Error(click.ClickException):
    """A failure that is not a verification result: exit 2."""

    exit_code = 2


def _is_url(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


class _Location:
    """One tier named on the command line: a local directory or a remote URL (a :class:`Tier`)."""

    def __init__(self, location: str, storage_options: dict[str, Any] | None) -> None:
        self.name = location
        self.remote = RemoteTier(location, storage_options) if _is_url(location) else None
        self.root = None if self.remote else Path(location.removeprefix("file://")).expanduser().absolute()
        if self.root is not None and not self.root.is_dir():
            raise click.UsageError(f"{location} is not a directory (nor a URL such as s3://bucket/run)")
        self.tier: Tier = self.remote or LocalTier(self.root)

    def list(self) -> list[CheckpointInfo]:
        return self.tier.list()

    def manifest(self, step: int) -> Manifest:
        return self.tier.read_manifest(step)

    def step_or_latest(self, step: int | None) -> int:
        steps = [c.step for c in self.list()]
        if step is None:
            if not steps:
                raise _Error(f"no committed checkpoint in {self.name}")
            return steps[-1]
        if step not in steps:
            raise _Error(f"no committed checkpoint for step {step} in {self.name}; steps: {steps}")
        return step

    def incomplete(self) -> list[tuple[str, float, dict[str, Any] | None]]:
        """Directories or prefixes without a manifest: their age in seconds and their live owner, if any."""
        now = time.time()
        found: list[tuple[str, float, dict[str, Any] | None]] = []
        if self.remote is None:
            assert self.root is not None
            for entry in os.scandir(self.root):
                step = parse_checkpoint_dirname(entry.name)
                tmp = parse_tmp_dirname(entry.name) is not None
                partial = (step is not None and not os.path.exists(os.path.join(entry.path, MANIFEST_NAME))) or tmp
                if partial and entry.is_dir():
                    owner = owner_of(self.root, Path(entry.path)) if tmp else None
                    found.append((entry.path, now - entry.stat().st_mtime, owner))
            return found
        by_prefix: dict[str, list[float]] = {}
        manifests = set()
        for path, info in self.remote.fs.find(self.remote.root, detail=True).items():
            parts = path.rstrip("/").split("/")
            if len(parts) < 2 or parse_checkpoint_dirname(parts[-2]) is None:
                continue
            prefix = "/".join(parts[:-1])
            if parts[-1] == "manifest.json":
                manifests.add(prefix)
            by_prefix.setdefault(prefix, []).append(_mtime(info))
        return [(p, now - max(ts), None) for p, ts in by_prefix.items() if p not in manifests]

    def remove_incomplete(self, path: str) -> None:
        if self.remote is None:
            shutil.rmtree(path)
            assert self.root is not None
            remove_dead(self.root, rank=0)  # and the dead marks left beside temporaries
        else:
            for f in self.remote.fs.find(path):
                self.remote.fs.rm_file(f)


def _runs_below(ctx: click.Context, location: str, depth: int = 2, limit: int = 200) -> list[tuple[str, list[Any]]]:
    """``(relative name, its checkpoints)`` of every run (a directory or prefix holding checkpoints) up to
    ``depth`` levels below ``location``, at most ``limit`` names looked at."""
    found: list[tuple[str, list[Any]]] = []
    pending = [("", depth)]
    looked = 0
    while pending and looked < limit:
        rel, left = pending.pop(0)
        where = f"{location.rstrip('/')}/{rel}" if rel else location
        try:
            if _is_url(where):
                tier = RemoteTier(where, ctx.obj)
                names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in tier.fs.ls(tier.root, detail=False))
            else:
                names = sorted(e.name for e in os.scandir(where.removeprefix("file://")) if e.is_dir())
        except (OSError, PersistError):
            continue
        for name in names:
            if name.startswith(".") or parse_checkpoint_dirname(name) is not None:
                continue
            looked += 1
            sub = f"{rel}/{name}" if rel else name
            try:
                infos = _open(ctx, f"{location.rstrip('/')}/{sub}").list()
            except (OSError, PersistError, click.UsageError):
                infos = []
            if infos:
                found.append((sub, infos))
            elif left > 1:
                pending.append((sub, left - 1))
    return found


def _newest_verified(loc: _Location, steps: list[int], say: Callable[[str], Any] = click.echo) -> int | None:
    """The newest of ``steps`` whose files verify (every byte against its checksums); says which do not."""
    for step in sorted(steps, reverse=True):
        try:
            problems = loc.tier.verify(step)
        except PersistError as e:
            problems = [str(e)]
        if not problems:
            return step
        say(f"step {step} does not verify: {problems[0]}")
    return None


def _mtime(info: dict[str, Any]) -> float:
    value = info.get("LastModified") or info.get("mtime") or info.get("created") or 0
    return value.timestamp() if hasattr(value, "timestamp") else float(value)


def _took(nbytes: int, seconds: float) -> str:
    """``"67.1 MB in 0.1 s (653 MB/s)"``: what a transfer or a verification moved, and how fast."""
    return f"{_size(nbytes)} in {seconds:.1f} s ({nbytes / max(seconds, 1e-9) / 1e6:.0f} MB/s)"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"


class _Bar:
    """What a command holds while it transfers: ``bar(n)`` advances; ``bar.echo(text)`` prints a line
    above the bar (through its console), or plainly when there is no bar."""

    def __init__(self, progress: Any = None, task: Any = None) -> None:
        self._progress, self._task = progress, task

    def __call__(self, n: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)

    def echo(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, highlight=False, markup=False)
        else:
            click.echo(text)


@contextmanager
def _progress(total: int, label: str, quiet: bool) -> Iterator[_Bar]:
    """A rich progress bar (percent, bytes, rate, time left) on a terminal; none with --quiet, when
    piped, or when there is nothing to transfer."""
    if quiet or total <= 0 or not sys.stderr.isatty():
        yield _Bar()
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TaskProgressColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    with Progress("[progress.description]{task.description}", BarColumn(), TaskProgressColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), transient=True, console=Console(stderr=True)) as bar:
        yield _Bar(bar, bar.add_task(label, total=total))


class _Group(click.Group):
    """Errors as one line (exit 2), the traceback only with --debug."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (PersistError, OSError, ValueError) as e:
            if ctx.params.get("debug"):
                raise
            click.echo(f"error: {e}", err=True)
            ctx.exit(2)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Global options are taken after the subcommand too (``persist ls s3://b/run --endpoint-url URL``),
        as the AWS tools take theirs."""
        return super().parse_args(ctx, _globals_first(args))


_GLOBAL_VALUED = ("--storage-options", "--endpoint-url", "--profile", "--region")
_GLOBAL_FLAGS = ("--debug",)


def _globals_first(args: list[str]) -> list[str]:
    """``args`` with the global options (and their values) moved in front of the subcommand."""
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            rest += args[i:]
            break
        if a in _GLOBAL_FLAGS or any(a.startswith(f"{o}=") for o in _GLOBAL_VALUED):
            front.append(a)
        elif a in _GLOBAL_VALUED and i + 1 < len(args):
            front += [a, args[i + 1]]
            i += 1
        else:
            rest.append(a)
        i += 1
    return front + rest


@click.group(cls=_Group, epilog="Shell completion (bash): eval \"$(_PERSIST_COMPLETE=bash_source persist)\" "
                                "(zsh_source, fish_source for the others).")
@click.version_option(package_name="torch-persist", prog_name="persist")
@click.option("--storage-options", default=None, help="fsspec options as JSON, e.g. '{\"client_kwargs\": {...}}'")
@click.option("--endpoint-url", default=None, help="S3: the endpoint (MinIO, a moto server, another cloud), as aws "
                                                    "--endpoint-url")
@click.option("--profile", default=None, help="S3: the AWS profile whose credentials to use, as aws --profile")
@click.option("--region", default=None, help="S3: the region, as aws --region")
@click.option("--debug", is_flag=True, help="show tracebacks")
@click.pass_context
def main(ctx: click.Context, storage_options: str | None, endpoint_url: str | None, profile: str | None,
         region: str | None, debug: bool) -> None:
    """See, verify, move and prune torch-persist checkpoints on a local directory or any fsspec URL.

    Global options may come before or after the command.

    \b
    Examples:
      persist ls s3://bucket/run-7 --endpoint-url http://127.0.0.1:9000
      persist verify /nvme/ckpt
      persist pull s3://bucket/run-7 /nvme/ckpt --profile training
    """
    try:
        options = json.loads(storage_options) if storage_options else None
    except json.JSONDecodeError as e:
        raise click.UsageError(f"--storage-options is not JSON (at character {e.pos}; its value is not shown: it "
                               "may hold credentials)") from None
    if options is not None and not isinstance(options, dict):
        raise click.UsageError(f"--storage-options holds a JSON {type(options).__name__}; it must be a JSON object of "
                               "fsspec options (its value is not shown: it may hold credentials), e.g. "
                               "'{\"client_kwargs\": {\"endpoint_url\": \"http://127.0.0.1:9000\"}}'")
    if endpoint_url or profile or region:  # as s3fs spells them
        options = dict(options or {})
        client = dict(options.get("client_kwargs") or {})
        if endpoint_url:
            client["endpoint_url"] = endpoint_url
        if region:
            client["region_name"] = region
        if client:
            options["client_kwargs"] = client
        if profile:
            options["profile"] = profile
    ctx.obj = options


def _open(ctx: click.Context, location: str) -> _Location:
    return _Location(location, ctx.obj)


@main.command("ls")
@click.argument("location")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per checkpoint, for scripts")
@click.option("--milestones", type=int, default=None, help="mark steps that are multiples of N")
@click.pass_context
def ls(ctx: click.Context, location: str, as_json: bool, milestones: int | None) -> None:
    """Committed checkpoints: step, time, size, files (sizes checked; `verify` reads every byte).

    \b
    Example:
      persist ls s3://bucket/run-7 --json
    """
    rows = []
    for kind in KINDS:  # full ones in LOCATION, weights-only ones in LOCATION/weights-only
        sub = kind_subdir(kind)
        if not sub:
            loc = _open(ctx, location)
        elif _is_url(location) or os.path.isdir(os.path.join(location.removeprefix("file://"), sub)):
            loc = _open(ctx, f"{location.rstrip('/')}/{sub}")
        else:
            continue
        for info, m in loc.tier.listing():  # one listing, each manifest read once
            rows.append({"step": info.step, "kind": kind, "time": info.time, "bytes": info.nbytes,
                         "files": len(m.files), "ranks": m.world_size, "path": info.path,
                         "milestone": bool(milestones) and info.step % milestones == 0, "abandoned": False})
        for info in loc.tier.abandoned():  # kept, never the latest: a resume from an older step branched
            rows.append({"step": info.step, "kind": kind, "time": info.time, "bytes": info.nbytes, "files": None,
                         "ranks": None, "path": info.path, "milestone": False, "abandoned": True})
    rows.sort(key=lambda r: (r["abandoned"], r["step"], KINDS.index(r["kind"])))
    if not rows and not as_json:  # a parent directory, a bucket root, a typo: say so, and what is below
        runs = _runs_below(ctx, location)
        click.echo(f"no checkpoints under {location}")
        for name, infos in runs:
            click.echo(f"  {name}: newest step {infos[-1].step}, {len(infos)} checkpoint{'s' * (len(infos) != 1)}, "
                       f"{_size(sum(i.nbytes for i in infos))}")
        ctx.exit(0 if runs else 1)
    if as_json:
        click.echo(json.dumps(rows))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=location)
    kinds = any(r["kind"] != FULL for r in rows)  # the kind column only when there is more than one kind
    columns = ("step", *(("kind",) if kinds else ()), "saved (UTC)", "age", "size", "files", "ranks", "milestone",
               "branch")
    for col in columns:
        table.add_column(col, justify="right" if col in ("step", "size", "files", "ranks") else "left",
                         no_wrap=col in ("step", "kind"))
    now = time.time()
    for r in rows:
        table.add_row(str(r["step"]), *((r["kind"],) if kinds else ()),
                      time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["time"])),
                      f"{(now - r['time']) / 3600:.1f} h", _size(r["bytes"]), str(r["files"] or ""),
                      str(r["ranks"] or ""), "yes" if r["milestone"] else "",
                      "abandoned" if r.get("abandoned") else "live")
    Console().print(table)


@main.command()
@click.argument("location")
@click.option("--step", type=int, default=None, help="default: the newest")
@click.option("--json", "as_json", is_flag=True)
@click.option("--depth", type=int, default=None, help="show N levels of keys; deeper entries are summed into them")
@click.option("--filter", "pattern", default=None, help="only entries whose name matches (a glob, or a substring)")
@click.pass_context
def inspect(ctx: click.Context, location: str, step: int | None, as_json: bool, depth: int | None,
            pattern: str | None) -> None:
    """The state's tree: names, dtypes, (global) shapes, bytes, values of scalars, which rank's file holds each
    tensor, or how a sharded one is laid out (placements, mesh, parts).

    Example: `persist inspect /nvme/ckpt --depth 2` (subtrees summed), `--filter 'optim/*'`.
    """
    import fnmatch

    import torch

    if depth is not None and depth < 1:
        raise click.UsageError(f"--depth={depth} must be >= 1 (1: the top-level keys, each subtree summed)")
    loc = _open(ctx, location)
    m = loc.manifest(loc.step_or_latest(step))
    rows: list[dict[str, Any]] = []

    def walk(node: dict[str, Any], path: str) -> None:
        name = path or "<root>"
        if "tensor" in node:
            rec = m.tensors[node["tensor"]]
            n = 1
            for d in rec["shape"]:
                n *= d
            size = n * torch.empty(0, dtype=dtype_from_name(rec["dtype"])).element_size()
            sharded = "chunks" in rec
            where = (f"sharded {rec.get('placements', '')} on mesh {tuple(rec.get('mesh', ()))}: "
                     f"{len(rec['chunks'])} part(s) in {len({c['file'] for c in rec['chunks']})} file(s)"
                     if sharded else rec["file"])
            rows.append({"name": name, "dtype": rec["dtype"], "shape": rec["shape"], "file": where,
                         "elements": n, "bytes": size, "value": None, "sharded": sharded,
                         "placements": rec.get("placements"), "mesh": rec.get("mesh")})
        elif "per_rank" in node:
            rows.append({"name": name, "dtype": "per-rank", "shape": None, "file": f"one per rank ({len(m.per_rank)})",
                         "elements": None, "bytes": sum(r[node["per_rank"]][2] for r in m.per_rank), "value": None})
        elif "dict" in node:
            for k, v in node["dict"]:
                walk(v, f"{path}/{k.get('value', '?')}" if path else str(k.get("value", "?")))
        elif "list" in node or "tuple" in node:
            for i, v in enumerate(node.get("list", node.get("tuple", []))):
                walk(v, f"{path}/{i}" if path else str(i))
        elif "object" in node:
            _, _, length = m.objects[node["object"]]
            rows.append({"name": name, "dtype": "pickled", "shape": None, "file": None, "elements": None,
                         "bytes": length, "value": None})
        elif "value" in node:
            value = node["value"]
            rows.append({"name": name, "dtype": type(value).__name__, "shape": None, "file": None, "elements": None,
                         "bytes": 0, "value": value})

    walk(m.tree, "")
    if pattern is not None:
        rows = [r for r in rows if fnmatch.fnmatchcase(r["name"], pattern) or pattern in r["name"]
                and not any(c in pattern for c in "*?[")]
    if depth is not None:
        rows = _summed_below(rows, depth)
    if as_json:
        click.echo(json.dumps({"step": m.step, "world_size": m.world_size, "bytes": m.nbytes, "entries": rows}))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{location} step {m.step}: {_size(m.nbytes)} in {len(m.files)} file(s), {m.world_size} rank(s)")
    for col in ("name", "dtype", "shape", "bytes", "value", "file"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for r in rows:
        table.add_row(r["name"], r["dtype"], "" if r["shape"] is None else str(tuple(r["shape"])),
                      _size(r["bytes"]) if r["bytes"] else "", "" if r["value"] is None else repr(r["value"]),
                      r["file"] or "")
    Console().print(table)


def _summed_below(rows: list[dict[str, Any]], depth: int) -> list[dict[str, Any]]:
    """Rows deeper than ``depth`` path components, summed into their ancestor at ``depth`` (in first-seen order)."""
    out: list[dict[str, Any]] = []
    groups: dict[str, dict[str, Any]] = {}
    for r in rows:
        parts = r["name"].split("/")
        if len(parts) <= depth:
            out.append(r)
            continue
        head = "/".join(parts[:depth])
        group = groups.get(head)
        if group is None:
            group = groups[head] = {"name": head, "dtype": "", "shape": None, "file": None, "elements": 0, "bytes": 0,
                                    "value": None, "count": 0}
            out.append(group)
        group["count"] += 1
        group["bytes"] += r["bytes"] or 0
        group["elements"] += r["elements"] or 0
        group["dtype"] = f"subtree ({group['count']} entries)"
    for group in groups.values():
        del group["count"]
    return out


@main.command()
@click.argument("location")
@click.option("--step", type=int, default=None, help="default: every committed checkpoint")
@click.option("--quiet", is_flag=True)
@click.option("--json", "as_json", is_flag=True, help="one JSON report: each checkpoint, bytes, seconds")
@click.pass_context
def verify(ctx: click.Context, location: str, step: int | None, quiet: bool, as_json: bool) -> None:
    """Read every byte and check every checksum of every directory that holds a manifest; exit 1 naming what is bad.

    \b
    Example:
      persist verify /nvme/ckpt --step 1200
    """
    loc = _open(ctx, location)
    claimed = loc.tier.committed_steps()  # not list(): that skips the very checkpoints verify must name
    if step is not None and step not in claimed:
        raise _Error(f"no committed checkpoint for step {step} in {location}; steps: {claimed}")
    steps = [step] if step is not None else claimed
    if not steps:
        raise _Error(f"no committed checkpoint in {location}")
    bad: list[str] = []
    report = []
    nbytes, t0 = 0, time.perf_counter()
    for s in steps:
        elsewhere: list[str] = []
        try:
            manifest = loc.manifest(s)
            total = sum(f.size for f in manifest.held())
            elsewhere = [f.name for f in manifest.elsewhere()]
        except PersistError as e:  # an unreadable manifest, a missing or short file
            total, problems = 0, [str(e)]
        else:
            with _progress(total, f"verify step {s}", quiet or as_json) as advance:
                problems = loc.tier.verify(s, advance)
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
        click.echo(f"{good} checkpoint{'s' * (good != 1)} verified, {failed} bad: {_took(nbytes, elapsed)}")
    ctx.exit(1 if bad else 0)


@main.command()
@click.argument("url")
@click.argument("local_dir")
@click.option("--step", type=int, default=None, help="default: the newest")
@click.option("--quiet", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def pull(ctx: click.Context, url: str, local_dir: str, step: int | None, quiet: bool, as_json: bool) -> None:
    """Download a checkpoint into LOCAL_DIR (parallel ranged reads, every chunk verified).

    \b
    Example:
      persist pull s3://bucket/run-7 /nvme/ckpt --step 1200
    """
    loc = _open(ctx, url)
    s = loc.step_or_latest(step)
    nbytes, t0 = loc.manifest(s).nbytes, time.perf_counter()
    with CheckpointReader(local_dir, remote_url=url, storage_options=ctx.obj) as reader:
        with _progress(nbytes, f"pull step {s}", quiet or as_json) as advance:
            path = reader.fetch(s, advance)
    elapsed = time.perf_counter() - t0
    if as_json:
        click.echo(json.dumps({"step": s, "path": str(path), "bytes": nbytes, "seconds": round(elapsed, 3)}))
    elif not quiet:
        click.echo(f"step {s} -> {path}: {_took(nbytes, elapsed)}")


@main.command()
@click.argument("local_dir")
@click.argument("url")
@click.option("--quiet", is_flag=True)
@click.pass_context
def push(ctx: click.Context, local_dir: str, url: str, quiet: bool) -> None:
    """Upload the committed local checkpoints the remote does not have (manifest last).

    \b
    Example:
      persist push /nvme/ckpt s3://bucket/run-7
    """
    local, remote = _open(ctx, local_dir), _open(ctx, url)
    if local.remote is not None or remote.remote is None:
        raise click.UsageError("push takes a local directory, then a remote URL")
    have = set(remote.remote.committed_steps())
    todo = [(info, m) for info, m in discover(local.root) if info.step not in have]
    with _progress(sum(m.nbytes for _, m in todo), f"push {len(todo)} checkpoint(s)", quiet) as bar:
        for info, m in todo:
            remote.remote.upload(Path(info.path), m)
            bar(m.nbytes)
            if not quiet:
                bar.echo(f"step {info.step} -> {url}/{checkpoint_dirname(info.step)}")  # above the bar, not in it
    if not todo and not quiet:
        click.echo(f"{url} has every committed checkpoint of {local_dir}")


@main.command()
@click.argument("location")
@click.option("--keep-last", type=int, default=None)
@click.option("--keep-every-n-steps", type=int, default=None)
@click.option("--keep-every-n-seconds", type=float, default=None)
@click.option("--incomplete-older-than", type=float, default=3600.0, show_default=True,
              help="remove directories/prefixes without a manifest only when older than this (seconds): "
                   "a running job may be writing them")
@click.option("--dry-run", is_flag=True, help="only say what would be removed")
@click.option("--no-verify", is_flag=True,
              help="do not read checkpoints to find the newest that verifies (then only the newest committed one "
                   "is kept whatever the policy)")
@click.option("--json", "as_json", is_flag=True, help="one JSON report: removed, kept (and why), incomplete")
@click.pass_context
def gc(ctx: click.Context, location: str, keep_last: int | None, keep_every_n_steps: int | None,
       keep_every_n_seconds: float | None, incomplete_older_than: float, dry_run: bool, no_verify: bool,
       as_json: bool) -> None:
    """Prune with the engine's retention policies (e.g. `persist gc /nvme/ckpt --keep-last 3`).

    Never removed: the newest committed checkpoint; the newest checkpoint that verifies (gc reads the
    newest ones, every byte against its checksums, until one verifies, so corrupt newer ones never
    cost the last good one); a live job's un-synced checkpoints and temporaries.
    """
    if incomplete_older_than < 0:
        raise click.UsageError(f"--incomplete-older-than={incomplete_older_than:g} must be >= 0 (seconds): a "
                               "running job may be writing a directory without a manifest right now")
    policy = policy_from_keywords(keep_last, keep_every_n_steps, keep_every_n_seconds)
    if policy is None:
        raise click.UsageError("say what to keep: --keep-last, --keep-every-n-steps and/or --keep-every-n-seconds")
    loc = _open(ctx, location)
    say = (lambda text: None) if as_json else click.echo
    report: dict[str, Any] = {"location": location, "dry_run": dry_run, "removed": [], "kept": [], "incomplete": []}
    context = RetentionContext(tier=loc.tier.kind, now=time.time())
    listed = loc.list()  # reads every manifest: once
    keep: dict[int, str] = {}
    if loc.root is not None:  # a live job's un-synced checkpoints and temporaries are not gc's to take
        remote, unsynced = read_unsynced(loc.root)
        committed = [c.step for c in listed]
        for step in committed if unsynced is None else sorted(unsynced & set(committed)):
            keep[step] = f"not yet uploaded to {remote}" if unsynced is not None else \
                "the record of what is uploaded is unreadable"
    if not no_verify:
        good = _newest_verified(loc, [c.step for c in listed], say)
        if good is not None:
            keep.setdefault(good, "the newest checkpoint that verifies")
    by_policy = to_delete(listed, policy, context=context)
    doomed = [c for c in by_policy if c.step not in keep]
    verb = "would remove" if dry_run else "removed"
    for info in doomed:
        if not dry_run:
            loc.tier.remove(info.step)
        say(f"{verb} step {info.step} ({_size(info.nbytes)})")
        report["removed"].append(info.step)
    doomed_steps = {c.step for c in by_policy}
    for step, why in keep.items():
        if why == "the newest checkpoint that verifies":
            if step in doomed_steps:
                say(f"kept step {step}: {why} (the policy would remove it)")
                report["kept"].append({"step": step, "why": why})
            continue
        say(f"kept step {step}: {why} (the job uploads it when the remote is back; `persist push` does too)")
        report["kept"].append({"step": step, "why": why})
    stale = []
    for path, age, owner in loc.incomplete():
        if owner is not None:
            say(f"kept incomplete {path}: owned by a live process ({describe(owner)})")
        elif age > incomplete_older_than:
            stale.append((path, age))
    for path, age in stale:
        if not dry_run:
            loc.remove_incomplete(path)
        say(f"{verb} incomplete {path} (no manifest, {age / 3600:.1f} h old)")
        report["incomplete"].append(path)
    if not doomed and not stale:
        say("nothing to remove")
    if as_json:
        click.echo(json.dumps(report))


@main.command()
@click.argument("source")
@click.argument("target")
@click.option("--step", "steps", type=int, multiple=True, help="the step(s) to copy (default: the newest)")
@click.option("--quiet", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def cp(ctx: click.Context, source: str, target: str, steps: tuple[int, ...], quiet: bool, as_json: bool) -> None:
    """Copy checkpoints between any two locations (local or remote), every chunk verified, manifest last.

    \b
    Example:
      persist cp s3://bucket/run-7 gs://archive/run-7 --step 4000
    """
    src = _open(ctx, source)
    todo = list(steps) or [src.step_or_latest(None)]
    for s_ in todo:
        src.step_or_latest(s_)  # says which steps there are when it is not one of them
    copied = _copy_steps(ctx, source, target, todo, quiet=quiet or as_json)
    if as_json:
        click.echo(json.dumps({"source": source, "target": target, "copied": copied}))


@main.command()
@click.argument("source")
@click.argument("target")
@click.option("--quiet", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def sync(ctx: click.Context, source: str, target: str, quiet: bool, as_json: bool) -> None:
    """Copy every committed checkpoint of SOURCE that TARGET lacks (either may be local or remote); nothing
    is deleted.

    \b
    Example:
      persist sync s3://bucket/run-7 /nvme/ckpt
    """
    have = set(_open(ctx, target).tier.committed_steps()) if _is_url(target) or os.path.isdir(
        target.removeprefix("file://")) else set()
    todo = [c.step for c in _open(ctx, source).list() if c.step not in have]
    copied = _copy_steps(ctx, source, target, todo, quiet=quiet or as_json)
    if as_json:
        click.echo(json.dumps({"source": source, "target": target, "copied": copied}))
    elif not todo and not quiet:
        click.echo(f"{target} has every committed checkpoint of {source}")


def _copy_steps(ctx: click.Context, source: str, target: str, steps: list[int], *, quiet: bool) -> list[int]:
    """Copy ``steps`` from ``source`` to ``target``: into a local directory by a verified download (a local
    source is read as a ``file://`` remote); to a remote by an upload, from a verified local copy (the
    source's own directory, or a temporary download)."""
    import tempfile

    source_url = source if _is_url(source) else "file://" + str(Path(source.removeprefix("file://")).absolute())
    copied = []
    for s_ in steps:
        t0 = time.perf_counter()
        if not _is_url(target):
            os.makedirs(target.removeprefix("file://"), exist_ok=True)
            with CheckpointReader(target.removeprefix("file://"), remote_url=source_url,
                                  storage_options=ctx.obj) as reader:
                nbytes = _open(ctx, source).manifest(s_).nbytes
                with _progress(nbytes, f"copy step {s_}", quiet) as advance:
                    path = str(reader.fetch(s_, advance))
        else:
            with contextlib.ExitStack() as stack:
                dst = RemoteTier(target, ctx.obj)
                stack.callback(dst.close)
                if _is_url(source):  # remote -> remote: through a verified local copy
                    scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="persist-cp-"))
                    reader = stack.enter_context(CheckpointReader(scratch, remote_url=source, storage_options=ctx.obj))
                    ckpt = reader.fetch(s_)
                else:
                    ckpt = Path(source.removeprefix("file://")).absolute() / checkpoint_dirname(s_)
                manifest = read_manifest(ckpt)
                if manifest.elsewhere():
                    raise _Error(f"{ckpt} holds node {manifest.node}'s files only (the checkpoint was written on "
                                 f"{len(manifest.nodes)} nodes); copy it from the remote the run uploaded to")
                nbytes = manifest.nbytes
                with _progress(nbytes, f"copy step {s_}", quiet) as advance:
                    dst.upload(ckpt, manifest)
                    advance(nbytes)
            path = f"{target.rstrip('/')}/{checkpoint_dirname(s_)}"
        copied.append(s_)
        if not quiet:
            click.echo(f"step {s_} -> {path}: {_took(nbytes, time.perf_counter() - t0)}")
    return copied


@main.command()
@click.argument("location")
@click.option("--json", "as_json", is_flag=True, help="one JSON object: every checkpoint's numbers and the verdict")
@click.option("--plot", "plot_to", default=None, help="draw the series into this PNG (needs matplotlib: "
                                                      "pip install 'torch-persist[plot]')")
@click.option("--last", type=int, default=20, show_default=True, help="rows of the table (the plot shows all)")
@click.pass_context
def stats(ctx: click.Context, location: str, as_json: bool, plot_to: str | None, last: int) -> None:
    """What the checkpoints cost, over time: interval, stall, save -> durable, bytes, upload lag, and a verdict.

    A local directory has the engine's record of each save (.history.jsonl); a remote URL has its
    manifests only (when each was saved, its bytes).

    \b
    Example:
      persist stats /nvme/ckpt --plot ckpt.png
    """
    rows = _stats_rows(ctx, location)
    if not rows:
        raise _Error(f"no checkpoints (nor a save history) under {location}")
    verdict = report.verdict(rows)
    if plot_to:
        try:
            report.plot(rows, plot_to, title=location)
        except ImportError:
            raise _Error("--plot needs matplotlib: pip install 'torch-persist[plot]'") from None
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
                      sec(r.get("stall_s")), sec(r.get("durable_s")), _size(r["bytes"]) if r.get("bytes") else "",
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


def _stats_rows(ctx: click.Context, location: str) -> list[dict[str, Any]]:
    """Per committed checkpoint (and per save the history remembers), oldest first: its numbers."""
    from persist_core.history import read_history

    loc = _open(ctx, location)
    by_step: dict[int, dict[str, Any]] = {}
    for info in loc.tier.list():
        by_step[info.step] = {"step": info.step, "time": info.time, "bytes": info.nbytes}
    if loc.root is not None:
        for h in read_history(loc.root):
            row = by_step.setdefault(h["step"], {"step": h["step"], "time": h.get("time", h["wall"]), "bytes": None})
            row.update({k: h[k] for k in ("stall_s", "durable_s", "lag_s", "write_gbps", "upload_gbps", "bytes")
                        if k in h})
    rows = [by_step[s] for s in sorted(by_step)]
    for prev, row in zip([None, *rows], rows):
        row["interval_s"] = None if prev is None else row["time"] - prev["time"]
    return rows


@main.command()
@click.argument("location")
@click.option("--step", "steps", type=int, multiple=True, required=True, help="the step to remove (repeatable)")
@click.option("--force", is_flag=True, help="also the newest committed checkpoint, or one not uploaded yet")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def rm(ctx: click.Context, location: str, steps: tuple[int, ...], force: bool, as_json: bool) -> None:
    """Remove committed checkpoints by step (a local one by one durable rename first, as retention does).

    The newest committed checkpoint, and a local one not yet uploaded to its remote, are refused unless
    --force: they may be the only good copy.

    \b
    Example:
      persist rm /nvme/ckpt --step 1200 --step 1300
    """
    loc = _open(ctx, location)
    committed = loc.tier.committed_steps()
    missing = [s for s in steps if s not in committed]
    if missing:
        raise _Error(f"no committed checkpoint for step(s) {missing} in {location}; steps: {committed}")
    if not force:
        if committed and committed[-1] in steps:
            raise _Error(f"step {committed[-1]} is the newest committed checkpoint in {location}; pass --force to "
                         "remove it anyway")
        if loc.root is not None:
            remote, unsynced = read_unsynced(loc.root)
            held = [s for s in steps if unsynced is None or s in unsynced]
            if held:
                raise _Error(f"step(s) {held} are not uploaded to {remote or 'the remote'} yet (.unsynced.json); "
                             "pass --force to remove them anyway")
    for s_ in steps:
        loc.tier.remove(s_)
        if not as_json:
            click.echo(f"removed step {s_} from {location}")
    if as_json:
        click.echo(json.dumps({"location": location, "removed": list(steps)}))


@main.command()
@click.argument("location")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def du(ctx: click.Context, location: str, as_json: bool) -> None:
    """Bytes held: committed checkpoints per kind, set-aside branches, and what has no manifest.

    \b
    Example:
      persist du s3://bucket/run-7
    """
    report: dict[str, Any] = {"location": location}
    total = 0
    for kind in KINDS:
        sub = kind_subdir(kind)
        if sub and not (_is_url(location) or os.path.isdir(os.path.join(location.removeprefix("file://"), sub))):
            continue
        loc = _open(ctx, f"{location.rstrip('/')}/{sub}" if sub else location)
        infos = loc.tier.list()
        nbytes = sum(i.nbytes for i in infos)
        report[kind] = {"checkpoints": len(infos), "bytes": nbytes}
        total += nbytes
        aside = loc.tier.abandoned()
        if aside:
            report.setdefault("abandoned", {"checkpoints": 0, "bytes": 0})
            report["abandoned"]["checkpoints"] += len(aside)
            report["abandoned"]["bytes"] += sum(i.nbytes for i in aside)
            total += sum(i.nbytes for i in aside)
    report["bytes"] = total
    if as_json:
        click.echo(json.dumps(report))
        return
    for key in (*KINDS, "abandoned"):
        if key in report:
            r = report[key]
            click.echo(f"{key}: {r['checkpoints']} checkpoint{'s' * (r['checkpoints'] != 1)}, {_size(r['bytes'])}")
    click.echo(f"total: {_size(total)}")


@main.command()
@click.argument("location")
@click.option("--step", type=int, default=None, help="default: the newest")
@click.option("--to", "target", required=True, help="the file (torch) or directory (accelerate) to write")
@click.option("--format", "fmt", type=click.Choice(["torch", "safetensors", *_exporters()]), default="torch",
              show_default=True,
              help="torch: one torch.save file; safetensors: one .safetensors file of every tensor by key path "
                   "(sharded ones whole), written tensor by tensor; others come from installed adapters "
                   "(accelerate: a plain Accelerate directory, with torch-persist[accelerate])")
@click.option("--unsafe-pickle", is_flag=True,
              help="unpickle non-tensor leaves in full (runs code a crafted checkpoint chose: only for checkpoints "
                   "you trust); default: only the types training states hold")
@click.pass_context
def export(ctx: click.Context, location: str, step: int | None, target: str, fmt: str, unsafe_pickle: bool) -> None:
    """Write a checkpoint as one torch.save file (Lightning loads it), one safetensors file, or a plain
    Accelerate directory. Sharded checkpoints come out whole (consolidated).

    \b
    Example:
      persist export s3://bucket/run-7 --format safetensors --to model.safetensors
    """
    parent = Path(target).expanduser().absolute().parent
    if fmt in ("torch", "safetensors") and not parent.is_dir():
        raise click.UsageError(f"--to {target}: its directory {parent} does not exist; create it or choose another")
    loc = _open(ctx, location)
    s = loc.step_or_latest(step)
    if fmt == "safetensors":
        if os.path.exists(target):
            raise click.UsageError(f"{target} exists; choose a new file")
        t0 = time.perf_counter()
        from persist_core.consolidate import export_safetensors

        n, nbytes, skipped = export_safetensors(loc.tier, s, Path(target))
        click.echo(f"step {s} -> {target}: {n} tensors, {_size(nbytes)}{_took(time.perf_counter() - t0, nbytes)}"
                   + (f"; not tensors, so not in it: {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}"
                      if skipped else ""))
        return
    if fmt != "torch":
        exporter = _exporters()[fmt].load()  # an adapter's, found by entry point
        out = exporter(location, target, step=s, storage_options=ctx.obj, weights_only=not unsafe_pickle)
        click.echo(f"step {s} -> {out} (accelerator.load_state({str(out)!r}))" if fmt == "accelerate" else
                   f"step {s} -> {out}")
        return
    import torch

    if os.path.exists(target):
        raise click.UsageError(f"{target} exists; choose a new file")
    cache = Path(target).absolute().parent / f".{Path(target).name}.download" if loc.remote else loc.root
    with CheckpointReader(cache, remote_url=location if loc.remote else None, storage_options=ctx.obj) as reader:
        state = reader.load(s, weights_only=not unsafe_pickle)
    if loc.remote:
        shutil.rmtree(cache, ignore_errors=True)
    torch.save(state, target)
    click.echo(f"step {s} -> {target} (torch.load / Trainer.fit(ckpt_path=...))")


if __name__ == "__main__":
    main()
