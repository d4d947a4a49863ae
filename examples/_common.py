"""Helpers the examples share: an embedded S3 remote, and a listing of a local_dir."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
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


def run_machine(cmd: list[str], run_id: str | None = None) -> dict | None:
    """Run one machine's training process: its last JSON line, or ``None`` when it was SIGKILLed.

    ``run_id``: the job's id, as a scheduler gives each restart of one job (``SLURM_JOB_ID``,
    ``TORCHELASTIC_RUN_ID``; here ``PERSIST_RUN_ID``): the machine that takes over continues that run's
    lease on the remote even when the first was killed before any upload committed.
    """
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **({"PERSIST_RUN_ID": run_id} if run_id else {})}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode == -signal.SIGKILL:
        return None
    if run.returncode != 0:
        sys.exit(f"training failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def remote_steps(scratch: Path, remote: str, endpoint: str | None) -> list[int]:
    """The committed steps on the remote."""
    from persist_core import CheckpointReader

    options = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else None
    with CheckpointReader(scratch, remote_url=remote, storage_options=options) as reader:
        return [c.step for c in reader.list("remote")]
