"""The strategy of ops no rule knows: everything replicated (never a crash)."""

from __future__ import annotations

from meshplan.ir.node import Node
from meshplan.sharding.context import RuleContext
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import NodeStrategies, Strategy


def replicated_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    out = ShardingSpec.replicated(node.rank)
    operands = tuple(ShardingSpec.replicated(ctx.graph[o].rank) for o in node.operands)
    strategy = Strategy("R (no rule)", out, operands, compute=ctx.model.compute_cost(ctx.local_flops(node, ())),
                        memory=ctx.local_bytes(node, out))
    return NodeStrategies(node.id, (strategy,), fallback=True)
