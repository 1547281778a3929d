"""Rules for dot_general: data, tensor (column/row) and batch parallel splits (Alpa Table 3)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator

from meshplan.cost.collectives import CollectiveKind
from meshplan.cost.fusion import ATTENTION_KERNELS, BACKWARD, training_pass
from meshplan.ir.node import Node, OpKind
from meshplan.sharding.context import RuleContext
from meshplan.sharding.rules.assign import assign_axes
from meshplan.sharding.rules.registry import register_rule
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import NodeStrategies, Strategy, StrategySpace

Slot = tuple[str, int]  # ("b", i) batch, ("l", i) lhs free, ("r", i) rhs free, ("c", i) contracting


class DotDims:
    """Where each dim group of a dot sits in lhs, rhs and the output."""

    def __init__(self, node: Node, lhs: Node, rhs: Node) -> None:
        self.lb, self.rb = node.attr("lhs_batch"), node.attr("rhs_batch")
        self.lc, self.rc = node.attr("lhs_contracting"), node.attr("rhs_contracting")
        self.lf = tuple(d for d in range(lhs.rank) if d not in self.lc + self.lb)
        self.rf = tuple(d for d in range(rhs.rank) if d not in self.rc + self.rb)
        self.lhs, self.rhs, self.out = lhs, rhs, node

    def slots(self) -> list[Slot]:
        return ([("b", i) for i in range(len(self.lb))] + [("l", i) for i in range(len(self.lf))]
                + [("r", i) for i in range(len(self.rf))] + [("c", i) for i in range(len(self.lc))])

    def size(self, slot: Slot) -> int:
        group, i = slot
        dims = {"b": self.lb, "l": self.lf, "c": self.lc}
        return self.rhs.shape[self.rf[i]] if group == "r" else self.lhs.shape[dims[group][i]]

    def specs(self, assignment: dict[Hashable, tuple[int, ...]]) -> tuple[ShardingSpec, ShardingSpec, ShardingSpec]:
        """(output, lhs, rhs) specs for a slot -> axes assignment."""
        nb, nl = len(self.lb), len(self.lf)
        out = [()] * self.out.rank
        lhs, rhs = [()] * self.lhs.rank, [()] * self.rhs.rank
        for (group, i), axes in assignment.items():
            if group == "b":
                out[i], lhs[self.lb[i]], rhs[self.rb[i]] = axes, axes, axes
            elif group == "l":
                out[nb + i], lhs[self.lf[i]] = axes, axes
            elif group == "r":
                out[nb + nl + i], rhs[self.rf[i]] = axes, axes
            else:
                lhs[self.lc[i]], rhs[self.rc[i]] = axes, axes
        return ShardingSpec(tuple(out)), ShardingSpec(tuple(lhs)), ShardingSpec(tuple(rhs))


@register_rule(OpKind.DOT)
def dot_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    dims = DotDims(node, ctx.operand(node, 0), ctx.operand(node, 1))
    alpa = ctx.config.space is StrategySpace.ALPA and len(dims.lc) == 1 and len(dims.lf) == 1 \
        and len(dims.rf) == 1 and ctx.mesh.ndim <= 2
    assignments = list(_alpa_assignments(dims, ctx) if alpa else _full_assignments(dims, ctx))
    if not assignments:  # no split uses every axis (dims too small): allow idle axes
        assignments = list(_full_assignments(dims, ctx, require_all=False))
    strategies = [s for a in assignments for s in _strategies(node, dims, a, ctx, scatter=not alpa)]
    return NodeStrategies(node.id, tuple(keep_forced_batch(node, strategies, ctx)))


def keep_forced_batch(node: Node, strategies: list[Strategy], ctx: RuleContext) -> list[Strategy]:
    """With the batch dim forced onto a mesh axis, a contraction's strategies that split its
    batch dim over that axis (or keep it whole when the axis has one device), if there are any."""
    forced = ctx.config.force_batch_dim_to_mesh_dim
    if forced is None or node.id not in ctx.batch_dims:
        return strategies
    batch_dim = ctx.batch_dims[node.id]
    if ctx.mesh.shape[forced] > 1:
        kept = [s for s in strategies if forced in s.output.dims[batch_dim]]
    else:  # an axis of one device: the micro-batch stays whole
        kept = [s for s in strategies if not s.output.dims[batch_dim]]
    return kept or strategies


def _full_assignments(dims: DotDims, ctx: RuleContext, require_all: bool | None = None) -> Iterator[dict]:
    # With compute priced at zero every axis must take part, or replication would look free.
    if require_all is None:
        require_all = ctx.config.contractions_use_all_axes
    if require_all is None:
        require_all = not ctx.model.compute_on
    for assignment in assign_axes(dims.slots(), ctx.axes, require_all=require_all):
        if all(ctx.fits(dims.size(slot), axes) for slot, axes in assignment.items()):
            yield assignment


def _alpa_assignments(dims: DotDims, ctx: RuleContext) -> Iterator[dict]:
    """The strategy list of Alpa's playground solver, in its order."""
    size = [ctx.mesh.shape[a] if a < ctx.mesh.ndim else 1 for a in (0, 1)]
    if len(dims.lb) == 2 and size[0] > 1 and size[1] > 1:
        yield {("b", 0): (0,), ("b", 1): (1,)}
        return
    lhs, rhs, con = ("l", 0), ("r", 0), ("c", 0)
    both = size[0] > 1 and size[1] > 1
    table = [({lhs: 0, rhs: 1}, True), ({lhs: 1, rhs: 0}, True),
             ({lhs: 0, con: 1}, size[1] > 1), ({lhs: 1, con: 0}, size[0] > 1),
             ({con: 0, rhs: 1}, both), ({con: 1, rhs: 0}, both)]
    for entry, enabled in table:
        if enabled:
            yield {slot: (axis,) for slot, axis in entry.items() if size[axis] > 1}
    for i in range(len(dims.lb)):
        for axis in (0, 1):
            if size[axis] > 1 and dims.size(("b", i)) >= size[axis]:
                yield {("b", i): (axis,)}


def _strategies(node: Node, dims: DotDims, assignment: dict, ctx: RuleContext, scatter: bool) -> Iterator[Strategy]:
    """The assignment's strategy, whose partial sums (if any) are all-reduced, and with
    `ctx.config.reduce_scatter` (and `scatter`) one more per output dim the partial sums can
    instead be reduce-scattered onto (ZeRO-2's gradients, Megatron's sequence parallelism)."""
    out, lhs, rhs = dims.specs(assignment)
    contracted = tuple(a for (group, _), axes in assignment.items() if group == "c" for a in axes)
    local_contract = math.prod(math.ceil(dims.size(("c", i)) / ctx.mesh.axis_size(assignment.get(("c", i), ())))
                               for i in range(len(dims.lc)))
    flops = 2.0 * math.prod(out.shard_shape(node.shape, ctx.mesh)) * local_contract
    local = {slot: math.ceil(dims.size(slot) / ctx.mesh.axis_size(assignment.get(slot, ()))) for slot in dims.slots()}
    compute = _compute(node, dims, local, flops, local_contract, ctx)
    partial = ctx.local_bytes(node, out)  # each device's partial result before any reduction
    for spec, reduction in reductions(node, out, contracted, ctx, scatter):
        yield contraction_strategy(node, spec, (lhs, rhs), contracted, reduction, compute, partial, ctx)


def reductions(node: Node, out: ShardingSpec, contracted: tuple[int, ...], ctx: RuleContext,
               scatter: bool = True) -> Iterator[tuple[ShardingSpec, CollectiveKind]]:
    """(output spec, reduction) choices of a contraction whose partial sums over `contracted` land
    as `out`: all-reduced, and with `ctx.config.reduce_scatter` (and `scatter`) reduce-scattered
    onto each output dim they fit (ZeRO-2's gradients, Megatron's sequence parallelism)."""
    yield out, CollectiveKind.ALL_REDUCE
    if not (contracted and scatter and ctx.config.reduce_scatter
            and any(ctx.mesh.shape[a] > 1 for a in contracted)):
        return
    for d, axes in enumerate(out.dims):
        # Onto a whole dim, or, under a given layout (Megatron's sequence parallelism beside
        # context parallelism), onto a dim already split, further within each shard.
        if (not axes or ctx.fixed) and ctx.fits(node.shape[d], tuple(axes) + contracted):
            onto = tuple(sorted(tuple(axes) + contracted))
            yield ShardingSpec(tuple(onto if i == d else a for i, a in enumerate(out.dims))), \
                CollectiveKind.REDUCE_SCATTER


def _compute(node: Node, dims: DotDims, local: dict, flops: float, contract: float, ctx: RuleContext) -> float:
    """Seconds of the local products: a GEMM per batch entry on the efficiency curve (without
    kernel models, batch dims fold into m), or part of a fused attention kernel."""
    kernels, fusion = ctx.model.kernels, ctx.fusion
    if kernels is not None and fusion is not None and fusion.is_fused_attention(node.id):
        return kernels.attention(flops, ATTENTION_KERNELS[node.attr("kernel")], training_pass(node) == BACKWARD)
    batch = math.prod(v for (group, _), v in local.items() if group == "b")
    m = math.prod(v for (group, _), v in local.items() if group == "l")
    n = math.prod(v for (group, _), v in local.items() if group == "r")
    if kernels is None:
        return ctx.model.contraction_cost(flops, batch * m, n, contract)
    return ctx.model.contraction_cost(flops, m, n, contract, batch)


def contraction_strategy(node: Node, out: ShardingSpec, operands: tuple[ShardingSpec, ShardingSpec],
                         contracted: tuple[int, ...], reduction: CollectiveKind, compute: float, partial: float,
                         ctx: RuleContext) -> Strategy:
    """A contraction's strategy: its partial sums over the `contracted` axes are all-reduced or
    reduce-scattered (`reduction`) onto `out`; `partial` is the bytes of each device's partial result."""
    collectives = (ctx.collective(reduction, contracted, partial),) if contracted else ()
    memory = ctx.held_bytes(node, out)
    if reduction is CollectiveKind.REDUCE_SCATTER and node.attr("accumulated"):
        # Summed over micro-batches before the once-per-iteration reduction: the whole partial
        # result is accumulated (Megatron's gradient buffer with the distributed optimizer).
        memory = max(memory, partial)
    name = f"{out} = {operands[0]} x {operands[1]}"
    if contracted:
        kind = "allreduce" if reduction is CollectiveKind.ALL_REDUCE else "reducescatter"
        name += f" ({kind} @ {''.join(map(str, sorted(contracted)))})"
    return Strategy(name, out, operands, compute=compute,
                    communication=sum(c.cost for c in collectives) * ctx.communication_weight(node), memory=memory,
                    collectives=collectives, penalty=ctx.model.activation_price * memory)
