"""Rank 0's check that the plain tensors every rank saved as replicated hold the same values: one problem that
names the tensors (and the ranks that differ), then the fix, once — not the whole sentence per tensor."""

from __future__ import annotations

import types

import torch

from persist_core.save.commit import Report, _replica_mismatches
from persist_core.format.tree import flatten


def report(digests: list[int | None]) -> Report:
    return Report(entry=None, records=None, signature="", error=None, step=1, per_rank=(), digests=digests)


def test_differing_replicas_are_named_together_and_the_fix_is_said_once():
    flat = flatten({f"t{i}": torch.zeros(2) for i in range(8)})
    base = types.SimpleNamespace(tree=flat.tree)
    problems = _replica_mismatches(base, [report(list(range(8))), report([0, 1, *range(102, 108)]),
                                          report(list(range(8)))])
    assert len(problems) == 1
    (text,) = problems
    assert "state['t2'] (ranks [1])" in text and "and 1 more" in text and "6 plain tensor(s)" in text
    assert text.count("PerRank") == 1 and text.count("to_local") == 1
    assert _replica_mismatches(base, [report(list(range(8)))] * 2) == []
