"""StrategyProblem: the intra-op problem as plain arrays (no Graph, no mesh).

Input: per node the costs and memory usages of its strategies and when its value is live;
per edge a cost matrix over the two nodes' strategies; forbidden strategies and pairs; one
memory limit. Output: a validated, immutable problem that `solve_problem` solves and that
scores any assignment (`cost_of`, `peak_usage`).

Memory is held as *terms*: a term belongs to one node, covers the half-open time range
[lo, hi) and has one usage per strategy of its node. A node given a live interval has one
term; a node given explicit live points has one term per run of consecutive points; merging
nodes in presolve concatenates their terms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from meshplan.errors import MeshplanError

FORBIDDEN = float("inf")  # the cost of a strategy or pair that may not be chosen
COST_RTOL = 1e-9  # relative: one plan's cost summed in another order differs by rounding only


def rounding_slack(cost: float) -> float:
    """How far two sums of one plan's costs may differ by rounding. Relative, not floored at
    an absolute 1e-9: plans priced in seconds cost 1e-8..1e-4, and an absolute slack called a
    plan 1 % above a 1e-7 optimum optimal."""
    return COST_RTOL * abs(cost)


class ProblemError(MeshplanError):
    """A strategy problem is malformed: lengths disagree, indices are out of range, ..."""


@dataclass(frozen=True, slots=True)
class Ragged:
    """Rows of different lengths in one flat array: row i is values[ptr[i]:ptr[i + 1]]."""

    values: np.ndarray
    ptr: np.ndarray

    @staticmethod
    def from_rows(rows: Sequence[Sequence[float]] | Sequence[np.ndarray], dtype=np.float64) -> Ragged:
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        ptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=ptr[1:])
        values = np.concatenate([np.asarray(r, dtype=dtype) for r in rows]) if len(rows) else np.zeros(0, dtype)
        return Ragged(values.astype(dtype, copy=False), ptr)

    def __len__(self) -> int:
        return len(self.ptr) - 1

    def row(self, i: int) -> np.ndarray:
        return self.values[self.ptr[i]:self.ptr[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.ptr)


@dataclass(frozen=True, slots=True)
class MemoryTerms:
    """Usage over time: term t of node `node[t]` holds usages.row(t)[s] bytes during [lo[t], hi[t])."""

    node: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    usages: Ragged

    def __len__(self) -> int:
        return len(self.node)

    @staticmethod
    def empty() -> MemoryTerms:
        z = np.zeros(0, dtype=np.int64)
        return MemoryTerms(z, z, z, Ragged(np.zeros(0), np.zeros(1, dtype=np.int64)))


@dataclass(frozen=True, slots=True)
class StrategyProblem:
    """Choose one strategy per node minimizing node costs + edge costs under a memory limit.

    Attributes:
        costs: per node, the cost of each strategy (`FORBIDDEN` = may not be chosen).
        edge_nodes: (E, 2) node pairs.
        edge_costs: per edge (u, v), the [k_u, k_v] cost matrix flattened row-major
            (`FORBIDDEN` = the pair may not be chosen together).
        memory: usage terms (see the module docstring).
        usage_limit: the bound on the summed usage at every time point (None: unlimited).
        name: for messages and reports.
    """

    costs: Ragged
    edge_nodes: np.ndarray
    edge_costs: Ragged
    memory: MemoryTerms
    usage_limit: float | None = None
    name: str = "problem"
    sizes: np.ndarray = field(init=False, repr=False, compare=False)  # strategies per node (computed once)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", self.costs.lengths)

    @property
    def num_nodes(self) -> int:
        return len(self.costs)

    @property
    def num_edges(self) -> int:
        return len(self.edge_nodes)

    def edge_matrix(self, e: int) -> np.ndarray:
        u, v = self.edge_nodes[e]
        return self.edge_costs.row(e).reshape(self.sizes[u], self.sizes[v])

    def cost_of(self, choice: np.ndarray) -> float:
        """Node plus edge costs of an assignment (inf when it uses a forbidden choice)."""
        choice = np.asarray(choice, dtype=np.int64)
        total = float(self.costs.values[self.costs.ptr[:-1] + choice].sum())
        if self.num_edges:
            u, v = self.edge_nodes[:, 0], self.edge_nodes[:, 1]
            flat = self.edge_costs.ptr[:-1] + choice[u] * self.sizes[v] + choice[v]
            total += float(self.edge_costs.values[flat].sum())
        return total

    def usage_profile(self, choice: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(time points where usage changes, summed usage from each such point on)."""
        choice = np.asarray(choice, dtype=np.int64)
        m = self.memory
        used = m.usages.values[m.usages.ptr[:-1] + choice[m.node]] if len(m) else np.zeros(0)
        return step_profile(m.lo, m.hi, used)

    def peak_usage(self, choice: np.ndarray) -> float:
        return float(self.usage_profile(choice)[1].max(initial=0.0))

    def is_feasible(self, choice: np.ndarray) -> bool:
        """Allowed choices and pairs, and within the memory limit (exactly, no tolerance)."""
        if not np.isfinite(self.cost_of(choice)):
            return False
        return self.usage_limit is None or self.peak_usage(choice) <= self.usage_limit


def ragged_arange(lengths: np.ndarray) -> np.ndarray:
    """[0 .. lengths[0]-1, 0 .. lengths[1]-1, ...] as one array."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    return np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)


def step_profile(lo: np.ndarray, hi: np.ndarray, amount: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The piecewise-constant sum of `amount[t]` over [lo[t], hi[t]): (change points, values)."""
    points = np.concatenate([lo, hi])
    deltas = np.concatenate([amount, -amount])
    order = np.argsort(points, kind="stable")
    points, deltas = points[order], deltas[order]
    keep = np.r_[points[1:] != points[:-1], True] if len(points) else np.zeros(0, bool)
    return points[keep], np.cumsum(deltas)[keep]


def strategy_problem(costs: Sequence[Sequence[float]], *, usages: Sequence[Sequence[float]] | None = None,
                     intervals: Sequence[Sequence[int]] | None = None,
                     live_points: Sequence[Sequence[int]] | None = None,
                     edges: Sequence[Sequence[int]] = (), edge_costs: Sequence[Sequence[float]] = (),
                     forbidden: Sequence[tuple[int, int]] = (),
                     forbidden_pairs: Sequence[tuple[int, int, int]] = (),
                     usage_limit: float | None = None, name: str = "problem") -> StrategyProblem:
    """Validate plain lists or arrays into a StrategyProblem.

    Args:
        costs: per node, one cost per strategy.
        usages: per node, one memory usage per strategy (None: no memory at all).
        intervals: per node, a half-open live range [lo, hi) (empty or lo >= hi: never live).
        live_points: instead of intervals, per node the time points at which it is live.
        edges: node pairs (u, v); edge_costs: per edge, the [k_u, k_v] matrix flattened row-major
            (or nested).
        forbidden: (node, strategy) pairs that may not be chosen.
        forbidden_pairs: (edge index, strategy of u, strategy of v) that may not occur together.
        usage_limit: bound on the summed usage at each time point (None: unlimited).

    Raises:
        ProblemError: lengths disagree, an index is out of range, or a cost is negative or NaN.
    """
    cost = Ragged.from_rows([np.asarray(c, dtype=np.float64).ravel() for c in costs])
    _check_values(cost.values, "node costs")
    sizes = cost.lengths
    if np.any(sizes == 0):
        raise ProblemError(f"node {int(np.argmax(sizes == 0))} has no strategy; every node needs at least one")
    for node, s in forbidden:
        _check_index(node, len(sizes), "forbidden node")
        _check_index(s, sizes[node], f"forbidden strategy of node {node}")
        cost.values[cost.ptr[node] + s] = FORBIDDEN
    pairs, matrices = _edges(edges, edge_costs, sizes)
    for e, i, j in forbidden_pairs:
        _check_index(e, len(pairs), "forbidden pair's edge")
        u, v = pairs[e]
        _check_index(i, sizes[u], f"forbidden pair's strategy of node {u}")
        _check_index(j, sizes[v], f"forbidden pair's strategy of node {v}")
        matrices.values[matrices.ptr[e] + i * sizes[v] + j] = FORBIDDEN
    memory = _memory(usages, intervals, live_points, sizes)
    if usage_limit is not None and not usage_limit >= 0:
        raise ProblemError(f"usage_limit must be a non-negative number or None, got {usage_limit}")
    return StrategyProblem(cost, pairs, matrices, memory, None if usage_limit is None else float(usage_limit), name)


def _check_values(values: np.ndarray, what: str) -> None:
    if np.isnan(values).any() or (values < 0).any():
        raise ProblemError(f"{what} must be non-negative numbers (inf for forbidden); found "
                           f"{values[np.isnan(values) | (values < 0)][0]}")


def _check_index(i: int, n: int, what: str) -> None:
    if not 0 <= int(i) < n:
        raise ProblemError(f"{what} {i} is out of range [0, {n})")


def _edges(edges, edge_costs, sizes: np.ndarray) -> tuple[np.ndarray, Ragged]:
    if len(edges) != len(edge_costs):
        raise ProblemError(f"{len(edges)} edges but {len(edge_costs)} edge cost matrices")
    pairs = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    for u, v in pairs:
        _check_index(u, len(sizes), "edge node")
        _check_index(v, len(sizes), "edge node")
        if u == v:
            raise ProblemError(f"edge ({u}, {v}) joins a node to itself; add its diagonal to the node's costs")
    matrices = Ragged.from_rows([np.asarray(c, dtype=np.float64).ravel() for c in edge_costs])
    expected = sizes[pairs[:, 0]] * sizes[pairs[:, 1]] if len(pairs) else np.zeros(0, np.int64)
    bad = np.flatnonzero(matrices.lengths != expected)
    if len(bad):
        e = int(bad[0])
        raise ProblemError(f"edge {e} ({pairs[e, 0]}, {pairs[e, 1]}) has {matrices.lengths[e]} costs; "
                           f"expected {sizes[pairs[e, 0]]} x {sizes[pairs[e, 1]]} = {expected[e]}")
    _check_values(matrices.values, "edge costs")
    return pairs, matrices


def _memory(usages, intervals, live_points, sizes: np.ndarray) -> MemoryTerms:
    if usages is None:
        return MemoryTerms.empty()
    if (intervals is None) == (live_points is None):
        raise ProblemError("give the nodes' live times as either intervals or live_points (exactly one)")
    if len(usages) != len(sizes):
        raise ProblemError(f"{len(usages)} usage lists for {len(sizes)} nodes")
    per_node = [np.asarray(u, dtype=np.float64).ravel() for u in usages]
    for v, u in enumerate(per_node):
        if len(u) != sizes[v]:
            raise ProblemError(f"node {v} has {sizes[v]} strategies but {len(u)} usages")
    spans = _spans(intervals, live_points, len(sizes))
    usage = Ragged.from_rows([per_node[v] for v, _, _ in spans])
    _check_values(usage.values, "usages")
    node, lo, hi = (np.array([s[k] for s in spans], dtype=np.int64) for k in range(3))
    return MemoryTerms(node, lo, hi, usage)


def _spans(intervals, live_points, n: int) -> list[tuple[int, int, int]]:
    """(node, lo, hi) per term; runs of consecutive live points become one term."""
    source = intervals if intervals is not None else live_points
    if len(source) != n:
        raise ProblemError(f"{len(source)} live-time entries for {n} nodes")
    spans = []
    for v, entry in enumerate(source):
        if intervals is not None:
            if len(entry) not in (0, 2):
                raise ProblemError(f"node {v}'s interval {list(entry)} is not [lo, hi]")
            if len(entry) and entry[0] < entry[1]:
                spans.append((v, int(entry[0]), int(entry[1])))
            continue
        points = np.unique(np.asarray(entry, dtype=np.int64))
        breaks = np.flatnonzero(np.diff(points) != 1) + 1
        spans.extend((v, int(run[0]), int(run[-1]) + 1) for run in np.split(points, breaks) if len(run))
    return spans
