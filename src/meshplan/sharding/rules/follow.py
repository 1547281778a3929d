"""Rules for ops that follow one operand's sharding: elementwise, layout, reduce, slicing.

A follower has one strategy per strategy of the operand it follows, so the intra-op pass can
merge it into that operand's decision before solving.
"""

from __future__ import annotations

from collections.abc import Callable

from meshplan.cost.collectives import Collective, CollectiveKind
from meshplan.ir.node import Node, OpKind
from meshplan.sharding.context import RuleContext
from meshplan.sharding.rules.registry import register_rule
from meshplan.sharding.spec import ShardingSpec, reshape_spec
from meshplan.sharding.strategy import NodeStrategies, Strategy

# Maps the followed operand's spec to (output spec, required operand specs, collectives).
Transform = Callable[[ShardingSpec], tuple[ShardingSpec, tuple[ShardingSpec, ...], tuple[Collective, ...]]]


def follow(node: Node, ctx: RuleContext, position: int, transform: Transform,
           materialized: bool = True) -> NodeStrategies:
    """One strategy per strategy of operand `position`, shaped by `transform`.

    `materialized=False` marks outputs that compilers fuse into their consumers (broadcasts):
    they hold no memory of their own.
    """
    leader = ctx.strategies_of(node.operands[position])
    strategies = []
    for lead in leader.strategies:
        out, required, collectives = transform(lead.output)
        held = ctx.held_bytes(node, out) if materialized else 0.0
        strategies.append(Strategy(
            f"follow {lead.output}" + "".join(f" {c}" for c in collectives), out, required,
            compute=_compute(node, ctx, out, required) * ctx.compute_weight(node),
            communication=sum(c.cost for c in collectives) * ctx.communication_weight(node),
            memory=held, collectives=collectives, penalty=ctx.model.activation_price * held,
        ))
    return NodeStrategies(node.id, tuple(strategies), follows=position)


def _compute(node: Node, ctx: RuleContext, out: ShardingSpec, operands: tuple[ShardingSpec, ...]) -> float:
    """A memory-bound kernel by its bytes (with kernel models), else its FLOPs at the flat rate."""
    seconds = ctx.memory_bound_cost(node, out, operands)
    return ctx.model.compute_cost(ctx.local_flops(node, out.axes())) if seconds is None else seconds


def deepest_operand(node: Node, ctx: RuleContext) -> int:
    """Position of the operand to follow: not a constant (a broadcast scalar would pin the
    result replicated), then, in an optimizer update, the optimizer state (so the state's
    layout, not the gradient's, decides: ZeRO-style sharding of the state stays possible),
    then the one furthest from the inputs, then the first."""
    update = bool(node.attr("per_iteration"))
    keys = [(o not in ctx.constant_like, update and o in ctx.state_derived, ctx.depth[o]) for o in node.operands]
    position = keys.index(max(keys))
    if keys[position][1]:
        ctx.state_derived.add(node.id)
    return position


def _relayout_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    """A copy that may take any layout (a relayout point): its operand is resharded to it."""
    from meshplan.sharding.rules.leaves import full_specs

    specs = full_specs(node, ctx) + [ShardingSpec.replicated(node.rank)]
    weight = ctx.communication_weight(node)
    return NodeStrategies(node.id, tuple(
        Strategy(f"relayout {spec}", spec, (spec,), compute=_compute(node, ctx, spec, (spec,)) * weight,
                 memory=ctx.held_bytes(node, spec),
                 penalty=ctx.model.activation_price * ctx.held_bytes(node, spec) * weight) for spec in specs))


@register_rule(OpKind.ELEMENTWISE)
def elementwise_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    if node.attr("relayout"):
        return _relayout_strategies(node, ctx)
    n = len(node.operands)
    return follow(node, ctx, deepest_operand(node, ctx), lambda s: (s, (s,) * n, ()))


@register_rule(OpKind.BROADCAST)
def broadcast_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    dims = node.attr("dims")
    return follow(node, ctx, 0, lambda s: (s.broadcast(dims, node.rank), (s,), ()), materialized=False)


@register_rule(OpKind.TRANSPOSE)
def transpose_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    perm = node.attr("perm")
    return follow(node, ctx, 0, lambda s: (s.transpose(perm), (s,), ()))


@register_rule(OpKind.RESHAPE)
def reshape_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    operand = ctx.operand(node, 0)

    def transform(spec: ShardingSpec):
        out = reshape_spec(spec, operand.shape, node.shape, ctx.mesh)
        kept = set(out.axes())
        required = spec.without_axes([a for a in spec.axes() if a not in kept])
        return out, (required,), ()

    return follow(node, ctx, 0, transform)


@register_rule(OpKind.REDUCE)
def reduce_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    dims = node.attr("dims")

    def transform(spec: ShardingSpec):
        out = spec.reduce(dims)
        return out, (spec,), _partial_sums(node, ctx, out, spec.reduced_axes(dims))

    return follow(node, ctx, 0, transform)


def unsplit(spec: ShardingSpec, dims: set[int]) -> ShardingSpec:
    """`spec` with `dims` whole."""
    return ShardingSpec(tuple(() if d in dims else a for d, a in enumerate(spec.dims)))


@register_rule(OpKind.SLICE, OpKind.DYNAMIC_SLICE)
def slice_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    """Dims that get cut must be whole on each device first; other dims keep their split."""
    operand = ctx.operand(node, 0)
    cut = {d for d in range(node.rank) if node.shape[d] != operand.shape[d]}
    rest = tuple(ShardingSpec.replicated(ctx.graph[o].rank) for o in node.operands[1:])

    def transform(spec: ShardingSpec):
        kept = unsplit(spec, cut)
        return kept, (kept, *rest), ()

    return follow(node, ctx, 0, transform)


@register_rule(OpKind.GATHER)
def gather_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    """An embedding lookup (no batch dims) follows the indices and reads the operand whole. A
    per-row pick (batch dims, e.g. cross-entropy's logp[b, labels[b]]) follows the operand like an
    elementwise op: its other dims keep their splits, and a split of the gathered dim leaves each
    device the entries it holds (the rest masked to zero), summed by an all-reduce over that dim's
    axes (Megatron's vocabulary-parallel cross-entropy). A constant side (an iota of positions)
    never leads, or it would pin the result replicated."""
    axis, batch_dims = node.attr("axis"), node.attr("batch_dims")
    rank = ctx.operand(node, 0).rank
    picked = ctx.operand(node, 1).rank - batch_dims  # index dims that pick independently

    def from_operand(spec: ShardingSpec):
        out = ShardingSpec(spec.dims[:axis] + ((),) * picked + spec.dims[axis + 1:])
        indices = ShardingSpec(spec.dims[:batch_dims] + ((),) * picked)
        return out, (spec, indices), _partial_sums(node, ctx, out, spec.dims[axis])

    def from_indices(spec: ShardingSpec):
        batch, own = spec.dims[:batch_dims], spec.dims[batch_dims:]
        out = ShardingSpec(batch + ((),) * (axis - batch_dims) + own + ((),) * (rank - axis - 1))
        return out, (ShardingSpec(batch + ((),) * (rank - batch_dims)), spec), ()

    leader = _leader(node, ctx, 0 if batch_dims else 1)
    return follow(node, ctx, leader, from_indices if leader else from_operand)


@register_rule(OpKind.SCATTER_ADD)
def scatter_add_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    """Gather's transpose (an embedding gradient, a cross-entropy label gradient) follows the
    updates: the output keeps the splits of their batch and other dims and the scattered dim is
    whole; splits of the index dims that pick independently leave partial sums to all-reduce.
    Constant updates (the gradient of a mean) do not lead: the output follows the indices."""
    axis, batch_dims = node.attr("axis"), node.attr("batch_dims")
    picked = ctx.operand(node, 0).rank - batch_dims

    def from_updates(spec: ShardingSpec):
        out = ShardingSpec(spec.dims[:axis] + ((),) + spec.dims[axis + picked:])
        indices = ShardingSpec(spec.dims[:batch_dims] + spec.dims[axis:axis + picked])
        split = tuple(a for d in spec.dims[axis:axis + picked] for a in d)
        return out, (indices, spec), _partial_sums(node, ctx, out, split)

    def from_indices(spec: ShardingSpec):
        batch, own = spec.dims[:batch_dims], spec.dims[batch_dims:]
        out = ShardingSpec(batch + ((),) * (node.rank - batch_dims))
        updates = ShardingSpec(batch + ((),) * (axis - batch_dims) + own + ((),) * (node.rank - axis - 1))
        split = tuple(a for d in own for a in d)
        return out, (spec, updates), _partial_sums(node, ctx, out, split)

    leader = _leader(node, ctx, 1)
    return follow(node, ctx, leader, from_updates if leader else from_indices)


def _leader(node: Node, ctx: RuleContext, preferred: int) -> int:
    """`preferred`, unless that operand is constant-like and the other one is not."""
    other = 1 - preferred
    constant = ctx.constant_like
    return other if node.operands[preferred] in constant and node.operands[other] not in constant else preferred


def _partial_sums(node: Node, ctx: RuleContext, out: ShardingSpec, axes: tuple[int, ...]) -> tuple[Collective, ...]:
    """The all-reduce summing partial results over `axes` (none when no axis has two devices)."""
    if not any(ctx.mesh.shape[a] > 1 for a in axes):
        return ()
    return (ctx.collective(CollectiveKind.ALL_REDUCE, axes, ctx.local_bytes(node, out)),)
