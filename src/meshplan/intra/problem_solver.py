"""solve_problem: StrategyProblem -> ProblemSolution (strategies, cost, status, bound).

The one entry every intra-op problem goes through (model-built and captured graphs via
`solve_intra`, external problems such as IOPDDL files via `meshplan solve-problem`):

1. exact presolve (`presolve`), which also spots forbidden structures that admit nothing;
2. compact memory rows (`memory`);
3. a feasible plan within seconds: least memory per node, then feasible moves of whole
   colour classes (`local_search`);
4. then, until the time limit: the whole MIP warm-started from that plan when it is small
   enough to solve (this also proves a bound), else memory prices (`lagrange`: Lagrangian
   relaxation of the memory rows, priced plans decoded from a message-passing dual, which
   also proves a bound) and, on the best plan, large-neighbourhood search whose windows are
   exact sub-MIPs (`lns`).

The best feasible assignment found is returned with the best proven bound; a solution found
is never reported as "no solution".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshplan.errors import OptionsError
from meshplan.intra.lagrange import price_memory
from meshplan.intra.lns import run_lns
from meshplan.intra.local_search import Incumbent, improve_feasible, least_memory_choice
from meshplan.intra.memory import MemoryRows, TermIndex, memory_rows, term_index
from meshplan.intra.mip import Block, MipModel, build_mip, solve_mip
from meshplan.intra.pairwise import PairwiseIndex, pairwise_index
from meshplan.intra.presolve import Infeasible, Presolved, presolve
from meshplan.intra.problem import StrategyProblem
from meshplan.intra.solvers import SolveStatus

BACKENDS = ("highs", "cbc")
PRICING_SHARE = 0.7  # of the time left after presolve, for memory prices; the rest for windows


@dataclass(frozen=True, slots=True)
class ProblemOptions:
    """Options of `solve_problem`.

    Attributes:
        time_limit: wall seconds for the whole solve (presolve, heuristics, MIP).
        mip_gap: relative gap at which the MIP may stop.
        backend: "highs" (warm-started, also drives the neighbourhood search) or "cbc" (PuLP;
            whole-problem MIP only, no warm start).
        full_mip_columns: solve the whole MIP when it has at most this many columns; larger
            problems are improved by neighbourhood search.
        seed: for the randomized neighbourhood choices.
    """

    time_limit: float = 60.0
    mip_gap: float = 0.0
    backend: str = "highs"
    full_mip_columns: int = 400_000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise OptionsError(f"unknown solver backend {self.backend!r}; use one of {', '.join(BACKENDS)}")
        if not self.time_limit > 0:
            raise OptionsError(f"time_limit must be positive seconds, got {self.time_limit}")


@dataclass(frozen=True, slots=True)
class ProblemSolution:
    """The answer of `solve_problem`.

    Attributes:
        choice: per node the chosen strategy (None when no feasible assignment was found).
        cost: its cost (None without a choice).
        status: OPTIMAL (proven), FEASIBLE (time limit, best found), INFEASIBLE, NO_SOLUTION.
        bound: a proven lower bound on the optimum (None when nothing is proven).
        gap: (cost - bound) / cost.
        wall_s: seconds spent.
        backend: the MIP backend.
        stats: sizes and timings of each phase, for reports and benchmarks.
    """

    choice: np.ndarray | None
    cost: float | None
    status: SolveStatus
    bound: float | None
    gap: float | None
    wall_s: float
    backend: str
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def has_solution(self) -> bool:
        return self.choice is not None


def solve_problem(problem: StrategyProblem, options: ProblemOptions | None = None) -> ProblemSolution:
    """Choose one strategy per node minimizing node + edge costs within the memory limit.

    Args:
        problem: the problem as arrays (see `strategy_problem`, `read_iopddl`).
        options: time limit, backend, gap.

    Returns:
        The best assignment found, its cost, status and proven bound.
    """
    options = options or ProblemOptions()
    start = time.perf_counter()
    deadline = start + options.time_limit
    stats: dict[str, Any] = {"nodes": problem.num_nodes, "edges": problem.num_edges}
    try:
        pre = presolve(problem)
    except Infeasible as exc:
        stats["infeasible"] = str(exc)
        return _answer(problem, None, None, False, start, options, stats, infeasible=True)
    q = pre.problem
    rows = _rows(pre)
    stats.update(presolve_s=time.perf_counter() - start, reduced_nodes=q.num_nodes, reduced_edges=q.num_edges,
                 reduced_strategies=int(q.sizes.sum()), memory_rows=len(rows))
    if len(rows) and (rows.capacity < 0).any() and not _varying_at(rows, rows.capacity < 0):
        stats["infeasible"] = "the usage no strategy can avoid exceeds the limit"
        return _answer(problem, None, None, False, start, options, stats, infeasible=True)
    return _search(problem, pre, rows, start, deadline, options, stats)


def _rows(pre: Presolved) -> MemoryRows:
    q = pre.problem
    if q.usage_limit is None:  # no constraint: every term covers no row
        z = np.zeros(0, dtype=np.int64)
        return MemoryRows(z, np.zeros(0), np.zeros(len(q.memory), np.int64), np.full(len(q.memory), -1, np.int64))
    return memory_rows(q.memory.lo, q.memory.hi, pre.base, q.usage_limit)


def _varying_at(rows: MemoryRows, bad: np.ndarray) -> bool:
    covered = np.zeros(len(rows) + 1)
    np.add.at(covered, rows.first[rows.first <= rows.last], 1)
    np.add.at(covered, rows.last[rows.first <= rows.last] + 1, -1)
    return bool((np.cumsum(covered)[:-1][bad] > 0).all())


def _search(problem: StrategyProblem, pre: Presolved, rows: MemoryRows, start: float, deadline: float,
            options: ProblemOptions, stats: dict[str, Any]) -> ProblemSolution:
    q = pre.problem
    if q.num_nodes == 0:  # presolve decided everything
        return _answer(problem, pre, np.zeros(0, dtype=np.int64), True, start, options, stats)
    rng = np.random.default_rng(options.seed)
    ix = pairwise_index(q)
    terms = term_index(rows, q.memory.node, q.memory.usages, q.costs.ptr)
    greedy = least_memory_choice(q, rows)
    fits = bool((terms.loads(greedy) <= rows.capacity).all())
    if fits:
        improve_feasible(ix, terms, q.costs.values, greedy)
        stats.update(heuristic_cost=q.cost_of(greedy) + pre.offset, heuristic_s=time.perf_counter() - start)
    model = _full_model(pre, rows, options)
    if model is None:
        return _search_large(problem, pre, (ix, terms, rows), greedy, fits, start, deadline, options, stats, rng)
    inc = Incumbent(q, rows, greedy)
    stats.update(mip_columns=model.num_cols, mip_rows=model.num_rows)
    outcome = _run_model(model, inc, deadline, options)
    stats["mip_s"] = outcome.wall_s
    if outcome.infeasible and not inc.feasible:
        return _answer(problem, None, None, False, start, options, stats, infeasible=True)
    best = inc.choice if inc.feasible else None
    better = outcome.choice is not None and (best is None or q.cost_of(outcome.choice) <= inc.cost)
    if better and _fits(q, rows, outcome.choice):
        best = outcome.choice
    bound = outcome.bound if outcome.bound is not None else _trivial_bound(pre)
    return _answer(problem, pre, best, outcome.optimal and best is outcome.choice, start, options, stats, bound=bound)


def _search_large(problem: StrategyProblem, pre: Presolved, index: tuple[PairwiseIndex, TermIndex, MemoryRows],
                  greedy: np.ndarray, fits: bool, start: float, deadline: float, options: ProblemOptions,
                  stats: dict[str, Any], rng: np.random.Generator) -> ProblemSolution:
    """Memory prices (which also prove a bound), then neighbourhood search on the best plan."""
    ix, terms, rows = index
    q = pre.problem
    priced = price_memory(q, ix, terms, greedy, fits, start + PRICING_SHARE * (deadline - start), rng)
    bound = max(_trivial_bound(pre), priced.bound + pre.offset)
    stats.update(priced_cost=priced.cost + pre.offset, price_rounds=priced.rounds, price_wins=priced.improvements,
                 priced_bound=priced.bound + pre.offset, priced_s=time.perf_counter() - start)
    if priced.choice is None:
        return _answer(problem, None, None, False, start, options, stats, bound=bound)
    if priced.cost - priced.bound <= 1e-9 * max(abs(priced.cost), 1.0):  # the prices proved it optimal
        return _answer(problem, pre, priced.choice, True, start, options, stats)
    inc = Incumbent(q, rows, priced.choice)
    lns = run_lns(inc, deadline - 0.03 * options.time_limit, rng)
    stats.update(lns_windows=lns.windows, lns_improved=lns.improved, lns_window=lns.final_window)
    return _answer(problem, pre, inc.choice, False, start, options, stats, bound=bound)


def _full_model(pre: Presolved, rows: MemoryRows, options: ProblemOptions) -> MipModel | None:
    q = pre.problem
    pairs = int(np.prod(q.sizes[q.edge_nodes], axis=1).sum()) if q.num_edges else 0
    if options.backend == "highs" and pairs + int(q.sizes.sum()) > options.full_mip_columns:
        return None
    return build_mip(whole_block(pre, rows))


def _run_model(model: MipModel, inc: Incumbent, deadline: float, options: ProblemOptions):
    remaining = max(deadline - time.perf_counter(), 0.5)
    if options.backend == "cbc":
        return _solve_with_cbc(model, remaining, options.mip_gap)
    return solve_mip(model, remaining, inc.choice if inc.feasible else None, options.mip_gap)


def _solve_with_cbc(model: MipModel, time_limit: float, mip_gap: float):
    from meshplan.intra.mip import MipOutcome
    from meshplan.intra.solvers import solve_program

    result = solve_program(model.to_linear_program(), "cbc", time_limit, mip_gap)
    if result.status is SolveStatus.INFEASIBLE:
        return MipOutcome(None, None, None, False, True, result.wall_s)
    if not result.has_solution:
        return MipOutcome(None, None, result.bound, False, False, result.wall_s)
    choice = model.choice(np.asarray(result.values))
    return MipOutcome(choice, result.objective, result.bound, result.status is SolveStatus.OPTIMAL, False,
                      result.wall_s)


def whole_block(pre: Presolved, rows: MemoryRows) -> Block:
    """The reduced problem as one MIP block."""
    q = pre.problem
    matrices = tuple(q.edge_matrix(e) for e in range(q.num_edges))
    return Block(q.costs, pre.offset, q.edge_nodes, matrices, q.memory.node, q.memory.usages, rows)


def _fits(q: StrategyProblem, rows: MemoryRows, choice: np.ndarray) -> bool:
    """Exact memory check (the MIP's tolerances could let a row exceed its capacity slightly)."""
    return Incumbent(q, rows, choice).feasible


def _trivial_bound(pre: Presolved) -> float:
    """Edge matrices are non-negative, so the cheapest strategy of every node bounds the optimum."""
    q = pre.problem
    mins = np.minimum.reduceat(q.costs.values, q.costs.ptr[:-1]) if q.num_nodes else np.zeros(0)
    return pre.offset + float(mins.sum())


def _answer(problem: StrategyProblem, pre: Presolved | None, choice: np.ndarray | None, optimal: bool,
            start: float, options: ProblemOptions, stats: dict[str, Any], bound: float | None = None,
            infeasible: bool = False) -> ProblemSolution:
    wall = time.perf_counter() - start
    stats["wall_s"] = wall
    if choice is None:
        status = SolveStatus.INFEASIBLE if infeasible else SolveStatus.NO_SOLUTION
        return ProblemSolution(None, None, status, None if infeasible else bound, None, wall, options.backend, stats)
    full = pre.expand(choice)
    cost = problem.cost_of(full)
    bound = cost if optimal else min(bound, cost) if bound is not None else None
    gap = max(0.0, cost - bound) / max(abs(cost), 1e-9) if bound is not None else None
    status = SolveStatus.OPTIMAL if optimal else SolveStatus.FEASIBLE
    return ProblemSolution(full, cost, status, bound, gap, wall, options.backend, stats)
