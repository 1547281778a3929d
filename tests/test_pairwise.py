"""Vectorized pairwise moves and message-passing bounds against exhaustive enumeration."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from meshplan.intra import strategy_problem
from meshplan.intra.problem.arrays import Ragged
from meshplan.intra.problem.memory import memory_rows, term_index
from meshplan.intra.search.dual import EdgeDual
from meshplan.intra.search.lagrange import price_memory
from meshplan.intra.search.local_search import improve_feasible, least_memory_choice, repair
from meshplan.intra.search.pairwise import (
    forest_dp,
    icm_sweep,
    local_costs,
    pairwise_index,
    random_forest,
    segment_argmin,
)


def random_problem(rng: np.random.Generator, nodes: int, density: float, memory: bool = False):
    sizes = rng.integers(1, 4, size=nodes)
    costs = [rng.integers(0, 20, size=k).astype(float) for k in sizes]
    pairs = [(u, v) for u in range(nodes) for v in range(u + 1, nodes) if rng.random() < density]
    matrices = [rng.integers(0, 15, size=sizes[u] * sizes[v]).astype(float) for u, v in pairs]
    if not memory:
        return strategy_problem(costs, edges=pairs, edge_costs=matrices)
    usages = [rng.integers(0, 10, size=k).astype(float) for k in sizes]
    intervals = [(lo, lo + int(rng.integers(1, 5))) for lo in rng.integers(0, 6, size=nodes).tolist()]
    every = [np.array(c) for c in itertools.product(*(range(k) for k in sizes))]
    peaks = [_peak(usages, intervals, c) for c in every]
    limit = float(min(peaks) + 0.3 * (max(peaks) - min(peaks)))
    return strategy_problem(costs, usages=usages, intervals=intervals, edges=pairs, edge_costs=matrices,
                            usage_limit=limit)


def _peak(usages, intervals, choice) -> float:
    load = np.zeros(12)
    for v, (lo, hi) in enumerate(intervals):
        load[lo:hi] += usages[v][choice[v]]
    return float(load.max())


def _all(problem):
    return [np.array(c, dtype=np.int64) for c in itertools.product(*(range(k) for k in problem.sizes))]


@pytest.mark.parametrize("seed", range(25))
def test_local_costs_and_forest_dp_are_exact(seed):
    rng = np.random.default_rng(seed)
    p = random_problem(rng, nodes=int(rng.integers(2, 8)), density=0.5)
    ix = pairwise_index(p)
    assert all(ix.colors[u] != ix.colors[v] for u, v in p.edge_nodes.tolist())
    choice = np.array([rng.integers(k) for k in p.sizes], dtype=np.int64)
    local = local_costs(ix, p.costs.values, choice)
    for v in range(p.num_nodes):
        for s in range(p.sizes[v]):
            moved = choice.copy()
            moved[v] = s
            assert local[ix.ptr[v] + s] - local[ix.ptr[v] + choice[v]] == pytest.approx(
                p.cost_of(moved) - p.cost_of(choice))
    forest = random_forest(ix, rng)
    outside = ~forest.inside
    same_outside = [c for c in _all(p) if (c[outside] == choice[outside]).all()]
    forest_dp(ix, p.costs.values, choice, forest)
    assert p.cost_of(choice) == min(p.cost_of(c) for c in same_outside)


@pytest.mark.parametrize("seed", range(25))
def test_edge_dual_bounds_the_optimum_and_rises(seed):
    rng = np.random.default_rng(seed)
    p = random_problem(rng, nodes=int(rng.integers(2, 8)), density=0.6)
    ix = pairwise_index(p)
    optimum = min(p.cost_of(c) for c in _all(p))
    dual = EdgeDual(ix)
    bounds = [dual.bound(p.costs.values)]
    for _ in range(15):
        dual.sweep(p.costs.values)
        bounds.append(dual.bound(p.costs.values))
    assert all(b <= optimum + 1e-9 for b in bounds)
    assert all(later >= earlier - 1e-9 for earlier, later in itertools.pairwise(bounds))
    choice = segment_argmin(ix, dual.beliefs(p.costs.values))
    before = p.cost_of(choice)
    icm_sweep(ix, p.costs.values, choice)
    assert p.cost_of(choice) <= before


@pytest.mark.parametrize("seed", range(25))
def test_memory_prices_bound_and_stay_feasible(seed):
    rng = np.random.default_rng(seed)
    p = random_problem(rng, nodes=int(rng.integers(2, 7)), density=0.5, memory=True)
    feasible = [c for c in _all(p) if p.is_feasible(c)]
    optimum = min(p.cost_of(c) for c in feasible)
    rows = memory_rows(p.memory.lo, p.memory.hi, (np.zeros(0, np.int64),) * 2 + (np.zeros(0),), p.usage_limit)
    ix = pairwise_index(p)
    terms = term_index(rows, p.memory.node, p.memory.usages, p.costs.ptr)
    start = least_memory_choice(p, rows)
    assert p.is_feasible(start)  # the limit is above the smallest peak
    cost_before = p.cost_of(start)
    improve_feasible(ix, terms, p.costs.values, start)
    assert p.is_feasible(start) and p.cost_of(start) <= cost_before
    greedy = np.array([int(np.argmin(p.costs.row(v))) for v in range(p.num_nodes)], dtype=np.int64)
    assert repair(ix, terms, p.costs.values, np.zeros(len(rows)), greedy, deadline=float("inf"))
    assert p.is_feasible(greedy)
    import time

    result = price_memory(p, ix, terms, start, True, time.perf_counter() + 0.3, rng)
    assert result.bound <= optimum + 1e-6
    assert p.is_feasible(result.choice) and result.cost == p.cost_of(result.choice) >= optimum


def test_memory_prices_without_the_dual(monkeypatch):
    """Above the size limit of the dual: still a feasible plan, no bound claimed."""
    import time

    import meshplan.intra.search.lagrange as lagrange

    monkeypatch.setattr(lagrange, "DUAL_MAX_ENTRIES", 0)
    rng = np.random.default_rng(3)
    p = random_problem(rng, nodes=6, density=0.5, memory=True)
    rows = memory_rows(p.memory.lo, p.memory.hi, (np.zeros(0, np.int64),) * 2 + (np.zeros(0),), p.usage_limit)
    ix = pairwise_index(p)
    terms = term_index(rows, p.memory.node, p.memory.usages, p.costs.ptr)
    start = least_memory_choice(p, rows)
    result = price_memory(p, ix, terms, start, True, time.perf_counter() + 0.2, rng)
    assert result.bound == -np.inf
    assert p.is_feasible(result.choice) and result.cost <= p.cost_of(start)


def test_repair_is_the_same_in_seconds_as_in_units():
    """A problem in seconds (costs 1e-8..1e-5) repairs to the plan the same problem in units
    repairs to: the price floor scales with the costs, not with one cost unit (which priced a
    byte far above every strategy's cost and sent every node to its least memory)."""
    repaired = []
    for seed in range(40):
        p = random_problem(np.random.default_rng(seed), nodes=6, density=0.5, memory=True)
        rows = memory_rows(p.memory.lo, p.memory.hi, (np.zeros(0, np.int64),) * 2 + (np.zeros(0),), p.usage_limit)
        greedy = np.array([int(np.argmin(p.costs.row(v))) for v in range(p.num_nodes)], dtype=np.int64)
        plans = []
        for scale in (1.0, 1e-6):
            q = replace(p, costs=Ragged(p.costs.values * scale, p.costs.ptr),
                        edge_costs=Ragged(p.edge_costs.values * scale, p.edge_costs.ptr))
            terms = term_index(rows, q.memory.node, q.memory.usages, q.costs.ptr)
            choice = greedy.copy()
            assert repair(pairwise_index(q), terms, q.costs.values, np.zeros(len(rows)), choice, float("inf"))
            plans.append(choice)
        assert p.is_feasible(plans[1])
        assert p.cost_of(plans[1]) == p.cost_of(plans[0]), seed
        repaired.append(not np.array_equal(plans[0], greedy))
    assert any(repaired)  # some instances needed repairing
