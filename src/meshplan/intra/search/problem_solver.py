"""solve_problem: StrategyProblem -> ProblemSolution (strategies, cost, status, bound).

The one entry every intra-op problem goes through (model-built and captured graphs via
`solve_intra`, external problems such as IOPDDL files via `meshplan solve-problem`):

1. exact presolve (`presolve`), which also spots forbidden structures that admit nothing;
2. compact memory rows (`memory`);
3. a feasible plan within seconds: least memory per node, then feasible moves of whole
   colour classes (`local_search`);
4. then, until the time limit, two searches: memory prices (`lagrange`: Lagrangian relaxation
   of the memory rows, priced plans decoded from a message-passing dual, which also proves a
   bound) and an exact side: the whole MIP with memory rows added as plans violate them
   (`lazy_rows`, when the MIP is small enough; it proves a bound too), else large-neighbourhood
   search whose windows are exact sub-MIPs (`lns`); without memory rows, once the bound fixes
   enough strategies out (reduced-cost fixing) the whole MIP over those left. With `workers >= 2` they run at once in
   two processes and trade plans (`portfolio`); with one worker the prices come first and the
   exact side gets the rest of the time, starting from their best plan.

The best feasible assignment found is returned with the best proven bound; a solution found
is never reported as "no solution". `on_plan` hears of every better plan as it is found (the
command line writes it, so an interrupted run leaves its last good plan behind).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from meshplan.errors import OptionsError
from meshplan.intra.problem.arrays import FORBIDDEN, Ragged, StrategyProblem, rounding_slack
from meshplan.intra.problem.memory import MemoryRows, TermIndex, memory_rows, term_index
from meshplan.intra.problem.presolve import Infeasible, Presolved, presolve
from meshplan.intra.search.candidates import candidates_first
from meshplan.intra.search.elimination import least_cost
from meshplan.intra.search.lagrange import MemoryPricing
from meshplan.intra.search.lazy_rows import Hooks, LazyOutcome, NoHooks, solve_lazy
from meshplan.intra.search.lns import run_lns
from meshplan.intra.search.local_search import Incumbent, improve_feasible, least_memory_choice
from meshplan.intra.search.mip import Block, MipModel, build_mip, edge_part_size
from meshplan.intra.search.pairwise import PairwiseIndex, icm_sweep, pairwise_index, segment_argmin
from meshplan.intra.search.portfolio import Channel, ChannelHooks, Child, can_fork
from meshplan.intra.solvers import SolveStatus

BACKENDS = ("highs", "cbc")
PRICING_SHARE = 0.7  # one worker, large problems: of the time left, for memory prices; the rest for windows
PRICING_FIRST = 0.25  # one worker, MIP-sized problems: at most this share for prices before the MIP
PRICING_FIRST_ROUNDS = 40  # ... and at most this many rounds
QUICK_MIP_COLUMNS = 20_000  # one worker: MIPs this small go first (HiGHS solves them in moments)
PRESOLVE_SHARE = 0.6  # presolve stops reducing after this share of the time limit
END_SHARE = 0.01  # of the time limit, kept for ending
ROUND_MARGIN = 1.5  # a round starts only if 1.5 times the longest round so far still fits
SEED_ROUNDS = 12  # portfolio: pricing rounds the MIP's process runs first to learn the binding rows
SEED_SHARE = 0.1  # ... within at most this share of its time
SEED_MIN_ROUNDS = 4  # ... but at least this many (the candidates' scores need them: on D, from
SEED_MOST_SHARE = 0.3  # zero prices the candidates' best plan cost 5.6 times the best known,
# after 4 rounds the best known) unless they take more than this share
CANDIDATES_SHARE = 0.6  # of the time left, at most for the MIP over the prices' candidate strategies
ELIMINATION_WORK = 5_000_000  # table entries: blocks without memory rows this small are solved
# exactly before any MIP (a LLaMA piece's embedding or head: at most 22,000, well under a
# millisecond; a block: 0.8-4 million, 10-40 ms, where HiGHS takes 60-200 ms on its MIP)


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
        workers: processes; with 2 or more the memory prices and the exact side run at once
            and trade plans (needs `fork`; otherwise one process does both in turn).
        lockstep: with several workers, trade plans only at numbered epochs, each side waiting
            for the other, so that a seed gives the same run every time (up to where the clock
            stops it); otherwise as soon as found (better under a time limit).
    """

    time_limit: float = 60.0
    mip_gap: float = 0.0
    backend: str = "highs"
    full_mip_columns: int = 400_000
    seed: int = 0
    workers: int = 1
    lockstep: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise OptionsError(f"unknown solver backend {self.backend!r}; use one of {', '.join(BACKENDS)}")
        if not self.time_limit > 0:
            raise OptionsError(f"time_limit must be positive seconds, got {self.time_limit}")
        if self.workers < 1:
            raise OptionsError(f"workers must be at least 1, got {self.workers}")


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


PlanListener = Callable[[np.ndarray, float], None]


def solve_problem(problem: StrategyProblem, options: ProblemOptions | None = None,
                  on_plan: PlanListener | None = None) -> ProblemSolution:
    """Choose one strategy per node minimizing node + edge costs within the memory limit.

    Args:
        problem: the problem as arrays (see `strategy_problem`, `read_iopddl`).
        options: time limit, backend, gap, workers.
        on_plan: called with every better feasible plan (one strategy per node of `problem`)
            and its cost as soon as it is found.

    Returns:
        The best assignment found, its cost, status and proven bound.
    """
    options = options or ProblemOptions()
    start = time.perf_counter()
    deadline = start + options.time_limit * (1 - END_SHARE) - 0.02  # the end: stop the child, expand the plan
    stats: dict[str, Any] = {"nodes": problem.num_nodes, "edges": problem.num_edges}
    try:
        pre = presolve(problem, deadline=start + PRESOLVE_SHARE * options.time_limit)
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
    return _search(problem, pre, rows, start, deadline, options, stats, on_plan)


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


class _Best:
    """The best feasible plan of the reduced problem so far, told to the listener as found."""

    def __init__(self, pre: Presolved, on_plan: PlanListener | None) -> None:
        self.pre, self.on_plan = pre, on_plan
        self.choice: np.ndarray | None = None
        self.cost = np.inf
        self.source = ""

    def offer(self, choice: np.ndarray | None, cost: float, source: str) -> bool:
        if choice is None or not cost < self.cost:
            return False
        self.choice, self.cost, self.source = choice.copy(), cost, source
        if self.on_plan is not None:
            self.on_plan(self.pre.expand(self.choice), self.cost + self.pre.offset)
        return True


@dataclass(frozen=True, slots=True)
class _Found:
    """What the searches proved: a bound (reduced problem), the best plan optimal, no plan exists."""

    bound: float
    optimal: bool = False
    infeasible: bool = False


@dataclass(frozen=True, slots=True)
class _Setting:
    """What every search of one solve shares: the reduced problem, its indexes, the clock."""

    problem: StrategyProblem
    pre: Presolved
    rows: MemoryRows
    ix: PairwiseIndex
    terms: TermIndex
    start: float
    deadline: float
    options: ProblemOptions

    def fits(self, choice: np.ndarray) -> bool:
        return bool((self.terms.loads(choice) <= self.rows.capacity).all())


def _search(problem: StrategyProblem, pre: Presolved, rows: MemoryRows, start: float, deadline: float,
            options: ProblemOptions, stats: dict[str, Any], on_plan: PlanListener | None) -> ProblemSolution:
    q = pre.problem
    if q.num_nodes == 0:  # presolve decided everything
        return _answer(problem, pre, np.zeros(0, dtype=np.int64), True, start, options, stats)
    rng = np.random.default_rng(options.seed)
    ix = pairwise_index(q)
    terms = term_index(rows, q.memory.node, q.memory.usages, q.costs.ptr)
    setting = _Setting(q, pre, rows, ix, terms, start, deadline, options)
    best = _Best(pre, on_plan)
    greedy = least_memory_choice(q, rows)
    fits = setting.fits(greedy)
    if fits:  # moves that keep memory within the limit also leave forbidden pairs behind
        improve_feasible(ix, terms, q.costs.values, greedy)
        fits = bool(np.isfinite(q.cost_of(greedy)))
    if fits:
        best.offer(greedy, q.cost_of(greedy), "greedy")
        stats.update(heuristic_cost=q.cost_of(greedy) + pre.offset, heuristic_s=time.perf_counter() - start)
    columns = _mip_columns(q)
    small = columns <= options.full_mip_columns
    if small:
        stats["mip_columns"] = columns
    if options.backend == "cbc" and small:
        return _solve_whole_with_cbc(problem, setting, best, stats)
    pricing = MemoryPricing(q, ix, terms, greedy, fits, rng)
    if options.workers >= 2 and can_fork():
        found = _portfolio(setting, pricing, best, small, stats, rng)
    else:
        found = _one_worker(setting, pricing, best, small, stats, rng, quick=small and columns <= QUICK_MIP_COLUMNS)
    stats.update(price_rounds=pricing.rounds, price_wins=pricing.improvements, best_from=best.source)
    if best.choice is None:
        bound = found.bound + pre.offset if np.isfinite(found.bound) else None
        return _answer(problem, None, None, False, start, options, stats, bound=bound, infeasible=found.infeasible)
    return _answer(problem, pre, best.choice, found.optimal, start, options, stats,
                   bound=max(found.bound + pre.offset, _trivial_bound(pre)))


def _mip_columns(q: StrategyProblem) -> int:
    """Columns of the whole MIP at most (strategies and strategy pairs)."""
    pairs = int(np.prod(q.sizes[q.edge_nodes], axis=1).sum()) if q.num_edges else 0
    return pairs + int(q.sizes.sum())


def _block(setting: _Setting) -> Block:
    """The reduced problem as one MIP block, without the presolve's constant offset."""
    return replace(whole_block(setting.pre, setting.rows), offset=0.0)


def _cheap_plan(setting: _Setting) -> np.ndarray:
    """A plan that ignores memory: the rows it breaks are the ones likely to bind."""
    ix, unary = setting.ix, setting.problem.costs.values
    plan = segment_argmin(ix, unary)
    for _ in range(4):
        if not icm_sweep(ix, unary, plan):
            break
    return plan


def _price(setting: _Setting, pricing: MemoryPricing, best: _Best, until: float, max_rounds: int | None = None,
           channel: Channel | None = None, enough: Callable[[], bool] | None = None) -> None:
    """Pricing rounds until `until` (a round starts only if it is likely to end in time), the
    bound proves the best plan optimal, the channel's peer proved its plan optimal, or `enough`."""
    longest, rounds = 0.0, 0
    while time.perf_counter() + ROUND_MARGIN * longest < until and not pricing.closed:
        if max_rounds is not None and rounds >= max_rounds:
            break
        if enough is not None and rounds and enough():
            break
        began = time.perf_counter()
        if pricing.step(until):
            best.offer(pricing.best, pricing.best_cost, "prices")
            if channel is not None:
                channel.publish(pricing.best)
        rounds += 1
        longest = max(longest, time.perf_counter() - began)
        if channel is not None:
            _adopt(setting, pricing, best, channel.checkpoint(), "exact")
            if channel.peer_optimal:
                return


def _adopt(setting: _Setting, pricing: MemoryPricing, best: _Best, plans: list[np.ndarray], source: str) -> None:
    for plan in plans:
        if setting.fits(plan):
            cost = setting.problem.cost_of(plan)
            best.offer(plan, cost, source)
            pricing.adopt(plan, cost)


def _one_worker(setting: _Setting, pricing: MemoryPricing, best: _Best, small: bool, stats: dict[str, Any],
                rng: np.random.Generator, quick: bool) -> _Found:
    """Prices first (but not before a quick MIP), then the exact side from their best plan."""
    now, deadline = time.perf_counter(), setting.deadline
    share = PRICING_FIRST if small else PRICING_SHARE
    fixed: list[StrategyProblem | None] = [None]

    def fixable() -> bool:  # large problems: price until the bound leaves a MIP small enough
        fixed[0] = _fixed_by_bound(setting, pricing, best)
        return fixed[0] is not None

    if not quick:
        _price(setting, pricing, best, now + share * (deadline - now), PRICING_FIRST_ROUNDS if small else None,
               enough=None if small else fixable)
    stats["priced_s"] = time.perf_counter() - setting.start
    if pricing.closed:
        return _Found(pricing.bound, optimal=True)
    if not small and (fixed[0] is not None or fixable()):
        optimal = _solve_fixed(setting, fixed[0], best, deadline, stats)
        if optimal or time.perf_counter() >= deadline - 0.03 * setting.options.time_limit:
            return _Found(pricing.bound, optimal=optimal)
    if small:
        rows = pricing.binding_rows()
        block = _block(setting)
        least = _least_cost(setting, block)
        start = best.choice
        if not _is_optimal(block, start, least):  # else the candidates' MIP would pass it on unbeaten
            start = _candidates_first(setting, pricing, start, deadline, NoHooks(), rows)
        if _is_optimal(block, start, least) and time.perf_counter() < deadline - 0.05:
            out = _settled(block, start)
        else:
            out = solve_lazy(block, start, deadline, hints=(_cheap_plan(setting), pricing.x),
                             mip_gap=setting.options.mip_gap, rows=rows)
        best.offer(out.choice, out.cost, "mip")
        stats.update(mip_rows=out.constraints, lazy_runs=out.runs, lazy_rows=out.rows)
        return _Found(max(pricing.bound, out.bound), out.optimal and out.cost <= best.cost + rounding_slack(best.cost),
                      out.infeasible)
    if best.choice is None:
        return _Found(pricing.bound)
    inc = Incumbent(setting.problem, setting.rows, best.choice)
    lns = run_lns(inc, deadline - 0.03 * setting.options.time_limit, rng)
    best.offer(inc.choice, inc.cost, "windows")
    stats.update(lns_windows=lns.windows, lns_improved=lns.improved, lns_window=lns.final_window)
    return _Found(pricing.bound)


def _fixed_by_bound(setting: _Setting, pricing: MemoryPricing, best: _Best) -> StrategyProblem | None:
    """Reduced-cost fixing, for a problem without memory rows: the reduced problem with every
    strategy forbidden that the message-passing bound proves no plan as good as the best one
    chooses (any plan choosing strategy i costs at least bound + excess(i)). None while the whole
    MIP over the strategies left would have more than `full_mip_columns` columns. On the 3-D view
    (4, 2, 2) of a GPT-3 block (7,108 strategies, 3.5 million columns) 8 pricing rounds leave
    2,674 strategies (144,000 columns after presolve), whose MIP proves in 21 s an optimum 0.47 %
    below the best plan prices and windows had found in 30 s (docs/design.md, N-D logical meshes)."""
    dual = pricing.dual
    if len(setting.rows) or dual is None or best.choice is None:
        return None
    q = setting.problem
    unary = q.costs.values
    room = best.cost - dual.bound(unary)
    keep = dual.excess(unary) <= room + rounding_slack(best.cost)
    sizes = np.add.reduceat(keep.astype(np.int64), q.costs.ptr[:-1])
    pairs = int((sizes[q.edge_nodes[:, 0]] * sizes[q.edge_nodes[:, 1]]).sum()) if q.num_edges else 0
    if pairs + int(sizes.sum()) > setting.options.full_mip_columns:
        return None
    return replace(q, costs=Ragged(np.where(keep, unary, FORBIDDEN), q.costs.ptr))


def _solve_fixed(setting: _Setting, fixed: StrategyProblem, best: _Best, deadline: float,
                 stats: dict[str, Any]) -> bool:
    """The whole MIP of the fixed problem until the deadline; True when it proves the best plan
    optimal (every plan at most as dear as the best one is a plan of the fixed problem)."""
    began = time.perf_counter()
    pre = presolve(fixed, deadline=began + 0.2 * max(deadline - began, 0.0))
    stats["fixed_strategies"] = int(pre.problem.sizes.sum())
    if pre.problem.num_nodes == 0:  # presolve decided the fixed problem: its one plan is the optimum
        choice = pre.expand(np.zeros(0, dtype=np.int64))
        best.offer(choice, setting.problem.cost_of(choice), "fixed")
        stats["fixed_s"] = time.perf_counter() - began
        return True
    start = pre.reduce(best.choice)  # the MIP starts from the best plan (it survives the fixing)
    out = solve_lazy(replace(whole_block(pre, _rows(pre)), offset=0.0), start, deadline,
                     mip_gap=setting.options.mip_gap)
    if out.choice is not None:
        choice = pre.expand(out.choice)
        best.offer(choice, setting.problem.cost_of(choice), "fixed")
    stats.update(fixed_columns=out.columns, fixed_s=time.perf_counter() - began)
    return out.optimal and out.choice is not None and \
        best.cost <= out.cost + pre.offset + rounding_slack(best.cost)


def _least_cost(setting: _Setting, block: Block) -> float | None:
    """The block's optimal cost by variable elimination, when it has no memory rows and its
    elimination is small enough (ELIMINATION_WORK); else None."""
    return None if len(setting.rows) else least_cost(block, ELIMINATION_WORK)


def _is_optimal(block: Block, start: np.ndarray | None, least: float | None) -> bool:
    """Whether no plan beats `start` by more than rounding (half the slack is left for the
    elimination's own sums, in another order: about 1e-14 relative)."""
    if start is None or least is None or not np.isfinite(least):
        return False
    return block.cost_of(start) <= least + 0.5 * rounding_slack(least)


def _settled(block: Block, start: np.ndarray) -> LazyOutcome:
    """What `solve_lazy` returns for a start no plan beats (`_is_optimal`) on a block without
    memory rows: the start itself, optimal (it takes only plans better than its best by more
    than rounding, and the MIP's optimum is that of a plan), and the size of its MIP."""
    cost = block.cost_of(start)
    columns, constraints = edge_part_size(block)
    return LazyOutcome(start, cost, cost, True, False, 0, 0, columns, constraints)


def _portfolio(setting: _Setting, pricing: MemoryPricing, best: _Best, small: bool, stats: dict[str, Any],
               rng: np.random.Generator) -> _Found:
    """Prices here, the exact side in a forked child, trading plans until the deadline."""
    start_plan, hints = best.choice, (_cheap_plan(setting),)
    child_rng = np.random.default_rng(rng.integers(2**63))

    def exact(channel: Channel, deadline: float):
        hooks = ChannelHooks(channel, setting.problem.cost_of)
        if small:
            start, rows = _seed_by_prices(pricing, start_plan, deadline)
            start = _candidates_first(setting, pricing, start, deadline, hooks, rows)
            out = solve_lazy(_block(setting), start, deadline, hooks, hints + (pricing.x,), setting.options.mip_gap,
                             rows)
            return out.choice, out.bound, out.optimal or out.infeasible
        if start_plan is None:  # the windows need a feasible plan: wait for the prices' first
            start = _first_offer(hooks, deadline)
            if start is None:
                return None, -np.inf, False
        inc = Incumbent(setting.problem, setting.rows, start_plan if start_plan is not None else start)
        run_lns(inc, deadline, child_rng, hooks=hooks)
        return inc.choice, -np.inf, False

    child = Child(exact, setting.deadline, setting.options.lockstep)
    try:
        _price(setting, pricing, best, setting.deadline, channel=child.channel)
    finally:
        result = child.stop()
    _adopt(setting, pricing, best, result.plans, "exact")
    stats.update(exact_side="mip" if small else "windows", exact_bound=result.bound + setting.pre.offset)
    if result.error:
        stats["exact_error"] = result.error.strip().splitlines()[-1]
    bound = max(pricing.bound, result.bound)
    infeasible = result.optimal and best.choice is None
    return _Found(bound, best.cost - bound <= rounding_slack(best.cost), infeasible)


def _candidates_first(setting: _Setting, pricing: MemoryPricing, start: np.ndarray | None, deadline: float,
                      hooks: Hooks, rows: np.ndarray) -> np.ndarray | None:
    """Before the whole MIP, the MIP over each node's most promising strategies by the prices
    (`candidates`) for at most CANDIDATES_SHARE of the time left: on IOPDDL's D it reached the
    best known cost in 3 CPU seconds (9 s at load 15), where the whole MIP had not finished its
    root LP within the 60 s limit at load 10-18.
    Skipped in lockstep mode, where only the deadline may end a phase. Returns the better of
    `start` and its plan, for the whole MIP to start from."""
    if setting.options.lockstep:
        return start
    until = time.perf_counter() + CANDIDATES_SHARE * max(deadline - time.perf_counter(), 0.0)
    found = candidates_first(_block(setting), pricing.scores(), start, until, hooks, rows)
    if found is None or not setting.fits(found):
        return start
    cost = setting.problem.cost_of(found)
    return found if start is None or cost < setting.problem.cost_of(start) else start


def _seed_by_prices(pricing: MemoryPricing, start: np.ndarray | None,
                    deadline: float) -> tuple[np.ndarray | None, np.ndarray]:
    """In the MIP's process (a forked copy of the prices): a few pricing rounds first, for a
    better start and the rows that bind. Seeded with the rows of a memory-blind plan only, the
    MIP on IOPDDL's D met two more binding rows in its plans, each a restart with a root LP of
    12 s: three runs in its 34 s and no plan; seeded with the priced rows it runs once."""
    now, left = time.perf_counter(), max(deadline - time.perf_counter(), 0.0)
    until, longest = now + SEED_SHARE * left, now + SEED_MOST_SHARE * left
    for done in range(SEED_ROUNDS):
        if pricing.closed or time.perf_counter() >= (until if done >= SEED_MIN_ROUNDS else longest):
            break
        pricing.step(longest)
    return (pricing.best if pricing.best is not None else start), pricing.binding_rows()


def _first_offer(hooks: ChannelHooks, deadline: float) -> np.ndarray | None:
    while time.perf_counter() < deadline:
        offered = hooks.offered()
        if offered is not None:
            return offered[0]
        time.sleep(0.02)
    return None


def _solve_whole_with_cbc(problem: StrategyProblem, setting: _Setting, best: _Best,
                          stats: dict[str, Any]) -> ProblemSolution:
    model = build_mip(whole_block(setting.pre, setting.rows))
    stats.update(mip_columns=model.num_cols, mip_rows=model.num_rows)
    outcome = _solve_with_cbc(model, max(setting.deadline - time.perf_counter(), 0.5), setting.options.mip_gap)
    stats["mip_s"] = outcome.wall_s
    pre, options, start = setting.pre, setting.options, setting.start
    if outcome.infeasible and best.choice is None:
        return _answer(problem, None, None, False, start, options, stats, infeasible=True)
    proven = outcome.choice is not None and setting.fits(outcome.choice)
    if proven:
        best.offer(outcome.choice, setting.problem.cost_of(outcome.choice), "mip")
    bound = outcome.bound if outcome.bound is not None else _trivial_bound(pre)
    # an optimum CBC proved is optimal whoever found it first (the greedy plan may tie with it)
    optimal = outcome.optimal and proven
    return _answer(problem, pre, best.choice, optimal, start, options, stats, bound=bound)


def _solve_with_cbc(model: MipModel, time_limit: float, mip_gap: float):
    from meshplan.intra.search.mip import MipOutcome
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
