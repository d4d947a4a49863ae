"""Policies as tiny pure dataclasses: what to keep (retention), when to save, and ``AnyOf``."""

from persist_core.policies.anyof import AnyOf, policy_from_keywords
from persist_core.policies.retention import (
    KeepEveryNSeconds,
    KeepEveryNSteps,
    KeepLastN,
    KeepSteps,
    Retainer,
    RetentionContext,
    RetentionDecision,
    RetentionPlan,
    RetentionPolicy,
    RetentionReason,
    plan_retention,
    to_delete,
)
from persist_core.policies.save import (
    Continuous,
    DecisionContext,
    EveryNSeconds,
    EveryNSteps,
    OptimalInterval,
    SavePolicy,
    check_save_policy,
)

__all__ = [
    "AnyOf",
    "Continuous",
    "DecisionContext",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepEveryNSeconds",
    "KeepEveryNSteps",
    "KeepLastN",
    "KeepSteps",
    "OptimalInterval",
    "Retainer",
    "RetentionContext",
    "RetentionDecision",
    "RetentionPlan",
    "RetentionPolicy",
    "RetentionReason",
    "SavePolicy",
    "check_save_policy",
    "plan_retention",
    "policy_from_keywords",
    "to_delete",
]
