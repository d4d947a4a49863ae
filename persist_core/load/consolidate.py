"""Whole tensors out of a checkpoint, sharded or not, without holding the state: ``persist export --format
safetensors``. Each tensor is assembled from the chunks the ranks wrote (every block verified) and
written before the next is read, so memory stays about the largest tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from persist_core import _knobs
from persist_core.errors import ConfigError
from persist_core.format.shard_file import dtype_from_name, encode_header, itemsize, safetensors_dtype
from persist_core.format.tree import tensor_paths
from persist_core.assembly.assemble import iter_tensors
from persist_core.load.references import resolve, split_name
from persist_core.tiers import Tier


def export_safetensors(tier: Tier, step: int, target: Path, *, prefix: str | None = None
                       ) -> tuple[int, int, list[str]]:
    """Write checkpoint ``step`` of ``tier`` as one safetensors file, streaming tensor by tensor (each read
    verified; memory about the largest tensor). JSON scalars go in its metadata; pickled leaves are left
    out. Returns ``(tensors, bytes, names left out)``.

    Args:
        prefix: only the tensors under this key path (``state_dict`` for a Lightning checkpoint, ``models/0`` for
            PersistHook's first model), keyed by what follows it: the model's keys as ``load_state_dict`` takes them.
            ``None``: every tensor, keyed by its key path (``state_dict/net.0.weight``).

    Raises:
        ConfigError: a tensor of a dtype safetensors cannot name (export it with ``--format torch``); no tensor
            under ``prefix`` (the message names the top-level keys holding tensors).
        CorruptCheckpointError: a block does not verify (nothing is left at ``target``).
    """
    m = tier.read_manifest(step)
    names: set[str] = set()
    if m.depends_on():  # an incremental checkpoint: what it references is read from the checkpoints holding it
        m, names = resolve(m, tier.read_manifest, where=f"{tier}")
    paths = tensor_paths(m.tree)
    keys = _keys(paths, prefix)
    entries: dict[str, Any] = {}
    pos = 0
    for path, rec in zip(paths, m.tensors):
        if path not in keys:
            continue
        dtype = dtype_from_name(rec.dtype)
        name = safetensors_dtype(dtype)
        if name is None:
            raise ConfigError(f"state[{path!r}] is {rec.dtype}, which safetensors has no name for; export it with "
                              "--format torch")
        n = 1
        for d in rec.shape:
            n *= d
        size = n * itemsize(dtype)
        entries[keys[path]] = {"dtype": name, "shape": list(rec.shape), "data_offsets": [pos, pos + size]}
        pos += size
    values, skipped = {}, []

    def scalars(node: dict[str, Any], path: str) -> None:
        if "value" in node:
            values[path or "<root>"] = json.dumps(node["value"])
        elif "object" in node or "per_rank" in node:
            skipped.append(path or "<root>")
        for k, v in node.get("dict", ()):
            scalars(v, f"{path}/{k.get('value', '?')}" if path else str(k.get("value", "?")))
        for i, v in enumerate(node.get("list", node.get("tuple", ()))):
            scalars(v, f"{path}/{i}" if path else str(i))

    scalars(m.tree, "")
    if prefix is not None:  # the model's file: the rest of the state is left out (named, as pickled leaves are)
        values = {k[len(prefix) + 1:]: v for k, v in values.items() if k.startswith(prefix + "/")}
        skipped = [p for p in skipped if p.startswith(prefix + "/")] + [p for p in paths if p not in keys]
    header = encode_header({"__metadata__": {"format": "pt", "torch-persist-step": str(step), **values}, **entries})

    def read(f: Any, first: int, views: list[memoryview]) -> None:
        if f.name in names:
            held, fname = split_name(f.name)
            tier.read_blocks(held, dataclasses.replace(f, name=fname), first, views)
            return
        tier.read_blocks(step, f, first, views)  # every block verified
    partial = target.with_name(f".{target.name}.partial")
    try:
        with ThreadPoolExecutor(_knobs.write_threads()) as pool, open(partial, "wb") as out:
            out.write(header)
            for _, t in iter_tensors(m, read_blocks=read, pool=pool, where=f"{tier}", only=keys):
                if t.numel():
                    out.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            out.flush()
            os.fsync(out.fileno())
        os.rename(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return len(entries), pos, skipped


def _keys(paths: list[str], prefix: str | None) -> dict[str, str]:
    """The exported tensors' key paths -> their keys in the file (``prefix``'s stripped; see
    :func:`export_safetensors`)."""
    if prefix is None:
        return {p: p for p in paths}
    prefix = prefix.strip("/")
    keys = {p: p[len(prefix) + 1:] for p in paths if p.startswith(prefix + "/")}
    if not keys:
        tops = sorted({p.split("/", 1)[0] for p in paths if "/" in p})
        raise ConfigError(f"--prefix {prefix}: no tensor of this checkpoint is under {prefix!r}; the keys holding "
                          f"tensors are {tops} (a Lightning checkpoint's model is under 'state_dict', PersistHook's first "
                          "under 'models/0')")
    return keys
