"""CFP's search pass: Analysis + Profiles -> CfpPlan (one candidate per block, whole model).

Exact ILP. Each segment occurrence o takes one profiled combination i (binary x[o, i]; out of
memory or failed combinations are not offered); its cost is the profile's time. A value one
occurrence reads from another block is resharded from the producer's layout to what its first
reader needs, priced by the cost model: for each such block pair (a, b) continuous e[a, b, s, t]
whose row sums are block a's choice indicator and column sums block b's (they are then 0/1).
Memory: parameters stay for the whole step, so while occurrence o runs a device holds every
occurrence's parameter bytes plus o's own other bytes (its profiled peak minus its parameters);
each such sum is at most the budget. `search_exhaustive` enumerates every assignment instead:
the brute-force twin used to check the ILP.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from meshplan.cfp.analysis import Analysis
from meshplan.cfp.price import reshard
from meshplan.cfp.profile import Profiles
from meshplan.cfp.report import format_bytes
from meshplan.errors import InfeasiblePlanError, OptionsError, PlanValidationError, SolverError
from meshplan.intra.program import LinearProgram
from meshplan.intra.solvers import SolveResult, SolveStatus, solve_program
from meshplan.ir.node import OpKind


@dataclass(frozen=True, slots=True)
class CfpPlan:
    """The searched plan.

    Attributes:
        graph, mesh, mode: what was planned, on what, from measured or analytic profiles.
        statistic: which time of the profiled runs was used (min, median or mean).
        block_choice: the candidate index of every block.
        occurrence_choice: the combination of every segment occurrence.
        predicted_time: segments' profiled times plus resharding between them (seconds).
        segment_time, resharding_time: its two parts.
        predicted_memory: bytes per device at the fullest segment.
        memory_budget: the budget held to (None: unlimited).
        solve: the solver's result.
        num_variables, num_constraints: the size of the ILP (0 for the exhaustive search).
    """

    graph: str
    mesh: tuple[int, ...]
    mode: str
    statistic: str
    block_choice: tuple[int, ...]
    occurrence_choice: tuple[tuple[int, ...], ...]
    predicted_time: float
    segment_time: float
    resharding_time: float
    predicted_memory: float
    memory_budget: float | None
    solve: SolveResult
    num_variables: int = 0
    num_constraints: int = 0


@dataclass(frozen=True, slots=True)
class _Option:
    """A profiled combination an occurrence may take."""

    choice: tuple[int, ...]
    time: float
    params: float  # bytes of the occurrence's own parameters per device
    peak: float


@dataclass(frozen=True, slots=True)
class _Edge:
    """Resharding cost between block a (occurrence oa, position ia) and block b (ob, ib)."""

    oa: int
    ia: int
    ob: int
    ib: int
    cost: np.ndarray  # [candidate of a, candidate of b]


STATISTICS = ("mean", "median", "min")


def search(analysis: Analysis, profiles: Profiles, memory_budget: float | None = None, statistic: str = "min",
           solver: str = "highs", time_limit: float = 60.0) -> CfpPlan:
    """Choose one candidate per block minimizing profiled time plus resharding under the budget.

    `statistic` is the profiled time used: "min" (default) is the least disturbed by other
    processes on a shared machine; "mean" and "median" are the alternatives.

    Raises:
        InfeasiblePlanError: no profiled combination fits the budget (the message gives the least
            memory any plan needs).
        SolverError: the solver found no plan within the time limit.
    """
    options, edges = build_problem(analysis, profiles, statistic)
    lp, x = _program(options, edges, memory_budget)
    result = solve_program(lp, solver, time_limit)
    if result.status is SolveStatus.INFEASIBLE:
        raise _infeasible(analysis, options, memory_budget, solver, time_limit)
    if not result.has_solution:
        raise SolverError(f"{solver} found no CFP plan within {time_limit:g} s; raise the time limit")
    picked = [int(np.argmax([result.values[v] for v in xs])) for xs in x]
    plan = _plan(analysis, profiles, statistic, options, edges, picked, memory_budget, result)
    return replace(plan, num_variables=lp.num_vars, num_constraints=len(lp.rows))


def search_exhaustive(analysis: Analysis, profiles: Profiles, memory_budget: float | None = None,
                      statistic: str = "min") -> CfpPlan:
    """The best plan by enumerating every assignment (small models only: the ILP's check)."""
    options, edges = build_problem(analysis, profiles, statistic)
    best: tuple[float, list[int]] | None = None
    for picked in itertools.product(*(range(len(o)) for o in options)):
        total, memory = evaluate(options, edges, picked)
        if (memory_budget is None or memory <= memory_budget * (1 + 1e-9)) and (best is None or total < best[0]):
            best = (total, list(picked))
    if best is None:
        raise InfeasiblePlanError(f"no profiled combination of {analysis.graph.name!r} fits "
                                  f"{format_bytes(memory_budget)} per device")
    result = SolveResult(SolveStatus.OPTIMAL, best[0], best[0], 0.0, 0.0, "exhaustive")
    return _plan(analysis, profiles, statistic, options, edges, best[1], memory_budget, result)


def build_problem(analysis: Analysis, profiles: Profiles, statistic: str = "min"
                  ) -> tuple[list[list[_Option]], list[_Edge]]:
    """Per occurrence, its offered combinations; and the resharding edges between blocks."""
    if statistic not in STATISTICS:
        raise OptionsError(f"unknown statistic {statistic!r}; use one of {', '.join(STATISTICS)}")
    if len(profiles.segments) != len(analysis.segments):
        raise PlanValidationError(f"{len(profiles.segments)} segment profiles for {len(analysis.segments)} unique "
                                  "segments: profile this analysis (same model, batch and mesh)")
    options = []
    for occ in analysis.occurrences:
        found = [_Option(c.choice, c.time(statistic), _param_bytes(analysis, occ, c.choice), c.peak_memory or 0.0)
                 for c in profiles.segments[occ.segment].combinations if c.ok]
        if not found:
            raise InfeasiblePlanError(f"every combination of segment {occ.segment} (blocks {occ.start}-{occ.stop - 1}) "
                                      f"failed or ran out of memory while profiling; see its profile")
        options.append(found)
    return options, _edges(analysis)


def evaluate(options: Sequence[Sequence[_Option]], edges: Sequence[_Edge], picked: Sequence[int]
             ) -> tuple[float, float]:
    """(time, peak memory) of taking combination picked[o] in every occurrence o."""
    chosen = [options[o][i] for o, i in enumerate(picked)]
    total = sum(c.time for c in chosen)
    total += sum(e.cost[chosen[e.oa].choice[e.ia], chosen[e.ob].choice[e.ib]] for e in edges)
    params = sum(c.params for c in chosen)
    return total, max(params + c.peak - c.params for c in chosen)


def _edges(analysis: Analysis) -> list[_Edge]:
    """One cost matrix per pair of blocks a value crosses between occurrences."""
    where = {b: (o, b - occ.start) for o, occ in enumerate(analysis.occurrences) for b in occ.blocks}
    choices = [[dict(s.choices) for s in block.strategies] for block in analysis.blocks]
    found: dict[tuple[int, int], np.ndarray] = {}
    g, owner = analysis.graph, analysis.owner
    for occ in analysis.occurrences:
        cut = occ.extract
        for k in cut.inputs:
            producer, reader = cut.origin[k], cut.origin[cut.graph.users(k)[0]]
            position = g[reader].operands.index(producer)
            a, b = owner[producer], owner[reader]
            matrix = np.array([[sum(c.cost for c in reshard(
                g, producer, _spec(analysis, producer, ca).output, _spec(analysis, reader, cb).operands[position],
                analysis.mesh, analysis.options.cost)) for cb in choices[b]] for ca in choices[a]])
            found[(a, b)] = found[(a, b)] + matrix if (a, b) in found else matrix
    return [_Edge(*where[a], *where[b], m) for (a, b), m in found.items() if m.any()]


def _spec(analysis: Analysis, v: int, choice: dict[int, int]):
    return analysis.strategies[v].strategies[choice[v]]


def _param_bytes(analysis: Analysis, occ, choice: Sequence[int]) -> float:
    cut = occ.extract
    layouts = analysis.segment_layouts(cut, occ.blocks, choice)
    return sum(layouts[k].memory for k, v in enumerate(cut.origin)
               if k not in cut.inputs and analysis.graph[v].kind is OpKind.PARAMETER)


def _program(options: list[list[_Option]], edges: list[_Edge], budget: float | None
             ) -> tuple[LinearProgram, list[list[int]]]:
    lp = LinearProgram()
    x = [[lp.add_var(f"x_{o}_{i}", opt.time, integer=True) for i, opt in enumerate(opts)]
         for o, opts in enumerate(options)]
    for xs in x:  # one combination per occurrence
        lp.add_row(dict.fromkeys(xs, 1.0), 1.0, 1.0, "one_hot")
    for n, edge in enumerate(edges):  # e's row sums are a's choice, column sums b's
        na, nb = edge.cost.shape
        e = [[lp.add_var(f"e_{n}_{s}_{t}", float(edge.cost[s, t])) for t in range(nb)] for s in range(na)]
        for s in range(na):
            terms = dict.fromkeys(e[s], 1.0) | _indicator(options, x, edge.oa, edge.ia, s)
            lp.add_row(terms, 0.0, 0.0, "edge_row")
        for t in range(nb):
            terms = {e[s][t]: 1.0 for s in range(na)} | _indicator(options, x, edge.ob, edge.ib, t)
            lp.add_row(terms, 0.0, 0.0, "edge_col")
    if budget is not None:  # every occurrence's parameters, plus o's other bytes
        for o in range(len(options)):
            lp.add_row(_memory_terms(options, x, o), float("-inf"), budget, "memory")
    return lp, x


def _indicator(options, x, o: int, position: int, candidate: int) -> dict[int, float]:
    """-1 * the sum of occurrence o's combinations whose block `position` takes `candidate`."""
    return {x[o][i]: -1.0 for i, opt in enumerate(options[o]) if opt.choice[position] == candidate}


def _memory_terms(options, x, o: int) -> dict[int, float]:
    terms = {x[p][i]: opt.params for p, opts in enumerate(options) for i, opt in enumerate(opts)}
    for i, opt in enumerate(options[o]):
        terms[x[o][i]] = opt.peak
    return terms


def _infeasible(analysis: Analysis, options, budget: float, solver: str, time_limit: float) -> InfeasiblePlanError:
    lp, x = _program(options, [], None)
    lp.cost = [0.0] * lp.num_vars
    need = lp.add_var("peak", 1.0, 0.0, float("inf"))
    for o in range(len(options)):
        lp.add_row(_memory_terms(options, x, o) | {need: -1.0}, float("-inf"), 0.0, "memory")
    result = solve_program(lp, solver, time_limit)
    least = f"; the least any plan needs is {format_bytes(result.objective)}" if result.has_solution else ""
    return InfeasiblePlanError(
        f"no plan of {analysis.graph.name!r} from the profiled combinations fits {format_bytes(budget)} per "
        f"device{least}. Raise the budget, use more devices, or a smaller batch.",
        min_budget_bytes=result.objective if result.has_solution else None)


def _plan(analysis: Analysis, profiles: Profiles, statistic: str, options, edges, picked: Sequence[int],
          budget: float | None, result: SolveResult) -> CfpPlan:
    chosen = [options[o][i] for o, i in enumerate(picked)]
    total, memory = evaluate(options, edges, picked)
    segment_time = sum(c.time for c in chosen)
    block_choice = tuple(k for c in chosen for k in c.choice)
    return CfpPlan(analysis.graph.name, analysis.mesh.shape, profiles.mode, statistic, block_choice,
                   tuple(c.choice for c in chosen), total, segment_time, total - segment_time, memory, budget, result)
