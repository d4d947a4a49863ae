"""Helpers the examples share: an embedded S3 remote, and a listing of a local_dir."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def remote_storage(out: Path, run: str):
    """A moto S3 server with a bucket when moto is installed, else a file:// directory."""
    try:
        import moto  # noqa: F401
        import s3fs
    except ImportError:
        yield (out / "remote" / run).as_uri(), None
        return
    from tests.support.moto_server import CREDENTIALS, moto_server

    os.environ.update(CREDENTIALS)
    with moto_server() as endpoint:
        s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True).mkdir("demo")
        yield f"s3://demo/{run}", endpoint


def listing(local_dir: Path) -> str:
    return ", ".join(f"{p.name} -> {os.readlink(p)}" if p.is_symlink() else p.name for p in sorted(local_dir.iterdir()))
