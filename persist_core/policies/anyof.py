"""``AnyOf``: one combinator for both kinds of policy (retention and save decisions)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from persist_core.errors import ConfigError
from persist_core.policies.retention import RetentionContext, answers, check_policy
from persist_core.tiers.tier import CheckpointInfo


class AnyOf:
    """Any of ``policies``: for retention, keep a checkpoint when any keeps it; for save
    decisions (:mod:`persist_core.policies.save`), save when any says so. All members are of one kind.
    """

    def __init__(self, *policies: Any) -> None:
        if not policies:
            raise ConfigError("AnyOf() needs at least one policy, e.g. AnyOf(KeepLastN(3), KeepEveryNSteps(1000))")
        if all(callable(getattr(p, "should_save", None)) for p in policies):
            self.kind = "save"
            self.policies = tuple(policies)
        else:
            self.kind = "retention"
            self.policies = tuple(check_policy(p, name=f"AnyOf argument {i}") for i, p in enumerate(policies))

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AnyOf) and other.policies == self.policies

    def __hash__(self) -> int:
        return hash(self.policies)

    def should_keep(self, checkpoints: Sequence[CheckpointInfo], *, context: RetentionContext) -> Sequence[bool]:
        if self.kind != "retention":
            raise ConfigError(f"{self!r} combines save-decision policies; it cannot decide retention")
        each = [answers(p, checkpoints, context) for p in self.policies]
        return [any(col) for col in zip(*each)] if each else []

    def should_save(self, context: Any) -> bool:
        if self.kind != "save":
            raise ConfigError(f"{self!r} combines retention policies; it cannot decide when to save")
        return any(p.should_save(context) for p in self.policies)

