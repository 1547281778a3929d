"""Enumerate every node's strategies through the rule registry (Graph -> node strategies)."""

from __future__ import annotations

import warnings
from dataclasses import replace

from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.fusion import Fusion, fused
from meshplan.cost.model import CostModel
from meshplan.ir.dimflow import trace_dims
from meshplan.ir.graph import Graph
from meshplan.ir.node import Node, OpKind
from meshplan.sharding.context import RuleConfig, RuleContext
from meshplan.sharding.rules import (  # noqa: F401  (register rules)
    conv,
    dot,
    fallback,
    follow,
    leaves,
    ordering,
    pooling,
    random,
    windows,
)
from meshplan.sharding.rules.registry import rule_for
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import NodeStrategies


class UnsupportedOpWarning(UserWarning):
    """Some ops have no sharding rule and were planned replicated."""


def enumerate_strategies(graph: Graph, mesh: LogicalMesh, model: CostModel,
                         config: RuleConfig | None = None) -> tuple[NodeStrategies, ...]:
    """The strategies of every node, in graph order; ops without a rule get replicated."""
    config = config or RuleConfig()
    batch_dims = {}
    if config.force_batch_dim_to_mesh_dim is not None:
        batch_dims = trace_dims(graph, batch_sources(graph))
    fixed = dict(config.fixed)
    ctx = RuleContext(graph, mesh, model, config, node_depths(graph), batch_dims, constant_nodes(graph),
                      fusion_of(graph, model), fixed)
    unknown: set[str] = set()
    for node in graph.nodes:
        rule = rule_for(node.kind)
        result = rule(node, ctx) if rule else fallback.replicated_strategies(node, ctx)
        if result.fallback:
            unknown.add(node.op)
        ctx.done[node.id] = _fixed(node, result, fixed) if fixed else result
    if unknown:
        warnings.warn(
            f"no sharding rule for {', '.join(sorted(unknown))}: planned replicated "
            "(correct, but may cost memory and communication)", UnsupportedOpWarning, stacklevel=2)
    return tuple(ctx.done[n.id] for n in graph.nodes)


def reprice_parameters(graph: Graph, mesh: LogicalMesh, model: CostModel, config: RuleConfig | None,
                       previous: tuple[NodeStrategies, ...]) -> tuple[NodeStrategies, ...]:
    """`enumerate_strategies` under `model`, given the strategies `previous` enumerated under a
    model that differs from it only in `memory_price`: that price reaches parameters' strategies
    alone (their penalty), so only their rule runs again (a memory-price menu re-plans a graph
    several times; the other rules are most of the enumeration's time)."""
    ctx = RuleContext(graph, mesh, model, config or RuleConfig(), node_depths(graph), {}, constant_nodes(graph),
                      fusion_of(graph, model))
    return tuple(rule_for(OpKind.PARAMETER)(node, ctx) if node.kind is OpKind.PARAMETER else previous[node.id]
                 for node in graph.nodes)


def _fixed(node: Node, result: NodeStrategies, fixed: dict[int, ShardingSpec]) -> NodeStrategies:
    """A free choice narrowed to the strategies giving the node its fixed output spec whose
    operands arrive as their own fixed specs or gathered (some splits dropped) rather than moved
    (the ILP picks the cheapest of those; followers take their leader's choice). When no
    strategy gives the spec, the node keeps every choice (the layout cannot pin it)."""
    target = fixed.get(node.id)
    if target is None or result.follows is not None:
        return result
    kept = [s for s in result.strategies if s.output == target]
    if not kept:
        return result
    scores = [sum(_arrival(fixed.get(o), r) == 2 for o, r in zip(node.operands, s.operands, strict=True))
              for s in kept]
    return replace(result, strategies=tuple(s for s, score in zip(kept, scores, strict=True) if score == min(scores)))


def _arrival(produced: ShardingSpec | None, required: ShardingSpec) -> int:
    """0: an operand arrives as required (or has no fixed spec), 1: after a gather, 2: after moving splits."""
    if produced is None or produced == required:
        return 0
    gathered = all(set(need) <= set(have) for have, need in zip(produced.dims, required.dims, strict=True))
    return 1 if gathered else 2


def fusion_of(graph: Graph, model: CostModel) -> Fusion | None:
    """The fused-kernel view the model's kernel costs price (None without kernel models)."""
    return fused(graph, model.kernels.flash) if model.kernels is not None else None


def constant_nodes(graph: Graph) -> frozenset[int]:
    """Nodes whose value depends on no parameter (constants, iotas and ops on them only)."""
    found: set[int] = set()
    for node in graph.nodes:
        if node.kind in (OpKind.CONSTANT, OpKind.IOTA) or (
                node.kind is not OpKind.PARAMETER and node.operands and all(o in found for o in node.operands)):
            found.add(node.id)
    return frozenset(found)


def node_depths(graph: Graph) -> tuple[int, ...]:
    """Longest path length from any source to each node."""
    depth: list[int] = []
    for node in graph.nodes:
        depth.append(1 + max((depth[o] for o in node.operands), default=-1))
    return tuple(depth)


def batch_sources(graph: Graph) -> dict[int, int]:
    """Parameter id -> its batch dim: the inputs capture tagged (`batch_dim`), else dim 0 of the
    first parameter (the graphs of `meshplan.models` put the activations first)."""
    tagged = {n.id: n.attr("batch_dim") for n in graph.parameters() if n.attr("batch_dim") is not None}
    if tagged:
        return tagged
    first = graph.parameters()[:1]
    return {first[0].id: 0} if first and first[0].rank else {}
