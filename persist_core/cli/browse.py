"""What is there: ``persist ls``, ``log``, ``inspect`` and ``du``."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import click

from persist_core.errors import PersistError
from persist_core.format.shard_file import dtype_from_name
from persist_core.layout import FULL, KINDS, kind_subdir, parse_checkpoint_dirname
from persist_core.sidefiles import is_link
from persist_core.tiers import RemoteTier
from persist_core.cli.memory import memory_rows
from persist_core.cli.app import CommandError, codec, human_size, is_url, main, open_location


def _local_sub_tier(location: str, sub: str) -> bool:
    """Whether the local ``location`` has the sub-tier ``sub`` (``weights-only``): a directory, not a link
    (never followed: not one torch-persist made)."""
    path = os.path.join(location.removeprefix("file://"), sub)
    return os.path.isdir(path) and not is_link(path)


@main.command("ls")
@click.argument("location")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per checkpoint, for scripts")
@click.option("--milestones", type=click.IntRange(min=1), default=None, help="mark steps that are multiples of N")
@click.option("--memory-dir", default=None, help="where the run's memory snapshots are (default /dev/shm/torch-persist-<uid>)")
@click.option("--lineage", is_flag=True, help="the run as its tree of resumes and branches (as `persist log`)")
@click.pass_context
def ls(ctx: click.Context, location: str, as_json: bool, milestones: int | None, memory_dir: str | None,
       lineage: bool) -> None:
    """Committed checkpoints: step, time, size, files (sizes checked; `verify` reads every byte).

    \b
    Example:
      persist ls s3://bucket/run-7 --json
    """
    if lineage:
        ctx.invoke(log_, location=location, as_json=as_json)
        return
    rows = []
    for kind in KINDS:  # full ones in LOCATION, weights-only ones in LOCATION/weights-only
        sub = kind_subdir(kind)
        if not sub:
            loc = open_location(ctx, location)
        elif is_url(location) or _local_sub_tier(location, sub):
            loc = open_location(ctx, f"{location.rstrip('/')}/{sub}")
        else:
            continue
        listing = loc.remote.listing(sealed=True) if loc.remote is not None else loc.tier.listing()
        for info, m in listing:  # one listing, each manifest read once; without the key: step, size, "encrypted"
            rows.append({"step": info.step, "kind": kind, "time": info.time if m else None, "bytes": info.nbytes,
                         "files": len(m.files) if m else None, "ranks": m.world_size if m else None,
                         "path": info.path, "milestone": bool(milestones) and info.step % milestones == 0,
                         "abandoned": False, **({} if m else {"encrypted": True})})
        for info in loc.tier.abandoned():  # kept, never the latest: a resume from an older step branched
            rows.append({"step": info.step, "kind": kind, "time": info.time if info.time == info.time else None,
                         "bytes": info.nbytes, "files": None,
                         "ranks": None, "path": info.path, "milestone": False, "abandoned": True})
    rows += memory_rows(location, memory_dir)  # a local directory's run's snapshots in memory (kind "memory")
    order = (*KINDS, "memory", "memory-partner")
    rows.sort(key=lambda r: (r["abandoned"], r["step"], order.index(r["kind"])))
    if not rows and not as_json:  # a parent directory, a bucket root, a typo: say so, and what is below
        runs = _runs_below(ctx, location)
        click.echo(f"no checkpoints under {location}")
        for name, infos in runs:
            click.echo(f"  {name}: newest step {infos[-1].step}, {len(infos)} checkpoint{'s' * (len(infos) != 1)}, "
                       f"{human_size(sum(i.nbytes for i in infos))}")
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
                      time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["time"])) if r["time"] is not None
                      else "encrypted", f"{(now - r['time']) / 3600:.1f} h" if r["time"] is not None else "", human_size(r["bytes"]), str(r["files"] or ""),
                      str(r["ranks"] or ""), "yes" if r["milestone"] else "",
                      "abandoned" if r.get("abandoned") else r.get("process", "live"))
    Console().print(table)


@main.command()
@click.argument("location")
@click.option("--step", type=click.IntRange(min=0), default=None, help="default: the newest")
@click.option("--json", "as_json", is_flag=True)
@click.option("--depth", type=click.IntRange(min=0), default=None,
              help="show N levels of keys; deeper entries are summed into them")
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
    loc = open_location(ctx, location)
    m = loc.manifest(loc.step_or_latest(step))
    rows: list[dict[str, Any]] = []

    def walk(node: dict[str, Any], path: str) -> None:
        name = path or "<root>"
        if "tensor" in node:
            rec = m.tensors[node["tensor"]]
            n = 1
            for d in rec.shape:
                n *= d
            size = n * torch.empty(0, dtype=dtype_from_name(rec.dtype)).element_size()
            where = (f"sharded {rec.placements or ''} on mesh {tuple(rec.mesh or ())}: "
                     f"{len(rec.chunks)} part(s) in {len(set(rec.files()))} file(s)" if rec.chunks is not None
                     else rec.file)
            rows.append({"name": name, "dtype": rec.dtype, "shape": list(rec.shape), "file": where,
                         "elements": n, "bytes": size, "value": None, "sharded": rec.sharded,
                         "placements": rec.placements, "mesh": None if rec.mesh is None else list(rec.mesh)})
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
        click.echo(json.dumps({"step": m.step, "world_size": m.world_size, "bytes": m.nbytes, "entries": rows,
                               "lineage": m.lineage, "nodes": [list(n) for n in m.nodes], "metadata": m.metadata}))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{location} step {m.step}: {human_size(m.nbytes)} in {len(m.files)} file(s), {m.world_size} rank(s)")
    for col in ("name", "dtype", "shape", "bytes", "value", "file"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for r in rows:
        table.add_row(r["name"], r["dtype"], "" if r["shape"] is None else str(tuple(r["shape"])),
                      human_size(r["bytes"]) if r["bytes"] else "", "" if r["value"] is None else repr(r["value"]),
                      r["file"] or "")
    Console().print(table)
    click.echo(_lineage_text(m))


def _lineage_text(m: Any) -> str:
    """The lineage of a checkpoint in a few lines (format version 7; older ones say they have none)."""
    lin = m.lineage
    if lin is None:
        return f"lineage: none recorded (format version {m.version})"
    resumed = lin.get("resumed_from")
    origin = "fresh start" if resumed is None else f"resumed from step {resumed.get('step')} of run {resumed.get('run')}"
    if lin.get("branch_from") is not None:
        origin += f" (a branch: went back to step {lin['branch_from']})"
    nodes = f", {len(m.nodes)} node(s) {[list(n) for n in m.nodes]}" if m.nodes else ""
    versions = ", ".join(f"{k} {v}" for k, v in (lin.get("versions") or {}).items())
    return "\n".join([f"lineage: run {lin.get('run')}, {origin}",
                      f"  world size {lin.get('world_size')}{nodes}; git commit {lin.get('git_commit') or 'none'}",
                      f"  versions: {versions}", f"  metadata: {json.dumps(m.metadata)}"])


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


@main.command("log")
@click.argument("location")
@click.option("--json", "as_json", is_flag=True, help="the tree as JSON, for scripts")
@click.pass_context
def log_(ctx: click.Context, location: str, as_json: bool) -> None:
    """A run as its tree of resumes and branches, from its checkpoints' lineage: each stretch of checkpoints one
    start or resume wrote, below the checkpoint it resumed from; set-aside checkpoints (a resume that went back)
    included. `persist ls LOCATION --lineage` is the same.

    \b
    Example:
      persist log /nvme/ckpt
    """
    from persist_core.lineage import run_tree, tree_lines

    loc = open_location(ctx, location)
    found = [(info.step, m.time, m.lineage, False) for info, m in loc.tier.listing()]
    found += [(m.step, m.time, m.lineage, True) for m in _set_aside_manifests(loc)]
    roots = run_tree(found)
    if as_json:
        click.echo(json.dumps([r.to_json() for r in roots]))
        return
    if not roots:
        raise CommandError(f"no checkpoints in {location}")
    click.echo(f"{location}: {len(found)} checkpoint(s), {len(roots)} root(s)")
    for line in tree_lines(roots):
        click.echo(line)


def _set_aside_manifests(loc: Any) -> list[Any]:
    """The manifests of the checkpoints set aside in ``loc`` (a branch), local or remote."""
    if loc.remote is None:
        return [m for _, _, m, _ in loc.tier.abandoned_manifests()]
    from persist_core.format.manifest import Manifest
    from persist_core.layout import MANIFEST_NAME

    out = []
    for info in loc.tier.abandoned():
        name = info.path.rstrip("/").rsplit("/", 1)[-1]
        raw = loc.remote.fs.cat_file(f"{loc.remote.path_of(name)}/{MANIFEST_NAME}")
        out.append(Manifest.from_bytes(raw, where=info.path, step=info.step))
    return out


@main.command()
@click.argument("location")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def du(ctx: click.Context, location: str, as_json: bool) -> None:
    """Bytes held: committed checkpoints per kind, set-aside branches, and what has no manifest. Incremental
    checkpoints: "bytes" is what each holds itself (own); "shared_bytes" what they reference in older ones (held
    there once, not counted again).

    \b
    Example:
      persist du s3://bucket/run-7
    """
    report: dict[str, Any] = {"location": location}
    total = 0
    for kind in KINDS:
        sub = kind_subdir(kind)
        if sub and not (is_url(location) or _local_sub_tier(location, sub)):
            report[kind] = {"checkpoints": 0, "bytes": 0, "referencing": 0, "shared_bytes": 0}  # as on a remote
            continue
        loc = open_location(ctx, f"{location.rstrip('/')}/{sub}" if sub else location)
        listing = loc.tier.listing()
        nbytes = sum(i.nbytes for i, _ in listing)
        report[kind] = {"checkpoints": len(listing), "bytes": nbytes,
                        "referencing": sum(1 for _, m in listing if m.depends_on()),
                        "shared_bytes": sum(m.referenced_bytes() for _, m in listing)}
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
        if key in report and (key == KINDS[0] or report[key]["checkpoints"]):
            r = report[key]
            shared = (f" (own; {r['referencing']} incremental reference {human_size(r['shared_bytes'])} more, "
                      "shared: held once by the checkpoints they reference)") if r.get("referencing") else ""
            click.echo(f"{key}: {r['checkpoints']} checkpoint{'s' * (r['checkpoints'] != 1)}, "
                       f"{human_size(r['bytes'])}{shared}")
    click.echo(f"total: {human_size(total)}")


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
            if is_url(where):
                tier = RemoteTier(where, ctx.obj, codec=codec())
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
                infos = open_location(ctx, f"{location.rstrip('/')}/{sub}").list()
            except (OSError, PersistError, click.UsageError):
                infos = []
            if infos:
                found.append((sub, infos))
            elif left > 1:
                pending.append((sub, left - 1))
    return found
