"""Rules for window reductions (pooling), max pooling's gradient and reversals: they follow their
operand. Batch and feature dims (window 1, stride 1, no padding) keep their split: a pooling under
data parallelism is free.

A pooling (a window reduction of an undilated operand) also keeps a split of one dim its window
slides along, over one mesh axis, where the blocks stay aligned (`ir/windows.py`'s
`spatial_halo`): each device pools its rows plus a halo of its neighbours' border rows, the
collective-permutes priced as `rules/halo.py` says. Other windowed dims are gathered (priced on
the edge that brings the operand), and so are all of them for a window sum over a dilated
operand (an average pooling's gradient) and for max pooling's gradient: for those XLA's
partitioner emits other exchanges (padded, wider ones, measured on JAX 0.10.2) than a halo.
Reversed dims stay whole.
"""

from __future__ import annotations

from meshplan.ir.node import Node, OpKind
from meshplan.ir.windows import Halo, spatial_halo, windowed_dims
from meshplan.sharding.context import RuleContext
from meshplan.sharding.rules.follow import follow, unsplit
from meshplan.sharding.rules.halo import halo_exchange
from meshplan.sharding.rules.registry import register_rule
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import NodeStrategies


@register_rule(OpKind.REDUCE_WINDOW, OpKind.SELECT_AND_SCATTER_ADD)
def window_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    """A pooling follows its input; max pooling's gradient follows the pooled cotangent (its
    first operand), the pooled input arriving split the same way."""
    whole = windowed_dims(node)
    n = len(node.operands)
    operand = ctx.operand(node, 0)

    def transform(spec: ShardingSpec):
        dim, halo = _halo_split(node, operand.shape, spec, whole, ctx)
        kept = unsplit(spec, whole - {dim})
        collectives = () if halo is None else halo_exchange(ctx, operand, kept, dim, halo)
        return kept, (kept,) * n, collectives

    return follow(node, ctx, 0, transform)


def _halo_split(node: Node, shape: tuple[int, ...], spec: ShardingSpec, windowed: set[int],
                ctx: RuleContext) -> tuple[int | None, Halo | None]:
    """The first windowed dim `spec` splits that a pooling may keep split (with its halo)."""
    ones = (1,) * node.rank
    if not ctx.config.halo_splits or node.kind is not OpKind.REDUCE_WINDOW \
            or node.attr("base_dilation", ones) != ones:
        return None, None
    window, strides, padding = (node.attr(k) for k in ("window_dimensions", "window_strides", "padding"))
    for dim in sorted(windowed):
        axes = spec.dims[dim]
        if len(axes) == 1:
            halo = spatial_halo(shape[dim], node.shape[dim], window[dim], strides[dim], padding[dim], 1,
                                node.attr("window_dilation", ones)[dim], ctx.mesh.shape[axes[0]])
            if halo is not None:
                return dim, halo
    return None, None


@register_rule(OpKind.REVERSE)
def reverse_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    reversed_dims = set(node.attr("dims"))

    def transform(spec: ShardingSpec):
        kept = unsplit(spec, reversed_dims)
        return kept, (kept,), ()

    return follow(node, ctx, 0, transform)
