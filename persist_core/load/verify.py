"""Resume verification (issue 55): the state a run resumes with against the checkpoint it loaded.

The baseline is what was saved: each plain tensor's digest (``TensorRecord.digest``, recorded on the writer thread,
format version 7) and each scalar value of the manifest's tree. :func:`compare` takes the live state apart as a save
would (:func:`~persist_core.format.tree.flatten`), digests its tensors (:func:`~persist_core.save.digests.tensor_digest`,
a device tensor in pieces) and names every key path, as ``persist inspect`` writes them, whose value differs, that
the checkpoint has and the state lacks (missing) or the other way round (new). What cannot be compared is counted,
never reported as a mismatch: sharded (``DTensor``) leaves and per-rank values of a checkpoint written by another
world size (resharded), pickled leaves (no digest), older checkpoints (no digests). Pure: no I/O, no logging; the
engine (:meth:`CheckpointEngine.verify_resume`) warns, raises or logs.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from persist_core.errors import ResumeMismatchError, ResumeMismatchWarning
from persist_core.format.manifest import Manifest
from persist_core.format.records import DIGESTS_VERSION
from persist_core.format.tree import flatten, is_dtensor
from persist_core.format.digest import tensor_digest

#: an absent leaf, and what :func:`_leaves` maps a path to
_ABSENT = object()


log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Verdict:
    """What :func:`compare` found: ``differ`` (key path -> "saved X, now Y", "missing", "new" or "differs"), what was
    equal, and what could not be compared (reason -> key paths)."""

    step: int
    differ: dict[str, str] = field(default_factory=dict)
    tensors: int = 0
    values: int = 0
    not_verified: dict[str, list[str]] = field(default_factory=dict)
    saved_world_size: int = 1
    per_rank_resharded: list[str] = field(default_factory=list)

    def not_restored(self, *, rank: int, world_size: int) -> str | None:
        """What per-rank state (``PerRank`` leaves: RNG states, data positions) a resume on ``world_size`` ranks of
        a checkpoint ``saved_world_size`` ranks wrote could not restore, as this ``rank`` says it; ``None``: all."""
        paths = self.per_rank_resharded
        if not paths:
            return None
        head = (f"resumed on {world_size} rank(s) from a checkpoint {self.saved_world_size} rank(s) wrote: per-rank "
                f"state not restored as saved ({', '.join(paths[:10])}{' ...' if len(paths) > 10 else ''})")
        if rank >= self.saved_world_size:
            return f"{head}: this rank got None (the checkpoint holds no value of rank {rank})"
        if rank == 0 and world_size < self.saved_world_size:
            return f"{head}: the values of ranks {_span(world_size, self.saved_world_size)} are restored on no rank"
        return None

    def message(self) -> str:
        """The differences, grouped by top-level key (``optim: lr of 2 of 6 param groups``), each named."""
        groups: dict[str, list[str]] = {}
        for path in self.differ:
            groups.setdefault(path.split("/", 1)[0], []).append(path)
        lines = [f"the state resumed from step {self.step} differs from what was saved in {len(self.differ)} key(s):"]
        for top, paths in groups.items():
            lines.append(f"  {top}: {_summary(paths)}")
            lines.extend(f"    {p}: {self.differ[p]}" for p in paths[:20])
            if len(paths) > 20:
                lines.append(f"    ... and {len(paths) - 20} more")
        lines.append("(pass verify_resume_ignore=[glob, ...] for intended changes, or verify_resume='off')")
        return "\n".join(lines)


def _summary(paths: list[str]) -> str:
    """``lr of 2 param groups`` where the paths differ in a list index only, else how many keys."""
    leaves = {p.rsplit("/", 1)[-1] for p in paths}
    if len(leaves) == 1 and len(paths) > 1:
        return f"{leaves.pop()} of {len(paths)} entries"
    return ", ".join(p.split("/", 1)[-1] for p in paths[:5]) + (f" (+{len(paths) - 5})" if len(paths) > 5 else "")


def compare(manifest: Manifest, state: Any, *, world_size: int, ignore: Sequence[str] = (),
            new_ok: Sequence[str] = (), partial: bool = False) -> Verdict | None:
    """The live ``state`` against ``manifest`` (the checkpoint loaded); ``None`` when the manifest has no digests
    (format version before 7, or a memory snapshot's). ``world_size``: this run's (per-rank values of a checkpoint
    another world size wrote are not compared). ``new_ok``: globs of key paths the state may have that the
    checkpoint lacks (keys torch adds to ``param_groups`` on load); ``partial``: compare only the top-level keys
    ``state`` has (an adapter's live state holds what its framework restores, not the whole checkpoint)."""
    if manifest.lineage is None and not any(t.digest is not None for t in manifest.tensors):
        return None
    saved = _leaves(manifest.tree)
    flat = flatten(state)
    live = _leaves(flat.tree)
    verdict = Verdict(step=manifest.step)
    saved_ws = (manifest.lineage or {}).get("world_size") or manifest.world_size  # a memory snapshot's: the run's
    resharded = saved_ws != world_size
    object.__setattr__(verdict, "saved_world_size", saved_ws)

    tops = {p.split("/", 1)[0] for p in live} if partial else None

    def skipped(path: str) -> bool:
        if tops is not None and path.split("/", 1)[0] not in tops:
            return True
        return any(fnmatch.fnmatchcase(path, g) for g in ignore)

    def unverified(reason: str, path: str) -> None:
        verdict.not_verified.setdefault(reason, []).append(path)

    tensors = values = 0
    for path in [*saved, *(p for p in live if p not in saved)]:
        if skipped(path):
            continue
        old, new = saved.get(path, _ABSENT), live.get(path, _ABSENT)
        if new is _ABSENT:
            verdict.differ[path] = "missing (saved, not in the state now)"
            continue
        if old is _ABSENT:
            if any(fnmatch.fnmatchcase(path, g) for g in new_ok):
                continue
            verdict.differ[path] = "new (in the state now, not saved)"
            continue
        kind_old, kind_new = next(iter(old)), next(iter(new))
        if kind_old == "per_rank":  # the state holds the value a load returned, not the PerRank wrapper
            unverified("resharded" if resharded else "per-rank value", path)
            if resharded:
                verdict.per_rank_resharded.append(path)
        elif kind_old == "tensor" and kind_new == "tensor":
            rec, (_, t) = manifest.tensors[old["tensor"]], flat.tensors[new["tensor"]]
            if rec.sharded or is_dtensor(t):
                unverified("resharded", path)
            elif rec.digest is None:
                unverified("no digest", path)
            elif (rec.dtype, tuple(rec.shape)) != (_dtype_name(t), tuple(t.shape)):
                verdict.differ[path] = f"saved {rec.dtype}{list(rec.shape)}, now {_dtype_name(t)}{list(t.shape)}"
            elif tensor_digest(t) != rec.digest:
                verdict.differ[path] = "tensor values differ"
            else:
                tensors += 1
        elif kind_old == "value" and kind_new == "value":
            a, b = old["value"], new["value"]
            if _same(a, b):
                values += 1
            else:
                verdict.differ[path] = f"saved {a!r}, now {b!r}"
        elif kind_old == "object" and kind_new in ("object", "per_rank"):
            unverified("pickled", path)
        else:
            verdict.differ[path] = f"saved a {kind_old}, now a {kind_new}"
    return _counted(verdict, tensors, values)


def verify_resume(manifest: Manifest | None, state: Any, *, mode: str, ignore: Sequence[str], rank: int,
                  world_size: int, new_ok: Sequence[str] = (), partial: bool = False) -> list[str]:
    """:meth:`CheckpointEngine.verify_resume <persist_core.engine.CheckpointEngine.verify_resume>` against
    ``manifest`` (the checkpoint loaded; ``None``: nothing loaded), with the options ``mode`` (``verify_resume``) and
    ``ignore`` (``verify_resume_ignore`` and the adapter's): the differing key paths, warned or raised per ``mode``,
    or one INFO line when equal. Needs no engine: an adapter whose run saves nothing checks without taking
    ``local_dir``'s writer lock.

    Raises:
        ResumeMismatchError: ``mode="raise"`` and something differs.
    """
    if mode == "off":
        return []
    if manifest is None:
        log.info("[rank=%d] resume not verified: no checkpoint was loaded", rank)
        return []
    verdict = compare(manifest, state, world_size=world_size, ignore=ignore, new_ok=new_ok, partial=partial)
    prefix = f"[rank={rank}][step={manifest.step}]"
    if verdict is None:
        log.info("%s resume not verified (no digests: checkpoint format v%d)", prefix, manifest.version)
        return []
    for reason, paths in verdict.not_verified.items():
        log.info("%s %d key(s) not verified (%s): %s", prefix, len(paths), reason, ", ".join(paths[:10]))
    lost = verdict.not_restored(rank=rank, world_size=world_size)
    if lost is not None:
        log.warning("%s %s", prefix, lost)
    if not verdict.differ:
        log.info("%s resume verified: %d tensors and %d values equal step %d", prefix, verdict.tensors,
                 verdict.values, manifest.step)
        return []
    keys = list(verdict.differ)
    if mode == "raise":
        raise ResumeMismatchError(verdict.message(), keys)
    warnings.warn(verdict.message(), ResumeMismatchWarning, stacklevel=3)
    return keys


def _span(first: int, end: int) -> str:
    """Ranks ``first`` to ``end - 1``, as words."""
    return str(first) if end - first == 1 else f"{first}..{end - 1}"


def _counted(v: Verdict, tensors: int, values: int) -> Verdict:
    object.__setattr__(v, "tensors", tensors)
    object.__setattr__(v, "values", values)
    return v


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _dtype_name(t: Any) -> str:
    from persist_core.format.shard_file import dtype_name

    return dtype_name(t.dtype)


def _leaves(tree: Any) -> dict[str, dict[str, Any]]:
    """Key path (as ``persist inspect`` writes it) -> leaf node of an encoded tree (an empty container is a leaf)."""
    out: dict[str, dict[str, Any]] = {}
    stack: list[tuple[Any, str]] = [(tree, "")]
    while stack:
        node, path = stack.pop()
        if "dict" in node:
            if not node["dict"]:
                out[path or "<root>"] = {"value": "{}"}
            for k, v in reversed(node["dict"]):
                key = str(k.get("value", "?"))
                stack.append((v, f"{path}/{key}" if path else key))
        elif "list" in node or "tuple" in node:
            items = node.get("list", node.get("tuple", []))
            if not items:
                out[path or "<root>"] = {"value": "()" if "tuple" in node else "[]"}
            for i in reversed(range(len(items))):
                stack.append((items[i], f"{path}/{i}" if path else str(i)))
        else:
            out[path or "<root>"] = node
    return out


__all__ = ["DIGESTS_VERSION", "Verdict", "compare"]
