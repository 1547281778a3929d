"""Rules for ops that follow one operand's sharding: elementwise, layout, reduce, slicing.

A follower has one strategy per strategy of the operand it follows, so the intra-op pass can
merge it into that operand's decision before solving.
"""

from __future__ import annotations

import itertools
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
    # Leaders' strategies differ in more than their output (reductions, operand layouts): a
    # follower's strategy depends on the output alone, so each distinct one is made once.
    made: dict[tuple[tuple[int, ...], ...], Strategy] = {}
    for lead in leader.strategies:
        strategy = made.get(lead.output.dims)
        if strategy is None:
            out, required, collectives = transform(lead.output)
            held = ctx.held_bytes(node, out) if materialized else 0.0
            strategy = made[lead.output.dims] = Strategy(
                f"follow {lead.output}" + "".join(f" {c}" for c in collectives), out, required,
                compute=_compute(node, ctx, out, required) * ctx.compute_weight(node),
                communication=sum(c.cost for c in collectives) * ctx.communication_weight(node),
                memory=held, collectives=collectives, penalty=ctx.model.activation_price * held,
            )
        strategies.append(strategy)
    return NodeStrategies(node.id, tuple(strategies), follows=position)


def _compute(node: Node, ctx: RuleContext, out: ShardingSpec, operands: tuple[ShardingSpec, ...]) -> float:
    """A memory-bound kernel by its bytes (with kernel models), else its FLOPs at the flat rate."""
    seconds = ctx.memory_bound_cost(node, out, operands)
    return ctx.model.compute_cost(ctx.local_flops(node, out.axes())) if seconds is None else seconds


def deepest_operand(node: Node, ctx: RuleContext) -> int:
    """Position of the operand to follow: not a constant (a broadcast scalar would pin the
    result replicated), then, in an optimizer update, the optimizer state (so the state's
    layout, not the gradient's, decides: ZeRO-style sharding of the state stays possible),
    then, when the batch dim is forced onto a mesh axis, one that carries the batch (a bias
    broadcast to the activations' shape cannot split their batch dim), then the one furthest
    from the inputs, then the first."""
    update = bool(node.attr("per_iteration"))
    batch = ctx.batch_dims
    # With vocabulary parallelism a row statistic broadcast back (x - max(x)) does not lead:
    # following it would gather the split row (Megatron's cross-entropy keeps the vocabulary split).
    whole = [ctx.config.gather_choices and ctx.graph[o].kind is not OpKind.BROADCAST for o in node.operands]
    # Under a given layout, an operand laid out as the layout lays out this node leads.
    target = ctx.fixed.get(node.id)
    aligned = [target is not None and ctx.fixed.get(o) == target for o in node.operands]
    keys = [(o not in ctx.constant_like, a, update and o in ctx.state_derived, w, o in batch, ctx.depth[o])
            for o, a, w in zip(node.operands, aligned, whole, strict=True)]
    position = keys.index(max(keys))
    if keys[position][2]:
        ctx.state_derived.add(node.id)
    return position


def _relayout_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    """A copy that may take any layout (a relayout point): its operand is resharded to it."""
    from meshplan.sharding.rules.leaves import full_specs

    specs = full_specs(node, ctx) + [ShardingSpec.replicated(node.rank)]
    weight = ctx.communication_weight(node)
    n = len(node.operands)
    return NodeStrategies(node.id, tuple(
        Strategy(f"relayout {spec}", spec, (spec,) * n, compute=_compute(node, ctx, spec, (spec,) * n) * weight,
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
    if ctx.config.gather_choices and batch_dims == 0 and ctx.operand(node, 0).kind is OpKind.PARAMETER:
        return _table_lookup_strategies(node, ctx)
    if ctx.config.gather_choices and 0 < batch_dims == axis and ctx.operand(node, 1).rank > batch_dims:
        return _token_gather_strategies(node, ctx)
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
    if ctx.config.gather_choices and batch_dims == 0 and node.attr("accumulated"):
        return _table_gradient_strategies(node, ctx)
    if ctx.config.gather_choices and batch_dims > 0 and axis == batch_dims:
        return _token_scatter_strategies(node, ctx)
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


def _table_lookup_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    """An embedding lookup (a weight table indexed by tokens) as a choice of its own: the output
    takes the indices' splits, and the table may be split over the other axes along the looked-up
    dim (Megatron's vocabulary-parallel embedding): each device picks the rows it holds, the
    others are zero, and the partial results are all-reduced (or reduce-scattered onto a whole
    output dim) over those axes."""
    axis = node.attr("axis")
    table, indices = ctx.operand(node, 0), ctx.operand(node, 1)
    strategies = []
    for index_spec in _gathered_variants(_distinct_outputs(ctx, indices.id), range(indices.rank)):
        out = ShardingSpec(((),) * axis + index_spec.dims + ((),) * (table.rank - axis - 1))
        for split in _free_axis_sets(ctx, index_spec, table.shape[axis]):
            table_spec = ShardingSpec(tuple(split if d == axis else () for d in range(table.rank)))
            strategies.extend(_with_partial_sums(node, ctx, out, (table_spec, index_spec), split))
    return NodeStrategies(node.id, tuple(strategies))


def _table_gradient_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    """An embedding's gradient (updates scattered into a zero table) as a choice of its own: the
    table gradient keeps the updates' splits of its other dims, sums the partial tables of the
    index dims' splits, and may be split along the scattered dim over axes the updates do not
    use (each device adds only the rows it holds: the vocabulary-parallel embedding's gradient)."""
    axis = node.attr("axis")
    indices, updates = ctx.operand(node, 0), ctx.operand(node, 1)
    picked = indices.rank
    strategies = []
    for update_spec in _gathered_variants(_distinct_outputs(ctx, updates.id), range(axis, axis + picked)):
        summed = tuple(a for d in update_spec.dims[axis:axis + picked] for a in d)
        for split in _free_axis_sets(ctx, update_spec, node.shape[axis]):
            out = ShardingSpec(update_spec.dims[:axis] + (split,) + update_spec.dims[axis + picked:])
            index_spec = ShardingSpec(update_spec.dims[axis:axis + picked])
            strategies.extend(_with_partial_sums(node, ctx, out, (index_spec, update_spec), summed))
    return NodeStrategies(node.id, tuple(strategies))


def _token_gather_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    """Tokens gathered out of their sequences (an MoE's dispatch, or its combine's gradient) as a
    choice of its own: rows keep the operand's batch splits, or those splits move onto the picked
    dim as the rows are gathered (an all-to-all to the experts)."""
    axis = node.attr("axis")
    operand, indices = ctx.operand(node, 0), ctx.operand(node, 1)
    picked = indices.rank - axis
    strategies = []
    for spec in _distinct_outputs(ctx, operand.id):
        whole = ShardingSpec(spec.dims[:axis] + ((),) + spec.dims[axis + 1:])
        out = ShardingSpec(whole.dims[:axis] + ((),) * picked + whole.dims[axis + 1:])
        index_spec = ShardingSpec(whole.dims[:axis] + ((),) * picked)
        held = ctx.held_bytes(node, out)
        choices = [(out, ())]
        moved = tuple(a for a in out.dims[axis - 1] if ctx.mesh.shape[a] > 1)
        if moved and ctx.fits(node.shape[axis], moved):
            to_experts = ShardingSpec(tuple(() if d == axis - 1 else moved if d == axis else a
                                            for d, a in enumerate(out.dims)))
            choices.append((to_experts, (ctx.collective(CollectiveKind.ALL_TO_ALL, moved,
                                                        ctx.local_bytes(node, out)),)))
        for result, collectives in choices:
            held = ctx.held_bytes(node, result)
            strategies.append(Strategy(f"{result} = gather {whole} {index_spec}", result, (whole, index_spec),
                                       compute=_compute(node, ctx, out, (whole, index_spec)),
                                       communication=sum(c.cost for c in collectives) * ctx.communication_weight(node),
                                       memory=held, collectives=collectives,
                                       penalty=ctx.model.activation_price * held))
    return NodeStrategies(node.id, tuple(strategies))


def _token_scatter_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    """Tokens scattered back into their sequences (an MoE's combine) as a choice of its own: the
    updates as they come (their index dims' splits summed by an all-reduce), or with those splits
    moved onto the batch dims first (an all-to-all back from the experts), so every device adds
    whole rows of its own sequences."""
    axis = node.attr("axis")
    indices, updates = ctx.operand(node, 0), ctx.operand(node, 1)
    picked = indices.rank - axis
    strategies = []
    for spec in _moved_onto_batch(_distinct_outputs(ctx, updates.id), axis, picked, updates.shape, ctx):
        out = ShardingSpec(spec.dims[:axis] + ((),) + spec.dims[axis + picked:])
        index_spec = ShardingSpec(spec.dims[:axis] + spec.dims[axis:axis + picked])
        summed = tuple(a for d in spec.dims[axis:axis + picked] for a in d)
        strategies.extend(_with_partial_sums(node, ctx, out, (index_spec, spec), summed))
    return NodeStrategies(node.id, tuple(strategies))


def _moved_onto_batch(specs: list[ShardingSpec], batch: int, picked: int, shape,
                      ctx: RuleContext) -> list[ShardingSpec]:
    """`specs` and each with the axes of its `picked` dims after `batch` moved onto the last batch
    dim (when it fits)."""
    variants = list(specs)
    for spec in specs:
        moved = tuple(a for d in spec.dims[batch:batch + picked] for a in d)
        onto = tuple(sorted(spec.dims[batch - 1] + moved))
        if moved and ctx.fits(shape[batch - 1], onto):
            dims = list(spec.dims)
            dims[batch - 1] = onto
            for d in range(batch, batch + picked):
                dims[d] = ()
            variants.append(ShardingSpec(tuple(dims)))
    return list(dict.fromkeys(variants))


def _distinct_outputs(ctx: RuleContext, node_id: int) -> list[ShardingSpec]:
    return list(dict.fromkeys(s.output for s in ctx.strategies_of(node_id).strategies))


def _gathered_variants(specs: list[ShardingSpec], dims) -> list[ShardingSpec]:
    """`specs` and each with the splits of `dims` dropped (the operand gathered along them first,
    which frees their axes for the table: Megatron gathers a sequence-parallel input this way)."""
    dims = tuple(dims)
    variants = [spec for spec in specs]
    for spec in specs:
        axes = [a for d in dims for a in spec.dims[d]]
        for mask in itertools.product((False, True), repeat=len(axes)):
            dropped = {a for a, drop in zip(axes, mask, strict=True) if drop}
            if dropped:
                variants.append(spec.without_axes(sorted(dropped)))
    return list(dict.fromkeys(variants))


def _free_axis_sets(ctx: RuleContext, used: ShardingSpec, size: int) -> list[tuple[int, ...]]:
    """The empty split and every non-empty set of mesh axes `used` leaves free that `size` fits."""
    free = [a for a in ctx.axes if a not in used.axes()]
    sets = [tuple(a for a, keep in zip(free, mask, strict=True) if keep)
            for mask in itertools.product((False, True), repeat=len(free))]
    return [s for s in sets if not s or ctx.fits(size, s)]


def _with_partial_sums(node: Node, ctx: RuleContext, out: ShardingSpec, operands: tuple[ShardingSpec, ...],
                       summed: tuple[int, ...]) -> list[Strategy]:
    """The strategy whose partial results over `summed` are all-reduced, and (with
    reduce-scatter on) those that reduce-scatter them onto a whole output dim instead (an
    accumulated gradient still holds its whole partial sum until the once-per-iteration
    reduction)."""
    choices = [(out, CollectiveKind.ALL_REDUCE)]
    if ctx.config.reduce_scatter and any(ctx.mesh.shape[a] > 1 for a in summed):
        choices += [(ShardingSpec(tuple(summed if i == d else a for i, a in enumerate(out.dims))),
                     CollectiveKind.REDUCE_SCATTER)
                    for d, axes in enumerate(out.dims) if not axes and ctx.fits(node.shape[d], summed)]
    strategies = []
    for spec, kind in choices:
        collectives = ((ctx.collective(kind, summed, ctx.local_bytes(node, out)),)
                       if any(ctx.mesh.shape[a] > 1 for a in summed) else ())
        held = ctx.held_bytes(node, spec)
        if kind is CollectiveKind.REDUCE_SCATTER and node.attr("accumulated"):
            held = max(held, ctx.local_bytes(node, out))
        strategies.append(Strategy(f"{spec} = {node.op} {operands[0]} {operands[1]}", spec, operands,
                                   compute=_compute(node, ctx, spec, operands) * ctx.compute_weight(node),
                                   communication=sum(c.cost for c in collectives) * ctx.communication_weight(node),
                                   memory=held, collectives=collectives, penalty=ctx.model.activation_price * held))
    return strategies


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
