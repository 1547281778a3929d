"""Large-neighbourhood search: re-solve a window of nodes exactly with the MIP, the rest fixed.

Incumbent -> better Incumbent. A window is either a connected piece of the graph grown from a
node whose choice costs most above its best, or the nodes live at a memory row with little
slack (where trading memory between nodes pays). Its sub-MIP sees the fixed neighbours as
linear costs and each memory row's capacity minus what the fixed nodes use; it starts from
the incumbent, so it can only improve it. Window size adapts: it grows while sub-MIPs solve
to optimality quickly and shrinks when they hit their time limit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from meshplan.intra.problem.arrays import Ragged, rounding_slack
from meshplan.intra.problem.memory import MemoryRows
from meshplan.intra.search.lazy_rows import Hooks, NoHooks, solve_lazy
from meshplan.intra.search.local_search import Incumbent
from meshplan.intra.search.mip import Block, MipOutcome, build_mip, solve_mip

LAZY_WINDOW_ROWS = 400  # windows with more memory rows than this add them lazily (`lazy_rows`)


@dataclass(frozen=True, slots=True)
class LnsStats:
    windows: int
    improved: int
    final_window: int


def run_lns(inc: Incumbent, deadline: float, rng: np.random.Generator, window: int = 60,
            sub_time: float = 3.0, hooks: Hooks | None = None) -> LnsStats:
    """Improve `inc` in place until `deadline` (perf_counter seconds); `hooks` report each
    better plan and offer plans found elsewhere (taken when better)."""
    hooks = hooks or NoHooks()
    windows = improved = 0
    overhead = 0.2  # seconds a window takes beyond its sub-MIP's limit (building, applying): the most seen
    while time.perf_counter() + overhead < deadline:
        began = time.perf_counter()
        nodes = _graph_window(inc, rng, window) if windows % 2 == 0 else _memory_window(inc, rng, window)
        limit = min(sub_time, deadline - time.perf_counter() - overhead)
        before = inc.cost
        result = _reoptimize(inc, nodes, limit)
        windows += 1
        if inc.cost < before:
            improved += 1
            hooks.found(inc.choice, inc.cost)
        if result == "timeout":
            window = max(8, int(window * 0.8))
        elif result in ("improved", "same"):
            window = min(inc.problem.num_nodes, int(window * 1.1) + 1)
        offered = hooks.offered()
        if offered is not None and offered[1] < inc.cost:
            inc.reset(offered[0])
        overhead = max(overhead, time.perf_counter() - began - limit)
    return LnsStats(windows, improved, window)



def _regret(inc: Incumbent, v: int) -> float:
    local = inc.local_costs(v)
    return float(local[inc.choice[v]] - local.min())


def _graph_window(inc: Incumbent, rng: np.random.Generator, size: int) -> np.ndarray:
    """A graph ball around the costliest of 16 sampled nodes (cost above its best given its
    neighbours); when the ball's component is exhausted, another ball from a random node (the
    components are tied by memory alone, which a window must be able to trade)."""
    n = inc.problem.num_nodes
    probes = rng.integers(0, n, size=min(n, 16))
    seed = int(max(probes, key=lambda v: _regret(inc, int(v))))
    seen = {seed}
    frontier = [seed]
    others = iter(rng.permutation(n).tolist())
    while len(seen) < min(size, n):
        if not frontier:
            frontier = [next(v for v in others if v not in seen)]
            seen.add(frontier[0])
            continue
        nxt = []
        for v in frontier:
            for w, _, _ in inc.neighbours[v]:
                if w not in seen:
                    seen.add(w)
                    nxt.append(w)
        rng.shuffle(nxt)
        frontier = nxt
    return np.array(sorted(seen))


def _memory_window(inc: Incumbent, rng: np.random.Generator, size: int) -> np.ndarray:
    """The nodes live at a row with little slack (a binding row), widened to the rows around it
    until the window is full (a random subset when one row alone has more)."""
    rows, m = inc.rows, inc.problem.memory
    if len(rows) == 0 or len(m) == 0:
        return _graph_window(inc, rng, size)
    tight = np.argsort(inc.slack)[:max(1, len(rows) // 50)]
    r = int(rng.choice(tight))
    reach = 0
    while True:
        live = np.unique(m.node[(rows.first <= r + reach) & (rows.last >= r - reach)])
        if len(live) >= size or reach >= len(rows):
            break
        reach = 2 * reach + 1
    if len(live) > size:
        live = rng.choice(live, size=size, replace=False)
    return np.sort(live)


def _reoptimize(inc: Incumbent, nodes: np.ndarray, time_limit: float) -> str:
    block, start = window_block(inc, nodes)
    before = block.cost_of(start)
    if len(block.rows) > LAZY_WINDOW_ROWS:
        lazy = solve_lazy(block, start, time.perf_counter() + time_limit)
        outcome = MipOutcome(lazy.choice, lazy.cost, lazy.bound, lazy.optimal, False, 0.0)
    else:
        outcome = solve_mip(build_mip(block), time_limit, start)
    if outcome.choice is None:
        return "timeout"
    after = block.cost_of(outcome.choice)
    status = "same" if outcome.optimal else "timeout"
    if after < before - rounding_slack(before) and _apply(inc, nodes, outcome.choice):
        return "improved" if outcome.optimal else "timeout"
    return status


def _apply(inc: Incumbent, nodes: np.ndarray, choice: np.ndarray) -> bool:
    """Apply the window's new choice if it keeps every row within capacity (exactly)."""
    old, cost = inc.choice[nodes].copy(), inc.cost
    for v, c in zip(nodes.tolist(), choice.tolist(), strict=True):
        inc.move(v, c)
    if inc.feasible:
        # moved one node at a time, the running cost may have met a forbidden pair halfway
        # (inf - inf): the window's new cost is known exactly, so recompute it
        inc.cost = inc.problem.cost_of(inc.choice)
        return True
    for v, c in zip(nodes.tolist(), old.tolist(), strict=True):
        inc.move(v, c)
    inc.cost = cost
    return False


def window_block(inc: Incumbent, nodes: np.ndarray) -> tuple[Block, np.ndarray]:
    """The sub-problem of `nodes` with everything else fixed at the incumbent."""
    p = inc.problem
    local = np.full(p.num_nodes, -1, dtype=np.int64)
    local[nodes] = np.arange(len(nodes))
    costs, edges, matrices = [], [], []
    for v in nodes.tolist():
        out = p.costs.row(v).copy()
        for w, e, rows_are_v in inc.neighbours[v]:
            m = p.edge_matrix(e)
            if local[w] < 0:
                out += m[:, inc.choice[w]] if rows_are_v else m[inc.choice[w], :]
            elif rows_are_v:
                edges.append((local[v], local[w]))
                matrices.append(m)
        costs.append(out)
    terms = np.concatenate([inc.node_terms[v] for v in nodes.tolist()] + [np.zeros(0, np.int64)])
    terms = terms[inc.rows.first[terms] <= inc.rows.last[terms]]
    rows = _window_rows(inc, terms)
    usage = Ragged.from_rows([p.memory.usages.row(t) for t in terms.tolist()])
    block = Block(Ragged.from_rows(costs), 0.0, np.array(edges, dtype=np.int64).reshape(-1, 2), tuple(matrices),
                  local[p.memory.node[terms]], usage, rows)
    return block, inc.choice[nodes].copy()


def _window_rows(inc: Incumbent, terms: np.ndarray) -> MemoryRows:
    """Segments between the window's term boundaries; capacity = the tightest row's room
    for the window (slack plus what the window uses now). Every term covers some row."""
    rows, m = inc.rows, inc.problem.memory
    if len(terms) == 0:
        z = np.zeros(0, dtype=np.int64)
        return MemoryRows(z, np.zeros(0), z, z)
    first, last = rows.first[terms], rows.last[terms]
    cuts = np.unique(np.concatenate([first, last + 1]))
    lo, hi = int(cuts[0]), int(cuts[-1])
    used = m.usages.values[m.usages.ptr[terms] + inc.choice[m.node[terms]]]
    delta = np.zeros(hi - lo + 1)
    np.add.at(delta, first - lo, used)
    np.add.at(delta, last + 1 - lo, -used)
    room = inc.slack[lo:hi] + np.cumsum(delta)[:-1]
    capacity = np.minimum.reduceat(room, cuts[:-1] - lo)
    seg_first = np.searchsorted(cuts, first)
    seg_last = np.searchsorted(cuts, last + 1) - 1
    return MemoryRows(cuts[:-1], capacity, seg_first, seg_last)
