"""Rules for ops along one dim that needs all its entries on each device: running reductions
(cumsum ...), sorts, top_k and argmax/argmin. That dim is whole ("replicated along the sorted
dim"); the other dims keep the followed operand's splits, so the op runs without communication."""

from __future__ import annotations

from meshplan.ir.node import Node, OpKind
from meshplan.sharding.context import RuleContext
from meshplan.sharding.rules.follow import deepest_operand, follow, unsplit
from meshplan.sharding.rules.registry import register_rule
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import NodeStrategies


@register_rule(OpKind.CUMULATIVE, OpKind.SORT, OpKind.TOP_K)
def along_dim_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    """Same-rank results: the dim is whole in every operand and in the result. A sort follows its
    keys (not an iota of positions, as argsort's second operand is)."""
    dim, n = node.attr("dim"), len(node.operands)

    def transform(spec: ShardingSpec):
        kept = unsplit(spec, {dim})
        return kept, (kept,) * n, ()

    return follow(node, ctx, deepest_operand(node, ctx), transform)


@register_rule(OpKind.ARG_REDUCE)
def arg_reduce_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    dim = node.attr("dim")

    def transform(spec: ShardingSpec):
        kept = unsplit(spec, {dim})
        return kept.reduce((dim,)), (kept,), ()

    return follow(node, ctx, 0, transform)
