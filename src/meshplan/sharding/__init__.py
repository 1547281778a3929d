"""Sharding specs, per-op strategy rules (a registry by op kind) and resharding costs."""

from meshplan.sharding.context import RuleConfig, RuleContext
from meshplan.sharding.enumerate import UnsupportedOpWarning, enumerate_strategies
from meshplan.sharding.resharding import resharding_collectives, resharding_cost
from meshplan.sharding.rules.registry import register_rule
from meshplan.sharding.spec import ShardingSpec, reshape_spec
from meshplan.sharding.strategy import NodeStrategies, Strategy, StrategySpace

__all__ = [
    "NodeStrategies", "RuleConfig", "RuleContext", "ShardingSpec", "Strategy", "StrategySpace",
    "UnsupportedOpWarning", "enumerate_strategies", "register_rule", "reshape_spec",
    "resharding_collectives", "resharding_cost",
]
