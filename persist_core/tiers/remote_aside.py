"""Setting a remote checkpoint aside (a branch's newer checkpoints, kept under their abandoned names), in two halves.

An object store has no rename: setting a checkpoint aside copies every object under its abandoned name, which takes
as long as the checkpoint is large. So the move is split, each half safe to be killed in:

1. :func:`hide`, at the moment the local tier sets its copy aside (the training thread, once per branch): the
   manifest is copied under the abandoned name as :data:`~persist_core.layout.ASIDE_MANIFEST_NAME`, then the live
   manifest is removed. A prefix without a manifest is no checkpoint, so from here on no reader — a fresh machine
   included — takes the step for live; what the killed run's local restart resumes, a fresh machine resumes too.
2. :func:`set_aside` (the sync thread, before the next upload; or the next engine's, :func:`hidden` at start-up):
   the shards are copied, the manifest goes in last under its own name, then the live prefix and the held manifest
   are removed. It also sets aside, whole, a step whose first half never ran (an outage at the branch).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from persist_core.errors import CorruptCheckpointError
from persist_core.layout import (ASIDE_MANIFEST_NAME, MANIFEST_NAME, abandoned_dirname, checkpoint_dirname,
                                 parse_abandoned_dirname)
from persist_core.tiers.codec import EncryptionKeyError
from persist_core.tiers.tier import CheckpointInfo

T = TypeVar("T")


class RemoteTier(Protocol):
    """What setting aside needs of :class:`persist_core.tiers.remote.RemoteTier` (which calls these functions)."""

    url: str
    root: str
    fs: Any
    stored: Any  # its codec side (tiers/codec/stored.py): reads an envelope, set aside or live

    def path_of(self, name: str) -> str: ...

    def retry(self, what: str, fn: Callable[[], T]) -> T: ...

    def copy_object(self, path: str, target: str) -> None: ...

    def remove(self, step: int) -> None: ...

    def remove_prefix(self, prefix: str, *, manifest: bool = True) -> None: ...

log = logging.getLogger(__name__)


def hide(tier: RemoteTier, step: int, at: int) -> None:
    """The first half: ``step`` leaves the live branch (its manifest held under its abandoned name). One attempt per
    request, no retries: the caller falls back to the second half alone when the remote does not answer."""
    src = tier.path_of(checkpoint_dirname(step))
    dst = tier.path_of(abandoned_dirname(step, at, secrets.token_hex(3)))
    tier.copy_object(f"{src}/{MANIFEST_NAME}", f"{dst}/{ASIDE_MANIFEST_NAME}")
    tier.fs.rm_file(f"{src}/{MANIFEST_NAME}")
    tier.fs.invalidate_cache(src)
    log.info("[step=%d] left the live branch on %s (its objects follow before the next upload): the run resumed "
             "from step %d", step, tier.url, at)


def hidden(tier: RemoteTier) -> list[tuple[int, int]]:
    """``(step, at)`` of every checkpoint whose first half ran and whose second did not, oldest first."""
    tier.fs.invalidate_cache(tier.root)
    found = set()
    for path in tier.retry("listing", lambda: tier.fs.find(tier.root)):
        parts = path.rstrip("/").split("/")
        if len(parts) >= 2 and parts[-1] == ASIDE_MANIFEST_NAME:
            parsed = parse_abandoned_dirname(parts[-2])
            if parsed is not None:
                found.add(parsed)
    return sorted(found)


def set_aside(tier: RemoteTier, step: int, at: int) -> None:
    """Copy checkpoint ``step`` under its abandoned name (manifest last), then remove it from the live branch; after
    :func:`hide`, into the name it chose, with the manifest it holds."""
    src = tier.path_of(checkpoint_dirname(step))
    held = _held(tier, step, at)
    dst = held or tier.path_of(abandoned_dirname(step, at, secrets.token_hex(3)))
    tier.fs.invalidate_cache(src)
    files = [p for p in tier.retry(f"listing {src}", lambda: tier.fs.find(src))
             if not (held and p.rstrip("/").endswith(f"/{MANIFEST_NAME}"))]  # a live manifest after hide: a new one
    files.sort(key=lambda p: p.endswith(MANIFEST_NAME))
    for path in files:
        target = dst + path[len(src.rstrip("/")):] if path.startswith(src) else f"{dst}/{path.rsplit('/', 1)[-1]}"
        tier.retry(f"copying {path}", lambda path=path, target=target: tier.copy_object(path, target))
    if held:
        pending, manifest = f"{dst}/{ASIDE_MANIFEST_NAME}", f"{dst}/{MANIFEST_NAME}"
        tier.retry(f"copying {pending}", lambda: tier.copy_object(pending, manifest))
        tier.retry(f"removing {pending}", lambda: tier.fs.rm_file(pending))
        tier.remove_prefix(src, manifest=False)
    else:
        tier.remove(step)
    log.info("[step=%d] set aside on %s: the run resumed from step %d and saved past it", step, tier.url, at)


def _held(tier: RemoteTier, step: int, at: int) -> str | None:
    """The abandoned prefix :func:`hide` chose for ``(step, at)``, or ``None``."""
    tier.fs.invalidate_cache(tier.root)
    for path in tier.retry("listing", lambda: tier.fs.find(tier.root)):
        parts = path.rstrip("/").split("/")
        if len(parts) >= 2 and parts[-1] == ASIDE_MANIFEST_NAME and parse_abandoned_dirname(parts[-2]) == (step, at):
            return path.rstrip("/").rsplit("/", 1)[0]
    return None


def abandoned(tier: RemoteTier) -> list[CheckpointInfo]:
    """Checkpoints set aside when a run resumed from an older one, oldest first."""
    tier.fs.invalidate_cache(tier.root)
    found = []
    for path in tier.retry("listing", lambda: tier.fs.find(tier.root)):
        parts = path.rstrip("/").split("/")
        parsed = parse_abandoned_dirname(parts[-2]) if len(parts) >= 2 and parts[-1] == MANIFEST_NAME else None
        if parsed is None:
            continue
        try:
            raw = tier.retry(f"reading {path}", lambda path=path: tier.fs.cat_file(path))
            m = tier.stored.manifest(raw, where=path, step=parsed[0], live=False)
        except EncryptionKeyError:  # no key: its step, size and "encrypted"
            found.append(tier.stored.sealed_info(parsed[0], f"{tier.url}/{parts[-2]}"))
            continue
        except CorruptCheckpointError as e:
            log.warning("skipping %s: %s", path, e)
            continue
        found.append(CheckpointInfo(step=parsed[0], time=m.time, nbytes=m.nbytes,
                                    path=f"{tier.url}/{parts[-2]}", tier="remote"))
    return sorted(found, key=lambda c: (c.step, c.path))


def remove_abandoned(tier: RemoteTier, path: str) -> None:
    """Delete the set-aside checkpoint at ``path`` (one that :func:`abandoned` listed; ``persist gc --abandoned``):
    the manifest first, then its shards.

    Raises:
        ValueError: ``path`` is not a set-aside checkpoint of ``tier``.
    """
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if path.rstrip("/") != f"{tier.url}/{name}" or parse_abandoned_dirname(name) is None:
        raise ValueError(f"{path} is not a set-aside checkpoint of {tier.url} (abandoned-step-N-at-M-...)")
    tier.remove_prefix(tier.path_of(name))
