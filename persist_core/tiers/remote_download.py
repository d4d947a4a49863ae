"""Reading a whole remote checkpoint: :func:`verify` (every block checked) and :func:`download` (into a directory
the caller renames into place), with parallel ranged reads of runs of checksum blocks, each decoded (when the
remote stores them encoded: :mod:`persist_core.tiers.codec`) and checked as it arrives; the manifest written last.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from persist_core import _link_knobs
from persist_core.errors import CorruptCheckpointError
from persist_core.fileio import fsync_dir
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.layout import MANIFEST_NAME, checkpoint_dirname


def verify(tier: Any, step: int, progress: Callable[[int], None] | None = None) -> list[str]:
    """Read every file of remote checkpoint ``step`` (ranged, parallel), each chunk against its crc32c; the
    problems found (a missing or short file, a chunk that does not match, a block that does not decode or authenticate)."""
    try:
        manifest = tier.read_manifest(step)
    except CorruptCheckpointError as e:
        return [str(e)]
    problems: list[str] = []

    def check(f: FileEntry, first: int, stop: int) -> None:
        start, end = first * f.chunk_bytes, min(stop * f.chunk_bytes, f.size)
        try:
            data = tier.read_logical(step, f, first, stop)
            f.check(data, first, where=f"{tier.url}/{checkpoint_dirname(step)}/{f.name}")
        except CorruptCheckpointError as e:
            problems.append(str(e))
        if progress is not None:
            progress(end - start)

    span = _link_knobs.remote_span_bytes(sum(f.size for f in manifest.files), tier.concurrency)
    with ThreadPoolExecutor(tier.concurrency, thread_name_prefix="persist-verify") as pool:
        futures = [pool.submit(check, f, first, stop) for f in manifest.files for first, stop in f.spans(span)]
        for fut in futures:
            fut.result()
    return sorted(problems)


def download(tier: Any, step: int, tmp: Path, progress: Callable[[int], None] | None = None) -> Manifest:
    """Download ``step`` into the empty directory ``tmp`` with parallel ranged reads, each chunk checked as it
    arrives, the manifest written last (the caller renames ``tmp`` into place); its manifest. Raises
    ``CorruptCheckpointError`` for a chunk that does not match, ``RemoteError`` when the remote cannot be read.
    """
    manifest = tier.read_manifest(step)
    span = _link_knobs.remote_span_bytes(sum(f.size for f in manifest.files), tier.concurrency)
    fds: list[int] = []
    try:  # every file's ranged reads at once (file by file, each file's tail left connections idle)
        with ThreadPoolExecutor(tier.concurrency, thread_name_prefix="persist-download") as pool:
            futures = []
            for f in manifest.files:
                fds.append(os.open(tmp / f.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
                futures += [pool.submit(_fetch_span, tier, step, fds[-1], f, first, stop, progress)
                            for first, stop in f.spans(span)]
            wait(futures)
            for fut in futures:
                fut.result()
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    (tmp / MANIFEST_NAME).write_bytes(manifest.to_bytes())
    with open(tmp / MANIFEST_NAME, "rb+") as fh:
        os.fsync(fh.fileno())
    fsync_dir(tmp)
    return manifest


def _fetch_span(tier: Any, step: int, fd: int, f: FileEntry, first: int, stop: int,
                progress: Callable[[int], None] | None = None) -> None:
    source = f"{tier.path_of(checkpoint_dirname(step))}/{f.name}"
    start = first * f.chunk_bytes
    data = tier.read_logical(step, f, first, stop)
    f.check(data, first, where=f"{source} (the remote copy)")
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], start + done)
    if progress is not None:
        progress(len(view))
