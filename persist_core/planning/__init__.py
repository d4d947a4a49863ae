"""What each rank writes (the shard plan) and who owns which bytes (the partition)."""

from persist_core.planning.partition import assign_owners, storage_groups, structure_signature
from persist_core.planning.save import EntryCopy, RankPlan, ShardPlan, plan_rank, plan_shard

__all__ = ["EntryCopy", "RankPlan", "ShardPlan", "assign_owners", "plan_rank", "plan_shard", "storage_groups", "structure_signature"]
