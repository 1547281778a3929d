"""Rules for ops that assemble or overwrite windows along a dim: concatenate, dynamic_update_slice."""

from __future__ import annotations

from meshplan.ir.node import Node, OpKind
from meshplan.sharding.context import RuleContext
from meshplan.sharding.rules.follow import deepest_operand, follow, unsplit
from meshplan.sharding.rules.registry import register_rule
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import NodeStrategies, Strategy


@register_rule(OpKind.CONCATENATE)
def concatenate_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    """Along a sharded dim: the operands are joined whole along `dim` (keeping their other
    splits), and the result either stays whole there or keeps the leading operand's split of
    `dim` (each device slices its part of the join: free, and what a consumer split along
    `dim`, e.g. a gradient padded back to full length, wants). The ILP picks; gathering the
    operands along `dim` is priced on the edges that bring them."""
    dim, n = node.attr("dim"), len(node.operands)
    leader = ctx.strategies_of(node.operands[deepest_operand(node, ctx)])
    choices: dict[tuple[ShardingSpec, ShardingSpec], None] = {}
    for lead in leader.strategies:
        joined = unsplit(lead.output, {dim})
        choices[(joined, joined)] = None
        if lead.output.dims[dim] and ctx.fits(node.shape[dim], lead.output.dims[dim]):
            choices[(lead.output, joined)] = None
    return NodeStrategies(node.id, tuple(_strategy(node, out, (joined,) * n, ctx) for out, joined in choices))


def _strategy(node: Node, out: ShardingSpec, operands: tuple[ShardingSpec, ...], ctx: RuleContext) -> Strategy:
    memory = ctx.local_bytes(node, out)
    return Strategy(f"{out} = concat {operands[0]}", out, operands, memory=memory,
                    penalty=ctx.model.activation_price * memory)


@register_rule(OpKind.DYNAMIC_UPDATE_SLICE)
def dynamic_update_slice_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    """A window written at run-time starts (a KV cache getting this step's keys): the dims the
    window covers in part must be whole, so every device can write its part locally; the other
    dims (batch, heads) keep the operand's split, and the update arrives split the same way."""
    update = ctx.operand(node, 1)
    cut = {d for d in range(node.rank) if update.shape[d] != node.shape[d]}
    starts = tuple(ShardingSpec.replicated(0) for _ in node.operands[2:])

    def transform(spec: ShardingSpec):
        kept = unsplit(spec, cut)
        return kept, (kept, kept, *starts), ()

    return follow(node, ctx, 0, transform)
