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
from meshplan.intra.solve import build_strategies
from meshplan.intra.strategy_graph import StrategyGraph
from meshplan.ir import Graph


def unshareable_pairs(graph: Graph, mesh: LogicalMesh, options: IntraOptions,
                      pairs: Iterable[tuple[int, int]]) -> set[tuple[int, int]]:
    """The (parameter node, result node) pairs of `pairs` that no strategy lays out alike."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the planner reports unsupported ops and dropped layout pins
        sg, _ = build_strategies(graph, mesh, options)
    return {(p, r) for p, r in pairs if not _can_share(sg, p, r)}


def _can_share(sg: StrategyGraph, param: int, result: int) -> bool:
    p_specs = _allowed_specs(sg, param)
    r_specs = _allowed_specs(sg, result)
    if sg.leader[param] == sg.leader[result]:  # one decision: choice i of both
        return any(p is not None and p == r for p, r in zip(p_specs, r_specs, strict=True))
    return any(p == r for p in p_specs if p is not None for r in r_specs if r is not None)


def _allowed_specs(sg: StrategyGraph, node: int) -> list:
    """The node's output spec per choice of its group, None where the choice is forbidden."""
    bad = sg.forbidden.get(sg.leader[node], set())
    return [None if i in bad else s.output for i, s in enumerate(sg.nodes[node].strategies)]
