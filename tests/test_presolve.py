"""Presolve's bulk reductions against enumeration: followers contracted onto the nodes that
decide them (mapping edges, also in chains and cycles), single-strategy nodes fixed; the
reduced problem's optimum plus the offset is the original's, and every reduced assignment
expands to an original one of the same cost and peak (scored by the independent scorer)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from iopddl_score import FORBIDDEN_AT, peak_usage, score
from meshplan.intra.problem.arrays import Ragged
from meshplan.intra.problem.contract import contract
from meshplan.intra.problem.iopddl import problem_from_iopddl
from meshplan.intra.problem.presolve import Infeasible, presolve


def follower_problem(rng: np.random.Generator, nodes: int) -> dict:
    """A random IOPDDL problem rich in what the bulk reductions handle: edges whose finite
    entries form a mapping (either way, or both: a permutation), single-strategy nodes,
    forbidden entries, memory that binds."""
    sizes = [int(k) for k in rng.choice([1, 2, 3, 4], size=nodes, p=[0.2, 0.3, 0.3, 0.2])]
    costs = [[int(c) for c in rng.integers(0, 30, size=k)] for k in sizes]
    usages = [[int(u) for u in rng.integers(0, 10, size=k)] for k in sizes]
    intervals = []
    for _ in range(nodes):
        lo = int(rng.integers(0, 6))
        intervals.append([lo, lo + int(rng.integers(0, 4))])
    pairs, matrices = [], []
    for u, v in itertools.combinations(range(nodes), 2):
        if rng.random() > 0.5:
            continue
        m = rng.integers(0, 20, size=(sizes[u], sizes[v])).astype(object)
        kind = rng.choice(["dense", "rows", "cols"]) if v - u <= 2 else "dense"  # chains of followers
        if kind == "rows":  # each strategy of u allows one of v
            keep = rng.integers(sizes[v], size=sizes[u])
            mask = np.zeros(m.shape, bool)
            mask[np.arange(sizes[u]), keep] = True
            m[~mask] = FORBIDDEN_AT
        elif kind == "cols":
            keep = rng.integers(sizes[u], size=sizes[v])
            mask = np.zeros(m.shape, bool)
            mask[keep, np.arange(sizes[v])] = True
            m[~mask] = FORBIDDEN_AT
        elif rng.random() < 0.3:
            m[rng.random(m.shape) < 0.3] = FORBIDDEN_AT
        pairs.append([u, v])
        matrices.append([int(x) for x in m.ravel()])
    problem = {"name": "followers", "nodes": {"intervals": intervals, "costs": costs, "usages": usages},
               "edges": {"nodes": pairs, "costs": matrices}, "usage_limit": 10**9}
    peaks = [peak_usage(problem, list(s)) for s in itertools.product(*(range(k) for k in sizes))]
    problem["usage_limit"] = int(min(peaks) + rng.random() * (max(peaks) - min(peaks)))
    return problem


def best_by_enumeration(raw: dict) -> int | None:
    found = [score(raw, list(s)) for s in itertools.product(*(range(len(c)) for c in raw["nodes"]["costs"]))]
    costs = [c for c, feasible in found if feasible]
    return min(costs) if costs else None


@pytest.mark.parametrize("seed", range(40))
def test_presolve_keeps_the_optimum_and_costs(seed):
    """Also when its deadline has passed (odd seeds: the bulk steps only)."""
    rng = np.random.default_rng(seed)
    raw = follower_problem(rng, nodes=int(rng.integers(3, 8)))
    expected = best_by_enumeration(raw)
    try:
        pre = presolve(problem_from_iopddl({"problem": raw}), deadline=0.0 if seed % 2 else None)
    except Infeasible:
        assert all(c >= FORBIDDEN_AT for c, _ in (score(raw, list(s)) for s in
                                                   itertools.product(*(range(len(c)) for c in raw["nodes"]["costs"]))))
        return
    q = pre.problem
    reduced_best = None
    for s in itertools.product(*(range(k) for k in q.sizes)):
        choice = np.array(s, dtype=np.int64)
        cost, feasible = score(raw, pre.expand(choice).tolist())
        if np.isfinite(q.cost_of(choice)):
            assert q.cost_of(choice) + pre.offset == cost
        if feasible and (reduced_best is None or cost < reduced_best):
            reduced_best = cost
    assert reduced_best == expected


@pytest.mark.parametrize("seed", range(10))
def test_contraction_scores_every_assignment_alike(seed):
    """Any roots and maps (fixed nodes too): the contracted cost and peak of every assignment
    of the roots are the original's of the expanded assignment."""
    rng = np.random.default_rng(100 + seed)
    raw = follower_problem(rng, nodes=6)
    p = problem_from_iopddl({"problem": raw})
    root = np.array([x if x < 2 or rng.random() < 0.3 else int(rng.integers(0, 2)) for x in range(6)])
    root[[x for x in range(6) if root[x] == x and p.sizes[x] == 1]] = -1
    root[(root >= 0) & (p.sizes[np.maximum(root, 0)] == 1)] = -1  # a group led by a single strategy is fixed
    maps = [np.arange(p.sizes[x]) if root[x] == x else
            rng.integers(p.sizes[x], size=1 if root[x] < 0 else p.sizes[root[x]]) for x in range(6)]
    c = contract(p, root, Ragged.from_rows(maps, dtype=np.int64))
    q = c.problem
    for s in itertools.product(*(range(k) for k in q.sizes)):
        full = np.array([maps[x][0] if c.root[x] < 0 else maps[x][s[c.root[x]]] for x in range(6)])
        assert q.cost_of(np.array(s)) + c.offset == p.cost_of(full)
        m = q.memory
        used = sorted(zip(m.lo, m.hi, m.usages.values[m.usages.ptr[:-1] + np.array(s, dtype=int)[m.node]], strict=True))
        fixed = list(zip(*c.base, strict=True))
        points = {t for lo, hi, _ in used + fixed for t in range(lo, hi)}
        peak = max((sum(u for lo, hi, u in used + fixed if lo <= t < hi) for t in points), default=0)
        assert peak == p.peak_usage(full)
