"""Solver backends behind one interface: LinearProgram in, SolveResult out."""

from __future__ import annotations

import ctypes
import enum
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from meshplan.errors import SolverError
from meshplan.intra.program import LinearProgram

COST_TARGET = 1e6  # the largest cost a solver is given (HiGHS's tolerances are absolute: 1e-6 gap, 1e-7 costs)


class SolveStatus(enum.Enum):
    OPTIMAL = "optimal"
    FEASIBLE = "feasible"  # stopped by the time limit with a solution
    INFEASIBLE = "infeasible"
    NO_SOLUTION = "no_solution"  # stopped by the time limit before finding one


@dataclass(frozen=True, slots=True)
class SolveResult:
    """What a backend returns: status, objective, best bound, relative gap, wall seconds."""

    status: SolveStatus
    objective: float | None
    bound: float | None
    gap: float | None
    wall_s: float
    backend: str
    values: tuple[float, ...] = field(default=(), compare=False, repr=False)  # the raw solution vector

    @property
    def has_solution(self) -> bool:
        return self.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE)


Backend = Callable[[LinearProgram, float, float], SolveResult]
_BACKENDS: dict[str, Backend] = {}


def register_backend(name: str) -> Callable[[Backend], Backend]:
    def decorate(fn: Backend) -> Backend:
        _BACKENDS[name] = fn
        return fn

    return decorate


def solve_program(lp: LinearProgram, backend: str = "highs", time_limit: float = 60.0,
                  mip_gap: float = 0.0) -> SolveResult:
    """Solve `lp` with the named backend; the objective includes the program's offset."""
    if backend not in _BACKENDS:
        raise SolverError(f"unknown solver backend {backend!r}; use one of {', '.join(sorted(_BACKENDS))}")
    if lp.num_vars == 0:  # nothing to choose: every group had one strategy
        return SolveResult(SolveStatus.OPTIMAL, lp.offset, lp.offset, 0.0, 0.0, backend, ())
    # Costs in seconds (1e-8..1e-4) sit below the solvers' absolute tolerances: solve with
    # them brought to about COST_TARGET (a power of two: exact), then undo the scale.
    scale = power_of_two_scale(np.array(lp.cost), COST_TARGET)
    result = _BACKENDS[backend](replace(lp, cost=[c * scale for c in lp.cost], offset=lp.offset * scale),
                                time_limit, mip_gap)
    if scale == 1.0:
        return result
    return replace(result, objective=None if result.objective is None else result.objective / scale,
                   bound=None if result.bound is None else result.bound / scale)


def power_of_two_scale(values: np.ndarray, target: float, up: bool = True) -> float:
    """The power of two bringing the largest finite |value| into (target / 2, target]; 1 when
    every value is 0, or (without `up`) when the largest is already at most `target`."""
    finite = np.abs(values[np.isfinite(values)])
    largest = float(finite.max()) if len(finite) else 0.0
    if largest == 0.0 or (not up and largest <= target):
        return 1.0
    return float(2.0 ** -np.ceil(np.log2(largest / target)))


def _gap(objective: float | None, bound: float | None) -> float | None:
    if objective is None or bound is None:
        return None
    return max(0.0, objective - bound) / max(abs(objective), 1e-9)


_banner_shown = False


def quiet_highs():
    """A `highspy.Highs` that prints nothing on standard output.

    HiGHS 1.16 prints its banner from C++ when the first instance of a process is made, before any
    option can silence it; that would corrupt `--json` output (and repeat once per worker process),
    so the first construction runs with the process's C-level stdout pointed at the null device.
    """
    global _banner_shown
    import highspy

    if _banner_shown:
        h = highspy.Highs()
    else:
        sys.stdout.flush()
        saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 1)
            h = highspy.Highs()
            ctypes.CDLL(None).fflush(None)  # drop the C library's buffered banner while fd 1 is the null device
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            os.close(null)
        _banner_shown = True
    h.setOptionValue("output_flag", False)
    return h


@register_backend("highs")
def solve_with_highs(lp: LinearProgram, time_limit: float, mip_gap: float) -> SolveResult:
    try:
        import highspy
    except ImportError as exc:  # pragma: no cover - highspy is a dependency
        raise SolverError("the HiGHS backend needs highspy: pip install highspy") from exc
    start = time.perf_counter()
    h = quiet_highs()
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    h.setOptionValue("threads", 1)
    h.passModel(_highs_model(highspy, lp))
    h.run()
    wall = time.perf_counter() - start
    status = h.getModelStatus()
    info = h.getInfo()
    ms = highspy.HighsModelStatus
    if status == ms.kInfeasible:
        return SolveResult(SolveStatus.INFEASIBLE, None, None, None, wall, "highs")
    has_primal = info.primal_solution_status == 2  # kSolutionStatusFeasible
    if not has_primal:
        return SolveResult(SolveStatus.NO_SOLUTION, None, None, None, wall, "highs")
    objective = info.objective_function_value + lp.offset
    bound = info.mip_dual_bound + lp.offset if lp.num_integer else objective
    optimal = status == ms.kOptimal
    values = tuple(h.getSolution().col_value)
    return SolveResult(SolveStatus.OPTIMAL if optimal else SolveStatus.FEASIBLE, objective, bound,
                       _gap(objective, bound) if not optimal else max(0.0, _gap(objective, bound) or 0.0),
                       wall, "highs", values)


def _highs_model(highspy, lp: LinearProgram):
    model = highspy.HighsLp()
    n = lp.num_vars
    model.num_col_ = n
    model.num_row_ = len(lp.rows)
    model.col_cost_ = np.array(lp.cost, dtype=np.float64)
    model.col_lower_ = np.array(lp.lower, dtype=np.float64)
    model.col_upper_ = np.array(lp.upper, dtype=np.float64)
    inf = highspy.kHighsInf
    model.row_lower_ = np.array([max(r.lower, -inf) for r in lp.rows], dtype=np.float64)
    model.row_upper_ = np.array([min(r.upper, inf) for r in lp.rows], dtype=np.float64)
    starts, index, value = [0], [], []
    for row in lp.rows:
        index.extend(row.indices)
        value.extend(row.coefs)
        starts.append(len(index))
    model.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    model.a_matrix_.start_ = np.array(starts, dtype=np.int32)
    model.a_matrix_.index_ = np.array(index, dtype=np.int32)
    model.a_matrix_.value_ = np.array(value, dtype=np.float64)
    model.a_matrix_.num_col_ = n
    model.a_matrix_.num_row_ = len(lp.rows)
    model.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                          for i in lp.integer]
    return model


@register_backend("cbc")
def solve_with_cbc(lp: LinearProgram, time_limit: float, mip_gap: float) -> SolveResult:
    try:
        import pulp
    except ImportError as exc:  # pragma: no cover - pulp is a dependency
        raise SolverError("the CBC backend needs PuLP: pip install pulp") from exc
    start = time.perf_counter()
    prob = pulp.LpProblem("meshplan_intra", pulp.LpMinimize)
    xs = [prob.add_variable(f"x{i}", lp.lower[i], None if lp.upper[i] == float("inf") else lp.upper[i],
                            pulp.LpInteger if lp.integer[i] else pulp.LpContinuous)
          for i in range(lp.num_vars)]
    prob += pulp.LpAffineExpression([(xs[i], c) for i, c in enumerate(lp.cost) if c]) + lp.offset
    for k, row in enumerate(lp.rows):
        body = pulp.LpAffineExpression(list(zip((xs[i] for i in row.indices), row.coefs, strict=True)))
        if row.lower == row.upper:
            prob += (body == row.lower), f"r{k}"
        else:
            if row.lower > float("-inf"):
                prob += (body >= row.lower), f"r{k}_lo"
            if row.upper < float("inf"):
                prob += (body <= row.upper), f"r{k}_hi"
    solver = pulp.COIN_CMD(msg=False, timeLimit=time_limit, gapRel=mip_gap or None)
    if not solver.available():
        raise SolverError("the CBC backend needs the cbc binary: pip install 'pulp[cbc]'")
    prob.solve(solver)
    wall = time.perf_counter() - start
    # PuLP can call a time-limited run "Optimal": trust the solution status instead.
    if prob.status == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible:
        return SolveResult(SolveStatus.INFEASIBLE, None, None, None, wall, "cbc")
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return SolveResult(SolveStatus.NO_SOLUTION, None, None, None, wall, "cbc")
    values = tuple(float(x.value() or 0.0) for x in xs)
    objective = float(np.dot(lp.cost, values)) + lp.offset
    if prob.sol_status == pulp.LpSolutionOptimal:
        return SolveResult(SolveStatus.OPTIMAL, objective, objective, 0.0, wall, "cbc", values)
    return SolveResult(SolveStatus.FEASIBLE, objective, None, None, wall, "cbc", values)

