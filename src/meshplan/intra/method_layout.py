"""Method layouts: what DataParallel, ZeRO-2, ZeRO-3 and tensor parallelism promise about every
value's sharding, turned into choices the ILP may not make (StrategyGraph.forbidden).

The cost model alone may find a plan cheaper than the layout a method names (split an
element-wise chain by columns, shard the optimizer update under data parallelism); a user who
asks for DataParallel reads "replicated weights, batch split, gradients all-reduced", so the
method's layout is a constraint, not a price. Values are told apart by the graph alone:

* batch values: those the batch inputs' batch dim reaches (`ir.dimflow.trace_dims` from the
  parameters tagged `batch_dim`), with that dim;
* forward values: the other values that feed a batch value (weights, masks, weights cast or
  transposed for use);
* update values: the rest (weight gradients once summed over the batch, the loss, the
  optimizer state and its update). Inputs among them are the optimizer state; inputs among
  the forward values are the weights.

| layout | batch values | weights | other forward values | optimizer state | other update values |
|---|---|---|---|---|---|
| DATA_PARALLEL | batch dim split over every axis, nothing else | whole | whole | whole | whole |
| ZERO2 | same | whole | whole | one dim split evenly | free |
| ZERO3 | same | one dim split evenly | free | one dim split evenly | free |
| TENSOR_PARALLEL | batch dim whole (inputs whole) | one dim split evenly (rank >= 2) | free | free | free |

Under the data-parallel layouts an operator also may not ask for a value pinned to one layout
(batch values; whole values) in another layout when that costs a collective: activations are
never gathered or exchanged, so DATA_PARALLEL's only collectives are the all-reduces of partial
sums over the batch, and ZeRO adds only the conversions of the state it shards. Under
TENSOR_PARALLEL no weight, nor a value that follows its layout, is converted with a collective.
Results that update an input in place take its layout through `Graph.aliases` (the runtime adds
one per updated input; element-wise ones become relayout points, `free_aliased_results`). A pin
that contradicts the choice another member of the same decision group already fixed (a follower
of a differently pinned leader) is dropped and named in a LayoutWarning.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import numpy as np

from meshplan.intra.problem.arrays import FORBIDDEN
from meshplan.intra.strategy_graph import StrategyGraph
from meshplan.ir.dimflow import trace_dims
from meshplan.ir.graph import Graph
from meshplan.ir.node import OpKind
from meshplan.sharding.spec import ShardingSpec

Allowed = Callable[[ShardingSpec], bool]


class MethodLayout(enum.Enum):
    """The layout a parallelization method promises (see the module's table)."""

    AUTO = "auto"
    DATA_PARALLEL = "data-parallel"
    ZERO2 = "zero-2"
    ZERO3 = "zero-3"
    TENSOR_PARALLEL = "tensor-parallel"


def free_aliased_results(graph: Graph) -> Graph:
    """`graph` with every element-wise result that updates an input in place (`Graph.aliases`)
    made a relayout point: a choice of its own instead of its operand's. Otherwise the whole
    optimizer update follows the gradient's decision, and a new weight whole at rest (ZeRO-2) or
    a moment split at rest next to an all-reduced bias gradient could not be planned."""
    results = {r for _, r in graph.aliases if graph[r].kind is OpKind.ELEMENTWISE and graph[r].operands}
    if not results:
        return graph
    nodes = tuple(dataclasses.replace(n, attrs=tuple(sorted({**dict(n.attrs), "relayout": True}.items())))
                  if n.id in results else n for n in graph.nodes)
    return dataclasses.replace(graph, nodes=nodes)


def pin_method_layout(sg: StrategyGraph, layout: MethodLayout, forbid_gathers: bool = True) -> tuple[str, ...]:
    """Forbid the choices of `sg` that break `layout`; return the nodes whose pin was dropped.

    Needs the batch inputs tagged (`batch_dim` attributes); without any, only the weights'
    and the optimizer state's pins apply. `forbid_gathers=False` lets TENSOR_PARALLEL convert
    a weight whose uses no single layout serves (a tied embedding: a lookup and a matmul).
    """
    if layout is MethodLayout.AUTO:
        return ()
    pins, exact = _pins(sg, layout)
    dropped = [sg.graph[n].label for n in sorted(pins) if not _forbid(sg, n, _violating_outputs(sg, n, pins[n]))]
    if layout is not MethodLayout.TENSOR_PARALLEL:
        for node in sg.graph.nodes:
            if node.operands and not _forbid(sg, node.id, _gathering_operands(sg, node.id, exact)):
                dropped.append(f"{node.label} (operands)")
    if layout is MethodLayout.TENSOR_PARALLEL and forbid_gathers:
        weights = [n for n, allowed in pins.items() if sg.graph[n].kind is OpKind.PARAMETER and n not in exact]
        _forbid_gathers(sg, weights)
    return tuple(dropped)


def _forbid_gathers(sg: StrategyGraph, weights: list[int]) -> None:
    """Weights are used where they lie: no choice may convert a weight, or a value that follows
    its layout (a transpose, a cast), with a collective."""
    graph = sg.graph
    groups = {sg.leader[w] for w in weights}
    for member in (n for n in range(len(graph)) if sg.leader[n] in groups):
        h = sg.leader[member]
        produced = [s.output for s in sg.nodes[member].strategies]
        for user in graph.users(member):
            g = sg.leader[user]
            if g in groups:
                continue
            for position in (k for k, o in enumerate(graph[user].operands) if o == member):
                required = [s.operands[position] for s in sg.nodes[user].strategies]
                bad = np.array([[bool(sg.reshard(member, p, r)) for r in required] for p in produced])
                key, bad = ((h, g), bad) if h < g else ((g, h), bad.T)
                matrix = sg.edges.get(key, np.zeros(bad.shape))
                sg.edges[key] = np.where(bad, FORBIDDEN, matrix)


def _pins(sg: StrategyGraph, layout: MethodLayout) -> tuple[dict[int, Allowed], dict[int, ShardingSpec]]:
    """Per pinned node, the specs it may take; and the nodes pinned to exactly one spec."""
    graph, mesh = sg.graph, sg.mesh
    axes = tuple(a for a, n in enumerate(mesh.shape) if n > 1)
    batch = trace_dims(graph, {n.id: n.attr("batch_dim") for n in graph.parameters()
                               if n.attr("batch_dim") is not None})
    forward = _feeding(graph, batch)
    exact: dict[int, ShardingSpec] = {}
    pins: dict[int, Allowed] = {}
    for node in graph.nodes:
        spec = _pin(node.id, graph, layout, batch, forward, axes, mesh)
        if isinstance(spec, ShardingSpec):
            exact[node.id] = spec
            pins[node.id] = spec.__eq__
        elif spec is not None:
            pins[node.id] = spec
    return pins, exact


def _pin(n: int, graph: Graph, layout: MethodLayout, batch: dict[int, int], forward: set[int],
         axes: tuple[int, ...], mesh) -> ShardingSpec | Allowed | None:
    node = graph[n]
    whole = ShardingSpec.replicated(node.rank)
    is_input = node.kind is OpKind.PARAMETER
    if layout is MethodLayout.TENSOR_PARALLEL:
        if n in batch:
            return whole if is_input else (lambda s, d=batch[n]: not s.dims[d])
        if is_input and n in forward and node.rank >= 2:
            return _split_evenly(node.shape, axes, mesh)
        return None
    if n in batch:
        split = ShardingSpec(tuple(axes if d == batch[n] else () for d in range(node.rank)))
        return split if mesh.axis_size(axes) <= node.shape[batch[n]] else None
    if layout is MethodLayout.DATA_PARALLEL or (layout is MethodLayout.ZERO2 and n in forward):
        return whole
    if is_input and (n not in forward or layout is MethodLayout.ZERO3):
        return _split_evenly(node.shape, axes, mesh)
    return None


def _split_evenly(shape: tuple[int, ...], axes: tuple[int, ...], mesh) -> ShardingSpec | Allowed:
    """One dim split over all `axes` evenly (placeable as a jit argument); whole when no dim divides."""
    size = mesh.axis_size(axes)
    if not axes or not any(d % size == 0 for d in shape):
        return ShardingSpec.replicated(len(shape))
    return lambda s: sum(1 for a in s.dims if a) == 1 and any(a == axes and shape[d] % size == 0
                                                              for d, a in enumerate(s.dims))


def _feeding(graph: Graph, batch: dict[int, int]) -> set[int]:
    """Nodes outside `batch` from which some batch value is computed."""
    feeds = set(batch)
    for node in reversed(graph.nodes):
        if node.id in feeds:
            feeds.update(node.operands)
    return feeds - set(batch)


def _violating_outputs(sg: StrategyGraph, node: int, allowed: Allowed) -> set[int]:
    return {i for i, s in enumerate(sg.nodes[node].strategies) if not allowed(s.output)}


def _gathering_operands(sg: StrategyGraph, node: int, exact: dict[int, ShardingSpec]) -> set[int]:
    """Choices of `node` that need an exactly pinned operand converted with a collective."""
    operands = sg.graph[node].operands
    bad = set()
    for i, s in enumerate(sg.nodes[node].strategies):
        if any(o in exact and sg.reshard(o, exact[o], required) for o, required in zip(operands, s.operands,
                                                                                       strict=True)):
            bad.add(i)
    return bad


def _forbid(sg: StrategyGraph, node: int, bad: set[int]) -> bool:
    """Forbid choices `bad` of the node's decision group unless that leaves none; say whether done."""
    group = sg.leader[node]
    taken = sg.forbidden.get(group, set())
    if len(taken | bad) >= sg.size(group):
        return False
    if bad:
        sg.forbidden[group] = taken | bad
    return True
