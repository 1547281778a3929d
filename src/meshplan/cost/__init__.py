"""Cost model: collectives (alpha-beta per mesh axis), compute, resharding rule."""

from meshplan.cost.collectives import TIE_CONSTANT, Collective, CollectiveCosts, CollectiveKind
from meshplan.cost.model import CostModel, ReshardingRule

__all__ = ["TIE_CONSTANT", "Collective", "CollectiveCosts", "CollectiveKind", "CostModel", "ReshardingRule"]
