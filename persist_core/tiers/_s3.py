"""Threaded S3 multipart transfers (botocore + s3transfer), for the S3 remote tier.

s3fs runs every request on one asyncio loop; plain ``s3fs.put_file`` reaches about a third of
what a threaded client reaches. This module builds a botocore client with the same credentials
and endpoint as the user's s3fs filesystem (``storage_options`` stay the one way to configure
S3) and uploads with s3transfer's ``TransferManager`` (what ``boto3.upload_file`` uses: parts on
threads, aborted on failure). Only :class:`persist_core.remote.RemoteTier` uses it.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
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
        part_bytes = max(self.part_bytes, -(-os.path.getsize(local) // _MAX_PARTS))
        if part_bytes != self._manager_part_bytes:  # a huge shard needs bigger parts (S3 allows 10,000)
            self._manager.shutdown()
            self._manager = self._make_manager(part_bytes)
        subscribers = None if turn is None else [_yielding()(turn)]
        self._manager.upload(str(local), bucket, key, subscribers=subscribers).result()

    def size(self, path: str) -> int:
        """The object's size, asked of S3 itself (a HEAD; never a cached listing)."""
        bucket, key = self._split(path)
        try:
            return int(self._client.head_object(Bucket=bucket, Key=key)["ContentLength"])
        except self._client.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(path) from e
            raise

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object at ``path``."""
        bucket, key = self._split(path)
        return self._client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"].read()


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
