"""``AnyOf``: one combinator for both kinds of policy; ``policy_from_keywords``: the adapters' sugar as one policy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from persist_core.errors import ConfigError
from persist_core.policies.retention import (
    KeepEveryNSeconds,
    KeepEveryNSteps,
    KeepLastN,
    RetentionContext,
    RetentionPolicy,
    answers,
    check_policy,
)
from persist_core.tiers.tier import CheckpointInfo


class AnyOf:
    """Any of ``policies``: for retention, keep a checkpoint when any keeps it; for save
    decisions (:mod:`persist_core.policies.save`), save when any says so. All members are of one kind.
    """

    def __init__(self, *policies: Any) -> None:
        if not policies:
            raise ConfigError("AnyOf() needs at least one policy, e.g. AnyOf(KeepLastN(3), KeepEveryNSteps(1000))")
        for i, p in enumerate(policies):
            if isinstance(p, type):
                raise ConfigError(f"AnyOf argument {i} is the class {p.__name__}; pass an instance, e.g. "
                                  f"{p.__name__}(...)")
        if all(callable(getattr(p, "should_save", None)) for p in policies):
            self.kind = "save"
            self.policies = tuple(policies)
        else:
            self.kind = "retention"
            self.policies = tuple(check_policy(p, name=f"AnyOf argument {i}") for i, p in enumerate(policies))

    def __repr__(self) -> str:  # flat and short: "KeepLastN(3) | KeepEveryNSteps(1000) | KeepLinked()"
        return " | ".join(repr(p) for p in self._flat())

    def _flat(self) -> list[Any]:
        return [q for p in self.policies for q in (p._flat() if isinstance(p, AnyOf) else [p])]

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


def policy_from_keywords(keep_last: int | None = None, keep_every_n_steps: int | None = None,
                         keep_every_n_seconds: float | None = None,
                         retention: RetentionPolicy | None = None) -> RetentionPolicy | None:
    """The adapters' keyword sugar as one policy (the one place it is turned into objects).

    Raises:
        ConfigError: a bad value (named), or ``retention`` together with a keyword.
    """
    sugar: list[RetentionPolicy] = []
    for name, value, make in (("keep_last", keep_last, KeepLastN), ("keep_every_n_steps", keep_every_n_steps, KeepEveryNSteps),
                              ("keep_every_n_seconds", keep_every_n_seconds, KeepEveryNSeconds)):
        if value is not None:
            try:
                sugar.append(make(value))
            except ConfigError as e:
                raise ConfigError(f"{name}={value!r} is not valid ({e}); pass a positive number or None") from e
    if retention is not None and sugar:
        raise ConfigError(
            f"retention={retention!r} was given together with keep_last/keep_every_n_steps/keep_every_n_seconds; "
            "pass either the keywords or one policy (e.g. AnyOf(KeepLastN(3), KeepEveryNSteps(1000)))"
        )
    if retention is not None:
        return check_policy(retention, name="retention")
    return None if not sugar else sugar[0] if len(sugar) == 1 else AnyOf(*sugar)

