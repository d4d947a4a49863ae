"""Moving checkpoints between tiers: ``persist pull``, ``push``, ``cp``, ``sync`` and ``export``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import click

from persist_core.errors import CheckpointNotFoundError, CorruptCheckpointError, RemoteError
from persist_core.format.manifest import Manifest
from persist_core.layout import checkpoint_dirname
from persist_core.load.reader import CheckpointReader
from persist_core.tiers import RemoteTier
from persist_core.tiers._retry import is_missing
from persist_core.tiers.local import committed_steps, discover, read_manifest
from persist_core.cli.app import (CommandError, Location, codec, distinct, encryption_key, is_url, main, open_location,
                                  progress, took)


def _exporters() -> dict[str, Any]:
    """Export formats the installed adapters offer (entry point group ``persist.exporters``)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group="persist.exporters")}


@main.command()
@click.argument("url")
@click.argument("local_dir")
@click.option("--step", type=click.IntRange(min=0), default=None, help="default: the newest")
@click.option("--quiet", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def pull(ctx: click.Context, url: str, local_dir: str, step: int | None, quiet: bool, as_json: bool) -> None:
    """Download a checkpoint into LOCAL_DIR (parallel ranged reads, every chunk verified); an incremental one
    after the checkpoints it references that LOCAL_DIR lacks.

    \b
    Example:
      persist pull s3://bucket/run-7 /nvme/ckpt --step 1200
    """
    distinct(url, local_dir)
    loc = open_location(ctx, url)
    s = loc.step_or_latest(step)
    manifest, t0 = loc.manifest(s), time.perf_counter()
    here = set(committed_steps(Path(local_dir))) if os.path.isdir(local_dir) else set()
    refs, lost = _references(loc, manifest, here)
    if lost:  # the remote lost what it references (a lifecycle rule, a removal): say which, and what can be pulled
        whole = next((c for c in sorted((c.step for c in loc.list() if c.step < s), reverse=True)
                      if not _references(loc, loc.manifest(c), here)[1]), None)
        raise CommandError(
            f"step {s} references step{'s' * (len(lost) > 1)} {', '.join(map(str, lost))}, which {url} lacks (its "
            "manifest is not there or does not read): it cannot be pulled whole; "
            + ("no older step there can be either" if whole is None else
               f"the newest step that can: persist pull {url} {local_dir} --step {whole}")
            + f" (persist verify {url} checks each)")
    nbytes = manifest.nbytes + sum(m.nbytes for m in refs)
    with CheckpointReader(local_dir, remote_url=url, storage_options=ctx.obj, remote_encryption_key=encryption_key()) as reader:
        with progress(nbytes, f"pull step {s}", quiet or as_json) as advance:
            path = reader.fetch(s, advance)
    elapsed = time.perf_counter() - t0
    if as_json:
        click.echo(json.dumps({"step": s, "path": str(path), "bytes": nbytes, "seconds": round(elapsed, 3)}))
    elif not quiet:
        click.echo(f"step {s} -> {path}: {took(nbytes, elapsed)}")


def _references(loc: Location, manifest: Manifest, here: set[int]) -> tuple[list[Manifest], list[int]]:
    """The manifests of the checkpoints ``manifest`` references that are not ``here``, and the steps of those
    ``loc`` lacks (missing, or not reading). Raises the remote's error when it cannot be read at all."""
    found, lost = [], []
    for ref in sorted(manifest.depends_on() - here):
        try:
            found.append(loc.manifest(ref))
        except (CorruptCheckpointError, CheckpointNotFoundError):
            lost.append(ref)
        except RemoteError as e:
            if not is_missing(e):
                raise
            lost.append(ref)
    return found, lost


@main.command()
@click.argument("local_dir")
@click.argument("url")
@click.option("--quiet", is_flag=True)
@click.option("--json", "as_json", is_flag=True, help="one JSON report: the steps uploaded, bytes, seconds")
@click.pass_context
def push(ctx: click.Context, local_dir: str, url: str, quiet: bool, as_json: bool) -> None:
    """Upload the committed local checkpoints the remote does not have (manifest last; a checkpoint another
    references before it).

    \b
    Example:
      persist push /nvme/ckpt s3://bucket/run-7
    """
    distinct(local_dir, url)
    local = open_location(ctx, local_dir)
    if local.root is None or "://" not in url:
        raise click.UsageError(f"push takes a local directory, then a remote URL (s3://bucket/run, "
                               f"file:///mnt/share/run); got {local_dir!r} and {url!r}")
    remote = RemoteTier(url, ctx.obj, codec=codec())  # file:// too: a remote on a mounted share, as the engine's remote_url
    have = set(remote.committed_steps())
    todo = [(info, m) for info, m in discover(local.root) if info.step not in have]  # oldest first: references first
    lacking = {info.step: sorted(m.depends_on() - have - {i.step for i, _ in todo}) for info, m in todo}
    if any(lacking.values()):
        raise CommandError("; ".join(f"step {s} references step(s) {refs}, on neither {local_dir} nor {url}"
                                     for s, refs in lacking.items() if refs) + ": nothing was uploaded")
    nbytes, t0 = sum(m.nbytes for _, m in todo), time.perf_counter()
    with progress(nbytes, f"push {len(todo)} checkpoint(s)", quiet or as_json) as bar:
        for info, m in todo:
            remote.upload(Path(info.path), m)
            bar(m.nbytes)
            if not quiet and not as_json:
                bar.echo(f"step {info.step} -> {url}/{checkpoint_dirname(info.step)}")  # above the bar, not in it
    elapsed = time.perf_counter() - t0
    if as_json:
        click.echo(json.dumps({"local_dir": local_dir, "url": url, "pushed": [info.step for info, _ in todo],
                               "bytes": nbytes, "seconds": round(elapsed, 3)}))
    elif quiet:
        pass
    elif not todo:
        click.echo(f"{url} has every committed checkpoint of {local_dir}")
    else:
        click.echo(f"pushed {len(todo)} checkpoint{'s' * (len(todo) != 1)}: {took(nbytes, elapsed)}")


@main.command()
@click.argument("source")
@click.argument("target")
@click.option("--step", "steps", type=click.IntRange(min=0), multiple=True,
              help="the step(s) to copy (default: the newest)")
@click.option("--quiet", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def cp(ctx: click.Context, source: str, target: str, steps: tuple[int, ...], quiet: bool, as_json: bool) -> None:
    """Copy checkpoints between any two locations (local or remote), every chunk verified, manifest last.

    \b
    Example:
      persist cp s3://bucket/run-7 gs://archive/run-7 --step 4000
    """
    distinct(source, target)
    src = open_location(ctx, source)
    there = [c.step for c in src.list()]
    todo = list(steps) or [src.step_or_latest(None, there)]
    for s_ in todo:
        src.step_or_latest(s_, there)  # says which steps there are when it is not one of them
    copied = _copy_steps(ctx, src, target, todo, quiet=quiet or as_json)
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
    distinct(source, target)
    have = set(open_location(ctx, target).tier.committed_steps()) if is_url(target) or os.path.isdir(
        target.removeprefix("file://")) else set()
    src = open_location(ctx, source)
    todo = [c.step for c in src.list() if c.step not in have]
    copied = _copy_steps(ctx, src, target, todo, quiet=quiet or as_json)
    if as_json:
        click.echo(json.dumps({"source": source, "target": target, "copied": copied}))
    elif not todo and not quiet:
        click.echo(f"{target} has every committed checkpoint of {source}")


def _copy_steps(ctx: click.Context, src: Location, target: str, steps: list[int], *, quiet: bool) -> list[int]:
    """Copy ``steps`` from ``src`` to ``target``: into a local directory by a verified download (a local
    source is read as a ``file://`` remote); to a remote by an upload, from a verified local copy (the
    source's own directory, or a temporary download). Each location is opened once for all the steps."""
    source = src.name
    source_url = source if is_url(source) else "file://" + str(src.root)
    copied = []
    with contextlib.ExitStack() as stack:
        if not is_url(target):
            os.makedirs(target.removeprefix("file://"), exist_ok=True)
            into = stack.enter_context(CheckpointReader(target.removeprefix("file://"), remote_url=source_url,
                                                        storage_options=ctx.obj, remote_encryption_key=encryption_key()))
        else:
            dst = RemoteTier(target, ctx.obj, codec=codec())
            stack.callback(dst.close)
        for s_ in steps:
            t0 = time.perf_counter()
            if not is_url(target):
                nbytes = src.manifest(s_).nbytes
                with progress(nbytes, f"copy step {s_}", quiet) as advance:
                    path = str(into.fetch(s_, advance))
            else:
                nbytes = _upload_step(ctx, src, dst, s_, quiet)
                path = f"{target.rstrip('/')}/{checkpoint_dirname(s_)}"
            copied.append(s_)
            if not quiet:
                click.echo(f"step {s_} -> {path}: {took(nbytes, time.perf_counter() - t0)}")
    return copied


def _upload_step(ctx: click.Context, src: Location, dst: RemoteTier, step: int, quiet: bool) -> int:
    """Upload ``step`` of ``src`` to ``dst`` from a verified local copy (a remote source's through a temporary
    download, removed after); its bytes."""
    import tempfile

    with contextlib.ExitStack() as stack:
        if src.remote is not None:  # remote -> remote: through a verified local copy
            scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="persist-cp-"))
            reader = stack.enter_context(CheckpointReader(scratch, remote_url=src.name, storage_options=ctx.obj, remote_encryption_key=encryption_key()))
            ckpt = reader.fetch(step)
        else:
            assert src.root is not None
            ckpt = src.root / checkpoint_dirname(step)
        manifest = read_manifest(ckpt)
        if manifest.elsewhere():
            raise CommandError(f"{ckpt} holds node {manifest.node}'s files only (the checkpoint was written on "
                               f"{len(manifest.nodes)} nodes); copy it from the remote the run uploaded to")
        # an incremental checkpoint: what it references goes up first (fetch brought it alongside)
        first = [(ref, read_manifest(ckpt.parent / checkpoint_dirname(ref)))
                 for ref in sorted(manifest.depends_on() - set(dst.committed_steps()))]
        nbytes = manifest.nbytes + sum(m.nbytes for _, m in first)
        with progress(nbytes, f"copy step {step}", quiet) as advance:
            for ref, m in first:
                dst.upload(ckpt.parent / checkpoint_dirname(ref), m)
                advance(m.nbytes)
            dst.upload(ckpt, manifest)
            advance(manifest.nbytes)
    return nbytes


@main.command()
@click.argument("location")
@click.option("--step", type=click.IntRange(min=0), default=None, help="default: the newest")
@click.option("--to", "target", required=True, help="the file (torch) or directory (accelerate) to write")
@click.option("--format", "fmt", type=click.Choice(["torch", "safetensors", *_exporters()]), default="torch",
              show_default=True,
              help="torch: one torch.save file; safetensors: one .safetensors file of every tensor by key path "
                   "(sharded ones whole), written tensor by tensor; others come from installed adapters "
                   "(accelerate: a plain Accelerate directory, with torch-persist[accelerate])")
@click.option("--prefix", default=None,
              help="safetensors only: just the tensors under this key, keyed as load_state_dict takes them "
                   "(state_dict: a Lightning checkpoint's model; models/0: PersistHook's first); default: every "
                   "tensor, keyed by its key path (state_dict/net.0.weight)")
@click.option("--unsafe-pickle", is_flag=True,
              help="unpickle non-tensor leaves in full (runs code a crafted checkpoint chose: only for checkpoints "
                   "you trust); default: only the types training states hold")
@click.pass_context
def export(ctx: click.Context, location: str, step: int | None, target: str, fmt: str, prefix: str | None,
           unsafe_pickle: bool) -> None:
    """Write a checkpoint as one torch.save file (Lightning loads it), one safetensors file, or a plain
    Accelerate directory. Sharded checkpoints come out whole (consolidated).

    \b
    Example:
      persist export s3://bucket/run-7 --format safetensors --to model.safetensors
      persist export /nvme/ckpt --format safetensors --prefix state_dict --to model.safetensors
    """
    if prefix is not None and fmt != "safetensors":
        raise click.UsageError(f"--prefix {prefix} is for --format safetensors (not {fmt}); drop it or add "
                               "--format safetensors")
    parent = Path(target).expanduser().absolute().parent
    if fmt in ("torch", "safetensors") and not parent.is_dir():
        raise click.UsageError(f"--to {target}: its directory {parent} does not exist; create it or choose another")
    loc = open_location(ctx, location)
    s = loc.step_or_latest(step)
    if fmt == "safetensors":
        if os.path.exists(target):
            raise click.UsageError(f"{target} exists; choose a new file")
        t0 = time.perf_counter()
        from persist_core.load.consolidate import export_safetensors

        n, nbytes, skipped = export_safetensors(loc.tier, s, Path(target), prefix=prefix)
        click.echo(f"step {s} -> {target}: {n} tensors, {took(nbytes, time.perf_counter() - t0)}"
                   + (f"; {'not under --prefix, or' if prefix else ''} not tensors, so not in it: {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}"
                      if skipped else ""))
        return
    if fmt != "torch":
        exporter = _exporters()[fmt].load()  # an adapter's, found by entry point
        key = encryption_key()  # given only when set: an exporter that takes no key still exports a plain remote
        out = exporter(location, target, step=s, storage_options=ctx.obj, weights_only=not unsafe_pickle,
                       **({"remote_encryption_key": key} if key is not None else {}))
        click.echo(f"step {s} -> {out} (accelerator.load_state({str(out)!r}))" if fmt == "accelerate" else
                   f"step {s} -> {out}")
        return
    import torch

    if os.path.exists(target):
        raise click.UsageError(f"{target} exists; choose a new file")
    cache = Path(target).absolute().parent / f".{Path(target).name}.download" if loc.remote else loc.root
    try:
        with CheckpointReader(cache, remote_url=location if loc.remote else None,
                              storage_options=ctx.obj if loc.remote else None,
                              remote_encryption_key=encryption_key()) as reader:
            state = reader.load(s, weights_only=not unsafe_pickle)
    finally:  # a failed read (a corrupt chunk, a refused pickle) leaves no download behind either
        if loc.remote:
            shutil.rmtree(cache, ignore_errors=True)
    torch.save(state, target)
    click.echo(f"step {s} -> {target} (torch.load / Trainer.fit(ckpt_path=...))")
