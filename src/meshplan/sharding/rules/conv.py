"""Rules for convolutions: split the batch, the output features, the input features (a
contraction: partial sums all-reduced or reduce-scattered, priced as a dot's) and spatial dims,
with the halo exchanges a sliding window needs.

A convolution is a dot whose contraction also runs over a sliding window, so its dims fall in
the dot's groups: the batch (lhs and output), the output features (kernel and output), the input
features (lhs and kernel, contracted) and the spatial dims. A spatial dim the window does not
slide along (window 1, stride 1, no padding, no dilation: a 1x1 convolution's) splits like a
batch dim. Along a dim the window slides over, a split over one mesh axis (spatial parallelism)
comes in two forms, both with a halo exchange of the input's border rows priced as the
collective-permutes XLA's partitioner emits (`rules/halo.py`):

- "h": input and output split in matching blocks (each device computes its block of output rows
  from its own input rows plus a halo): forward convolutions and input gradients;
- "w": input and window split in matching blocks, the output whole: a kernel gradient whose
  window is the cotangent. Each device sums over its rows only: partial sums, all-reduced or
  reduce-scattered like the input features'.

They are offered only where the split keeps each device's work next to its own rows (sizes the
axis divides, blocks that stay aligned, a halo no deeper than a block; `ir/windows.py`'s
`spatial_halo`), on one such dim per convolution, or two "h" dims over two mesh axes (2-D
tiles, their halos exchanged dim by dim, the corners with the later dim), and not for grouped
convolutions.

The kernel gradient of a convolution is itself a convolution whose "input features" are the
batch: under data parallelism it is the contraction that all-reduces the gradients. Grouped
convolutions (depthwise) split along the batch and pointwise spatial dims; a batch-grouped one
(a grouped kernel's gradient) along the input features and pointwise spatial dims.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Iterator

from meshplan.ir.node import Node, OpKind
from meshplan.ir.windows import ConvDims, Halo, conv_tap_pairs, is_pointwise, spatial_halo
from meshplan.sharding.context import RuleContext
from meshplan.sharding.rules.assign import assign_axes
from meshplan.sharding.rules.dot import contraction_strategy, keep_forced_batch, reductions
from meshplan.sharding.rules.halo import halo_exchange
from meshplan.sharding.rules.registry import register_rule
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import NodeStrategies, Strategy

# ("b", 0) batch, ("o", 0) output features, ("c", 0) input features, ("s", i) pointwise spatial i,
# ("h", i) spatial i with a halo, ("w", i) spatial i of the input and the window (partial sums)
Slot = tuple[str, int]
HALO_SLOTS = ("h", "w")


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
        for i in range(self.dims.spatial_rank):
            if is_pointwise(node, i, rhs.shape):
                self.slots.append(("s", i))
            elif not grouped and not batch_grouped:
                self.slots += [("h", i), ("w", i)]

    def halo(self, slot: Slot, shards: int) -> Halo | None:
        """The halo of a "h" or "w" split of spatial dim slot[1] over `shards` devices, if offered."""
        group, i = slot
        d, node = self.dims, self.node
        return spatial_halo(self.lhs.shape[d.lhs[2 + i]], node.shape[d.out[2 + i]], self.rhs.shape[d.rhs[2 + i]],
                            node.attr("window_strides")[i], node.attr("padding")[i], node.attr("lhs_dilation")[i],
                            node.attr("rhs_dilation")[i], shards, split_window=group == "w")

    def offered(self, assignment: dict[Slot, tuple[int, ...]], ctx: RuleContext) -> bool:
        """Each slot fits its axes; halo splits each over one mesh axis with a valid halo: one,
        or two "h" splits (rows over one axis, columns over another: 2-D tiles)."""
        if not all(ctx.fits(self.size(slot), axes) for slot, axes in assignment.items()):
            return False
        halos = [(slot, axes) for slot, axes in assignment.items() if slot[0] in HALO_SLOTS]
        if not halos:
            return True
        if not ctx.config.halo_splits or len(halos) > 2 or (len(halos) == 2 and any(s[0] != "h" for s, _ in halos)):
            return False
        if ("o", 0) in assignment:  # XLA's partitioner (JAX 0.10.2) computes rows split with output features split
            return False  # over another axis wrongly (max error = the largest output entry); tests/test_conv_runtime.py
        return all(len(axes) == 1 and self.halo(slot, ctx.mesh.shape[axes[0]]) is not None for slot, axes in halos)

    def size(self, slot: Slot) -> int:
        group, i = slot
        if group == "o":
            return self.rhs.shape[self.dims.rhs[0]]
        if group == "w":
            return self.rhs.shape[self.dims.rhs[2 + i]]
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
            elif group == "w":
                lhs[d.lhs[2 + i]], rhs[d.rhs[2 + i]] = axes, axes
            else:
                out[d.out[2 + i]], lhs[d.lhs[2 + i]] = axes, axes
        return ShardingSpec(tuple(out)), ShardingSpec(tuple(lhs)), ShardingSpec(tuple(rhs))


@register_rule(OpKind.CONV)
def conv_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    slots = ConvSlots(node, ctx.operand(node, 0), ctx.operand(node, 1))
    require_all = ctx.config.contractions_use_all_axes
    if require_all is None:
        require_all = not ctx.model.compute_on  # free compute: replication would look free
    # The splits without halos are chosen as if halos did not exist (so offering them only adds choices).
    plain, halo = [], []
    for a in assign_axes(slots.slots, ctx.axes, require_all=require_all):
        if slots.offered(a, ctx):
            (halo if any(group in HALO_SLOTS for group, _ in a) else plain).append(a)
    if not plain:  # no split uses every axis (dims too small): allow idle axes
        plain = [a for a in assign_axes(slots.slots, ctx.axes)
                 if not any(group in HALO_SLOTS for group, _ in a) and slots.offered(a, ctx)]
    assignments = plain + halo
    strategies = [s for a in assignments for s in _strategies(node, slots, a, ctx)]
    return NodeStrategies(node.id, tuple(keep_forced_batch(node, strategies, ctx)))


def _strategies(node: Node, slots: ConvSlots, assignment: dict, ctx: RuleContext) -> Iterator[Strategy]:
    out, lhs, rhs = slots.specs(assignment)
    contracted = tuple(sorted(a for (group, _), axes in assignment.items() if group in ("c", "w") for a in axes))
    kernel, dims = slots.rhs, slots.dims
    # Per output entry: the kernel's input features (a padded share of them) times its real taps (a share
    # of them under a "w" split), an implicit GEMM's k.
    taps = conv_tap_pairs(node, slots.lhs.shape, kernel.shape)
    taps /= math.prod(ctx.mesh.axis_size(axes) for (group, _), axes in assignment.items() if group == "w")
    in_features = assignment.get(("c", 0), ())
    local_k = math.ceil(kernel.shape[dims.rhs[1]] / ctx.mesh.axis_size(in_features)) * taps
    local_out = out.shard_shape(node.shape, ctx.mesh)
    flops = 2.0 * math.prod(local_out) * local_k
    n = local_out[dims.out[1]]
    compute = ctx.model.contraction_cost(flops, math.prod(local_out) / max(n, 1), n, local_k)
    partial = ctx.local_bytes(node, out)  # each device's partial result before any reduction
    halo = _halo_collectives(slots, assignment, lhs, ctx)
    for spec, reduction in reductions(node, out, contracted, ctx):
        strategy = contraction_strategy(node, spec, (lhs, rhs), contracted, reduction, compute, partial, ctx)
        yield _with_halo(strategy, halo, ctx.communication_weight(node)) if halo else strategy


def _halo_collectives(slots: ConvSlots, assignment: dict, lhs: ShardingSpec, ctx: RuleContext) -> tuple:
    """The halo exchanges of the input, dim by dim in the input's order, as XLA's partitioner
    makes them: a later dim's exchange carries the block grown by the earlier dims' halos (so the
    corners of 2-D tiles come with the columns)."""
    split = sorted((slots.dims.lhs[2 + slot[1]], slot, axes) for slot, axes in assignment.items()
                   if slot[0] in HALO_SLOTS)
    collectives, grown = (), {}
    for dim, slot, axes in split:
        halo = slots.halo(slot, ctx.mesh.axis_size(axes))
        collectives += halo_exchange(ctx, slots.lhs, lhs, dim, halo, grown)
        grown[dim] = halo.left + halo.right
    return collectives


def _with_halo(strategy: Strategy, halo: tuple, weight: float) -> Strategy:
    """The strategy with the halo exchange of its input priced in (before its own reduction)."""
    return dataclasses.replace(strategy, name=f"{strategy.name} halo {' '.join(map(str, halo))}",
                               communication=strategy.communication + sum(c.cost for c in halo) * weight,
                               collectives=halo + strategy.collectives)
