"""solve_problem on array problems: exhaustive enumeration on small ones, the shared IOPDDL
instances re-scored by an independent evaluator (tests/iopddl_score.py)."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import numpy as np
import pytest

from iopddl_score import FORBIDDEN_AT, load, peak_usage, score
from meshplan.intra import ProblemOptions, SolveStatus, solve_problem, strategy_problem
from meshplan.intra.problem.arrays import ProblemError
from meshplan.intra.problem.iopddl import problem_from_iopddl, read_iopddl
from meshplan.intra.problem.memory import memory_rows
from meshplan.intra.problem.presolve import presolve

from data_files import IOPDDL, iopddl_instance

EXAMPLE = IOPDDL / "example.json"
BEST_KNOWN = {"B": 532_843, "U": 2_443_995_952}


def random_iopddl(rng: np.random.Generator, nodes: int, forbid: float, tight: float) -> dict:
    """A random problem in the IOPDDL format, its limit between the smallest and largest peak."""
    sizes = rng.integers(1, 4, size=nodes)
    costs = [[int(c) for c in rng.integers(0, 20, size=k)] for k in sizes]
    for row in costs:
        if len(row) > 1 and rng.random() < forbid:
            row[rng.integers(len(row))] = FORBIDDEN_AT
    usages = [[int(u) for u in rng.integers(0, 10, size=k)] for k in sizes]
    intervals = []
    for _ in range(nodes):
        lo = int(rng.integers(0, 8))
        intervals.append([lo, lo + int(rng.integers(0, 5))])
    pairs = [(u, v) for u in range(nodes) for v in range(u + 1, nodes) if rng.random() < 0.45]
    matrices = []
    for u, v in pairs:
        m = rng.integers(0, 15, size=sizes[u] * sizes[v])
        m[rng.random(len(m)) < forbid] = FORBIDDEN_AT
        matrices.append([int(x) for x in m])
    problem = {"name": "random", "nodes": {"intervals": intervals, "costs": costs, "usages": usages},
               "edges": {"nodes": [list(p) for p in pairs], "costs": matrices}, "usage_limit": 0}
    peaks = [peak_usage(problem, list(s)) for s in itertools.product(*(range(k) for k in sizes))]
    problem["usage_limit"] = int(min(peaks) + tight * (max(peaks) - min(peaks)))
    return problem


def enumerate_best(problem: dict) -> int | None:
    best = None
    for combo in itertools.product(*(range(len(c)) for c in problem["nodes"]["costs"])):
        cost, feasible = score(problem, list(combo))
        if feasible and (best is None or cost < best):
            best = cost
    return best


@pytest.mark.parametrize("seed", range(120))
def test_small_problems_equal_enumeration(seed):
    rng = np.random.default_rng(seed)
    raw = random_iopddl(rng, nodes=int(rng.integers(2, 8)), forbid=float(rng.choice([0.0, 0.2, 0.5])),
                        tight=float(rng.choice([0.0, 0.3, 1.0])))
    expected = enumerate_best(raw)
    result = solve_problem(problem_from_iopddl({"problem": raw}), ProblemOptions(time_limit=20))
    if expected is None:
        assert result.status is SolveStatus.INFEASIBLE and result.choice is None
        return
    assert result.status is SolveStatus.OPTIMAL
    assert score(raw, result.choice.tolist()) == (expected, True)
    assert result.cost == expected and result.bound == expected


@pytest.mark.parametrize("seed", range(20))
def test_costs_in_seconds_are_solved_exactly(seed):
    """Costs of 1e-9..1e-8 (a plan priced in seconds): below HiGHS's absolute tolerances (a gap
    of 1e-6, reduced costs of 1e-7) unless the MIP scales them up. Unscaled, the first plan
    HiGHS met was called optimal (most of these seeds failed)."""
    rng = np.random.default_rng(5000 + seed)
    raw = random_iopddl(rng, nodes=int(rng.integers(5, 8)), forbid=0.0, tight=1.0)
    expected = enumerate_best(raw)
    p = problem_from_iopddl({"problem": raw})
    seconds = replace(p, costs=replace(p.costs, values=p.costs.values * 1e-9),
                      edge_costs=replace(p.edge_costs, values=p.edge_costs.values * 1e-9))
    for backend in ("highs", "cbc"):
        result = solve_problem(seconds, ProblemOptions(time_limit=20, backend=backend))
        assert result.status is SolveStatus.OPTIMAL
        assert score(raw, result.choice.tolist())[0] == expected, backend
        assert result.cost == pytest.approx(expected * 1e-9, rel=1e-9)


@pytest.mark.parametrize("seed", range(30))
def test_search_path_is_feasible_and_bounded(seed):
    """Without the whole MIP (memory prices, then windows): a feasible plan whose proven bound
    is at most the enumerated optimum, which is at most its cost."""
    rng = np.random.default_rng(1000 + seed)
    raw = random_iopddl(rng, nodes=int(rng.integers(3, 8)), forbid=0.0, tight=float(rng.choice([0.3, 1.0])))
    expected = enumerate_best(raw)
    result = solve_problem(problem_from_iopddl({"problem": raw}), ProblemOptions(time_limit=0.5, full_mip_columns=0))
    cost, feasible = score(raw, result.choice.tolist())
    assert feasible and cost == result.cost >= expected
    assert result.bound <= expected


@pytest.mark.data
def test_example_instance_is_optimal():
    raw = load(str(EXAMPLE))
    result = solve_problem(read_iopddl(EXAMPLE), ProblemOptions(time_limit=10))
    assert result.status is SolveStatus.OPTIMAL
    assert score(raw, result.choice.tolist()) == (enumerate_best(raw), True)


def test_live_points_equal_intervals():
    rng = np.random.default_rng(7)
    raw = random_iopddl(rng, nodes=6, forbid=0.0, tight=0.2)
    n = raw["nodes"]
    points = [list(range(lo, hi)) for lo, hi in n["intervals"]]
    by_points = strategy_problem(n["costs"], usages=n["usages"], live_points=points, edges=raw["edges"]["nodes"],
                                 edge_costs=raw["edges"]["costs"], usage_limit=raw["usage_limit"])
    assert solve_problem(by_points).cost == enumerate_best(raw)


def test_forbidden_arguments_and_gapped_live_points():
    # Node 0 may not take strategy 0; the pair (1, 1) is forbidden; node 1 is live at 0 and 2 only.
    p = strategy_problem([[0, 5], [0, 1]], usages=[[1, 1], [4, 1]], live_points=[[1], [0, 2]],
                         edges=[(0, 1)], edge_costs=[[0, 0, 0, 0]], forbidden=[(0, 0)],
                         forbidden_pairs=[(0, 1, 1)], usage_limit=3)
    assert len(p.memory) == 3  # node 1's two runs are two terms
    result = solve_problem(p)
    assert result.status is SolveStatus.INFEASIBLE  # node 1: strategy 0 needs 4 > 3, strategy 1 is forbidden
    relaxed = solve_problem(p.__class__(p.costs, p.edge_nodes, p.edge_costs, p.memory, 4.0))
    assert relaxed.choice.tolist() == [1, 0] and relaxed.cost == 5


@pytest.mark.parametrize("seed", range(20))
def test_memory_rows_hold_the_peak(seed):
    """The compact rows see the same peak as every time point, for any assignment."""
    rng = np.random.default_rng(seed)
    raw = random_iopddl(rng, nodes=7, forbid=0.0, tight=1.0)
    p = problem_from_iopddl({"problem": raw})
    pre = presolve(p)
    q = pre.problem
    rows = memory_rows(q.memory.lo, q.memory.hi, pre.base, float(raw["usage_limit"]))
    for _ in range(10):
        choice = np.array([rng.integers(k) for k in q.sizes], dtype=np.int64)
        m = q.memory
        use = m.usages.values[m.usages.ptr[:-1] + choice[m.node]] if len(m) else np.zeros(0)
        loads = np.zeros(len(rows))
        for t in range(len(m)):
            loads[rows.first[t]:rows.last[t] + 1] += use[t]
        worst = float((loads - rows.capacity).max(initial=-float(raw["usage_limit"]))) + raw["usage_limit"]
        assert worst == pytest.approx(peak_usage(raw, pre.expand(choice).tolist()))
        assert q.cost_of(choice) + pre.offset == score(raw, pre.expand(choice).tolist())[0]


@pytest.mark.data
@pytest.mark.parametrize(("change", "message"), [
    (lambda p: p["nodes"].pop("usages"), "missing field"),
    (lambda p: p["edges"]["costs"][0].pop(), "has 1 costs; expected"),
    (lambda p: p["edges"]["nodes"].__setitem__(0, [0, 9]), "out of range"),
    (lambda p: p["nodes"]["costs"][1].__setitem__(0, -3), "non-negative"),
])
def test_malformed_problems_are_refused(change, message):
    raw = load(str(EXAMPLE))
    change(raw)
    with pytest.raises(ProblemError, match=message):
        problem_from_iopddl({"problem": raw})


@pytest.mark.data
@pytest.mark.parametrize("name", ["B", "U"])
def test_shared_instances_answer_truthfully_under_any_load(name):
    """A limit shorter than reading the file is what any machine load makes of a short limit:
    the answer is then whatever the first, untimed steps give, and it must still be true. How
    good the plans get at the contest's limits is measured in benchmarks/bench_large_ilp.py."""
    path = str(iopddl_instance(name))
    raw = load(path)
    result = solve_problem(read_iopddl(path), ProblemOptions(time_limit=0.1))
    # each instance has a known plan, so "no plan exists" would be a false proof
    assert result.status in (SolveStatus.FEASIBLE, SolveStatus.OPTIMAL, SolveStatus.NO_SOLUTION)
    assert result.bound is None or result.bound <= BEST_KNOWN[name]
    if result.has_solution:
        assert score(raw, result.choice.tolist()) == (result.cost, True)
        assert result.bound is not None and result.bound <= result.cost
    if name == "U":  # its least-memory plan fits, with or without the presolve's reductions
        assert result.status is SolveStatus.FEASIBLE


@pytest.mark.data
def test_solution_file_round_trips(tmp_path):
    from meshplan.intra.problem.iopddl import solution_to_json

    p = read_iopddl(EXAMPLE)
    data = solution_to_json(p, solve_problem(p))
    assert json.loads(json.dumps(data))["solution"] == data["solution"]
    assert score(load(str(EXAMPLE)), data["solution"]) == (data["cost"], True)


def test_reduced_cost_fixing_keeps_the_optimum():
    """Without memory rows, a problem above `full_mip_columns` is priced until the bound fixes
    enough strategies out for the whole MIP over the rest (reduced-cost fixing): its answer is the
    enumerated optimum, proven."""
    fixed = 0
    for seed in range(12):
        rng = np.random.default_rng(7000 + seed)
        sizes = rng.integers(2, 6, size=6)
        costs = [rng.integers(0, 40, size=k).astype(float) * 1e-7 for k in sizes]
        pairs = [(u, v) for u in range(6) for v in range(u + 1, 6) if rng.random() < 0.7]
        matrices = [rng.integers(0, 30, size=sizes[u] * sizes[v]).astype(float) * 1e-7 for u, v in pairs]
        p = strategy_problem(costs, edges=pairs, edge_costs=matrices)
        expected = min(p.cost_of(np.array(c)) for c in itertools.product(*(range(k) for k in sizes)))
        pre = presolve(p)
        q = pre.problem
        columns = int(q.sizes.sum() + sum(q.sizes[u] * q.sizes[v] for u, v in q.edge_nodes))
        result = solve_problem(p, ProblemOptions(time_limit=1, full_mip_columns=columns - 1))
        assert result.cost == pytest.approx(expected, rel=1e-9), seed
        if "fixed_strategies" in result.stats:  # else the bound left too many (prices and windows)
            assert result.status is SolveStatus.OPTIMAL and result.bound == pytest.approx(expected, rel=1e-9)
            fixed += 1
        reduced = pre.reduce(result.choice)  # a plan read into the reduced problem and back
        assert reduced is None or np.array_equal(pre.expand(reduced), result.choice)
    assert fixed >= 4
