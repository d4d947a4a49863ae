"""One writer per ``remote_url``: a lease object beside the checkpoints, renewed while the run uploads.

``remote_url/.lease.json`` names the run that writes there (its run id, host, pid) and when the
lease expires. A writer takes it when it is free, expired, or already its run's (a restart on the
same ``local_dir`` keeps its run id in ``local_dir/.run-id``; a fresh machine that resumes by loading
the remote's checkpoint continues that run and takes its id; otherwise pass ``run_id`` or have the
launcher's: ``PERSIST_RUN_ID``, ``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID``). Another
live run's lease makes uploads and remote retention stop with :class:`DirectoryInUseError` naming
the holder. The lease is checked and renewed before each upload and each remote deletion, and
given back at close.

Object stores here offer no portable compare-and-swap, so taking a lease is write-then-read-back:
two writers starting within one round trip may both believe they hold it until the next renewal,
which finds out. The renewal before every write keeps the window to one upload.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from persist_core.errors import CorruptCheckpointError, DirectoryInUseError
from persist_core.layout import LEASE_NAME
from persist_core.run_ids import keep_run_id
from persist_core.tiers._retry import causes

log = logging.getLogger(__name__)


_LATEST_EXPIRY = 253402300799.0  # the last second of year 9999: a lease that ends later is not one we wrote


def _lease_record(raw: bytes) -> dict[str, Any] | None:
    """A lease as :meth:`RemoteLease.ensure` writes it, or ``None``: not JSON, not an object, or an
    ``expires`` that is not a finite number of seconds since the epoch before year 10000."""
    try:
        record = json.loads(raw)
    except ValueError:  # UnicodeDecodeError too
        return None
    if not isinstance(record, dict):
        return None
    expires = record.get("expires", 0)
    if not isinstance(expires, (int, float)) or isinstance(expires, bool) or not math.isfinite(expires) or \
            not 0 <= expires <= _LATEST_EXPIRY:
        return None
    return record


class RemoteLease:
    """This run's lease on a remote tier (``tier``: a :class:`RemoteTier`); all calls on the sync thread.

    Args:
        tier: the remote tier.
        run_id: this run's id.
        ttl_s: how long the lease lasts unrenewed.
        clock: wall clock (seconds since the epoch): leases are compared across machines.
    """

    def __init__(self, tier: Any, run_id: str, *, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self._tier = tier
        self.run_id = run_id
        self._ttl = ttl_s
        self._clock = clock
        self._renewed_at: float | None = None
        self._path = tier.path_of(LEASE_NAME)
        self._adopt_into: Path | None = None
        self._token: str | None = None

    def _read(self) -> dict[str, Any] | None:
        try:
            raw = self._tier.retry("reading the lease", lambda: self._tier.stored.read_record(self._path))
        except Exception as e:  # a missing lease object, however the store says it
            if any(isinstance(c, FileNotFoundError) for c in causes(e)):
                return None
            forged = next((c for c in causes(e) if isinstance(c, CorruptCheckpointError)), None)
            if forged is None:
                raise
            return self._unreadable(forged)
        record = _lease_record(raw)
        if record is None:
            log.warning("%s is unreadable (not a JSON lease with a finite 'expires'); taking it over", self._path)
        return record

    def _unreadable(self, why: CorruptCheckpointError) -> dict[str, Any] | None:
        """A lease that does not authenticate with this run's key (sealed under another key, written without one, or
        altered): no holder can be read from it. Written within the lease's time to live it may be a live writer's
        (another key's run): refused until it is that old; older, it is taken over (with a warning)."""
        try:
            info = self._tier.fs.info(self._path)
            written = info.get("LastModified") or info.get("mtime") or info.get("created") or 0
            written = written.timestamp() if hasattr(written, "timestamp") else float(written)
        except Exception:  # no time to go by: as an unreadable plain lease, taken over
            written = 0.0
        if self._clock() - written < self._ttl:
            return {"run_id": None, "unreadable": str(why), "expires": written + self._ttl}
        log.warning("%s does not authenticate with remote_encryption_key (%s); taking it over", self._path, why)
        return None

    def _refuse(self, holder: dict[str, Any]) -> DirectoryInUseError:
        until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(holder.get("expires", 0))))
        if holder.get("unreadable"):
            return DirectoryInUseError(
                f"remote_url={self._tier.url!r} holds a lease this run cannot read with its remote_encryption_key "
                f"({holder['unreadable']}): another run, sealing with another key, may be writing there. Give this run "
                f"its own remote_url, or pass the key that run uses; the lease is taken over after {until} if it is "
                "not renewed. Local checkpoints are kept meanwhile")
        return DirectoryInUseError(
            f"remote_url={self._tier.url!r} is written by another run: run_id={holder.get('run_id')!r} on "
            f"host={holder.get('host')} pid={holder.get('pid')}, its lease runs until {until}. Two runs on one "
            "remote_url prune and overwrite each other's checkpoints: give this run its own remote_url; or, if "
            f"this is that same run resuming on a new machine, pass run_id={holder.get('run_id')!r} (or set "
            "PERSIST_RUN_ID), or wait until the lease expires. Local checkpoints are kept meanwhile")

    def adopt(self, root: Path) -> None:
        """This run resumed from the remote's checkpoint (a fresh machine): it continues the run that holds
        the lease, and takes its run id (kept in ``root`` for restarts there) at the next :meth:`ensure`."""
        self._adopt_into = root
        self._renewed_at = None  # check the holder at the next write, even if this run took the lease already

    def ensure(self) -> None:
        """Take or renew the lease before a write to the remote.

        Raises:
            DirectoryInUseError: another run's unexpired lease (named).
            RemoteError: the lease could not be read or written.
        """
        now = self._clock()
        if self._renewed_at is not None and now - self._renewed_at < self._ttl / 3:
            return
        holder = self._read()
        if holder is not None and self._adopt_into is not None and isinstance(holder.get("run_id"), str):
            log.info("continuing run %s on %s (resumed from its checkpoint)", holder["run_id"], self._tier.url)
            self.run_id = holder["run_id"]
            keep_run_id(self._adopt_into, self.run_id)
        self._adopt_into = None
        if holder is not None and self._renewed_at is not None and holder.get("token") != self._token:
            self._renewed_at = None  # taken over (the same run resumed elsewhere): this copy must stop writing
            raise self._refuse(holder)
        if holder is not None and holder.get("run_id") != self.run_id and float(holder.get("expires", 0)) > now:
            self._renewed_at = None
            raise self._refuse(holder)
        mine = {"run_id": self.run_id, "host": socket.gethostname(), "pid": os.getpid(), "expires": now + self._ttl,
                "token": secrets.token_hex(4)}
        body = json.dumps(mine).encode()
        root = self._tier.root
        self._tier.retry("creating the remote root", lambda: self._tier.fs.makedirs(root, exist_ok=True))
        self._tier.retry("writing the lease", lambda: self._tier.stored.write_record(self._path, body))
        self._tier.fs.invalidate_cache(self._path)
        back = self._read()
        if back is None or back.get("token") != mine["token"]:  # another writer took it in the same moment
            raise self._refuse(back or mine)
        if self._renewed_at is None:
            log.info("took the lease on %s for run %s", self._tier.url, self.run_id)
        self._renewed_at, self._token = now, mine["token"]

    @property
    def held(self) -> bool:
        """This run took the lease (and has not lost or released it since)."""
        return self._renewed_at is not None

    def release(self) -> None:
        """Give the lease back if this run holds it (best effort: it expires anyway)."""
        if self._renewed_at is None:
            return
        try:
            holder = self._read()
            if holder is not None and holder.get("token") == self._token:  # not if another copy took it over
                self._tier.fs.rm_file(self._path)
        except Exception as e:  # it expires by itself
            log.warning("could not give back the lease on %s: %s", self._tier.url, e)
        self._renewed_at = None
