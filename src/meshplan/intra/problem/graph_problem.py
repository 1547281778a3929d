"""StrategyGraph -> StrategyProblem: a model-built or captured graph as the array problem.

One problem node per decision (a group of a leader and its followers; with layer sharing,
all groups that share one choice). Node costs are the groups' compute + communication +
resharding vectors summed; edges are the resharding matrices between decisions (an edge
inside one shared decision adds its diagonal); an alias pair forbids the pairs of specs that
differ; each graph node's value is one memory term over its live range, with the memory of
its strategy under each choice of its decision.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.intra.problem.arrays import FORBIDDEN, MemoryTerms, Ragged, StrategyProblem
from meshplan.intra.strategy_graph import StrategyGraph, live_ranges

BUDGET_TOLERANCE = 1e-9  # relative: a plan exactly at the budget must not fail on rounding


@dataclass(frozen=True, slots=True)
class GraphProblem:
    """The problem and where each group's choice is (`node_of[g]`: its problem node)."""

    problem: StrategyProblem
    node_of: dict[int, int]

    def group_choice(self, choice: np.ndarray) -> dict[int, int]:
        return {g: int(choice[c]) for g, c in self.node_of.items()}


def graph_problem(sg: StrategyGraph, budget: float | None, canon: dict[int, int] | None = None) -> GraphProblem:
    """The array problem of `sg` under a per-device memory budget (None: unlimited)."""
    canon = canon or {g: g for g in sg.groups}
    decisions = list(dict.fromkeys(canon[g] for g in sg.groups))
    index = {c: k for k, c in enumerate(decisions)}
    node_of = {g: index[canon[g]] for g in sg.groups}
    costs = [np.zeros(sg.size(c)) for c in decisions]
    for g in sg.groups:
        costs[node_of[g]] += sg.compute[g] + sg.communication[g] + sg.resharding[g]
    for g, bad in sg.forbidden.items():
        costs[node_of[g]][sorted(bad)] = FORBIDDEN
    edges: dict[tuple[int, int], np.ndarray] = {}
    for (a, b), matrix in sg.edges.items():
        _add_edge(costs, edges, node_of[a], node_of[b], matrix)
    for a, b, equal in sg.aliases:
        _add_edge(costs, edges, node_of[a], node_of[b], np.where(equal, 0.0, FORBIDDEN))
    pairs = sorted(edges)
    memory = _memory(sg, node_of)  # also without a budget: less memory breaks ties between plans
    limit = None if budget is None else budget * (1 + BUDGET_TOLERANCE)
    problem = StrategyProblem(Ragged.from_rows(costs), np.array(pairs, dtype=np.int64).reshape(-1, 2),
                              Ragged.from_rows([edges[p].ravel() for p in pairs]), memory, limit, sg.graph.name)
    return GraphProblem(problem, node_of)


def _add_edge(costs: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray], a: int, b: int,
              matrix: np.ndarray) -> None:
    if a == b:  # one decision on both ends: only equal choices meet
        costs[a] += np.diag(matrix)
        return
    key, m = ((a, b), matrix) if a < b else ((b, a), matrix.T)
    edges[key] = edges[key] + m if key in edges else m.astype(np.float64)


def _memory(sg: StrategyGraph, node_of: dict[int, int]) -> MemoryTerms:
    first, last = live_ranges(sg.graph, sg.model.parameters_held)
    terms = [(v, sg.memory(v)) for v in range(len(sg.graph))]
    terms = [(v, use) for v, use in terms if use.any()]
    if not terms:
        return MemoryTerms.empty()
    node = np.array([node_of[sg.leader[v]] for v, _ in terms], dtype=np.int64)
    vs = np.array([v for v, _ in terms], dtype=np.int64)
    return MemoryTerms(node, first[vs], last[vs] + 1, Ragged.from_rows([use for _, use in terms]))
