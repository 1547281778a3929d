"""Rules for nodes without operands: parameters, constants, iota."""

from __future__ import annotations

from meshplan.ir.node import Node, OpKind
from meshplan.sharding.context import RuleContext
from meshplan.sharding.rules.assign import assign_axes
from meshplan.sharding.rules.registry import register_rule
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import NodeStrategies, Strategy, StrategySpace


@register_rule(OpKind.PARAMETER)
def parameter_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    """A parameter may be split over any axes on any dims, or replicated."""
    if node.attr("per_iteration"):
        ctx.state_derived.add(node.id)  # optimizer state: the update follows its layout
    specs = _alpa_parameter_specs(node, ctx) if ctx.config.space is StrategySpace.ALPA \
        else full_specs(node, ctx)
    split = [s for s in specs if not s.is_replicated]
    forced = ctx.config.force_batch_dim_to_mesh_dim
    batch_dim = node.attr("batch_dim", 0 if node.attr("batch_input") else None)  # models' graphs: dim 0
    if forced is not None and batch_dim is not None:
        # Inputs that arrive split over the batch (activations, their gradients, tokens); whole
        # when the forced axis has one device.
        if ctx.mesh.shape[forced] > 1:
            on_axis = [s for s in split if forced in s.dims[batch_dim]]
        else:
            on_axis = [s for s in [*split, ShardingSpec.replicated(node.rank)] if not s.dims[batch_dim]]
        if on_axis:
            return NodeStrategies(node.id, tuple(Strategy(_spec_name(s), s, (), memory=ctx.local_bytes(node, s))
                                                 for s in on_axis))
    if ctx.config.allow_replicated_parameters or not split:
        split.append(ShardingSpec.replicated(node.rank))
    price, replicated = ctx.model.memory_price, ctx.model.replicated_parameter_cost
    strategies = tuple(Strategy(_spec_name(s), s, (), compute=replicated if s.is_replicated else 0.0,
                                memory=ctx.local_bytes(node, s), penalty=price * ctx.local_bytes(node, s))
                       for s in split)
    return NodeStrategies(node.id, strategies)


def full_specs(node: Node, ctx: RuleContext) -> list[ShardingSpec]:
    """Every split of the node's dims over the mesh axes (each axis to one dim or to none)."""
    specs = []
    for assignment in assign_axes(range(node.rank), ctx.axes):
        spec = ShardingSpec(tuple(assignment.get(d, ()) for d in range(node.rank)))
        if ctx.spec_fits(node.shape, spec):
            specs.append(spec)
    return specs


def _alpa_parameter_specs(node: Node, ctx: RuleContext) -> list[ShardingSpec]:
    """One split dim on one axis at a time (Alpa's "S{i} @ {j}")."""
    specs = []
    for d in range(node.rank):
        for axis in ctx.axes:
            if ctx.fits(node.shape[d], (axis,)):
                specs.append(ShardingSpec(tuple((axis,) if i == d else () for i in range(node.rank))))
    return specs


def _spec_name(spec: ShardingSpec) -> str:
    if spec.is_replicated:
        return "R"
    return " ".join(f"S{d} @ {''.join(map(str, a))}" for d, a in enumerate(spec.dims) if a)


@register_rule(OpKind.CONSTANT, OpKind.IOTA)
def replicated_leaf(node: Node, ctx: RuleContext) -> NodeStrategies:
    """Constants are made on every device; any split of them is free slicing later. An iota is
    generated inside the kernels that read it (compilers fuse it), so it holds no memory."""
    spec = ShardingSpec.replicated(node.rank)
    memory = 0.0 if node.kind is OpKind.IOTA else ctx.held_bytes(node, spec)
    return NodeStrategies(node.id, (Strategy("R", spec, (), memory=memory),))
