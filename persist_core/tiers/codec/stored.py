"""What the remote tier stores for one checkpoint when a codec is on, and what it reads back: the envelope of each
step's manifest (read once per manifest read, kept), each file's encoded copy made before its upload, and the
per-file layout record a node's rank leaves for rank 0's manifest (``<file>.blocks``, sealed like the lease)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from persist_core.errors import CorruptCheckpointError, RemoteError
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.layout import ASIDE_MANIFEST_NAME, MANIFEST_NAME, parse_abandoned_dirname
from persist_core.tiers.codec import envelope, files
from persist_core.tiers.codec.blocks import Codec
from persist_core.tiers.codec.envelope import Envelope
from persist_core.tiers._retry import is_missing
from persist_core.tiers.tier import CheckpointInfo

log = logging.getLogger(__name__)

LAYOUT_SUFFIX = ".blocks"
SEALED = "remote (encrypted)"  # the tier a listing without the key names


class Stored:
    """The codec side of one :class:`~persist_core.tiers.remote.RemoteTier` (``tier``: its ``fs``, ``retry``,
    ``url``)."""

    def __init__(self, tier: Any, codec: Codec) -> None:
        self._tier = tier
        self.codec = codec
        self._envelopes: dict[int, Envelope | None] = {}  # per step: the envelope its manifest was read with
        self._headers: dict[int, dict[str, Any]] = {}  # per step whose manifest this process could not open
        self._layouts: dict[tuple[int, str], tuple[int, ...]] = {}  # (step, file) -> what this process uploaded
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(files.threads(), thread_name_prefix="persist-codec")
            return self._pool

    # ------------------------------------------------------------------ manifests

    def manifest(self, raw: bytes, *, where: str, step: int, live: bool = True) -> Manifest:
        """The logical manifest in ``raw`` (an envelope, or a plain manifest), its envelope kept for the reads.

        Raises:
            CorruptCheckpointError: corrupt or not authentic; an abandoned checkpoint's envelope read as ``live``.
            EncryptionKeyError: encrypted, with no key or another one.
        """
        if not envelope.is_envelope(raw):
            if self.codec.key is not None:  # a plain manifest where the run encrypts: written without the key, or forged
                raise CorruptCheckpointError(f"{where} is not encrypted, but remote_encryption_key is set: it was "
                                             "written without the key, or forged (refused)")
            manifest = Manifest.from_bytes(raw, where=where, step=step)
            self._envelopes[step] = None
            return manifest
        try:
            env, inner = envelope.unwrap(raw, self.codec, where=where)
        except CorruptCheckpointError:
            raise
        except Exception:
            self._headers[step] = envelope.peek(raw, where=where)[0]
            raise
        if live and env.state != "live":
            raise CorruptCheckpointError(f"{where} is a checkpoint that was set aside ({env.state}); its objects "
                                         "were put back at a live prefix (refused)")
        if env.step != step:
            raise CorruptCheckpointError(f"{where}: the envelope says step {env.step} (refused)")
        manifest = Manifest.from_bytes(inner, where=where, step=step)
        if {f.name for f in manifest.files} - set(env.layout) or env.save != files.save_id(manifest):
            raise CorruptCheckpointError(f"{where}: the envelope does not fit its manifest (refused)")
        if live:
            self._envelopes[step] = env
        return manifest

    def sealed_info(self, step: int, path: str) -> CheckpointInfo:
        """What a listing without the key shows of an encrypted checkpoint: its step, its size, "encrypted"."""
        header = self._headers.pop(step, {})
        return CheckpointInfo(step=step, time=float("nan"), nbytes=int(header.get("nbytes", 0)), path=path,
                              tier=SEALED)

    def envelope(self, step: int) -> Envelope | None:
        """The envelope of ``step`` (``None``: its objects are plain), reading its manifest if not read yet. A step
        whose manifest is not on the remote yet (another node's files, read before rank 0 commits the checkpoint
        there) is stored as this tier writes: plain when its codec does nothing."""
        if step not in self._envelopes:
            try:
                self._tier.read_manifest(step)
            except RemoteError as e:
                if self.codec.active or not is_missing(e):
                    raise
                return None
        return self._envelopes.get(step)

    def size(self, step: int, f: FileEntry) -> int:
        """The bytes the remote holds of ``f`` (its stored blocks when encoded)."""
        env = self._envelopes.get(step)
        return f.size if env is None else sum(env.layout.get(f.name, ()))

    def wrap(self, manifest: Manifest, raw: bytes, *, where: str) -> bytes:
        """The manifest object to upload for ``manifest`` (``raw``: its logical bytes)."""
        if not self.codec.active:
            return raw
        layout = {}
        for f in manifest.files:
            held = self._layouts.pop((manifest.step, f.name), None)
            layout[f.name] = held if held is not None else self._layout_record(where, f)
        env = Envelope(step=manifest.step, nbytes=manifest.nbytes, encrypted=self.codec.key is not None,
                       compression=self.codec.compression, run=files.run_of(manifest), save=files.save_id(manifest),
                       layout=layout)
        self._envelopes.pop(manifest.step, None)
        return envelope.wrap(env, raw, self.codec)

    def rewraps(self, path: str, target: str) -> bool:
        """Copy a manifest being set aside (``path`` to ``target`` under an abandoned name) as an abandoned
        envelope; ``False`` (copy it as it is) for any other object, or a plain manifest."""
        parts = target.rstrip("/").split("/")
        if (len(parts) < 2 or parts[-1] not in (MANIFEST_NAME, ASIDE_MANIFEST_NAME)
                or parse_abandoned_dirname(parts[-2]) is None):
            return False
        tier = self._tier
        raw = tier.retry(f"reading {path}", lambda: tier.fs.cat_file(path))
        if not envelope.is_envelope(raw):
            return False
        env, inner = envelope.unwrap(raw, self.codec, where=path)
        if env.state == "abandoned":
            return False
        moved = Envelope(**{**env.__dict__, "state": "abandoned"})
        tier.retry(f"writing {target}", lambda: tier.fs.pipe_file(target, envelope.wrap(moved, inner, self.codec)))
        return True

    # ------------------------------------------------------------------ upload

    def blocks(self, local_ckpt: Path, step: int, f: FileEntry) -> Iterator[bytes | bytearray] | None:
        """The stored blocks of ``f`` in order, encoded as the transfer takes them (:func:`files.encode_blocks`);
        their lengths are kept for the layout once the last one is taken. ``None`` when the codec is off (the local
        file is uploaded as it is)."""
        if not self.codec.active:
            return None
        return self._encode(local_ckpt, step, f)

    def _encode(self, local_ckpt: Path, step: int, f: FileEntry) -> Iterator[bytes | bytearray]:
        manifest = Manifest.from_bytes((local_ckpt / MANIFEST_NAME).read_bytes(), where=str(local_ckpt), step=step)
        lengths: list[int] = []
        for block in files.encode_blocks(self.codec, local_ckpt / f.name, f, run=files.run_of(manifest),
                                         save=files.save_id(manifest), pool=self.pool()):
            lengths.append(len(block))
            yield block
        self._layouts[(step, f.name)] = tuple(lengths)

    def uploaded(self, step: int, f: FileEntry, prefix: str) -> None:
        """After ``f`` went up: its layout record beside it (for the rank that writes the manifest)."""
        lengths = self._layouts.get((step, f.name))
        if lengths is None:
            return
        body = envelope.seal_record(json.dumps(list(lengths)).encode(), f"{f.name}{LAYOUT_SUFFIX}", self.codec)
        target = f"{prefix}/{f.name}{LAYOUT_SUFFIX}"
        self._tier.retry(f"writing {target}", lambda: self._tier.fs.pipe_file(target, body))

    def _layout_record(self, prefix: str, f: FileEntry) -> tuple[int, ...]:
        path = f"{prefix}/{f.name}{LAYOUT_SUFFIX}"
        raw = self._tier.retry(f"reading {path}", lambda: self._tier.fs.cat_file(path))
        body = envelope.open_record(raw, f"{f.name}{LAYOUT_SUFFIX}", self.codec, where=path)
        try:
            return tuple(int(n) for n in json.loads(body))
        except (ValueError, TypeError) as e:
            raise CorruptCheckpointError(f"{path} is corrupt ({e})") from None

    # ------------------------------------------------------------------ download

    def read(self, step: int, f: FileEntry, first: int, stop: int, read_range: Callable[[int, int], bytes], *,
             where: str, into: list[memoryview] | None = None) -> bytes | bytearray:
        """Blocks ``[first, stop)`` of ``f`` decoded, by one ranged read of their stored bytes; decoded straight
        into ``into`` (byte views of their logical bytes, in order) when given (then ``b""`` is returned)."""
        env = self._envelopes[step]
        assert env is not None
        lengths = env.layout[f.name]
        if len(lengths) != len(f.chunks):
            raise CorruptCheckpointError(f"{where}: {len(lengths)} stored blocks, {len(f.chunks)} expected")
        start, end = files.stored_range(lengths, first, stop)
        data = read_range(start, end)
        if len(data) != end - start:
            raise CorruptCheckpointError(f"{where}: {len(data)} stored bytes from byte {start}, {end - start} "
                                         "asked; the remote copy is short")
        args = dict(run=env.run, save=env.save, encrypted=env.encrypted, where=where, pool=self.pool())
        if into is None:
            return files.decode_blocks(self.codec, data, lengths, f, first, stop, **args)
        files.decode_into(self.codec, data, lengths, f, first, stop, into, **args)
        return b""

    # ------------------------------------------------------------------ small records

    def read_record(self, path: str) -> bytes:
        """A small record (the lease) read and opened (sealed under the key when there is one)."""
        raw = self._tier.fs.cat_file(path)
        return envelope.open_record(raw, path.rsplit("/", 1)[-1], self.codec, where=path)

    def write_record(self, path: str, body: bytes) -> None:
        self._tier.fs.pipe_file(path, envelope.seal_record(body, path.rsplit("/", 1)[-1], self.codec))


