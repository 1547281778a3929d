"""A feasible assignment fast: greedy by memory, then feasible single-node moves.

Input: a presolved StrategyProblem and its memory rows. Output: `Incumbent`, a mutable
assignment that keeps its cost and per-row memory slack up to date, so that moves (here) and
window re-optimizations (`lns`) can be checked and applied in time proportional to what they
touch.

The greedy start takes, per node, the strategy that uses the least memory (ties: the cheaper
one); when even that exceeds the limit somewhere, no assignment fits and the problem is
infeasible only if the smallest usage of every term already breaks it (checked by the
caller). Local moves then switch one node to its cheapest strategy that keeps every row
within its capacity, sweeping until no node improves.
"""

from __future__ import annotations

import time

import numpy as np

from meshplan.intra.memory import MemoryRows, row_loads
from meshplan.intra.problem import StrategyProblem


class Incumbent:
    """An assignment of a reduced problem with its cost and memory slack per row."""

    def __init__(self, problem: StrategyProblem, rows: MemoryRows, choice: np.ndarray) -> None:
        self.problem, self.rows = problem, rows
        self.choice = np.asarray(choice, dtype=np.int64).copy()
        self.neighbours = _neighbours(problem)
        self.node_terms = _node_terms(problem)
        self.reset(self.choice)

    def reset(self, choice: np.ndarray) -> None:
        """Take another assignment (recomputing its cost and slack)."""
        self.choice = np.asarray(choice, dtype=np.int64).copy()
        m = self.problem.memory
        use = m.usages.values[m.usages.ptr[:-1] + self.choice[m.node]] if len(m) else np.zeros(0)
        self.slack = self.rows.capacity - row_loads(self.rows, use)
        self.cost = self.problem.cost_of(self.choice)

    def copy(self) -> Incumbent:
        twin = object.__new__(Incumbent)
        twin.problem, twin.rows, twin.neighbours, twin.node_terms = (self.problem, self.rows, self.neighbours,
                                                                     self.node_terms)
        twin.choice, twin.slack, twin.cost = self.choice.copy(), self.slack.copy(), self.cost
        return twin

    @property
    def feasible(self) -> bool:
        return bool((self.slack >= 0).all())

    def local_costs(self, v: int) -> np.ndarray:
        """Node v's cost per strategy given its neighbours' current strategies."""
        out = self.problem.costs.row(v).copy()
        for w, e, rows_are_v in self.neighbours[v]:
            m = self.problem.edge_matrix(e)
            out += m[:, self.choice[w]] if rows_are_v else m[self.choice[w], :]
        return out

    def memory_fits(self, v: int, repairing: bool = False) -> np.ndarray:
        """Per strategy of v, whether switching to it keeps every row within capacity (with
        `repairing`: adds nothing to rows already over capacity and keeps the others within)."""
        terms = self.node_terms[v]
        if len(terms) == 0:
            return np.ones(self.problem.sizes[v], dtype=bool)
        m, rows = self.problem.memory, self.rows
        first, last = rows.first[terms], rows.last[terms]
        cuts = np.unique(np.concatenate([first, last + 1]))
        lo, hi = cuts[0], cuts[-1]
        if hi <= lo:
            return np.ones(self.problem.sizes[v], dtype=bool)
        seg_slack = np.minimum.reduceat(self.slack[lo:hi], cuts[:-1] - lo)
        cover = (first[:, None] <= cuts[None, :-1]) & (last[:, None] >= cuts[None, :-1])
        use = np.vstack([m.usages.row(t) for t in terms])
        delta = (use - use[:, [self.choice[v]]]).T @ cover  # [strategy, segment]
        if repairing:
            seg_slack = np.maximum(seg_slack, 0.0)
        return np.all(delta <= seg_slack[None, :] + 1e-9 * np.abs(seg_slack[None, :]), axis=1)

    def move(self, v: int, new: int, local: np.ndarray | None = None) -> None:
        """Switch v to strategy `new`, updating cost and slack."""
        old = int(self.choice[v])
        if old == new:
            return
        local = self.local_costs(v) if local is None else local
        self.cost += float(local[new] - local[old])
        m, rows = self.problem.memory, self.rows
        for t in self.node_terms[v]:
            u = m.usages.row(t)
            if rows.first[t] <= rows.last[t]:
                self.slack[rows.first[t]:rows.last[t] + 1] -= u[new] - u[old]
        self.choice[v] = new


def _neighbours(problem: StrategyProblem) -> list[list[tuple[int, int, bool]]]:
    out: list[list[tuple[int, int, bool]]] = [[] for _ in range(problem.num_nodes)]
    for e, (u, v) in enumerate(problem.edge_nodes.tolist()):
        out[u].append((v, e, True))
        out[v].append((u, e, False))
    return out


def _node_terms(problem: StrategyProblem) -> list[np.ndarray]:
    node = problem.memory.node
    order = np.argsort(node, kind="stable")
    bounds = np.searchsorted(node[order], np.arange(problem.num_nodes + 1))
    return [order[bounds[v]:bounds[v + 1]] for v in range(problem.num_nodes)]


def least_memory_choice(problem: StrategyProblem, rows: MemoryRows) -> np.ndarray:
    """Per node, the strategy with the smallest usage summed over the rows its terms cover
    (ties broken by cost)."""
    m = problem.memory
    span = np.maximum(rows.last - rows.first + 1, 0).astype(np.float64)
    weight = np.zeros(len(problem.costs.values))
    if len(m):
        flat = np.repeat(problem.costs.ptr[m.node], m.usages.lengths) + _local_index(m.usages)
        np.add.at(weight, flat, m.usages.values * np.repeat(span, m.usages.lengths))
    choice = np.zeros(problem.num_nodes, dtype=np.int64)
    costs = problem.costs
    for v in range(problem.num_nodes):
        a, b = costs.ptr[v], costs.ptr[v + 1]
        choice[v] = int(np.lexsort((costs.values[a:b], weight[a:b]))[0])
    return choice


def _local_index(r) -> np.ndarray:
    return np.arange(len(r.values)) - np.repeat(r.ptr[:-1], r.lengths)


def improve_by_moves(inc: Incumbent, deadline: float, rng: np.random.Generator, sweeps: int = 50) -> int:
    """Feasible single-node moves, in random order, until a sweep improves nothing."""
    moves = 0
    for _ in range(sweeps):
        improved = 0
        for v in rng.permutation(inc.problem.num_nodes):
            if time.perf_counter() > deadline:
                return moves
            local = inc.local_costs(int(v))
            current = local[inc.choice[v]]
            better = local < current - 1e-9 * max(abs(current), 1.0)
            if not better.any():
                continue
            fits = better & inc.memory_fits(int(v))
            if fits.any():
                candidates = np.flatnonzero(fits)
                inc.move(int(v), int(candidates[np.argmin(local[candidates])]), local)
                improved += 1
        moves += improved
        if not improved:
            break
    return moves
