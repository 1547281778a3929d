"""A feasible assignment fast: greedy by memory, repair, then feasible moves.

Input: a presolved StrategyProblem and its memory rows. Output: assignments as arrays, and
`Incumbent`, a mutable assignment that keeps its cost and per-row memory slack up to date, so
that window re-optimizations (`lns`) can be checked and applied in time proportional to what
they touch.

The greedy start takes, per node, the strategy that uses the least memory (ties: the cheaper
one); when even that exceeds the limit somewhere, no assignment fits and the problem is
infeasible only if the smallest usage of every term already breaks it (checked by the
caller). `repair` brings an assignment over capacity back within it by pricing the rows
that are over; `improve_feasible` moves whole colour classes at once (`pairwise.icm_sweep`)
and takes back the moves that would break a row.
"""

from __future__ import annotations

import time

import numpy as np

from meshplan.intra.problem.arrays import StrategyProblem
from meshplan.intra.problem.memory import MemoryRows, TermIndex, row_loads
from meshplan.intra.search.pairwise import PairwiseIndex, class_local_costs, icm_sweep, segment_argmin


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


def repair(ix: PairwiseIndex, terms: TermIndex, unary: np.ndarray, lam: np.ndarray, choice: np.ndarray,
           deadline: float, max_rounds: int = 200) -> bool:
    """Bring `choice` (updated in place) within every row's capacity: raise the prices of the
    rows over capacity and let the nodes live there move (a colour class at a time) to their
    best strategy under the raised prices, until every row fits. Returns whether it does."""
    capacity = terms.rows.capacity
    raised = lam.copy()
    floor = _price_floor(unary, capacity)
    for _ in range(max_rounds):
        over = terms.loads(choice) > capacity
        if not over.any():
            return True
        if time.perf_counter() > deadline:
            return False
        raised[over] = raised[over] * 1.5 + floor
        priced = unary + terms.prices(raised)
        movable = np.zeros(ix.num_nodes, dtype=bool)
        movable[terms.node[terms.touching(over)]] = True
        icm_sweep(ix, priced, choice, movable)
    return bool((terms.loads(choice) <= capacity).all())


def _price_floor(unary: np.ndarray, capacity: np.ndarray) -> float:
    """A small price per byte and row: one thousandth of the mean cost per byte of capacity.

    Scale-free (no floor at one cost unit or one byte): plans priced in seconds cost 1e-8..1e-4,
    and a floor of 1e-3 "units" priced every byte a thousand times above any strategy's cost, so
    the first raise sent every node to its least memory whatever it cost. Falls back to 1 only
    for a zero scale (all costs zero, no room)."""
    finite = np.abs(unary[np.isfinite(unary)])
    scale = float(finite.mean()) if len(finite) else 0.0
    room = float(np.abs(capacity).mean()) if len(capacity) else 0.0
    return 1e-3 * (scale if scale > 0 else 1.0) / (room if room > 0 else 1.0)


def improve_feasible(ix: PairwiseIndex, terms: TermIndex, unary: np.ndarray, choice: np.ndarray,
                     sweeps: int = 10) -> int:
    """Iterated conditional modes that keep every row within capacity: a colour class moves at
    once to its best strategies; moves of nodes live at a row that the batch pushed over
    capacity are taken back until all rows fit. `choice` must fit on entry; returns moves."""
    capacity = terms.rows.capacity
    moved = 0
    for _ in range(sweeps):
        swept = 0
        for c in range(len(ix.color_entries)):
            local = class_local_costs(ix, unary, choice, c)
            best = segment_argmin(ix, local)
            now = local[ix.ptr[:-1] + choice]
            with np.errstate(invalid="ignore"):  # inf - inf: no move
                gain = now - local[ix.ptr[:-1] + best]
            go = np.flatnonzero((ix.colors == c) & (gain > 1e-12 * np.maximum(np.abs(now), 1.0)))
            old = choice[go].copy()
            choice[go] = best[go]
            while len(go):
                over = terms.loads(choice) > capacity
                if not over.any():
                    break
                at_over = np.zeros(ix.num_nodes, dtype=bool)
                at_over[terms.node[terms.touching(over)]] = True
                back = at_over[go]
                if not back.any():  # cannot happen: only moved nodes changed any load
                    choice[go] = old
                    go = go[:0]
                    break
                choice[go[back]] = old[back]
                go, old = go[~back], old[~back]
            swept += len(go)
        moved += swept
        if not swept:
            break
    return moved
