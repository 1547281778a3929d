"""Variable elimination (intra/search/elimination.py) against enumeration, and the MIPs it
settles (problem_solver) against running them."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from meshplan.intra import ProblemOptions, solve_problem
from meshplan.intra.problem.arrays import Ragged
from meshplan.intra.problem.iopddl import problem_from_iopddl
from meshplan.intra.problem.memory import MemoryRows
from meshplan.intra.search import problem_solver
from meshplan.intra.search.elimination import least_cost
from meshplan.intra.search.mip import Block, edge_part, edge_part_size
from test_problem_solver import random_iopddl


def random_block(rng: np.random.Generator, nodes: int, density: float, forbid: float) -> Block:
    """Random costs (some pairs forbidden) on a random graph, possibly in several pieces."""
    sizes = rng.integers(1, 5, size=nodes)
    costs = Ragged.from_rows([rng.random(k) * 1e-3 for k in sizes])
    edges = [(u, v) for u in range(nodes) for v in range(u + 1, nodes) if rng.random() < density]
    matrices = []
    for u, v in edges:
        m = rng.random((sizes[u], sizes[v])) * 1e-3
        m[rng.random(m.shape) < forbid] = np.inf
        matrices.append(m)
    none = np.zeros(0, dtype=np.int64)
    return Block(costs, float(rng.random()), np.array(edges, dtype=np.int64).reshape(-1, 2), tuple(matrices), none,
                 Ragged(np.zeros(0), np.zeros(1, dtype=np.int64)), MemoryRows(none, np.zeros(0), none, none))


def enumerated_least(block: Block) -> float:
    return min(block.cost_of(np.array(c)) for c in itertools.product(*(range(k) for k in block.sizes.tolist())))


@pytest.mark.parametrize("seed", range(40))
def test_least_cost_equals_enumeration(seed):
    rng = np.random.default_rng(seed)
    block = random_block(rng, nodes=int(rng.integers(1, 8)), density=float(rng.choice([0.2, 0.5, 0.9])),
                         forbid=float(rng.choice([0.0, 0.3, 0.8])))
    expected = enumerated_least(block)
    got = least_cost(block, max_work=10**6)
    assert got == expected if np.isinf(expected) else got == pytest.approx(expected, rel=1e-13, abs=0)


def test_least_cost_gives_up_past_its_work():
    block = random_block(np.random.default_rng(0), nodes=7, density=1.0, forbid=0.0)  # one table of all 7 nodes
    assert least_cost(block, max_work=10**6) == pytest.approx(enumerated_least(block), rel=1e-13)
    assert least_cost(block, max_work=10) is None


@pytest.mark.parametrize("seed", range(6))
def test_edge_part_size_is_the_edge_parts(seed):
    block = random_block(np.random.default_rng(100 + seed), nodes=6, density=0.6, forbid=0.2)
    part = edge_part(block)
    assert edge_part_size(block) == (len(part.cost), part.num_rows)


@pytest.mark.parametrize("seed", range(40))
def test_settled_plans_are_the_mips(seed, monkeypatch):
    """Without memory rows a start no plan beats is returned without HiGHS: plan, cost, status,
    bound and the MIP's size equal those of running the MIPs (elimination turned off)."""
    rng = np.random.default_rng(2000 + seed)
    raw = random_iopddl(rng, nodes=int(rng.integers(3, 8)), forbid=float(rng.choice([0.0, 0.2])), tight=1.0)
    p = problem_from_iopddl({"problem": raw})
    p = replace(p, usage_limit=None, costs=replace(p.costs, values=p.costs.values * 1e-9),
                edge_costs=replace(p.edge_costs, values=p.edge_costs.values * 1e-9))
    options = ProblemOptions(time_limit=20, mip_gap=1e-4)
    settled = solve_problem(p, options)
    monkeypatch.setattr(problem_solver, "ELIMINATION_WORK", 0)
    solved = solve_problem(p, options)
    assert np.array_equal(settled.choice, solved.choice)
    assert (settled.cost, settled.status, settled.bound, settled.gap) == (solved.cost, solved.status, solved.bound,
                                                                          solved.gap)
    assert settled.stats.get("mip_rows") == solved.stats.get("mip_rows")


def test_some_random_problems_are_settled():
    """The previous test meets both paths: starts settled without HiGHS and MIPs run."""
    runs = []
    for seed in range(40):
        rng = np.random.default_rng(2000 + seed)
        raw = random_iopddl(rng, nodes=int(rng.integers(3, 8)), forbid=float(rng.choice([0.0, 0.2])), tight=1.0)
        p = replace(problem_from_iopddl({"problem": raw}), usage_limit=None)
        stats = solve_problem(p, ProblemOptions(time_limit=20, mip_gap=1e-4)).stats
        if "lazy_runs" in stats:
            runs.append(stats["lazy_runs"])
    assert 0 in runs and any(r > 0 for r in runs)
