"""Leaf digests on the writer thread (resume verification, issue 55): the xxh3-128 of each plain tensor's elements in
C order, from the staged bytes, recorded in the manifest (``TensorRecord.digest``).

Who calls what: the :class:`~persist_core.save.writer.Writer` calls :func:`with_digests` on its thread once the staged
bytes are complete and before an incremental save compacts them; nothing is added to the training thread.
:func:`tensor_digest` is the live side's (``load/verify.py``): the same digest of a live tensor, a CUDA one copied to
the host in pieces (never a second full copy of the state at once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Executor

from persist_core.format.digest import contiguous, staged_digest
from persist_core.format.manifest import Manifest
from persist_core.format.shard_file import parse_header
from persist_core.format.torch_zip import image_offset


def with_digests(base: Manifest, view: memoryview, *, pool: Executor | None = None,
                 turn: Callable[[], None] = lambda: None, known: dict[str, str] | None = None) -> Manifest:
    """``base`` with the digest of each plain tensor this rank staged in ``view`` (the shard as staged).

    ``known``: entries left out of the staging copy (incremental, unchanged) and the hash of each one's bytes, which
    is a record's digest where the record is that whole entry; ``turn``: waited for before each record (a guarded
    update has the cores)."""
    known = known or {}
    image = image_offset(bytes(view[:64]))
    header = bytes(view[image : image + 8 + int.from_bytes(view[image : image + 8], "little")])
    spans = {name: (image + b, image + e) for name, b, e in parse_header(header, file_size=len(view) - image)[1]}
    users: dict[str | None, int] = {}
    for r in base.tensors:
        if r is not None and r.chunks is None:
            users[r.entry] = users.get(r.entry, 0) + 1

    def digest(i: int) -> tuple[int, str | None]:
        r = base.tensors[i]
        turn()
        if r.entry in spans:
            return i, staged_digest(r, view, spans[r.entry][0])
        if r.entry in known and users[r.entry] == 1 and r.offset == 0 and contiguous(r):
            return i, known[r.entry]  # type: ignore[index]
        return i, None

    todo = [i for i, r in enumerate(base.tensors) if r is not None and r.chunks is None and r.step is None]
    found = dict(pool.map(digest, todo) if pool is not None else map(digest, todo))
    tensors = tuple(dataclasses.replace(r, digest=found[i]) if found.get(i) else r for i, r in enumerate(base.tensors))
    return dataclasses.replace(base, tensors=tensors)
