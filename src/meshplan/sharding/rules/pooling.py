"""Rules for window reductions (pooling and an average pooling's gradient), max pooling's
gradient and reversals: they follow their operand. Batch and feature dims (window 1, stride 1,
no padding) keep their split: a pooling under data parallelism is free.

A window sum or reduction also keeps a split of one dim its window slides along, over one mesh
axis, where the blocks stay aligned (`ir/windows.py`'s `spatial_halo`): each device reduces its
rows plus a halo of its neighbours' border rows, the collective-permutes priced as `rules/halo.py`
says (XLA's partitioner sends them). That includes an average pooling's gradient, a window sum of
the cotangent dilated by the strides (as the IR's autodiff forms it and capture folds JAX's
pad-then-sum into it, `capture/folding.py`): its halo is the cotangent rows its windows reach.

Max pooling's gradient (`select_and_scatter_add`) keeps such a split too, as the runtime runs it
(`runtime/halo_pooling.py`, explicit exchanges, not XLA's: for this op XLA's partitioner sends
wider, padded blocks, measured on JAX 0.10.2): each device receives the pooled input's halo rows
(the forward pooling's halo), scatters its own windows' cotangent over its rows and the halo
rows, and sends the halo rows' sums back to the neighbours that own them: a collective-permute
per direction each way, the same rows x the rest of the block. Other windowed dims are gathered
(priced on the edge that brings the operand), as are a max or min over a dilated operand's.
Reversed dims stay whole.
"""

from __future__ import annotations

from meshplan.ir.node import Node, OpKind
from meshplan.ir.windows import Halo, window_halo, windowed_dims
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
        if node.kind is OpKind.REDUCE_WINDOW:  # a pooling, or an average pooling's gradient: the operand's halo
            return kept, (kept,), halo_exchange(ctx, operand, kept, dim, halo)
        # the pooled input's halo in, the halo rows' gradient sums back out
        pooled_input = ctx.operand(node, 1)
        return kept, (kept, kept), halo_exchange(ctx, pooled_input, kept, dim, halo) + halo_exchange(
            ctx, node, kept, dim, halo)

    return follow(node, ctx, 0, transform)


def _halo_split(node: Node, spec: ShardingSpec, windowed: set[int], ctx: RuleContext) -> tuple[int | None, Halo | None]:
    """The first windowed dim `spec` splits that the op may keep split (with its halo)."""
    ones = (1,) * node.rank
    dilated = node.attr("base_dilation", ones) != ones
    if not ctx.config.halo_splits or (dilated and node.attr("op") != "sum"):
        return None, None
    # XLA's partitioner runs a window reduction's exchange; the runtime runs max pooling's gradient's,
    # which needs the windows of a block to cover the block and its halo
    by_runtime = node.kind is OpKind.SELECT_AND_SCATTER_ADD
    if by_runtime and not ctx.config.runtime_exchanges:
        return None, None
    for dim in sorted(windowed):
        axes = spec.dims[dim]
        if len(axes) != 1:
            continue
        found = window_halo(node, ctx.operand(node, 0).shape, dim, ctx.mesh.shape[axes[0]])
        if found is not None and (found[1] is not None or not by_runtime):
            return dim, found[0]
    return None, None


@register_rule(OpKind.REVERSE)
def reverse_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    reversed_dims = set(node.attr("dims"))

    def transform(spec: ShardingSpec):
        kept = unsplit(spec, reversed_dims)
        return kept, (kept,), ()

    return follow(node, ctx, 0, transform)
