"""The remote tier: any fsspec URL, uploads with the manifest last, verified ranged reads and downloads.

Commit on an object store: every shard object is uploaded (multipart on S3) and its size checked, then the
manifest object is written: a prefix without a manifest is not a checkpoint, so a crash mid-upload leaves nothing
visible. Building one checks only what needs no network (the URL parses, its backend is installed); the sync thread
uploads and removes, loads read.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import fsspec

from persist_core import _knobs, _link_knobs
from persist_core.tiers import remote_aside, remote_download, remote_encoded, store_checksums
from persist_core.tiers._retry import causes, retry
from persist_core.tiers._s3 import S3Transfer
from persist_core.errors import ConfigError, CorruptCheckpointError, RemoteError
from persist_core.layout import (
    MANIFEST_NAME,
    checkpoint_dirname,
    parse_checkpoint_dirname,
)
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.tiers.tier import CheckpointInfo
from persist_core.tiers.codec import Codec, EncryptionKeyError
from persist_core.tiers.codec import stored
from persist_core.turn import NO_TURN, Turn
from persist_core.tiers._fsspec import Yielding, read_into, with_timeouts

log = logging.getLogger(__name__)

T = TypeVar("T")

#: what a set-aside copy reads at a time on a backend that cannot copy on the server
_COPY_PIECE_BYTES = 64 << 20

class RemoteTier:
    """The :class:`~persist_core.tiers.tier.Tier` of one fsspec URL, laid out as the local tier.

    Args:
        url: e.g. ``s3://bucket/run-7``, ``gs://...``, ``file:///mnt/shared/run``, ``memory://run``.
        storage_options: passed to fsspec as-is (credentials, ``client_kwargs``, ...).

    Readers never write: listing and loading only read. Reachability and write access are found
    out by the first upload (on the engine's sync thread), reported like any upload failure.

    Raises:
        ConfigError: unknown protocol or missing fsspec backend; the message names the URL and the fix.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, turn: Turn = NO_TURN,
                 codec: Codec | None = None, concurrency: int | None = None) -> None:
        self.url = _knobs.check_remote_url(url).rstrip("/")
        storage_options = _knobs.check_storage_options(storage_options)
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url, **with_timeouts(self.url, storage_options))
        except ImportError as e:
            raise ConfigError(
                f"remote_url={url!r} needs an fsspec backend that is not installed ({e}); "
                "e.g. pip install 'torch-persist[s3]' for s3:// or 'torch-persist[gcs]' for gs://"
            ) from e
        except ValueError as e:
            raise ConfigError(
                f"remote_url={url!r} cannot be used: {e}; use an fsspec URL such as s3://bucket/prefix, "
                "gs://bucket/prefix, az://container/prefix, file:///path or memory://name"
            ) from e
        self.root = root.rstrip("/")
        self._protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self._is_s3 = "s3" in self._protocols
        self.part_bytes = _link_knobs.remote_part_bytes()
        self.concurrency = _link_knobs.remote_concurrency() if concurrency is None else concurrency
        self.retries = _link_knobs.remote_retries()
        self.backoff_s = _link_knobs.remote_backoff_s()
        self._turn = turn  # waited for before each piece an upload sends: they hold off while an update runs
        self._heads = remote_encoded.Heads(self.concurrency)  # block 0 as a header read decoded it
        self.stored = stored.Stored(self, codec or Codec())  # what the codec makes of what goes up and comes down
        self._s3: S3Transfer | None = None
        if self._is_s3:
            try:
                self._s3 = S3Transfer(self.fs, part_bytes=self.part_bytes, concurrency=self.concurrency)
            except Exception as e:  # an unusual s3fs set-up: its own (slower) transfers still work
                log.warning("threaded S3 transfers unavailable for %s (%s); using s3fs's", self.url, e)

    kind = "remote"

    @property
    def location(self) -> str:
        return self.url

    def close(self) -> None:
        """Release transfer threads."""
        self.stored.close()
        if self._s3 is not None:
            self._s3.close()

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r})"

    def _path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def path_of(self, name: str) -> str:
        """The store path of ``name`` directly under the remote root (the lease object)."""
        return self._path(name)

    # ------------------------------------------------------------------ retries

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying transport and throttling failures with exponential backoff.

        Raises:
            RemoteError: a failure that is not transient, or still failing after ``retries`` attempts.
        """
        return retry(what, self.url, fn, attempts=self.retries, backoff_s=self.backoff_s)

    def hint(self, error: BaseException) -> str:
        """The likely fix when ``error`` (an upload's) means the URL itself is unusable, else ``""``."""
        for e in causes(error):
            if isinstance(e, FileNotFoundError):
                return f"; the bucket or path of remote_url={self.url!r} does not exist: create it or fix the URL"
            if isinstance(e, PermissionError):
                return (f"; remote_url={self.url!r} is not writable with these credentials: check them (environment, "
                        "profile or storage_options) and the bucket policy")
        return ""

    # ------------------------------------------------------------------ listing

    def committed_steps(self) -> list[int]:
        """Steps whose prefix holds a manifest, ascending (nothing verified)."""
        return sorted(self._objects())

    def _objects(self) -> dict[int, dict[str, int | None]]:
        """One recursive listing (no glob: the URL may hold glob characters): per step whose prefix holds a
        manifest, the size of each object in it."""
        self.fs.invalidate_cache(self.root)
        found = self.retry("listing", lambda: self.fs.find(self.root, detail=True))
        by_step: dict[int, dict[str, int | None]] = {}
        for path, entry in found.items():
            parts = path.rstrip("/").split("/")
            if len(parts) >= 2 and "/".join(parts[:-2]).strip("/") == self.root.strip("/"):
                step = parse_checkpoint_dirname(parts[-2])
                if step is not None:
                    by_step.setdefault(step, {})[parts[-1]] = entry.get("size")
        return {step: objects for step, objects in by_step.items() if MANIFEST_NAME in objects}

    def read_manifest(self, step: int) -> Manifest:
        """The manifest of ``step``, with every file it names checked for presence and size.

        Raises:
            CorruptCheckpointError: unreadable manifest, or a file missing or of the wrong size.
            RemoteError: the remote could not be read.
        """
        return self._read_manifest(step, None)

    def _read_manifest(self, step: int, sizes: dict[str, int | None] | None) -> Manifest:
        """:meth:`read_manifest`, the object sizes taken from ``sizes`` (a listing made already) if given."""
        prefix = self._path(checkpoint_dirname(step))
        raw = self.retry(f"reading {prefix}/{MANIFEST_NAME}", lambda: self.fs.cat_file(f"{prefix}/{MANIFEST_NAME}"))
        manifest = self.stored.manifest(raw, where=f"{self.url}/{checkpoint_dirname(step)}/{MANIFEST_NAME}", step=step)
        if sizes is None:
            self.fs.invalidate_cache(prefix)
            listing = self.retry(f"listing {prefix}", lambda: self.fs.ls(prefix, detail=True))
            sizes = {entry["name"].rstrip("/").split("/")[-1]: entry.get("size") for entry in listing}
        for f in manifest.files:
            size = self.stored.size(step, f)
            if sizes.get(f.name) != size:
                raise CorruptCheckpointError(
                    f"{self.url}/{checkpoint_dirname(step)}/{f.name} has size {sizes.get(f.name)}; the manifest says {size}"
                )
        return manifest

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints whose manifest and sizes check, oldest first."""
        return [info for info, _ in self.listing(sealed=True)]

    def listing(self, *, sealed: bool = False) -> list[tuple[CheckpointInfo, Manifest]]:
        """Committed checkpoints whose manifest and sizes check, with their manifests, oldest first: one
        recursive listing (every object's size) and one read per manifest. ``sealed``: an encrypted remote read
        without the key lists each checkpoint's step, size and "encrypted" (its manifest ``None``) instead of raising
        :class:`~persist_core.tiers.codec.EncryptionKeyError`."""
        found: list[tuple[CheckpointInfo, Any]] = []
        for step, sizes in sorted(self._objects().items()):
            try:
                m = self._read_manifest(step, sizes)
            except EncryptionKeyError:
                if not sealed or self.stored.codec.key is not None:
                    raise
                found.append((self.stored.sealed_info(step, f"{self.url}/{checkpoint_dirname(step)}"), None))
                continue
            except CorruptCheckpointError as e:
                log.warning("skipping remote step %d: %s", step, e)
                continue
            found.append((CheckpointInfo(step=step, time=m.time, nbytes=m.nbytes,
                                         path=f"{self.url}/{checkpoint_dirname(step)}", tier="remote"), m))
        return found

    # ------------------------------------------------------------------ upload / remove

    def upload(self, local_ckpt: Path, manifest: Manifest, *, files: tuple[FileEntry, ...] | None = None) -> None:
        """Upload a committed local checkpoint: shards (size-checked), then the manifest.

        Args:
            local_ckpt: its local directory.
            manifest: its manifest (a node's copy: the remote gets the copy that holds every file).
            files: the shard files to upload from here (default: every file ``local_ckpt`` holds);
                with several nodes each rank uploads its own and the manifest waits for all of them.

        Raises:
            RemoteError: a permanent failure, or retries exhausted; nothing is committed then.
        """
        prefix = self._path(checkpoint_dirname(manifest.step))
        self.upload_files(local_ckpt, manifest.step, manifest.held() if files is None else files)
        store_checksums.record(self, self._s3, manifest.step, manifest.files)  # before the commit (its module)
        raw = (local_ckpt / MANIFEST_NAME).read_bytes() if manifest.node is None else manifest.placed(None).to_bytes()
        raw = self.stored.wrap(manifest, raw, where=prefix)
        self.retry(f"committing {prefix}", lambda: self.fs.pipe_file(f"{prefix}/{MANIFEST_NAME}", raw))

    def upload_files(self, local_ckpt: Path, step: int, files: tuple[FileEntry, ...]) -> None:
        """Upload shard files of checkpoint ``step`` from ``local_ckpt``, each size-checked (no manifest).

        Raises:
            RemoteError: a permanent failure, or retries exhausted.
        """
        prefix = self._path(checkpoint_dirname(step))
        if "file" in self._protocols:  # a local or mounted file system wants the directory first
            self.retry(f"creating {prefix}", lambda: self.fs.makedirs(prefix, exist_ok=True))
        for f in files:
            target = f"{prefix}/{f.name}"
            if self.stored.codec.active:  # encoded block by block as the transfer sends them
                expected = remote_encoded.put(self, self._s3, local_ckpt, step, f, target)
            else:
                self.retry(f"uploading {target}", lambda f=f, target=target: self._put(local_ckpt / f.name, target))
                expected = f.size
            size = self.retry(f"checking {target}", lambda target=target: self._size(target))
            if size != expected:
                raise RemoteError(f"uploaded {target} has {size} bytes, expected {expected}; the upload will be redone")
            self.stored.uploaded(step, f, prefix)

    def _size(self, path: str) -> int:
        """The size the remote itself gives (an upload's check): never from a listing another thread cached
        meanwhile (s3fs's dircache: a reader listing the prefix while this rank uploads into it)."""
        if self._s3 is not None:
            return self._s3.size(path)
        self.fs.invalidate_cache(path)
        return self.fs.info(path)["size"]

    def _put(self, local: Path, target: str) -> None:
        if self._s3 is not None:
            self._s3.put_file(local, target, turn=self._turn.wait)
        elif self._is_s3:
            self.fs.put_file(str(local), target, chunksize=self.part_bytes, max_concurrency=self.concurrency,
                             callback=Yielding(self._turn.wait))
        else:
            self.fs.put_file(str(local), target, callback=Yielding(self._turn.wait))

    def store_checksums(self, step: int) -> store_checksums.Compared:
        """The store's checksums of ``step``'s objects now (HEAD requests) against those recorded at upload."""
        return store_checksums.compare(self, self._s3, step)

    @property
    def turn(self) -> Turn:
        """What each piece an upload sends waits for (a guarded update's turn)."""
        return self._turn

    def read_stored(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object at ``path`` as stored (one ranged read, no retry)."""
        return self._read_range(path, start, end)

    def _read_range(self, path: str, start: int, end: int) -> bytes:
        if self._s3 is not None:
            return self._s3.read_range(path, start, end)
        return self.fs.cat_file(path, start=start, end=end)

    def _read_into(self, path: str, start: int, views: list[memoryview]) -> int:
        if self._s3 is not None:  # from the socket into the views
            return self._s3.read_into(path, start, views)
        return read_into(self.fs, path, start, views)

    def set_aside(self, step: int, at: int) -> None:
        """Set checkpoint ``step`` aside under its abandoned name (:func:`~persist_core.tiers.remote_aside.set_aside`:
        the second half after :meth:`hide`, or the whole move)."""
        remote_aside.set_aside(self, step, at)

    def hide(self, step: int, at: int) -> None:
        """Take ``step`` off the live branch at once, the rest of its move to follow (:mod:`.remote_aside`)."""
        remote_aside.hide(self, step, at)

    def hidden(self) -> list[tuple[int, int]]:
        """``(step, at)`` of the checkpoints taken off the live branch whose move did not finish."""
        return remote_aside.hidden(self)

    def copy_object(self, path: str, target: str) -> None:
        """One object copied on the remote: server-side where the backend can (S3), else read and written back
        in pieces (a backend without a copy); a file system that wants directories gets the target's first."""
        if "file" in self._protocols:
            self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        if self.stored.rewraps(path, target):  # a manifest set aside: its envelope says so, authenticated
            return
        try:
            self.fs.copy(path, target)
        except NotImplementedError:
            with self.fs.open(path, "rb") as src, self.fs.open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, _COPY_PIECE_BYTES)

    def abandoned(self) -> list[CheckpointInfo]:
        """Checkpoints set aside when a run resumed from an older one, oldest first."""
        return remote_aside.abandoned(self)

    def remove(self, step: int) -> None:
        """Delete a remote checkpoint: the manifest first, then its shards."""
        self.remove_prefix(self._path(checkpoint_dirname(step)))

    def remove_abandoned(self, path: str) -> None:
        """Delete the set-aside checkpoint at ``path`` (``persist gc --abandoned``; raises ``ValueError`` for any
        other path)."""
        remote_aside.remove_abandoned(self, path)

    def remove_prefix(self, prefix: str, *, manifest: bool = True) -> None:
        """Delete every object under ``prefix``: its manifest first (``manifest``: it has one), then the rest."""
        if manifest:
            self.retry(f"removing {prefix}/{MANIFEST_NAME}", lambda: self.fs.rm_file(f"{prefix}/{MANIFEST_NAME}"))
        self.fs.invalidate_cache(prefix)
        # file by file: fsspec's recursive rm treats glob characters in the URL as patterns
        for path in self.retry(f"listing {prefix}", lambda: self.fs.find(prefix)):
            self.retry(f"removing {path}", lambda path=path: self.fs.rm_file(path))
        if "file" in self._protocols:
            self.retry(f"removing {prefix}", lambda: self.fs.rmdir(prefix))

    # ------------------------------------------------------------------ download

    def verify(self, step: int, progress: Callable[[int], None] | None = None) -> list[str]:
        """Read every file of remote checkpoint ``step`` (ranged, parallel), each chunk against its crc32c; the
        problems found (a missing or short file, a chunk that does not match, a block that does not decode)."""
        return remote_download.verify(self, step, progress)

    def download(self, step: int, tmp: Path, progress: Callable[[int], None] | None = None) -> Manifest:
        """Download ``step`` into the empty directory ``tmp`` (:func:`.remote_download.download`); its manifest."""
        return remote_download.download(self, step, tmp, progress)

    def read_range(self, step: int, f: FileEntry, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of file ``f`` of checkpoint ``step`` (not verified: a header, read to plan).

        Raises:
            RemoteError: the remote could not be read.
        """
        if self.stored.envelope(step) is not None:  # the blocks that hold the range, decoded
            first, stop = f.blocks(start, min(end, f.size))
            data = self.read_logical(step, f, first, stop)
            if first == 0:  # a header, read to plan: the restore's first read of block 0 takes it from here
                self._heads.keep(step, f.name, stop, data)
            return bytes(memoryview(data)[start - first * f.chunk_bytes:min(end, f.size) - first * f.chunk_bytes])
        source = f"{self._path(checkpoint_dirname(step))}/{f.name}"
        return self.retry(f"reading {source}", lambda: self._read_range(source, start, min(end, f.size)))

    def read_blocks(self, step: int, f: FileEntry, first: int, views: list[memoryview], *, verify: bool = True) -> None:
        """Fill ``views`` (whole checksum blocks of file ``f`` of checkpoint ``step`` from block ``first`` on,
        in order) with one ranged read, and verify them.

        Raises:
            CorruptCheckpointError: a block does not match its checksum.
            RemoteError: the remote could not be read.
        """
        start = first * f.chunk_bytes
        end = start + sum(len(v) for v in views)
        source = f"{self._path(checkpoint_dirname(step))}/{f.name}"
        if self.stored.envelope(step) is None:  # stored raw: from the socket into the views
            got = self.retry(f"reading {source}", lambda: self._read_into(source, start, views))
        else:  # decoded on the codec's threads straight into the views, as each ranged read arrives
            got = remote_encoded.read_into(self, step, f, first, views, self._heads, where=f"{self.url}/{source}")
        if got != end - start:
            raise CorruptCheckpointError(f"{self.url}/{checkpoint_dirname(step)}/{f.name}: {got} bytes from "
                                         f"byte {start}, {end - start} asked; the remote copy is short")
        if verify:
            f.check_views(views, first, where=f"{self.url}/{checkpoint_dirname(step)}/{f.name}")

    def read_logical(self, step: int, f: FileEntry, first: int, stop: int) -> bytes:
        """The bytes of blocks ``[first, stop)`` of file ``f`` of ``step`` as the local tier holds them (one ranged
        read; decoded when the remote stores them encoded), not verified."""
        source = f"{self._path(checkpoint_dirname(step))}/{f.name}"
        env = self.stored.envelope(step)
        if env is None:
            start, end = first * f.chunk_bytes, min(stop * f.chunk_bytes, f.size)
            return self.retry(f"reading {source}", lambda: self._read_range(source, start, end))
        return self.stored.read(step, f, first, stop, lambda start, end: self.retry(
            f"reading {source}", lambda: self._read_range(source, start, end)), where=f"{self.url}/{source}")

