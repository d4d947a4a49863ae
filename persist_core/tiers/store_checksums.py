"""The store's own checksum of each object a checkpoint uploaded: recorded beside it at the upload, compared later
without downloading a byte (``persist verify URL --remote``).

S3 checks what it receives: botocore sends a checksum with every upload (CRC32; CRC32C where ``botocore[crt]`` is
installed), S3 computes its own from the bytes that arrived and refuses the request when they differ (``BadDigest``),
then keeps the value with the object (Amazon S3 User Guide, "Checking object integrity for data uploads"). For a
multipart upload it keeps a composite value, the checksum of the parts' checksums, which depends on the part size.

Who calls what, in which order (rank 0's sync thread, or ``persist push``/``cp``: :meth:`RemoteTier.upload`):

1. every shard object is uploaded and its size checked (:meth:`RemoteTier.upload_files`; with several nodes, each
   rank its own);
2. :func:`record`: the store is asked for each shard object's checksum (one HEAD with ``ChecksumMode=ENABLED``, two
   for a multipart object: the part size), and the answers go into one small side object,
   :data:`~persist_core.layout.STORE_CHECKSUMS_NAME`, in the checkpoint's prefix;
3. the manifest, last: the commit. A crash before it leaves a prefix without a manifest (no checkpoint; ``persist gc``
   removes it), the record included.

:func:`compare` (``persist verify --remote``) asks the store again, HEAD requests only, and names each object whose
checksum, size or ETag is not what was recorded: replaced or damaged after its upload. The record holds what the
store said, not what the client computed: the manifest's crc32c per block stays what loads verify.

Other stores (``file://``, ``memory://``, ``gs://``, ``az://`` through fsspec) record nothing: fsspec gives no
checksum the store checked on arrival, so :func:`compare` says "not recorded by this store" and fails nothing; a
checkpoint uploaded before this record existed says "no record".
"""

from __future__ import annotations

import base64
import json
import logging
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from persist_core.format.manifest import FileEntry
from persist_core.layout import STORE_CHECKSUMS_NAME, checkpoint_dirname
from persist_core.tiers._s3 import S3Transfer

log = logging.getLogger(__name__)

T = TypeVar("T")

#: the record's own format version
RECORD_VERSION = 1
#: what compare() says of a store that records nothing (not S3, or S3 reached without the threaded client)
NOT_RECORDED = "not recorded by this store"


class RemoteTier(Protocol):
    """What the record needs of :class:`persist_core.tiers.remote.RemoteTier` (which calls these functions)."""

    url: str
    fs: Any
    concurrency: int

    def path_of(self, name: str) -> str: ...

    def retry(self, what: str, fn: Callable[[], T]) -> T: ...


@dataclass(frozen=True)
class Compared:
    """What :func:`compare` found for one checkpoint: ``problems`` (one line per object that differs or is missing),
    how many objects were ``checked``, and ``note`` when nothing could be (:data:`NOT_RECORDED`, or no record)."""

    problems: list[str] = field(default_factory=list)
    checked: int = 0
    note: str | None = None


def record(tier: RemoteTier, s3: S3Transfer | None, step: int, files: Iterable[FileEntry]) -> None:
    """Write the store's checksum of every shard object of ``step`` into its record (before the manifest); nothing
    where the store records none (``s3`` is ``None``).

    Raises:
        RemoteError: the store could not be asked or written (the upload fails and is redone).
    """
    if s3 is None:
        return
    prefix = tier.path_of(checkpoint_dirname(step))
    names = [f.name for f in files]
    with ThreadPoolExecutor(max(1, min(tier.concurrency, len(names))), thread_name_prefix="persist-head") as pool:
        heads = list(pool.map(lambda n: tier.retry(f"asking for {prefix}/{n}'s checksum",
                                                   lambda: s3.head(f"{prefix}/{n}", parts=True)), names))
    objects = dict(zip(names, heads))
    for name, head in objects.items():
        if "checksum" not in head:
            log.info("[step=%d] %s/%s: the store reported no checksum (its ETag is recorded)", step, prefix, name)
    raw = json.dumps({"version": RECORD_VERSION, "objects": objects}, sort_keys=True).encode()
    tier.retry(f"writing {prefix}/{STORE_CHECKSUMS_NAME}",
               lambda: tier.fs.pipe_file(f"{prefix}/{STORE_CHECKSUMS_NAME}", raw))


def compare(tier: RemoteTier, s3: S3Transfer | None, step: int) -> Compared:
    """Each recorded object's checksum, size and ETag as the store reports them now (HEAD requests: nothing
    downloaded) against the record of ``step``.

    Raises:
        RemoteError: the store could not be asked.
    """
    if s3 is None:
        return Compared(note=NOT_RECORDED)
    prefix = tier.path_of(checkpoint_dirname(step))
    where = f"{tier.url}/{checkpoint_dirname(step)}"

    def read() -> bytes | None:
        try:
            return tier.fs.cat_file(f"{prefix}/{STORE_CHECKSUMS_NAME}")
        except FileNotFoundError:
            return None

    raw = tier.retry(f"reading {prefix}/{STORE_CHECKSUMS_NAME}", read)
    if raw is None:
        return Compared(note=f"no record of the store's checksums ({STORE_CHECKSUMS_NAME}): uploaded before "
                             "torch-persist kept one, or by another tool")
    try:
        recorded = json.loads(raw)["objects"]
    except (ValueError, KeyError, TypeError):
        recorded = None
    if not isinstance(recorded, dict) or not all(isinstance(v, dict) for v in recorded.values()):
        return Compared(problems=[f"{where}/{STORE_CHECKSUMS_NAME} is unreadable; it should hold the store's "
                                  "checksums recorded at upload"])

    def now(name: str) -> dict[str, Any] | None:
        try:
            return s3.head(f"{prefix}/{name}")
        except FileNotFoundError:
            return None

    names = sorted(recorded)
    with ThreadPoolExecutor(max(1, min(tier.concurrency, len(names))), thread_name_prefix="persist-head") as pool:
        heads = list(pool.map(lambda n: tier.retry(f"asking for {prefix}/{n}'s checksum", lambda: now(n)), names))
    problems = [p for name, head in zip(names, heads) if (p := _differs(f"{where}/{name}", recorded[name], head))]
    return Compared(problems=problems, checked=len(names))


def _differs(where: str, was: dict[str, Any], now: dict[str, Any] | None) -> str | None:
    """What differs between the store's answer at upload and now, in one line; ``None`` when nothing does."""
    if now is None:
        return f"{where}: missing; it was uploaded with {was.get('size')} bytes"
    compared = was.get("checksum") is not None and now.get("checksum") is not None  # else the size and the ETag
    if compared and (now.get("algorithm"), now.get("checksum")) != (was.get("algorithm"), was.get("checksum")):
        return (f"{where}: the store's {was.get('algorithm')} checksum is {now.get('checksum')!r} "
                f"({now.get('algorithm') or 'none'}), it was {was['checksum']!r} at upload: the object was replaced "
                "or damaged since (a load finds the blocks that differ and falls back)")
    if now.get("size") != was.get("size"):
        return f"{where}: {now.get('size')} bytes, it was {was.get('size')} at upload"
    if was.get("etag") is not None and now.get("etag") != was.get("etag"):
        return f"{where}: the store's ETag is {now.get('etag')}, it was {was.get('etag')} at upload"
    return None


def crc32_of(data: bytes | memoryview, part_bytes: int | None = None) -> str:
    """The base64 CRC32 S3 computes for ``data`` uploaded whole (``part_bytes`` ``None``), or uploaded in parts of
    ``part_bytes`` (the composite: the CRC32 of the parts' big-endian CRC32s; S3 may add ``-N``, N parts, to the value
    it reports): a recorded value checked against local bytes."""
    def b64(crc: int) -> str:
        return base64.b64encode(crc.to_bytes(4, "big")).decode()

    view = memoryview(data)
    if part_bytes is None:
        return b64(zlib.crc32(view))
    parts = [zlib.crc32(view[i : i + part_bytes]).to_bytes(4, "big") for i in range(0, len(view), part_bytes)]
    return b64(zlib.crc32(b"".join(parts)))
