"""Threaded S3 multipart transfers with botocore, for the S3 remote tier.

s3fs runs every request on one asyncio loop, where SigV4 payload hashing of each part is
serialized; plain ``s3fs.put_file`` reaches about half of what a threaded client reaches. This
module builds a botocore client with the same credentials and endpoint as the user's s3fs
filesystem (``storage_options`` stay the one way to configure S3) and moves parts on a thread
pool, where hashing and I/O run in parallel. Only :class:`persist_core.remote.RemoteTier` uses it.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_MAX_PARTS = 10_000  # S3's limit per multipart upload


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
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="persist-s3")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _split(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self._fs.split_path(path)
        return bucket, key

    def put_file(self, local: Path, path: str) -> None:
        """Upload ``local`` to ``path``: one PUT when small, else a multipart upload (aborted on failure)."""
        bucket, key = self._split(path)
        size = os.path.getsize(local)
        part_bytes = max(self.part_bytes, -(-size // _MAX_PARTS))
        fd = os.open(local, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if size <= part_bytes:
                self._client.put_object(Bucket=bucket, Key=key, Body=os.pread(fd, size, 0))
                return
            upload_id = self._client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
            try:
                def part(number: int) -> dict[str, Any]:
                    start = (number - 1) * part_bytes
                    body = os.pread(fd, min(part_bytes, size - start), start)
                    etag = self._client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                                    Body=body)["ETag"]
                    return {"ETag": etag, "PartNumber": number}

                parts = list(self._pool.map(part, range(1, -(-size // part_bytes) + 1)))
                self._client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id,
                                                       MultipartUpload={"Parts": parts})
            except BaseException:
                try:
                    self._client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
                except Exception as e:  # the upload's own error is the one to report
                    log.warning("could not abort multipart upload %s of %s: %s", upload_id, path, e)
                raise
        finally:
            os.close(fd)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object at ``path``."""
        bucket, key = self._split(path)
        return self._client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"].read()
