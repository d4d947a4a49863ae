"""The memory tier (issue 42): snapshots in host shared memory that outlive the process, and their copies on a
partner node. A flow beside ``save/``, ``load/`` and ``sync/``: it imports what lies below the flows (``staging/``,
``assembly/``, ``tiers/``, ``planning/``, ``format/``, the shared primitives) and no other flow; the save and
load flows know it by the protocols they state (:class:`~persist_core.save.saver.SnapshotSide`,
:class:`~persist_core.tiers.tier.HostReader` (the store's read side: the load flow reads memory as one more source),
:class:`~persist_core.load.agree.Partner`).

The parts, bottom up: :mod:`~persist_core.memory.files` (every directory and file this user's own, never through a
link), :mod:`~persist_core.memory.store` (:class:`MemoryTier`, the option; :class:`MemoryStore`, one rank's slots
and their records; the read side of the ``Tier`` protocol), :mod:`~persist_core.memory.slots` (the staging buffers
mapped from the slots), :mod:`~persist_core.memory.wire` (one snapshot image sent to another rank),
:mod:`~persist_core.memory.partner` (the partner copies and the copy steps), :mod:`~persist_core.memory.snapshots`
(the save side), :mod:`~persist_core.memory.read` (a snapshot, or a partner's copy pulled back, read into a state).

Restore order: a load reads a step from the first source that holds it and verifies, in
:data:`~persist_core.load.choose.RESTORE_ORDER`: this host's memory (a snapshot that outlived the process), the
partner's copy in another node's memory (pulled back over the wire), the local disk, the remote. With several ranks,
every rank first agrees on the newest step every rank can get (:func:`~persist_core.load.agree.agreed_load`).

Call order (the training thread unless said; every rank alike):

1. build: the store, its slots (:class:`~persist_core.memory.slots.SlotAllocator`), the staging pool of them, the
   partner copies (several nodes: :class:`PartnerCopies`, two threads), then :class:`Snapshots`, given each of them.
2. at each snapshot step (``maybe_snapshot``): :meth:`Snapshots.before` — with partner copies every rank agrees
   whether it is a copy step (:meth:`PartnerCopies.agree`, a collective call; its answer also says which kept slots go
   back) — then the save flow stages the state into a slot (the pool's allocator drops the slot's old record first).
3. :meth:`Snapshots.taken`: the slot holds the step's bytes; the snapshots' thread checksums it and writes its
   record (:meth:`MemoryStore.commit`), keeps the newest committed slot, and offers a copy step's snapshot to the
   partner copies (:meth:`PartnerCopies.offer`; one without a snapshot: :meth:`PartnerCopies.skip`).
4. before each optimizer update (``wait_snapshot``) and at each save: :meth:`Snapshots.wait`, the newest snapshot
   committed.
5. ``wait()``: :meth:`Snapshots.wait`, then :meth:`PartnerCopies.flush`.
6. a restore: the load flow reads the :class:`MemoryStore` (each slot a copy of its own) and, with several nodes,
   pulls a partner's copy back through :class:`~persist_core.memory.read.PartnerLink`.
7. ``close()``: the partner copies first (:meth:`PartnerCopies.close`, before the slots they read go), then the
   snapshots (:meth:`Snapshots.close`): a run that ended well removes its snapshots, a failed one keeps them.
"""

from persist_core.memory.partner import CopyStep, CopySteps, PartnerCopies, partners
from persist_core.memory.read import PartnerLink
from persist_core.memory.snapshots import Snapshots
from persist_core.memory.option import MemoryTier, check_memory, memory_tier
from persist_core.memory.store import MemoryStore, Snapshot

__all__ = ["CopyStep", "CopySteps", "MemoryStore", "MemoryTier", "PartnerCopies", "PartnerLink", "Snapshot",
           "Snapshots", "check_memory", "memory_tier", "partners"]
