"""Where a checkpoint comes from (issue 55): the lineage every manifest a save writes carries (format version 7).

Who calls what: the engine makes one :class:`Lineage` (the versions read and the git commit looked up once, when it
is made, the commit on a thread of its own: nothing of it on a save's path), tells it
what it loaded or resumed from (:meth:`Lineage.resumed`), and the saver records :meth:`Lineage.record` in each
manifest. Nothing here fails a save: what cannot be found out is ``None``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from persist_core.errors import ConfigError
from persist_core.run_ids import run_id_of

log = logging.getLogger(__name__)

#: the packages whose versions a manifest records when this process imported them (torch and torch-persist always)
FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers")


def package_versions() -> dict[str, str]:
    """torch's and torch-persist's versions, and each of :data:`FRAMEWORKS` already imported (``sys.modules``)."""
    import torch

    out = {"torch": str(torch.__version__), "torch-persist": _own_version()}
    for name in FRAMEWORKS:
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module is not None else None
        if version is not None:
            out[name] = str(version)
    return out


def _own_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch-persist")
    except PackageNotFoundError:
        return "unknown"


def git_commit() -> str | None:
    """``git rev-parse HEAD`` in the current directory (the training code's checkout), or ``None`` (no checkout, no
    git, anything else): best effort, never raising."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and len(commit) in (40, 64) else None


class Lineage:
    """One engine's lineage: its run, what it resumed from, and what it runs on.

    Args:
        run_id: this run's id (``None``: none kept).
        world_size: how many ranks save.
    """

    def __init__(self, *, run_id: str | None, world_size: int) -> None:
        self._run_id = run_id
        self._world_size = world_size
        self._lock = threading.Lock()
        self._versions = package_versions()  # once: never on a save's path
        self._commit: list[str | None] = []  # looked up once, in the background (a subprocess: never on a save's path)
        threading.Thread(target=lambda: self._commit.append(git_commit()), name="persist-lineage", daemon=True).start()
        self._resumed: dict[str, Any] | None = None
        self._branch: int | None = None
        if run_id is not None:
            _LIVE[run_id] = self  # what this process's memory snapshots of the run record (snapshot_lineage)

    @classmethod
    def of(cls, root: Path, given: str | None, *, world_size: int) -> Lineage:
        """The lineage of an engine on ``root``: its run id the one given, the launcher's, or the one kept in ``root``
        (``None`` when there is none: never made here, nor an error)."""
        try:
            run_id = run_id_of(root, given, create=False)
        except ConfigError:
            run_id = None
        return cls(run_id=run_id, world_size=world_size)

    def resumed(self, step: int, *, run: str | None, branch: bool) -> None:
        """This run continues from committed ``step`` of ``run``; ``branch``: newer checkpoints were committed (the run
        went back to ``step``)."""
        with self._lock:
            self._resumed = {"step": step, "run": run}
            self._branch = step if branch else None

    def record(self) -> dict[str, Any]:
        """The lineage a manifest written now records."""
        with self._lock:  # the commit: None until its lookup ended (a save right after the engine was made)
            return {"run": self._run_id, "resumed_from": None if self._resumed is None else dict(self._resumed),
                    "branch_from": self._branch, "world_size": self._world_size, "versions": dict(self._versions),
                    "git_commit": self._commit[0] if self._commit else None}


#: the newest engine's lineage of each run in this process (weakly held: gone with its engine)
_LIVE: weakref.WeakValueDictionary[str, Lineage] = weakref.WeakValueDictionary()


def snapshot_lineage(run_id: str) -> dict[str, Any] | None:
    """The lineage a memory snapshot of run ``run_id`` records (the memory tier builds its manifests apart from the
    engine's saves): the newest live engine's of that run in this process, or ``None``."""
    lineage = _LIVE.get(run_id)
    return None if lineage is None else lineage.record()


# ---------------------------------------------------------------- a run as its tree (``persist log``)


@dataclass
class Segment:
    """One stretch of a run: the checkpoints whose lineage says the same run resumed from the same step (a fresh
    start: from none), in step order; ``set_aside``: those of them a later resume that went back set aside
    (``abandoned``); ``children``: the stretches that resumed from one of its steps."""

    run: str | None
    resumed_from: dict[str, Any] | None
    branch_from: int | None
    steps: list[int] = field(default_factory=list)
    set_aside: list[int] = field(default_factory=list)
    children: list[Segment] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "resumed_from": self.resumed_from, "branch_from": self.branch_from,
                "steps": self.steps, "set_aside": self.set_aside, "children": [c.to_json() for c in self.children]}


#: the key of checkpoints without lineage (format version before 7): one segment of their own
_UNKNOWN = ("?",)


def run_tree(checkpoints: Iterable[tuple[int, float, dict[str, Any] | None, bool]]) -> list[Segment]:
    """A run's checkpoints ``(step, time saved, lineage, set aside)`` as the tree of its resumes and branches: the
    roots (a fresh start, checkpoints without lineage, a resume from a step no longer here), each with the segments
    that resumed from one of its checkpoints below it, oldest first. Pure."""
    segments: dict[tuple[Any, ...], Segment] = {}
    for step, when, lin, aside in sorted(checkpoints, key=lambda c: (c[0], c[1])):
        if lin is None:
            key = _UNKNOWN
            seg = segments.get(key) or Segment(run=None, resumed_from={"unknown": True}, branch_from=None)
        else:
            origin = lin.get("resumed_from")
            key = (lin.get("run"), None if origin is None else (origin.get("step"), origin.get("run")),
                   lin.get("branch_from"))
            seg = segments.get(key) or Segment(run=lin.get("run"), resumed_from=origin,
                                               branch_from=lin.get("branch_from"))
        segments[key] = seg
        seg.steps.append(step)
        seg.times.append(when)
        if aside:
            seg.set_aside.append(step)
    roots: list[Segment] = []
    for key, seg in sorted(segments.items(), key=lambda kv: min(kv[1].times)):
        parent = None if key == _UNKNOWN or seg.resumed_from is None else _parent(seg, segments.values())
        (roots if parent is None else parent.children).append(seg)
    return roots


def _parent(seg: Segment, segments: Iterable[Segment]) -> Segment | None:
    """The segment holding the checkpoint ``seg`` resumed from (of the run it names, when it names one): the newest
    of that step saved before ``seg``'s first; else (the resumed run saved that step again) the one before it."""
    assert seg.resumed_from is not None
    step, run = seg.resumed_from.get("step"), seg.resumed_from.get("run")
    if not isinstance(step, int):
        return None
    first = min(seg.times)
    best, best_key = None, (-1, 0.0)
    for other in segments:
        if other is seg or not (run is None or other.run in (run, None)):
            continue
        for s, t in zip(other.steps, other.times):
            if s <= step and t <= first and (s, t) > best_key:
                best, best_key = other, (s, t)
    return best


def tree_lines(roots: list[Segment]) -> list[str]:
    """The tree as text, one line per segment, children indented under their parent."""
    lines: list[str] = []

    def walk(seg: Segment, lead: str, branch: str) -> None:
        lines.append(f"{lead}{branch}{_describe(seg)}")
        below = lead + ("   " if branch == "└─ " else "│  " if branch else "")
        for i, child in enumerate(seg.children):
            walk(child, below, "└─ " if i == len(seg.children) - 1 else "├─ ")

    for root in roots:
        walk(root, "", "")
    return lines


def _describe(seg: Segment) -> str:
    steps = seg.steps
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]} ({len(steps)} checkpoints)"
    if seg.resumed_from is None:
        origin = "fresh start"
    elif seg.resumed_from.get("unknown"):
        origin = "no lineage recorded (format version before 7)"
    else:
        origin = f"resumed from step {seg.resumed_from.get('step')}"
        if seg.resumed_from.get("run") not in (None, seg.run):
            origin += f" of run {seg.resumed_from.get('run')}"
    if seg.branch_from is not None:
        origin += f", a branch (went back to step {seg.branch_from})"
    aside = f"; set aside: {', '.join(map(str, seg.set_aside))}" if seg.set_aside else ""
    run = f" [run {seg.run}]" if seg.run is not None else ""
    return f"{span}: {origin}{run}{aside}"
