"""The ``persist`` group, its global options, and what every command shares: a LOCATION (a local
directory or any fsspec URL) opened as a tier, one-line errors (exit 2), sizes, rates and progress bars."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from persist_core.errors import PersistError
from persist_core.layout import MANIFEST_NAME, NODE_PROBE_PREFIX, is_url, parse_checkpoint_dirname, parse_tmp_dirname
from persist_core.ownership import owner_of, remove_dead
from persist_core.format.manifest import Manifest
from persist_core.tiers import CheckpointInfo, LocalTier, RemoteTier, Tier
from persist_core.tiers.codec import Codec, SecretKey
from persist_core.tiers.codec.key import KEY_BYTES
from persist_core.tiers.codec.stored import SEALED


class CommandError(click.ClickException):
    """A failure that is not a verification result: exit 2."""

    exit_code = 2


class Location:
    """One tier named on the command line: a local directory or a remote URL (a :class:`Tier`)."""

    def __init__(self, location: str, storage_options: dict[str, Any] | None) -> None:
        self.name = location
        self.remote = RemoteTier(location, storage_options, codec=codec()) if is_url(location) else None
        self.root = None if self.remote else Path(location.removeprefix("file://")).expanduser().absolute()
        if self.root is not None and not self.root.is_dir():
            raise click.UsageError(f"{location} is not a directory (nor a URL such as s3://bucket/run)")
        self.tier: Tier = self.remote or LocalTier(self.root)

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints whose manifest reads; an encrypted remote without its key raises
        :class:`~persist_core.tiers.codec.EncryptionKeyError` (only ``ls`` lists what it can without the key)."""
        infos = self.tier.list()
        sealed = [info for info in infos if info.tier == SEALED]
        if self.remote is not None and sealed:
            self.remote.read_manifest(sealed[0].step)  # raises, naming the key
        return infos

    def manifest(self, step: int) -> Manifest:
        return self.tier.read_manifest(step)

    def step_or_latest(self, step: int | None, steps: list[int] | None = None) -> int:
        """``step`` if it is committed here, the newest when ``None`` (``steps``: what :meth:`list` said)."""
        steps = [c.step for c in self.list()] if steps is None else steps
        if step is None:
            if not steps:
                raise CommandError(f"no committed checkpoint in {self.name}")
            return steps[-1]
        if step not in steps:
            raise CommandError(f"no committed checkpoint for step {step} in {self.name}; steps: {steps}")
        return step

    def incomplete(self) -> list[tuple[str, float, dict[str, Any] | None]]:
        """Directories or prefixes without a manifest: their age in seconds and their live owner, if any."""
        now = time.time()
        found: list[tuple[str, float, dict[str, Any] | None]] = []
        if self.remote is None:
            assert self.root is not None
            for entry in os.scandir(self.root):
                if entry.is_symlink():  # not ours: never followed nor removed
                    continue
                step = parse_checkpoint_dirname(entry.name)
                tmp = parse_tmp_dirname(entry.name) is not None
                partial = (step is not None and not os.path.exists(os.path.join(entry.path, MANIFEST_NAME))) or tmp
                if partial and entry.is_dir():
                    owner = owner_of(self.root, Path(entry.path)) if tmp else None
                    found.append((entry.path, now - entry.stat().st_mtime, owner))
                elif entry.name.startswith(NODE_PROBE_PREFIX) and entry.is_file():  # a first save killed mid-probe
                    found.append((entry.path, now - entry.stat().st_mtime, None))
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
            by_prefix.setdefault(prefix, []).append(mtime(info))
        return [(p, now - max(ts), None) for p, ts in by_prefix.items() if p not in manifests]

    def remove_incomplete(self, path: str) -> None:
        if self.remote is None:
            if os.path.isfile(path):
                os.remove(path)
            else:
                shutil.rmtree(path)
            assert self.root is not None
            remove_dead(self.root, rank=0)  # and the dead marks left beside temporaries
        else:
            for f in self.remote.fs.find(path):
                self.remote.fs.rm_file(f)


def mtime(info: dict[str, Any]) -> float:
    value = info.get("LastModified") or info.get("mtime") or info.get("created") or 0
    return value.timestamp() if hasattr(value, "timestamp") else float(value)


def took(nbytes: int, seconds: float) -> str:
    """``"67.1 MB in 0.1 s (653 MB/s)"``: what a transfer or a verification moved, and how fast."""
    return (f"{human_size(nbytes)} in {seconds:.1f} s" if seconds >= 1 else f"{human_size(nbytes)} in {seconds:.2f} s") \
        + f" ({nbytes / max(seconds, 1e-9) / 1e6:.0f} MB/s)"


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"


class Bar:
    """What a command holds while it transfers: ``bar(n)`` advances; ``bar.echo(text)`` prints a line
    above the bar (through its console), or plainly when there is no bar."""

    def __init__(self, progress: Any = None, task: Any = None) -> None:
        self._progress, self._task = progress, task

    def __call__(self, n: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)

    def echo(self, text: str) -> None:
        if self._progress is not None:
            from rich.text import Text

            # a Text, not markup=False: that flag also reached the bar redrawn with the line, which then
            # showed its own style tag literally ("[progress.description]push ...")
            self._progress.console.print(Text(text), highlight=False)
        else:
            click.echo(text)


@contextmanager
def progress(total: int, label: str, quiet: bool) -> Iterator[Bar]:
    """A rich progress bar (percent, bytes, rate, time left) on a terminal; none with --quiet, when
    piped, or when there is nothing to transfer."""
    if quiet or total <= 0 or not sys.stderr.isatty():
        yield Bar()
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TaskProgressColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    with Progress("[progress.description]{task.description}", BarColumn(), TaskProgressColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), transient=True, console=Console(stderr=True)) as bar:
        yield Bar(bar, bar.add_task(label, total=total))


class Group(click.Group):
    """Every error as one line (exit 2), the traceback only with --debug; click's own (usage errors, exits)
    as click shows them."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as e:
            if ctx.params.get("debug"):
                raise
            click.echo(f"error: {one_line(e)}", err=True)
            ctx.exit(2)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Global options are taken after the subcommand too (``persist ls s3://b/run --endpoint-url URL``),
        as the AWS tools take theirs."""
        return super().parse_args(ctx, globals_first(args))


def one_line(error: Exception) -> str:
    """``error`` as the one line the CLI prints: our errors and the OS's as they say themselves, anything
    else with its type (a ``KeyError('x')`` alone says only ``'x'``), and --debug for the traceback."""
    text = " ".join(str(error).split())
    if isinstance(error, (PersistError, OSError, ValueError)) and text:
        return text
    return f"{type(error).__name__}{': ' + text if text else ''} (--debug shows the traceback)"


_GLOBAL_VALUED = ("--storage-options", "--endpoint-url", "--profile", "--region", "--encryption-key-env",
                  "--compression")
_GLOBAL_FLAGS = ("--debug",)


def globals_first(args: list[str]) -> list[str]:
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


@click.group(cls=Group, epilog="Shell completion (bash): eval \"$(_PERSIST_COMPLETE=bash_source persist)\" "
                                "(zsh_source, fish_source for the others).")
@click.version_option(package_name="torch-persist", prog_name="persist")
@click.option("--storage-options", default=None, help="fsspec options as JSON, e.g. '{\"client_kwargs\": {...}}'")
@click.option("--endpoint-url", default=None, help="S3: the endpoint (MinIO, a moto server, another cloud), as aws "
                                                    "--endpoint-url")
@click.option("--profile", default=None, help="S3: the AWS profile whose credentials to use, as aws --profile")
@click.option("--region", default=None, help="S3: the region, as aws --region")
@click.option("--encryption-key-env", default=None, metavar="NAME",
              help="the environment variable holding the remote's remote_encryption_key (64 hex digits)")
@click.option("--compression", type=click.Choice(["zstd", "none"]), default=None,
              help="what push, sync and cp write to a remote: zstd-compressed blocks (remote_compression)")
@click.option("--debug", is_flag=True, help="show tracebacks")
@click.pass_context
def main(ctx: click.Context, storage_options: str | None, endpoint_url: str | None, profile: str | None,
         region: str | None, encryption_key_env: str | None, compression: str | None, debug: bool) -> None:
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
    ctx.meta[_CODEC] = Codec(None if compression in (None, "none") else compression,
                             None if encryption_key_env is None else SecretKey(_key_from_env(encryption_key_env)))


_CODEC = "persist.codec"


def _key_from_env(name: str) -> Any:
    """A callable reading the key from ``name`` (64 hex digits) when first needed; a usage error if it is unset."""
    value = os.environ.get(name)
    if not value:
        raise click.UsageError(f"--encryption-key-env {name}: the environment variable {name} is not set (it must "
                               "hold the remote_encryption_key as 64 hex digits)")
    try:
        key = bytes.fromhex(value.strip())
    except ValueError:
        raise click.UsageError(f"--encryption-key-env {name}: {name} is not hex (64 hex digits; its value is not "
                               "shown)") from None
    if len(key) != KEY_BYTES:
        raise click.UsageError(f"--encryption-key-env {name}: {name} holds {len(key)} bytes; the "
                               f"remote_encryption_key is {KEY_BYTES} (64 hex digits; its value is not shown)")
    return lambda: key


def codec() -> Codec:
    """The codec the global options ask for (what the remote tiers the command opens read and write with)."""
    ctx = click.get_current_context(silent=True)
    found = None if ctx is None else ctx.find_root().meta.get(_CODEC)
    return found if found is not None else Codec()


def encryption_key() -> SecretKey | None:
    """The key ``--encryption-key-env`` named, for a :class:`~persist_core.CheckpointReader`."""
    return codec().key


def open_location(ctx: click.Context, location: str) -> Location:
    return Location(location, ctx.obj)


def where(location: str) -> str:
    """What ``location`` names, spelled one way: a local directory (or ``file://`` URL) as its real path, any
    other URL as ``scheme://path`` without trailing slashes."""
    if not is_url(location) or location.startswith("file://"):
        return os.path.realpath(os.path.expanduser(location.removeprefix("file://")))
    scheme, _, rest = location.partition("://")
    return f"{scheme.lower()}://{'/'.join(p for p in rest.split('/') if p)}"


def distinct(source: str, target: str) -> None:
    """A usage error when ``source`` and ``target`` are one location (a copy onto itself rewrites what it reads)."""
    if where(source) == where(target):
        raise click.UsageError(f"{source} and {target} are the same location: a copy onto itself rewrites the files it "
                               "reads; name another target")
