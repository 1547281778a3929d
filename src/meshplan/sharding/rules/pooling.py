"""Rules for window reductions (pooling), max pooling's gradient and reversals: they follow their
operand, with the dims a window slides along (or that are reversed) whole on each device.

A split of a windowed dim would need halo exchanges with the neighbouring devices; such dims are
gathered instead (priced on the edge that brings the operand). Batch and feature dims (window 1,
stride 1, no padding) keep their split: a pooling under data parallelism is free.
"""

from __future__ import annotations

from meshplan.ir.node import Node, OpKind
from meshplan.ir.windows import windowed_dims
from meshplan.sharding.context import RuleContext
from meshplan.sharding.rules.follow import follow, unsplit
from meshplan.sharding.rules.registry import register_rule
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import NodeStrategies


@register_rule(OpKind.REDUCE_WINDOW, OpKind.SELECT_AND_SCATTER_ADD)
def window_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    """A pooling follows its input; max pooling's gradient follows the pooled cotangent (its
    first operand), the pooled input arriving split the same way."""
    whole = windowed_dims(node)
    n = len(node.operands)

    def transform(spec: ShardingSpec):
        kept = unsplit(spec, whole)
        return kept, (kept,) * n, ()

    return follow(node, ctx, 0, transform)


@register_rule(OpKind.REVERSE)
def reverse_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    reversed_dims = set(node.attr("dims"))

    def transform(spec: ShardingSpec):
        kept = unsplit(spec, reversed_dims)
        return kept, (kept,), ()

    return follow(node, ctx, 0, transform)
