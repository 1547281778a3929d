"""Memory prices: Lagrangian relaxation of the memory rows, solved by coordinate descent.

Incumbent -> better Incumbent. When memory binds, which nodes get the memory at the peak is
a global trade-off that single-node moves and small windows cannot make. Each round prices
every row (lambda >= 0, cost per byte), lets every node pick its cheapest strategy under
cost + priced usage given its neighbours (a sweep of coordinate descent), raises the prices
of rows left over capacity and lowers the others (subgradient steps), then repairs the
priced assignment into a feasible one (cheapest memory cuts first at the most violated row)
and keeps it if it beats the incumbent.
"""

from __future__ import annotations

import time

import numpy as np

from meshplan.intra.forest import forest_descent, random_forest
from meshplan.intra.local_search import Incumbent, improve_by_moves


def price_memory(inc: Incumbent, deadline: float, rng: np.random.Generator, rounds: int = 200) -> int:
    """Improve `inc` in place; returns how many rounds improved it."""
    q, rows = inc.problem, inc.rows
    m = q.memory
    covers = m.usages.lengths
    flat = np.repeat(q.costs.ptr[m.node] - m.usages.ptr[:-1], covers) + np.arange(len(m.usages.values))
    span_first, span_last = np.repeat(rows.first, covers), np.repeat(rows.last, covers)
    finite = rows.capacity[np.isfinite(rows.capacity)]
    scale = max(float(np.abs(finite).max(initial=1.0)), 1.0)
    total = max(abs(inc.cost), 1.0)
    lam = np.zeros(len(rows))
    trial = inc.copy()
    wins = stale = 0
    eta = 0.5
    for _ in range(rounds):
        if time.perf_counter() > deadline:
            break
        prefix = np.concatenate([[0.0], np.cumsum(lam)])
        priced = np.where(span_first <= span_last, prefix[span_last + 1] - prefix[span_first], 0.0)
        unary = q.costs.values.copy()
        np.add.at(unary, flat, m.usages.values * priced)
        for _ in range(2):
            forest_descent(trial, unary, random_forest(trial, rng))
        over = -trial.slack  # > 0 where the priced assignment breaks a row
        lam = np.maximum(0.0, lam + eta * total / scale * np.clip(over / scale, -1.0, 1.0))
        candidate = trial.copy()
        if _repair(candidate, deadline):
            improve_by_moves(candidate, min(deadline, time.perf_counter() + 2.0), rng, sweeps=3)
            if candidate.cost < inc.cost - 1e-9 * total:
                inc.reset(candidate.choice)
                wins, stale = wins + 1, 0
                continue
        stale += 1
        if stale >= 3:  # no progress at this step size: take smaller steps
            eta, stale = eta * 0.7, 0
    return wins


def _sweep(inc: Incumbent, unary: np.ndarray, rng: np.random.Generator) -> None:
    """One pass of coordinate descent on unary + edge costs (memory ignored)."""
    q = inc.problem
    for v in rng.permutation(q.num_nodes).tolist():
        local = unary[q.costs.ptr[v]:q.costs.ptr[v + 1]].copy()
        for w, e, rows_are_v in inc.neighbours[v]:
            mat = q.edge_matrix(e)
            local += mat[:, inc.choice[w]] if rows_are_v else mat[inc.choice[w], :]
        best = int(np.argmin(local))
        if best != inc.choice[v]:
            inc.move(v, best)


def _repair(inc: Incumbent, deadline: float) -> bool:
    """Cut usage at the most violated row by the cheapest moves per byte until all rows fit."""
    rows, m = inc.rows, inc.problem.memory
    while not inc.feasible:
        if time.perf_counter() > deadline:
            return False
        r = int(np.argmin(inc.slack))
        terms = np.flatnonzero((rows.first <= r) & (rows.last >= r))
        moves = []
        for v in np.unique(m.node[terms]).tolist():
            at_r = [t for t in inc.node_terms[v].tolist() if rows.first[t] <= r <= rows.last[t]]
            use = np.sum([m.usages.row(t) for t in at_r], axis=0)
            saved = use[inc.choice[v]] - use
            ok = (saved > 0) & inc.memory_fits(v, repairing=True)
            if not ok.any():
                continue
            local = inc.local_costs(v)
            ratio = np.where(ok, (local - local[inc.choice[v]]) / np.where(ok, saved, 1.0), np.inf)
            j = int(np.argmin(ratio))
            moves.append((float(ratio[j]), v, j, float(saved[j])))
        if not moves:
            return False
        need = -inc.slack[r]
        for _, v, j, saved in sorted(moves):
            inc.move(v, j)
            need -= saved
            if need <= 0:
                break
    return True
