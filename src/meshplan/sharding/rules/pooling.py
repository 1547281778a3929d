"""Rules for window reductions (pooling), max pooling's gradient and reversals: they follow their
operand. Batch and feature dims (window 1, stride 1, no padding) keep their split: a pooling under
data parallelism is free.

A pooling (a window reduction of an undilated operand) also keeps a split of one dim its window
slides along, over one mesh axis, where the blocks stay aligned (`ir/windows.py`'s
`spatial_halo`): each device pools its rows plus a halo of its neighbours' border rows, the
collective-permutes priced as `rules/halo.py` says (XLA's partitioner sends them).

Max pooling's gradient (`select_and_scatter_add`) keeps such a split too, as the runtime runs it
(`runtime/halo_pooling.py`, explicit exchanges, not XLA's: for this op XLA's partitioner sends
wider, padded blocks, measured on JAX 0.10.2): each device receives the pooled input's halo rows
(the forward pooling's halo), scatters its own windows' cotangent over its rows and the halo
rows, and sends the halo rows' sums back to the neighbours that own them: a collective-permute
per direction each way, the same rows x the rest of the block. Other windowed dims are gathered
(priced on the edge that brings the operand), and so are all of them for a window sum over a
dilated operand (an average pooling's gradient: XLA partitions its interior padding with padded
exchanges this model does not price). Reversed dims stay whole.
"""

from __future__ import annotations

from meshplan.ir.node import Node, OpKind
from meshplan.ir.windows import Halo, halo_window_padding, spatial_halo, windowed_dims
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
        dim, halo = _halo_split(node, spec, whole, ctx)
        kept = unsplit(spec, whole - {dim})
        if halo is None:
            return kept, (kept,) * n, ()
        if node.kind is OpKind.REDUCE_WINDOW:
            return kept, (kept,), halo_exchange(ctx, operand, kept, dim, halo)
        # the pooled input's halo in, the halo rows' gradient sums back out
        pooled_input = ctx.operand(node, 1)
        return kept, (kept, kept), halo_exchange(ctx, pooled_input, kept, dim, halo) + halo_exchange(
            ctx, node, kept, dim, halo)

    return follow(node, ctx, 0, transform)


def _halo_split(node: Node, spec: ShardingSpec, windowed: set[int], ctx: RuleContext) -> tuple[int | None, Halo | None]:
    """The first windowed dim `spec` splits that the op may keep split (with its halo)."""
    ones = (1,) * node.rank
    if not ctx.config.halo_splits or node.attr("base_dilation", ones) != ones:
        return None, None
    pooled = node.kind is OpKind.REDUCE_WINDOW
    # (input rows, output rows) of the pooling: max pooling's gradient maps its cotangent (operand 0) back
    first = ctx.operand(node, 0).shape
    rows, out_rows = (first, node.shape) if pooled else (node.shape, first)
    window, strides, padding = (node.attr(k) for k in ("window_dimensions", "window_strides", "padding"))
    dilation = node.attr("window_dilation", ones)
    for dim in sorted(windowed):
        axes = spec.dims[dim]
        if len(axes) != 1:
            continue
        shards = ctx.mesh.shape[axes[0]]
        halo = spatial_halo(rows[dim], out_rows[dim], window[dim], strides[dim], padding[dim], 1, dilation[dim],
                            shards)
        if halo is None:
            continue
        # the runtime's exchange for max pooling's gradient needs each block's windows to cover its extended rows
        if pooled or halo_window_padding(rows[dim] // shards, out_rows[dim] // shards, window[dim], strides[dim],
                                         padding[dim], halo) is not None:
            return dim, halo
    return None, None


@register_rule(OpKind.REVERSE)
def reverse_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    reversed_dims = set(node.attr("dims"))

    def transform(spec: ShardingSpec):
        kept = unsplit(spec, reversed_dims)
        return kept, (kept,), ()

    return follow(node, ctx, 0, transform)
