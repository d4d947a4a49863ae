"""How a load reads and verifies bytes: runs of adjacent checksum blocks, each run one verified read, the runs
in parallel; and what the reads cost (:class:`LoadStats`).

Two shapes of read: a :class:`ReadPlan` takes requested byte ranges of shard files (the ranges
:mod:`~persist_core.assembly.plan` computed for a load into targets) and merges them into runs;
:func:`read_shard` reads one shard file whole into one byte tensor per entry (a whole load). The bytes
come from the tier (``read_blocks``/``fill``: local ``preadv``, or the remote's ranged reads); what they
mean is :mod:`~persist_core.assembly.assemble`'s.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from persist_core import _knobs
from persist_core.errors import CorruptCheckpointError
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.format.shard_file import entry_dtypes, parse_header, whole_entry_mismatch
from persist_core.format.torch_zip import image_offset
from persist_core.tiers.local import read_blocks
from persist_core.tiers.remote import RemoteTier

#: ``read_blocks(file, first, views)``: fill ``views`` — in file order, whole checksum blocks of ``file`` from
#: block ``first`` on — with its bytes, and verify them
ReadBlocks = Callable[[FileEntry, int, list[memoryview]], None]

_HEADER_GUESS = 1 << 16


def bytes_of(t: torch.Tensor) -> memoryview:
    """A writable view of the bytes of the contiguous CPU tensor ``t`` (valid while ``t`` lives)."""
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


@dataclass
class LoadStats:
    """What a load read: the bytes its targets needed, the bytes it read for them, and how many came from
    the remote."""

    needed_bytes: int = 0
    read_bytes: int = 0
    requests: int = 0
    remote_bytes: int = 0  # of which from the remote (ranged reads, or a download), by the reader's count
    remote_files: dict[str, int] = field(default_factory=dict)  # ... per shard file
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_remote(self, n: int, name: str) -> None:
        with self._lock:
            self.remote_bytes += n
            self.remote_files[name] = self.remote_files.get(name, 0) + n

    def add(self, needed: int, read: int, requests: int) -> None:
        with self._lock:
            self.needed_bytes += needed
            self.read_bytes += read
            self.requests += requests


@dataclass
class _Request:
    """Bytes ``[start, end)`` of one file: read straight into ``into`` (a target's own memory), or into a
    buffer then handed to ``done``."""

    start: int
    end: int
    done: Callable[[memoryview], None] | None = None
    into: memoryview | None = None


class ReadPlan:
    """Byte-range requests per file, then one verified read per run of adjacent checksum blocks."""

    def __init__(self, manifest: Manifest, read_blocks: ReadBlocks, pool: Executor, stats: LoadStats,
                 headers: dict[str, tuple[dict[str, tuple[int, int]], dict[str, str]]] | None = None) -> None:
        self._files = {f.name: f for f in manifest.files}
        self._read = read_blocks
        self._pool = pool
        self._stats = stats
        self._requests: dict[str, list[_Request]] = {}
        self._headers = {} if headers is None else headers  # shared by the plans of one streaming read

    def entry(self, fname: str, name: str) -> tuple[int, int]:
        """Absolute ``(begin, end)`` of entry ``name`` in file ``fname`` (its header read once, verified)."""
        if fname not in self._headers:
            fe = self._file(fname)
            n = min(fe.size, _HEADER_GUESS)
            prefix = self._read_range(fe, 0, n)
            try:
                try:
                    spans = parse_header(prefix, file_size=fe.size)[1]
                except CorruptCheckpointError:
                    if n == fe.size:
                        raise
                    prefix = self._read_range(fe, 0, fe.size)  # a header longer than the guess (thousands of entries)
                    spans = parse_header(prefix, file_size=fe.size)[1]
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"{fname}: {e}") from e
            self._headers[fname] = ({name: (b, e) for name, b, e in spans}, entry_dtypes(prefix))
        try:
            return self._headers[fname][0][name]
        except KeyError:
            raise CorruptCheckpointError(f"{fname} has no entry {name!r} that its manifest names") from None

    def check_whole(self, fname: str, name: str, dtype: torch.dtype, numel: int, where: str) -> None:
        """The entry ``name`` holds exactly ``numel`` elements of ``dtype``, as its header says (a record whose
        dtype was swapped for another of the same size is caught here)."""
        begin, end = self.entry(fname, name)
        problem = whole_entry_mismatch(self._headers[fname][1].get(name), end - begin, dtype, numel)
        if problem is not None:
            raise CorruptCheckpointError(f"{where}: entry {name!r} of {fname}: {problem}")

    def dtypes(self, fname: str) -> dict[str, str]:
        """The safetensors dtype of each entry of ``fname`` (its header read by :meth:`entry` before)."""
        return dict(self._headers[fname][1])

    def _file(self, fname: str) -> FileEntry:
        try:
            return self._files[fname]
        except KeyError:
            raise CorruptCheckpointError(f"the manifest names a file {fname!r} it does not list") from None

    def _read_range(self, fe: FileEntry, start: int, end: int) -> bytes:
        first, stop = fe.blocks(start, end)
        base = first * fe.chunk_bytes
        data = bytearray(min(stop * fe.chunk_bytes, fe.size) - base)
        self._read(fe, first, [memoryview(data)])
        self._stats.add(0, len(data), 1)
        return bytes(memoryview(data)[start - base : end - base])

    def request(self, fname: str, start: int, end: int, done: Callable[[memoryview], None] | None = None, *,
                into: memoryview | None = None) -> None:
        """Bytes ``[start, end)`` of ``fname``: read into ``into`` (exactly that many bytes), or handed to ``done``."""
        fe = self._file(fname)
        if not 0 <= start <= end <= fe.size:
            raise CorruptCheckpointError(f"{fname}: bytes {start}..{end} are outside its {fe.size} bytes")
        self._requests.setdefault(fname, []).append(_Request(start, end, done, into))

    def run(self) -> None:
        """Read every request's bytes (runs of blocks in parallel) and hand them to its ``done``."""
        jobs = []
        span_cap = _knobs.chunk_bytes()
        for fname, requests in self._requests.items():
            fe = self._files[fname]
            requests.sort(key=lambda r: r.start)
            run: list[_Request] = []
            first = stop = -1
            for r in requests:
                if r.end == r.start:
                    if r.done is not None:
                        r.done(memoryview(b""))
                    continue
                a, b = fe.blocks(r.start, r.end)
                if run and r.start < run[-1].end:  # overlapping requests: never expected; read them apart
                    jobs.append(self._pool.submit(self._serve, fe, first, stop, run))
                    run, first, stop = [r], a, b
                    continue
                if run and a <= stop and (stop - first) * fe.chunk_bytes < span_cap:
                    stop = max(stop, b)
                    run.append(r)
                    continue
                if run:
                    jobs.append(self._pool.submit(self._serve, fe, first, stop, run))
                run, first, stop = [r], a, b
            if run:
                jobs.append(self._pool.submit(self._serve, fe, first, stop, run))
        errors = [j.exception() for j in jobs]
        first_error = next((e for e in errors if e is not None), None)
        if first_error is not None:
            raise first_error

    def _serve(self, fe: FileEntry, first: int, stop: int, run: list[_Request]) -> None:
        """One read of blocks ``[first, stop)``: each request's bytes land in its target (or a buffer for its
        ``done``), the bytes between them and at the ends in scratch, and every block is verified."""
        pos, end = first * fe.chunk_bytes, min(stop * fe.chunk_bytes, fe.size)
        views: list[memoryview] = []
        buffered: list[tuple[_Request, memoryview]] = []
        for r in run:
            if r.start > pos:
                views.append(memoryview(bytearray(r.start - pos)))
            view = r.into if r.into is not None else memoryview(bytearray(r.end - r.start))
            if r.into is None:
                buffered.append((r, view))
            views.append(view)
            pos = r.end
        if end > pos:
            views.append(memoryview(bytearray(end - pos)))
        self._read(fe, first, views)
        self._stats.add(sum(r.end - r.start for r in run), end - first * fe.chunk_bytes, 1)
        for r, view in buffered:
            assert r.done is not None
            r.done(view)


#: ``fill(blocks)``: read and (where they carry a checksum) verify a run of consecutive checksum blocks,
#: each ``(views in file order, file offset, expected crc32c or None, block index)``
Fill = Callable[[list[tuple[list[memoryview], int, int | None, int]]], None]


def read_shard(fe: FileEntry, *, head: Callable[[int], bytes], fill: Fill, pool: Executor, verify: bool,
               where: str, span_bytes: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One shard file, wherever it is, into one CPU byte tensor per entry, every checksum block verified;
    and the safetensors dtype its header gives each entry.

    Args:
        fe: the file's manifest entry.
        head: the first ``n`` bytes of the file (its header).
        fill: reads runs of blocks straight into the entries' memory (local ``preadv``, remote ranged reads).
        pool: threads; runs of about one write's worth of blocks are read in parallel.
        verify: check every block's crc32c.
        where: the file's name, for messages.
        span_bytes: about how many bytes one ``fill`` call reads (default: one write's worth).
    """
    prefix = head(1 << 16)
    skip = image_offset(prefix)  # past the zip local header of a torch-loadable shard
    if len(prefix) >= skip + 8 and skip + 8 + int.from_bytes(prefix[skip : skip + 8], "little") > len(prefix):
        prefix = head(min(fe.size, skip + 8 + int.from_bytes(prefix[skip : skip + 8], "little")))
    try:
        data_start, entries = parse_header(prefix, file_size=fe.size)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from e
    header_copy = bytearray(data_start)
    # regions in file order: (file offset, memoryview to fill)
    regions: list[tuple[int, memoryview]] = [(0, memoryview(header_copy))]
    tensors: dict[str, torch.Tensor] = {}
    for name, begin, end in entries:
        if name.startswith("__pad__"):
            regions.append((begin, memoryview(bytearray(end - begin))))
        else:
            t = tensors[name] = torch.empty(end - begin, dtype=torch.uint8)
            if end > begin:
                regions.append((begin, bytes_of(t)))

    chunk = fe.chunk_bytes
    n_chunks = -(-fe.size // chunk)
    if verify and len(fe.chunks) != n_chunks:
        raise CorruptCheckpointError(f"{where}: manifest lists {len(fe.chunks)} checksums for {n_chunks} chunks")
    blocks = []
    r = 0
    for i in range(n_chunks):
        lo, hi = i * chunk, min((i + 1) * chunk, fe.size)
        views = []
        while r < len(regions) and regions[r][0] < hi:
            off, mv = regions[r]
            a, b = max(lo, off) - off, min(hi, off + len(mv)) - off
            views.append(mv[a:b])
            if off + len(mv) <= hi:
                r += 1
            else:
                break
        blocks.append((views, lo, fe.chunks[i] if verify else None, i))
    per = max(1, (span_bytes or _knobs.chunk_bytes()) // chunk)  # one job: about one write's worth of blocks
    jobs = [pool.submit(fill, blocks[b : b + per]) for b in range(0, len(blocks), per)]
    errors = [j.exception() for j in jobs]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    if bytes(header_copy) != prefix[:data_start]:
        raise CorruptCheckpointError(f"{where}: header changed while reading")
    return tensors, entry_dtypes(prefix)


def node_copy_blocks(ckpt: Path, manifest: Manifest, tier: RemoteTier | None, *, verify: bool,
                     stats: LoadStats) -> Callable[..., None]:
    """``read_blocks`` for the local copy ``ckpt``: the files it holds from disk, the others' (a node's copy: the
    other nodes' files) by ranged reads from ``tier``, counted in ``stats.remote_bytes``."""
    held = {f.name for f in manifest.held()}

    def read(f: Any, first: int, views: list[memoryview]) -> None:
        if f.name in held:
            read_blocks(ckpt / f.name, f, first, views, verify=verify)
            return
        if tier is None:
            raise CorruptCheckpointError(
                f"{ckpt}: {f.name} is held on another node (this directory holds node {manifest.node}'s files) and "
                "there is no remote_url to read it from; pass the remote_url the run uploaded to")
        tier.read_blocks(manifest.step, f, first, views, verify=verify)
        stats.count_remote(sum(len(v) * v.itemsize for v in views), f.name)

    return read
