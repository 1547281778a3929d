"""Rules for convolutions: split the batch, the output features, the input features (a
contraction: partial sums all-reduced or reduce-scattered, priced as a dot's) and pointwise
spatial dims.

A convolution is a dot whose contraction also runs over a sliding window, so its dims fall in
the dot's groups: the batch (lhs and output), the output features (kernel and output), the input
features (lhs and kernel, contracted) and the spatial dims. A spatial dim the window does not
slide along (window 1, stride 1, no padding, no dilation: a 1x1 convolution's) splits like a
batch dim. A spatial dim the window slides along would need halo exchanges (each device also
reading its neighbours' border rows); they are not offered, so images stay whole along their
height and width and convolutions split along batch and features only.

The kernel gradient of a convolution is itself a convolution whose "input features" are the
batch: under data parallelism it is the contraction that all-reduces the gradients. Grouped
convolutions (depthwise) split along the batch and pointwise spatial dims; a batch-grouped one
(a grouped kernel's gradient) along the input features and pointwise spatial dims.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator

from meshplan.ir.node import Node, OpKind
from meshplan.ir.windows import ConvDims, is_pointwise
from meshplan.sharding.context import RuleContext
from meshplan.sharding.rules.assign import assign_axes
from meshplan.sharding.rules.dot import contraction_strategy, keep_forced_batch, reductions
from meshplan.sharding.rules.registry import register_rule
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import NodeStrategies, Strategy

Slot = tuple[str, int]  # ("b", 0) batch, ("o", 0) output features, ("c", 0) input features, ("s", i) spatial i


class ConvSlots:
    """The splittable dim groups of one convolution and where each sits in lhs, rhs and output."""

    def __init__(self, node: Node, lhs: Node, rhs: Node) -> None:
        self.dims, self.node, self.lhs, self.rhs = ConvDims.of(node), node, lhs, rhs
        grouped = node.attr("feature_group_count") > 1
        batch_grouped = node.attr("batch_group_count") > 1
        self.slots: list[Slot] = []
        if not batch_grouped:
            self.slots.append(("b", 0))
        if not grouped and not batch_grouped:
            self.slots.append(("o", 0))
        if not grouped:
            self.slots.append(("c", 0))
        self.slots += [("s", i) for i in range(self.dims.spatial_rank) if is_pointwise(node, i, rhs.shape)]

    def size(self, slot: Slot) -> int:
        group, i = slot
        if group == "o":
            return self.rhs.shape[self.dims.rhs[0]]
        role = {"b": 0, "c": 1}.get(group, 2 + i)
        return self.lhs.shape[self.dims.lhs[role]]

    def specs(self, assignment: dict[Hashable, tuple[int, ...]]) -> tuple[ShardingSpec, ShardingSpec, ShardingSpec]:
        """(output, lhs, rhs) specs for a slot -> axes assignment."""
        out, lhs, rhs = [[()] * self.node.rank for _ in range(3)]
        d = self.dims
        for (group, i), axes in assignment.items():
            if group == "b":
                out[d.out[0]], lhs[d.lhs[0]] = axes, axes
            elif group == "o":
                out[d.out[1]], rhs[d.rhs[0]] = axes, axes
            elif group == "c":
                lhs[d.lhs[1]], rhs[d.rhs[1]] = axes, axes
            else:
                out[d.out[2 + i]], lhs[d.lhs[2 + i]] = axes, axes
        return ShardingSpec(tuple(out)), ShardingSpec(tuple(lhs)), ShardingSpec(tuple(rhs))


@register_rule(OpKind.CONV)
def conv_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    slots = ConvSlots(node, ctx.operand(node, 0), ctx.operand(node, 1))
    require_all = ctx.config.contractions_use_all_axes
    if require_all is None:
        require_all = not ctx.model.compute_on  # free compute: replication would look free
    assignments = [a for a in assign_axes(slots.slots, ctx.axes, require_all=require_all)
                   if all(ctx.fits(slots.size(slot), axes) for slot, axes in a.items())]
    if not assignments:  # no split uses every axis (dims too small): allow idle axes
        assignments = [a for a in assign_axes(slots.slots, ctx.axes)
                       if all(ctx.fits(slots.size(slot), axes) for slot, axes in a.items())]
    strategies = [s for a in assignments for s in _strategies(node, slots, a, ctx)]
    return NodeStrategies(node.id, tuple(keep_forced_batch(node, strategies, ctx)))


def _strategies(node: Node, slots: ConvSlots, assignment: dict, ctx: RuleContext) -> Iterator[Strategy]:
    out, lhs, rhs = slots.specs(assignment)
    contracted = assignment.get(("c", 0), ())
    kernel = slots.rhs
    # Per output entry: the kernel's input features (a padded share of them) times its taps, an implicit GEMM's k.
    taps = math.prod(kernel.shape[d] for d in slots.dims.rhs[2:])
    local_k = math.ceil(kernel.shape[slots.dims.rhs[1]] / ctx.mesh.axis_size(contracted)) * taps
    local_out = out.shard_shape(node.shape, ctx.mesh)
    flops = 2.0 * math.prod(local_out) * local_k
    n = local_out[slots.dims.out[1]]
    compute = ctx.model.contraction_cost(flops, math.prod(local_out) / max(n, 1), n, local_k)
    partial = ctx.local_bytes(node, out)  # each device's partial result before any reduction
    for spec, reduction in reductions(node, out, contracted, ctx):
        yield contraction_strategy(node, spec, (lhs, rhs), contracted, reduction, compute, partial, ctx)
