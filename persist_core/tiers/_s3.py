"""Threaded S3 multipart transfers (botocore + s3transfer), for the S3 remote tier.

s3fs runs every request on one asyncio loop; plain ``s3fs.put_file`` reaches about a third of
what a threaded client reaches. This module builds a botocore client with the same credentials
and endpoint as the user's s3fs filesystem (``storage_options`` stay the one way to configure
S3) and uploads with s3transfer's ``TransferManager`` (what ``boto3.upload_file`` uses: parts on
threads, aborted on failure). Only :class:`persist_core.remote.RemoteTier` uses it.

What the store says it holds (:meth:`S3Transfer.head`): its size, ETag and the checksum it computed and checked as
the bytes arrived (botocore sends one with every upload: CRC32, or CRC32C where ``botocore[crt]`` is installed; for a
multipart upload S3 keeps a composite value, the checksum of the parts' checksums, with the part size).
:mod:`persist_core.tiers.store_checksums` records it at upload and compares it later.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from persist_core import _link_knobs

log = logging.getLogger(__name__)

_MAX_PARTS = 10_000  # S3's limit per multipart upload
#: the checksums S3 may hold for an object, in the order one is taken when it holds several
ALGORITHMS = ("CRC32", "CRC32C", "CRC64NVME", "SHA1", "SHA256")
_CHECKSUM = "CRC32"  # what a streamed upload asks the store to check and keep (as s3transfer does by default)


class S3Transfer:
    """Multipart upload and ranged reads of single objects, ``concurrency`` parts at a time.

    Args:
        fs: the user's ``s3fs.S3FileSystem`` (its credentials, endpoint and config are reused).
        part_bytes: multipart part size (>= 5 MiB, S3's minimum).
        concurrency: parts in flight per object.
    """

    def __init__(self, fs: Any, *, part_bytes: int, concurrency: int) -> None:
        import botocore.config
        import botocore.session
        from botocore import UNSIGNED

        self._fs = fs
        self.part_bytes = max(part_bytes, 5 << 20)
        client_kwargs = dict(fs.client_kwargs)
        config_kwargs = {"max_pool_connections": 2 * concurrency, **fs.config_kwargs}
        if fs.anon:
            config_kwargs["signature_version"] = UNSIGNED
        if fs.endpoint_url and "endpoint_url" not in client_kwargs:
            client_kwargs["endpoint_url"] = fs.endpoint_url
        credentials = {k: v for k, v in (("aws_access_key_id", fs.key), ("aws_secret_access_key", fs.secret),
                                         ("aws_session_token", fs.token)) if v}
        profile = fs.kwargs.get("profile")
        session = botocore.session.Session(profile=profile) if profile else botocore.session.get_session()
        self._client = session.create_client("s3", config=botocore.config.Config(**config_kwargs),
                                             **client_kwargs, **credentials)
        self._concurrency = concurrency
        self._manager = self._make_manager(self.part_bytes)

    def _make_manager(self, part_bytes: int) -> Any:
        from s3transfer.manager import TransferConfig, TransferManager

        self._manager_part_bytes = part_bytes
        config = TransferConfig(multipart_threshold=part_bytes, multipart_chunksize=part_bytes,
                                max_request_concurrency=self._concurrency)
        return TransferManager(self._client, config)

    def close(self) -> None:
        self._manager.shutdown()

    def _split(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self._fs.split_path(path)
        return bucket, key

    def put_file(self, local: Path, path: str, *, turn: Callable[[], None] | None = None) -> None:
        """Upload ``local`` to ``path``: one PUT when small, else a multipart upload (aborted on failure).
        ``turn``: called by the transfer threads as they read each piece to send (it may wait)."""
        bucket, key = self._split(path)
        size = os.path.getsize(local)
        # parts that give every connection one (not under 8 MiB), at most part_bytes, at least S3's 5 MiB, and
        # large enough for S3's 10,000 parts
        part_bytes = max(_link_knobs.remote_span_bytes(size, self._concurrency, self.part_bytes), 5 << 20,
                         -(-size // _MAX_PARTS))
        if part_bytes != self._manager_part_bytes:  # a huge shard needs bigger parts (S3 allows 10,000)
            self._manager.shutdown()
            self._manager = self._make_manager(part_bytes)
        subscribers = None if turn is None else [_yielding()(turn)]
        self._manager.upload(str(local), bucket, key, subscribers=subscribers).result()

    def put_stream(self, pieces: Iterable[bytes | bytearray], path: str, *, size_hint: int,
                   retry: Callable[[str, Callable[[], Any]], Any], turn: Callable[[], None] | None = None) -> int:
        """Upload the bytes of ``pieces`` laid end to end (taken as they come: an encoder's output, which goes on
        making the next pieces meanwhile) to ``path``; the bytes uploaded. One PUT when they fit one part, else a
        multipart upload in equal parts (the last shorter), ``concurrency`` parts in flight and no more taken from
        ``pieces`` until one is done (bounded memory), aborted on failure. Each request goes through ``retry``
        (``(what, fn)``): a part retried re-sends the same bytes. ``size_hint``: about how many bytes (the part
        size follows it, as :meth:`put_file`'s follows the file's size); ``turn``: called before each part is sent.
        """
        bucket, key = self._split(path)
        part_bytes = max(_link_knobs.remote_span_bytes(size_hint, self._concurrency, self.part_bytes), 5 << 20,
                         -(-size_hint // (_MAX_PARTS - 1)))
        parts = _parts(pieces, part_bytes)
        try:
            first = next(parts)
            second = next(parts, None)
            if second is None:  # one part: one PUT
                if turn is not None:
                    turn()
                self.put_object(bucket, key, first, retry=retry, path=path)
                return len(first)
            upload = retry(f"starting the upload of {path}", lambda: self._client.create_multipart_upload(
                Bucket=bucket, Key=key, ChecksumAlgorithm=_CHECKSUM))["UploadId"]
            try:
                sent = self._send_parts(itertools.chain((first, second), parts), bucket, key, upload, path,
                                        retry=retry, turn=turn)
                retry(f"completing the upload of {path}", lambda: self._client.complete_multipart_upload(
                    Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": sent[1]}))
            except BaseException:
                try:
                    self._client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
                except Exception as e:  # the store drops it by its lifecycle rule, or persist gc's listing
                    log.warning("could not abort the failed multipart upload of %s (%s)", path, e)
                raise
            return sent[0]
        finally:
            parts.close()

    def _send_parts(self, parts: Iterable[bytes], bucket: str, key: str, upload: str, path: str, *,
                    retry: Callable[[str, Callable[[], Any]], Any],
                    turn: Callable[[], None] | None) -> tuple[int, list[dict[str, Any]]]:
        """Send ``parts`` as parts 1, 2, ... of ``upload``, ``concurrency`` at a time: ``(bytes, the parts' records
        for the completion)``."""
        slots = threading.BoundedSemaphore(self._concurrency)
        failed: list[BaseException] = []
        futures: list[Future[dict[str, Any]]] = []
        total = 0

        def send(number: int, body: bytes) -> dict[str, Any]:
            try:
                if turn is not None:
                    turn()
                return self.upload_part(bucket, key, upload, number, body, retry=retry, path=path)
            except BaseException as e:
                failed.append(e)
                raise
            finally:
                slots.release()

        with ThreadPoolExecutor(self._concurrency, thread_name_prefix="persist-part") as pool:
            for number, body in enumerate(parts, start=1):
                slots.acquire()  # no more parts made while `concurrency` are in flight
                if failed:
                    slots.release()
                    break
                total += len(body)
                futures.append(pool.submit(send, number, body))
            wait(futures)
        return total, [fut.result() for fut in futures]

    def put_object(self, bucket: str, key: str, body: bytes, *, retry: Callable[[str, Callable[[], Any]], Any],
                   path: str) -> None:
        """One object in one PUT (retried with the same bytes)."""
        retry(f"uploading {path}", lambda: self._client.put_object(Bucket=bucket, Key=key, Body=body,
                                                                   ChecksumAlgorithm=_CHECKSUM))

    def upload_part(self, bucket: str, key: str, upload: str, number: int, body: bytes, *,
                    retry: Callable[[str, Callable[[], Any]], Any], path: str) -> dict[str, Any]:
        """One part sent (retried with the same bytes): its record for the completion (ETag and checksum)."""
        r = retry(f"uploading part {number} of {path}", lambda: self._client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=body, ChecksumAlgorithm=_CHECKSUM))
        part = {"PartNumber": number, "ETag": r["ETag"]}
        if r.get(f"Checksum{_CHECKSUM}"):
            part[f"Checksum{_CHECKSUM}"] = r[f"Checksum{_CHECKSUM}"]
        return part

    def size(self, path: str) -> int:
        """The object's size, asked of S3 itself (a HEAD; never a cached listing)."""
        return int(self._head(path, checksums=False)["ContentLength"])

    def head(self, path: str, *, parts: bool = False) -> dict[str, Any]:
        """What S3 says of the object at ``path`` (a HEAD with ``ChecksumMode=ENABLED``; nothing downloaded):
        ``size`` and ``etag``; ``algorithm``, ``checksum`` (base64, as S3 gives it) and ``type`` (``FULL_OBJECT`` or
        ``COMPOSITE``) where it holds a checksum; with ``parts``, for a multipart object, ``parts`` and
        ``part_bytes`` (the first part's size: a second HEAD, of part 1), which a composite value is computed over.

        Raises:
            FileNotFoundError: no such object.
        """
        try:
            r = self._head(path, checksums=True)
        except PermissionError:  # SSE-KMS without kms:Decrypt: the size and the ETag, no checksum
            log.warning("%s: the store refuses its checksum to these credentials (SSE-KMS wants kms:Decrypt for "
                        "ChecksumMode); recording its ETag", path)
            r, parts = self._head(path, checksums=False), False
        found: dict[str, Any] = {"size": int(r["ContentLength"]), "etag": r.get("ETag")}
        multipart = "-" in str(found["etag"] or "")  # a multipart upload's ETag ends with -<parts>
        algorithm = next((a for a in ALGORITHMS if r.get(f"Checksum{a}")), None)
        if algorithm is not None:
            value = r[f"Checksum{algorithm}"]
            # without ChecksumType (S3 before 2025, moto): a multipart object's value is the composite
            kind = r.get("ChecksumType") or ("COMPOSITE" if multipart or "-" in value else "FULL_OBJECT")
            found.update(algorithm=algorithm, checksum=value, type=kind)
        if parts and multipart:
            first = self._head(path, checksums=True, PartNumber=1)
            count = first.get("PartsCount") or int(str(found["etag"]).strip('"').rsplit("-", 1)[-1])
            found.update(parts=int(count), part_bytes=int(first["ContentLength"]))
        return found

    def _head(self, path: str, *, checksums: bool, **extra: Any) -> dict[str, Any]:
        """A HEAD; with ``checksums``, ``ChecksumMode=ENABLED`` (on an SSE-KMS object S3 then wants ``kms:Decrypt``:
        the size check after each upload asks without it)."""
        bucket, key = self._split(path)
        if checksums:
            extra["ChecksumMode"] = "ENABLED"
        try:
            return self._client.head_object(Bucket=bucket, Key=key, **extra)
        except self._client.exceptions.ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(path) from e
            if checksums and code in ("403", "AccessDenied"):
                raise PermissionError(path) from e
            raise

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object at ``path``."""
        bucket, key = self._split(path)
        return self._client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"].read()

    def read_into(self, path: str, start: int, views: Sequence[memoryview]) -> int:
        """Fill ``views`` (byte views, in order) with the object's bytes from ``start`` on, by one ranged GET read
        from the socket straight into them: no intermediate copy of the range (``Body.read()`` builds a bytes object
        that is then copied again; on a restore those copies compete with the link and the checksums for the
        cores). The bytes read: fewer when the object is shorter."""
        bucket, key = self._split(path)
        total = sum(v.nbytes for v in views)
        body = self._client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + total - 1}")["Body"]
        raw = getattr(body, "_raw_stream", None)  # urllib3's response; its _fp: http.client's, with a real readinto
        fp = getattr(raw, "_fp", None)
        into = fp.readinto if fp is not None and hasattr(fp, "readinto") else functools.partial(_read_once, body)
        got = 0
        with body:
            for view in views:
                view = view.cast("B")
                done = 0
                while done < len(view):
                    n = into(view[done:])
                    if not n:
                        return got + done
                    done += n
                got += done
            if fp is not None and fp.isclosed() and hasattr(raw, "release_conn"):
                raw.release_conn()  # every byte read: the connection goes back to the pool (closing would drop it)
        return got


def _parts(pieces: Iterable[bytes | bytearray], size: int) -> Iterator[bytes]:
    """The bytes of ``pieces`` laid end to end, cut into parts of ``size`` bytes (the last shorter; one empty part
    when there are none), each taken from ``pieces`` only as far as it needs."""
    held: list[memoryview] = []
    n, made = 0, False
    try:
        for piece in pieces:
            view = memoryview(piece)
            while len(view):
                take = min(size - n, len(view))
                held.append(view[:take])
                n, view = n + take, view[take:]
                if n == size:
                    yield b"".join(held)
                    held, n, made = [], 0, True
        if n or not made:
            yield b"".join(held)
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()


def _read_once(body: Any, view: memoryview) -> int:
    data = body.read(len(view))
    view[: len(data)] = data
    return len(data)


@functools.cache
def _yielding() -> type:
    """The s3transfer subscriber that calls ``turn`` at each piece a transfer thread reads to send (the
    class is made once, on first use: s3transfer is imported only with the S3 tier)."""
    from s3transfer.subscribers import BaseSubscriber

    class Yielding(BaseSubscriber):  # type: ignore[misc]
        def __init__(self, turn: Callable[[], None]) -> None:
            self._turn = turn

        def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
            self._turn()

    return Yielding
