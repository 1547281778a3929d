"""Which (parameter, result) node pairs the strategy space can give one layout.

A buffer reused in place (a donated argument holding its updated value) needs its argument and
its result split alike; an alias pair with no common layout makes the ILP infeasible, so
callers drop such pairs before planning (meshplan.parallel.donation).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from meshplan.cluster.mesh import LogicalMesh
from meshplan.intra.options import IntraOptions
from meshplan.intra.strategy_graph import StrategyGraph, build_strategy_graph
from meshplan.ir import Graph
from meshplan.sharding.enumerate import UnsupportedOpWarning, enumerate_strategies


def unshareable_pairs(graph: Graph, mesh: LogicalMesh, options: IntraOptions,
                      pairs: Iterable[tuple[int, int]]) -> set[tuple[int, int]]:
    """The (parameter node, result node) pairs of `pairs` that no strategy lays out alike."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsupportedOpWarning)  # the planner reports them
        nodes = enumerate_strategies(graph, mesh, options.cost, options.rules)
    sg = build_strategy_graph(graph, mesh, options.cost, nodes)
    return {(p, r) for p, r in pairs if not _can_share(sg, p, r)}


def _can_share(sg: StrategyGraph, param: int, result: int) -> bool:
    p_specs = [s.output for s in sg.nodes[param].strategies]
    r_specs = [s.output for s in sg.nodes[result].strategies]
    if sg.leader[param] == sg.leader[result]:  # one decision: choice i of both
        return any(p == r for p, r in zip(p_specs, r_specs, strict=True))
    return any(p == r for p in p_specs for r in r_specs)
