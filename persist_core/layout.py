"""Every file and directory name torch-persist writes. Nothing else formats or parses names.

A local tier looks like::

    local_dir/
        step-000000000100/                  a committed checkpoint (it holds a manifest)
            manifest.json                   written last
            rank-00000.safetensors          one shard file per rank (rank-00000.ckpt: torch.load reads it too)
        .tmp-step-000000000200-pid4242-1a2b3c/        being written, downloaded or deleted
        .tmp-step-000000000200-pid4242-1a2b3c.owner   its owner's mark: locked while the owner lives
        abandoned-step-000000000300-at-000000000200-9f8e7d/   set aside: a resume from step 200 branched
        abandoned-step-000000000300-at-start-4c5d6e/          set aside: a run started over (start_over=True)
        .lock-rank-00000                    the writer lock of rank 0 (who holds it: host, pid, start)
        .unsynced.json                      steps committed here and not yet uploaded (for ``persist gc``)
        .run-id                             the run id a restart on this directory keeps (remote lease)
        .trainer/checkpoint-100/            a checkpoint written out as the HF Trainer resumes from it
        weights-only/                       checkpoints of the other kind: weights only (Lightning's
            step-000000000100/                  save_weights_only), a tier of its own laid out as above

A checkpoint has a kind, ``full`` (resumable) or ``weights-only``, and ``(step, kind)`` is its key:
the full ones live in ``local_dir`` (and ``remote_url``), the weights-only ones in
``local_dir/weights-only`` (and ``remote_url/weights-only``), each kind with its own retention.

A remote holds ``.lease.json`` beside its checkpoints: the run writing there, until when.

A temporary directory whose ``.owner`` file nobody holds locked (or that has none) is dead: any
process may remove it. See :mod:`persist_core.ownership`.

A name is ours only if it round-trips: its parser's result, formatted again, gives back exactly that
name (ASCII digits, no trailing newline, no extra leading zero). Anything else under ``local_dir`` is not
a checkpoint, a temporary, a lock or a shard, and never stops a load. Steps run from 0 to
:data:`MAX_STEP`; a step is written with 12 digits at least, more past 10**12 - 1.
"""

from __future__ import annotations

import re

from persist_core.errors import ConfigError

MANIFEST_NAME = "manifest.json"
#: on the remote, in a set-aside checkpoint's prefix while its move is under way (tiers.remote_aside): the manifest
#: taken off the live branch, not yet this prefix's own (no reader takes it for a checkpoint)
ASIDE_MANIFEST_NAME = "manifest.aside.json"
#: on the remote, in a checkpoint's prefix, written before its manifest: the checksum the store reported for each
#: shard object at upload (tiers.store_checksums; S3 only)
STORE_CHECKSUMS_NAME = "store-checksums.json"

MAX_STEP = 2**63 - 1
"""The largest step the layout supports: the largest a signed 64-bit step counter holds (19 digits), so
that every name (``abandoned-step-N-at-M-...``, ``.tmp-step-N-pid...owner``) stays far below a file name's
255 bytes. A larger step is a :class:`ConfigError` when its name is made (at ``save()``)."""

_STEP_DIGITS = 12  # at least; a step past 10**12 - 1 is written with all its digits
_STEP = rf"([0-9]{{{_STEP_DIGITS},{len(str(MAX_STEP))}}})"  # ASCII digits only; bounded before int()
_INDEX = r"([0-9]{5,10})"  # a rank: 5 digits at least
_CHECKPOINT_RE = re.compile(r"step-" + _STEP)
_TMP_RE = re.compile(rf"\.tmp-step-{_STEP}-pid([0-9]{{1,10}})-([0-9a-f]{{1,32}})")
_ABANDONED_RE = re.compile(rf"abandoned-step-{_STEP}-at-({_STEP[1:-1]}|start)-([0-9a-f]{{1,32}})")

#: the branch point of a run that started over (``start_over=True``): every committed checkpoint is set aside
START = -1
_LOCK_RE = re.compile(r"\.lock-rank-" + _INDEX)

OWNER_SUFFIX = ".owner"
LEASE_NAME = ".lease.json"  # on the remote: which run writes there, until when
RUN_ID_NAME = ".run-id"  # in local_dir: the run id a restart on this directory keeps
UNSYNCED_NAME = ".unsynced.json"
HISTORY_NAME = ".history.jsonl"  # in local_dir: one JSON line per save committed or uploaded (persist stats)
NODE_PROBE_PREFIX = ".node-probe-"  # in local_dir, for a moment at the first save: which ranks share it


FULL = "full"
WEIGHTS_ONLY = "weights-only"
KINDS = (FULL, WEIGHTS_ONLY)


def is_url(location: str) -> bool:
    """Whether ``location`` names remote storage (an fsspec URL); ``file://`` and plain paths are local."""
    return "://" in location and not location.startswith("file://")


def kind_subdir(kind: str) -> str:
    """The sub-directory (and remote sub-prefix) of a kind's checkpoints: ``""`` for full ones."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")
    return "" if kind == FULL else WEIGHTS_ONLY


TRAINER_DIRNAME = ".trainer"  # in local_dir: checkpoints written out in the Hugging Face Trainer's own layout


def trainer_checkpoint_dirname(step: int) -> str:
    """The Trainer's name for its checkpoint of ``step`` (``checkpoint-500``), under ``TRAINER_DIRNAME``."""
    return f"checkpoint-{step}"


def check_step(step: int) -> int:
    """``step`` when the layout can name it (0 to :data:`MAX_STEP`).

    Raises:
        ConfigError: ``step`` is negative or past :data:`MAX_STEP` (the message names it and the range).
    """
    if not 0 <= step <= MAX_STEP:
        raise ConfigError(f"step={step} is outside the steps torch-persist's layout supports "
                          f"(0 to MAX_STEP={MAX_STEP}, 2**63 - 1): pass the training step, a counter of optimizer steps")
    return step


def _digits(step: int) -> str:
    return f"{check_step(step):0{_STEP_DIGITS}d}"


def _fullmatch(pattern: re.Pattern[str], name: object) -> re.Match[str] | None:
    return pattern.fullmatch(name) if isinstance(name, str) else None


def _step(digits: str) -> int | None:
    step = int(digits)
    return step if step <= MAX_STEP else None


def checkpoint_dirname(step: int) -> str:
    """Name of the committed checkpoint directory for ``step``.

    Raises:
        ConfigError: ``step`` is negative or past :data:`MAX_STEP`.
    """
    return f"step-{_digits(step)}"


def parse_checkpoint_dirname(name: str) -> int | None:
    """The step of a committed checkpoint directory name, or ``None`` for any other name (one that
    :func:`checkpoint_dirname` does not give back exactly)."""
    m = _fullmatch(_CHECKPOINT_RE, name)
    step = None if m is None else _step(m.group(1))
    return step if step is not None and checkpoint_dirname(step) == name else None


def tmp_dirname(step: int, pid: int, token: str) -> str:
    """Name of the temporary directory a checkpoint is written into before its rename."""
    return f".tmp-{checkpoint_dirname(step)}-pid{pid}-{token}"


def parse_tmp_dirname(name: str) -> tuple[int, int] | None:
    """``(step, pid)`` of a temporary directory name, or ``None`` for any other name (one that
    :func:`tmp_dirname` does not give back exactly)."""
    m = _fullmatch(_TMP_RE, name)
    step = None if m is None else _step(m.group(1))
    if step is None or tmp_dirname(step, int(m.group(2)), m.group(3)) != name:
        return None
    return step, int(m.group(2))


def shard_filename(rank: int, *, torch_zip: bool = False) -> str:
    """Name of the shard file that ``rank`` writes: ``.safetensors``, or ``.ckpt`` for a shard that
    ``torch.load`` reads too (:mod:`persist_core.format.torch_zip`; torch reads a ``.safetensors``
    name as safetensors)."""
    return f"rank-{rank:05d}.{'ckpt' if torch_zip else 'safetensors'}"


_SHARD_RE = re.compile(rf"rank-{_INDEX}\.(safetensors|ckpt)")


def parse_shard_filename(name: str) -> int | None:
    """The rank of a shard file name, or ``None`` for any other name (one that :func:`shard_filename`
    does not give back exactly)."""
    m = _fullmatch(_SHARD_RE, name)
    if m is None or shard_filename(int(m.group(1)), torch_zip=m.group(2) == "ckpt") != name:
        return None
    return int(m.group(1))


def owner_filename(tmp_name: str) -> str:
    """Name of the owner mark of the temporary directory ``tmp_name`` (next to it)."""
    return tmp_name + OWNER_SUFFIX


def lock_filename(rank: int) -> str:
    """Name of the writer lock file that ``rank`` holds in ``local_dir``."""
    return f".lock-rank-{rank:05d}"


def parse_lock_filename(name: str) -> int | None:
    """The rank of a writer lock file name, or ``None`` for any other name (one that
    :func:`lock_filename` does not give back exactly)."""
    m = _fullmatch(_LOCK_RE, name)
    return int(m.group(1)) if m is not None and lock_filename(int(m.group(1))) == name else None


def abandoned_dirname(step: int, at: int, token: str) -> str:
    """Name a checkpoint of an abandoned branch is set aside under: ``step``, set aside when a run
    resumed from ``at`` and saved past it (``at-start`` for :data:`START`: a run that started over)."""
    point = "start" if at == START else _digits(at)
    return f"abandoned-{checkpoint_dirname(step)}-at-{point}-{token}"


def parse_abandoned_dirname(name: str) -> tuple[int, int] | None:
    """``(step, at)`` of a set-aside checkpoint's name, or ``None`` for any other name (one that
    :func:`abandoned_dirname` does not give back exactly)."""
    m = _fullmatch(_ABANDONED_RE, name)
    step, at = (None, None) if m is None else (
        _step(m.group(1)), START if m.group(2) == "start" else _step(m.group(2)))
    if step is None or at is None or abandoned_dirname(step, at, m.group(3)) != name:
        return None
    return step, at


def node_probe_filename(token: str, rank: int) -> str:
    """The file rank ``rank`` writes in ``local_dir`` so the ranks find out which of them share it."""
    return f"{NODE_PROBE_PREFIX}{token}-rank-{rank:05d}"


# The memory tier (issue 42): snapshots in host shared memory that outlives the process::
#
#     memory_dir/                            /dev/shm/torch-persist-<uid> by default (every directory 0700, file 0600)
#         <run-id>/rank-00000/               one rank's snapshots
#             life-1a2b3c4d/                 one engine's (a process's) slots; flock-ed while it lives
#                 slot-0  slot-1 ...         mapped staging buffers: a shard file image each
#                 slot-0.json ...            a slot's commit record (its manifest), written after its bytes
#                 .local-dir                 the local_dir of the engine that mapped them (its path)
#                 .identity                  whose they are: local_dir's .local-dir-id (partner copies: the layout)
#                 .closed                    its engine closed: no live process holds it, whoever holds its flock
#         <run-id>/partner-of-rank-00002/    the copy of rank 2's newest snapshot this node holds (its partner, the
#             life-5e6f7a8b/                 same local rank on the previous node; memory/partner.py): slots and
#                 slot-0  slot-0.json ...    records as above, a record written once every byte verified
#         <run-id>/rank-00002/pulled-<token> a partner's copy pulled back on restore (removed once read)
DEFAULT_MEMORY_DIR = "/dev/shm/torch-persist-<uid>"  # for messages; memory.files.default_base() makes it
_LIFE_RE = re.compile(r"life-([0-9a-f]{8,32})")
_SLOT_RE = re.compile(r"slot-([0-9]{1,6})")
SLOT_RECORD_SUFFIX = ".json"
LOCAL_DIR_NAME = ".local-dir"  # in a life's directory: the local_dir of the engine that mapped it
IDENTITY_NAME = ".identity"  # in a life's directory: whose snapshots they are (below)
CLOSED_NAME = ".closed"  # in a life's directory: its engine closed (a child it forked may still hold its flock)
LOCAL_DIR_ID_NAME = ".local-dir-id"  # in local_dir: the identity of this incarnation of it (made once, random)


def memory_base_dirname(uid: int) -> str:
    """The default memory tier base's name (in ``/dev/shm``): one per user."""
    return f"torch-persist-{uid}"


def local_dir_identity_value(token: str) -> str:
    """What ``.local-dir-id`` holds, and a life of that ``local_dir`` records."""
    return f"local-dir-{token}"


def layout_identity(groups: tuple[tuple[int, ...], ...]) -> str:
    """What a life of partner copies records: the run's node layout (each node's ranks), not a node's local_dir."""
    return "nodes-" + "-".join(".".join(str(r) for r in g) for g in groups)


def memory_rank_dirname(rank: int) -> str:
    """The directory of one rank's snapshots under ``memory_dir/<run-id>``."""
    return f"rank-{rank:05d}"


_RANK_RE = re.compile(r"rank-" + _INDEX)


def parse_memory_rank_dirname(name: str) -> int | None:
    """The rank whose snapshots the directory ``name`` under ``memory_dir/<run-id>`` holds, or ``None``."""
    m = _fullmatch(_RANK_RE, name)
    return None if m is None else int(m.group(1))


_PARTNER_RE = re.compile(r"partner-of-rank-" + _INDEX)


def partner_dirname(rank: int) -> str:
    """The directory of the partner copies of rank ``rank``'s snapshots (on the node that holds them)."""
    return f"partner-of-rank-{rank:05d}"


def parse_partner_dirname(name: str) -> int | None:
    """The rank whose snapshots the partner directory ``name`` holds copies of, or ``None``."""
    m = _fullmatch(_PARTNER_RE, name)
    return None if m is None else int(m.group(1))


def pulled_filename(token: str) -> str:
    """A partner's copy pulled back into this rank's directory on restore (removed once read)."""
    return f"pulled-{token}"


def life_dirname(token: str) -> str:
    """The directory of one engine's slots (a lifetime of the process that mapped them)."""
    name = f"life-{token}"
    if _fullmatch(_LIFE_RE, name) is None:
        raise ValueError(f"token={token!r} is not 8-32 hex digits")
    return name


def is_life_dirname(name: str) -> bool:
    return _fullmatch(_LIFE_RE, name) is not None


def slot_filename(index: int) -> str:
    """A slot's mapped file; its commit record is this name + :data:`SLOT_RECORD_SUFFIX`."""
    return f"slot-{index}"


def parse_slot_record_name(name: str) -> str | None:
    """The slot file a commit record ``slot-N.json`` belongs to, or ``None``."""
    if not isinstance(name, str) or not name.endswith(SLOT_RECORD_SUFFIX):
        return None
    slot = name[: -len(SLOT_RECORD_SUFFIX)]
    return slot if _fullmatch(_SLOT_RE, slot) is not None else None
