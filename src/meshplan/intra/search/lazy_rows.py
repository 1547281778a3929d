"""The whole MIP with its memory rows added only where they are violated (row generation).

Block (all memory rows) + a feasible start -> best feasible assignment, proven bound, optimal?

Production graphs have thousands of memory rows (IOPDDL's D: 22,104 after presolve for 203
nodes) but only a handful bind: the LP of D with the 10 most violated rows satisfies all
22,104, and its bound is within 0.6 % of the best known cost. A MIP with every row spends its
time on the rows' LP; one with a few rows finds good plans. So the MIP starts with the rows a
cheap plan violates most and, whenever HiGHS finds a plan that breaks a row it does not have
(checked exactly in the improving-solution callback), stops, adds the rows that plan breaks
most and starts again from the best feasible plan. A MIP on a subset of the rows is a
relaxation, so every dual bound it proves holds for the whole problem, and an optimum of the
relaxation that fits every row is optimal.

`Hooks` connect the run to a portfolio: plans found are reported as they come, plans that
other searches found are passed to HiGHS through its user-solution callback.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from meshplan.intra.problem.arrays import rounding_slack
from meshplan.intra.problem.memory import peak_rows, row_loads, row_subset
from meshplan.intra.search.mip import Block, MipModel, build_mip, edge_part
from meshplan.intra.solvers import quiet_highs

ROWS_PER_ROUND = 8  # rows added after each violation (local peaks of the excess first)


class Hooks(Protocol):
    """How a search meets the others: report plans, receive theirs."""

    def found(self, choice: np.ndarray, cost: float) -> None:
        """A feasible plan (of the reduced problem) and its cost."""

    def offered(self) -> tuple[np.ndarray, float] | None:
        """The best plan another search found since the last call, if any."""

    def proved(self, bound: float) -> None:
        """A lower bound on the optimum."""


class NoHooks:
    def found(self, choice: np.ndarray, cost: float) -> None:
        pass

    def offered(self) -> tuple[np.ndarray, float] | None:
        return None

    def proved(self, bound: float) -> None:
        pass


@dataclass(frozen=True, slots=True)
class LazyOutcome:
    """Best feasible plan (None if none), its cost, the best proven bound, whether proven optimal
    (or, with no plan, proven infeasible)."""

    choice: np.ndarray | None
    cost: float
    bound: float
    optimal: bool
    infeasible: bool
    runs: int
    rows: int
    columns: int = 0  # size of the last MIP (for reports)
    constraints: int = 0


def solve_lazy(block: Block, start: np.ndarray | None, deadline: float, hooks: Hooks | None = None,
               hints: tuple[np.ndarray, ...] = (), mip_gap: float = 0.0,
               rows: np.ndarray | None = None) -> LazyOutcome:
    """Row generation until `deadline` (perf_counter seconds); `start`: a feasible plan or None;
    `hints`: plans (feasible or not) whose violated rows seed the first MIP; `rows`: more rows
    for it (those memory prices found binding: each row a plan of the MIP breaks later costs
    a restart, a root LP of 10-20 s on IOPDDL's D)."""
    state = _State(block, hooks or NoHooks())
    if start is not None:
        state.offer(start)
    selected = state.seed_rows(hints + ((start,) if start is not None else ()))
    if rows is not None:
        selected = np.union1d(selected, rows)
    edges = edge_part(block)
    runs, warm = 0, True
    while time.perf_counter() < deadline - 0.05:
        runs += 1
        model = build_mip(replace(block, rows=row_subset(block.rows, selected)), edges)
        state.size = (model.num_cols, model.num_rows)
        run = _Run(model, state, selected)
        optimal = run.solve(deadline - time.perf_counter(), mip_gap, warm)
        if run.new_rows is not None:
            selected = np.union1d(selected, run.new_rows)
            continue
        if run.infeasible and state.best is None:  # a relaxation admits nothing: neither does the problem
            return state.outcome(False, runs, len(selected), infeasible=True)
        if optimal and state.best is not None and state.best_cost <= run.objective + rounding_slack(run.objective):
            return state.outcome(True, runs, len(selected))
        if optimal and warm:
            # HiGHS 1.16 can report the optimum's objective with the warm start's values (seen
            # when its presolve alone solves the model): solve once more without the start
            warm = False
            continue
        break
    return state.outcome(False, runs, len(selected))


class _State:
    """The best feasible plan, the best bound, and exact checks against every row."""

    def __init__(self, block: Block, hooks: Hooks) -> None:
        self.block, self.hooks = block, hooks
        self.best: np.ndarray | None = None
        self.best_cost = np.inf
        self.bound = -np.inf
        self.size = (0, 0)

    def excess(self, choice: np.ndarray) -> np.ndarray:
        b = self.block
        use = b.usage.values[b.usage.ptr[:-1] + choice[b.term_node]] if len(b.term_node) else np.zeros(0)
        return row_loads(b.rows, use) - b.rows.capacity

    def offer(self, choice: np.ndarray, report: bool = False) -> bool:
        """Keep `choice` if it fits every row and beats the best; report it to the hooks."""
        cost = self.block.cost_of(choice)
        if not cost < self.best_cost - rounding_slack(cost) or (self.excess(choice) > 0).any():
            return False
        self.best, self.best_cost = choice.copy(), cost
        if report:
            self.hooks.found(self.best, cost)
        return True

    def seed_rows(self, plans: tuple[np.ndarray, ...]) -> np.ndarray:
        """The rows the hint plans break most, and the rows a start leaves the least room in."""
        chosen = [np.zeros(0, dtype=np.int64)]
        for plan in plans:
            excess = self.excess(plan)
            chosen.append(peak_rows(excess, ROWS_PER_ROUND) if (excess > 0).any()
                          else np.argsort(-excess)[:2])
        return np.unique(np.concatenate(chosen))

    def outcome(self, optimal: bool, runs: int, rows: int, infeasible: bool = False) -> LazyOutcome:
        bound = self.best_cost if optimal else self.bound
        return LazyOutcome(self.best, float(self.best_cost), float(bound), optimal, infeasible, runs, rows, *self.size)


class _Run:
    """One HiGHS run on a subset of the rows, with the callbacks of row generation."""

    def __init__(self, model: MipModel, state: _State, selected: np.ndarray) -> None:
        self.model, self.state = model, state
        self.selected = np.zeros(len(state.block.rows), dtype=bool)
        self.selected[selected] = True
        self.new_rows: np.ndarray | None = None
        self.pending: np.ndarray | None = None
        self.objective = np.inf
        self.infeasible = False

    def solve(self, time_limit: float, mip_gap: float, warm: bool = True) -> bool:
        import highspy

        from meshplan.intra.search.mip import _highs_lp

        h = quiet_highs()
        h.setOptionValue("time_limit", max(float(time_limit), 0.01))
        h.setOptionValue("mip_rel_gap", float(mip_gap))
        h.setOptionValue("threads", 1)
        h.setOptionValue("primal_feasibility_tolerance", 1e-9)
        # HiGHS's presolve spent 60 s (machine loaded) on D's 72,000 edge columns without
        # finishing; without it the root LP took 20 s and a sub-MIP found a plan within 0.3 %
        h.setOptionValue("presolve", "off")
        h.passModel(_highs_lp(highspy, self.model))
        if warm and self.state.best is not None:
            x = self.model.start_values(self.state.best)
            h.setSolution(len(x), np.arange(len(x), dtype=np.int32), x)
        h.cbMipImprovingSolution.subscribe(self._improving)
        h.cbMipInterrupt.subscribe(self._interrupt)
        h.cbMipUserSolution.subscribe(self._user_solution)
        h.run()
        info = h.getInfo()
        self.infeasible = h.getModelStatus() == highspy.HighsModelStatus.kInfeasible
        self._note_bound(info.mip_dual_bound)
        if info.primal_solution_status == 2:
            self.objective = self.model.objective(info.objective_function_value)
            self._check(self.model.choice(np.asarray(h.getSolution().col_value)))
        return h.getModelStatus() == highspy.HighsModelStatus.kOptimal and self.new_rows is None

    def _check(self, choice: np.ndarray) -> None:
        """Keep a plan that fits every row; otherwise note the rows it breaks that the run lacks."""
        if self.state.offer(choice, report=True):
            return
        excess = self.state.excess(choice)
        excess[self.selected] = 0.0  # rows the run has are broken only within HiGHS's tolerance
        if (excess > 0).any() and self.new_rows is None:
            self.new_rows = peak_rows(excess, ROWS_PER_ROUND)

    def _improving(self, event) -> None:
        self._check(self.model.choice(np.asarray(event.data_out.mip_solution)))

    def _note_bound(self, scaled: float) -> None:
        """A dual bound of this relaxation holds for the whole problem: told as soon as proven,
        since a portfolio's child is killed at the deadline, before its run returns (D's root LP
        bound, within 0.5 % of the best known cost, was lost that way)."""
        if np.isfinite(scaled) and self.model.objective(scaled) > self.state.bound:
            self.state.bound = self.model.objective(scaled)
            self.state.hooks.proved(self.state.bound)

    def _interrupt(self, event) -> None:
        self._note_bound(event.data_out.mip_dual_bound)
        if self.new_rows is not None:
            event.interrupt()
            return
        offered = self.state.hooks.offered()
        if offered is not None and self.state.offer(offered[0]):
            self.pending = self.state.best

    def _user_solution(self, event) -> None:
        if self.pending is None:
            return
        event.data_in.setSolution(self.model.start_values(self.pending))
        event.data_in.user_has_solution = True
        self.pending = None

