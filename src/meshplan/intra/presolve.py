"""Exact presolve of a StrategyProblem: StrategyProblem -> Presolved (smaller problem + postsolve).

Every reduction keeps at least one optimal assignment, so the optimum of the reduced problem
plus `offset` equals the original optimum. Work is linear in the graph's size (each node and
edge is revisited only when a neighbour changed; dominance compares a bounded number of
candidate strategies per node):

- forbidden strategies go, and so do strategies every pair of some edge forbids;
- a node with one strategy left is fixed: its edges fold into its neighbours' costs;
- row and column minima of an edge matrix move into the two nodes' costs; an all-zero edge
  goes;
- merged followers: when each strategy of u allows exactly one strategy of v (the edge's
  finite pattern is a mapping), or v is a leaf without memory (its best strategy given u's
  is a mapping), v is merged into u: its costs, memory terms and other edges follow u;
- a strategy no better than another one on cost, on every memory term and on every edge row
  (dominated) goes;
- the memory terms' constant part (usage every strategy has) moves to a fixed base profile.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from meshplan.intra.problem import MemoryTerms, Ragged, StrategyProblem

DOMINANCE_CANDIDATES = 48  # strategies tried as dominators per node: bounds the work per node
DOMINANCE_WIDTH = 20_000  # nodes with wider comparison profiles (huge neighbourhoods) are skipped


class Infeasible(Exception):  # noqa: N818 - internal signal, not an error for users
    """Forbidden strategies and pairs leave some node without any strategy."""

    def __init__(self, node: int) -> None:
        super().__init__(f"node {node} has no strategy left that its forbidden pairs allow")
        self.node = node


@dataclass(frozen=True, slots=True)
class Presolved:
    """A reduced problem and how to read its solutions back.

    Attributes:
        problem: the reduced problem (its memory terms hold only what varies with the choice).
        offset: cost that every assignment of `problem` adds.
        base: constant usage terms (lo, hi, amount): usage that no choice can avoid.
        owner: per original node, the reduced node that decides it (-1: fixed).
        maps: per original node, its strategy for each strategy of its owner (fixed: one entry).
    """

    problem: StrategyProblem
    offset: float
    base: tuple[np.ndarray, np.ndarray, np.ndarray]
    owner: np.ndarray
    maps: Ragged

    def expand(self, choice: np.ndarray) -> np.ndarray:
        """An assignment of the reduced problem -> the original problem's."""
        choice = np.asarray(choice, dtype=np.int64)
        picked = np.zeros(len(self.owner), dtype=np.int64)
        decided = self.owner >= 0
        picked[decided] = choice[self.owner[decided]]
        return self.maps.values[self.maps.ptr[:-1] + picked].astype(np.int64)


class _Work:
    """The problem as mutable per-node and per-edge arrays while reductions run."""

    def __init__(self, p: StrategyProblem) -> None:
        n = p.num_nodes
        self.cost = [p.costs.row(v).copy() for v in range(n)]
        self.alive = np.ones(n, dtype=bool)
        self.adj: list[dict[int, int]] = [{} for _ in range(n)]
        self.ends: dict[int, tuple[int, int]] = {}
        self.mat: dict[int, np.ndarray] = {}
        self.next_edge = 0
        self.offset = 0.0
        sizes, ptr = p.sizes, p.edge_costs.ptr
        for e, (u, v) in enumerate(p.edge_nodes.tolist()):
            self.add_edge(u, v, p.edge_costs.values[ptr[e]:ptr[e + 1]].reshape(sizes[u], sizes[v]).copy())
        m = p.memory
        self.lo, self.hi = m.lo.copy(), m.hi.copy()
        self.use = [m.usages.row(t).copy() for t in range(len(m))]
        self.terms: list[list[int]] = [[] for _ in range(n)]
        for t, v in enumerate(m.node):
            self.terms[v].append(t)
        self.base: list[tuple[int, int, float]] = []
        self.members: list[list[tuple[int, np.ndarray]]] = [[(v, np.arange(len(self.cost[v])))] for v in range(n)]
        self.fixed: dict[int, int] = {}
        self.queue: deque[int] = deque(range(n))
        self.queued = np.ones(n, dtype=bool)

    # -- structure -------------------------------------------------------------------------

    def add_edge(self, u: int, v: int, matrix: np.ndarray) -> None:
        """Add matrix [u, v] to the edge u-v, creating it if absent."""
        e = self.adj[u].get(v)
        if e is not None:
            a, _ = self.ends[e]
            self.mat[e] = self.mat[e] + (matrix if a == u else matrix.T)
            return
        e = self.next_edge
        self.next_edge += 1
        self.ends[e], self.mat[e] = (u, v), matrix
        self.adj[u][v] = e
        self.adj[v][u] = e

    def oriented(self, e: int, u: int) -> np.ndarray:
        """Edge e's matrix with u's strategies as rows."""
        return self.mat[e] if self.ends[e][0] == u else self.mat[e].T

    def drop_edge(self, e: int) -> None:
        u, v = self.ends.pop(e)
        del self.mat[e], self.adj[u][v], self.adj[v][u]
        self.push(u)
        self.push(v)

    def push(self, v: int) -> None:
        if self.alive[v] and not self.queued[v]:
            self.queued[v] = True
            self.queue.append(v)

    # -- reductions ------------------------------------------------------------------------

    def restrict(self, v: int, keep: np.ndarray) -> None:
        """Keep only strategies `keep` (a mask or sorted indices) of node v."""
        self.cost[v] = self.cost[v][keep]
        if len(self.cost[v]) == 0:
            raise Infeasible(v)
        for w, e in self.adj[v].items():
            self.mat[e] = self.mat[e][keep] if self.ends[e][0] == v else self.mat[e][:, keep]
            self.push(w)
        for t in self.terms[v]:
            self.use[t] = self.use[t][keep]
        self.members[v] = [(x, m[keep]) for x, m in self.members[v]]
        self.push(v)

    def fix(self, v: int) -> None:
        """Node v has one strategy: fold its edges into the neighbours and its memory into the base."""
        self.offset += float(self.cost[v][0])
        for w, e in list(self.adj[v].items()):
            self.cost[w] = self.cost[w] + self.oriented(e, w)[:, 0]
            self.drop_edge(e)
        for t in self.terms[v]:
            self.base.append((int(self.lo[t]), int(self.hi[t]), float(self.use[t][0])))
        self.terms[v] = []
        for x, m in self.members[v]:
            self.fixed[x] = int(m[0])
        self.members[v] = []
        self.alive[v] = False

    def merge(self, u: int, v: int, e: int, mapping: np.ndarray) -> None:
        """Merge v into u: v takes strategy mapping[i] whenever u takes i."""
        m = self.oriented(e, u)
        rows = np.arange(len(mapping))
        self.cost[u] = self.cost[u] + self.cost[v][mapping] + m[rows, mapping]
        del self.mat[e], self.ends[e], self.adj[u][v], self.adj[v][u]
        for w, f in list(self.adj[v].items()):
            moved = self.oriented(f, v)[mapping]
            del self.mat[f], self.ends[f], self.adj[v][w], self.adj[w][v]
            self.add_edge(u, w, moved)
            self.push(w)
        for t in self.terms[v]:
            self.use[t] = self.use[t][mapping]
        self.terms[u].extend(self.terms[v])
        self.members[u].extend((x, mx[mapping]) for x, mx in self.members[v])
        self.terms[v], self.members[v] = [], []
        self.alive[v] = False
        self.push(u)

    def settle_memory(self, v: int) -> None:
        """Move each term's smallest usage to the base; drop terms that no longer vary."""
        kept = []
        for t in self.terms[v]:
            low = float(self.use[t].min())
            if low:
                self.base.append((int(self.lo[t]), int(self.hi[t]), low))
                self.use[t] = self.use[t] - low
            if self.use[t].any():
                kept.append(t)
        self.terms[v] = kept


def presolve(problem: StrategyProblem, dominance_passes: int = 3, deadline: float | None = None) -> Presolved:
    """Reduce `problem` exactly (see the module docstring). Past `deadline` (perf_counter
    seconds) it stops reducing and returns the problem as reduced so far (still exact: every
    step keeps an optimal assignment); only forbidden strategies are always removed.

    Raises:
        Infeasible: the forbidden strategies and pairs admit no assignment at all.
    """
    w = _Work(problem)
    _run_queue(w, deadline)
    for _ in range(dominance_passes):
        if _late(deadline) or not _dominance_pass(w, deadline):
            break
        _run_queue(w, deadline)
    return _collect(w, problem)


def _late(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() > deadline


def _run_queue(w: _Work, deadline: float | None) -> None:
    checked = 0
    while w.queue:
        v = w.queue.popleft()
        w.queued[v] = False
        if w.alive[v]:
            _check_node(w, v)
        checked += 1
        if checked % 256 == 0 and _late(deadline):
            _drop_forbidden(w)
            return


def _drop_forbidden(w: _Work) -> None:
    """Out of time: still remove forbidden strategies (the searches assume finite costs)."""
    for v in np.flatnonzero(w.alive).tolist():
        allowed = np.isfinite(w.cost[v])
        if not allowed.all():
            w.restrict(v, allowed)


def _check_node(w: _Work, v: int) -> None:
    allowed = np.isfinite(w.cost[v])
    if not allowed.all():
        w.restrict(v, allowed)
    for e in list(w.adj[v].values()):
        if e in w.ends and w.alive[v]:
            _check_edge(w, e)
    if not w.alive[v]:
        return
    w.settle_memory(v)
    if len(w.cost[v]) == 1:
        w.fix(v)
    elif not w.terms[v] and len(w.adj[v]) == 0:
        w.restrict(v, np.array([int(np.argmin(w.cost[v]))]))
    elif not w.terms[v] and len(w.adj[v]) == 1:
        (u, e), = w.adj[v].items()
        m = w.oriented(e, u) + w.cost[v][None, :]
        w.merge(u, v, e, np.argmin(m, axis=1))


def _check_edge(w: _Work, e: int) -> None:
    """Arc consistency, peeling of row/column minima, and follower merging on edge e."""
    u, v = w.ends[e]
    m = w.mat[e]
    finite = np.isfinite(m)
    rows, cols = finite.any(axis=1), finite.any(axis=0)
    if not rows.all():
        w.restrict(u, rows)
        return
    if not cols.all():
        w.restrict(v, cols)
        return
    row_min = m.min(axis=1)
    m = m - row_min[:, None]
    col_min = m.min(axis=0)
    m = m - col_min[None, :]
    w.cost[u] = w.cost[u] + row_min
    w.cost[v] = w.cost[v] + col_min
    w.mat[e] = m
    if not m.any():
        w.drop_edge(e)
    elif (finite.sum(axis=1) == 1).all():
        w.merge(u, v, e, np.argmax(finite, axis=1))
    elif (finite.sum(axis=0) == 1).all():
        w.merge(v, u, e, np.argmax(finite, axis=0))


def _dominance_pass(w: _Work, deadline: float | None) -> bool:
    changed = False
    for v in np.flatnonzero(w.alive):
        if _late(deadline):
            break
        keep = _undominated(w, int(v))
        if keep is not None:
            w.restrict(int(v), keep)
            changed = True
    return changed


def _undominated(w: _Work, v: int) -> np.ndarray | None:
    """Mask of strategies of v that no candidate strategy dominates (None: all survive)."""
    k = len(w.cost[v])
    parts = [w.cost[v][:, None]] + [w.use[t][:, None] for t in w.terms[v]]
    parts += [w.oriented(e, v) for e in w.adj[v].values()]
    if sum(p.shape[1] for p in parts) * k > DOMINANCE_WIDTH * 8:
        return None
    table = np.hstack(parts)
    order = np.lexsort((np.arange(k), table.sum(axis=1, where=np.isfinite(table)), w.cost[v]))
    keep = np.ones(k, dtype=bool)
    for a in order[:DOMINANCE_CANDIDATES]:
        if not keep[a]:
            continue
        beaten = np.all(table[a] <= table, axis=1)
        beaten[a] = False
        keep &= ~beaten
    return None if keep.all() else keep


def _collect(w: _Work, problem: StrategyProblem) -> Presolved:
    alive = np.flatnonzero(w.alive)
    index = np.full(len(w.alive), -1, dtype=np.int64)
    index[alive] = np.arange(len(alive))
    costs = Ragged.from_rows([w.cost[v] for v in alive])
    edges = sorted(w.ends.items(), key=lambda item: (index[item[1][0]], index[item[1][1]]))
    edge_nodes = np.array([(index[u], index[v]) for _, (u, v) in edges], dtype=np.int64).reshape(-1, 2)
    edge_costs = Ragged.from_rows([w.mat[e].ravel() for e, _ in edges])
    term_ids = [(index[v], t) for v in alive for t in w.terms[v]]
    node = np.array([x for x, _ in term_ids], dtype=np.int64)
    ts = np.array([t for _, t in term_ids], dtype=np.int64)
    memory = MemoryTerms(node, w.lo[ts], w.hi[ts], Ragged.from_rows([w.use[t] for t in ts])) \
        if len(ts) else MemoryTerms.empty()
    reduced = StrategyProblem(costs, edge_nodes, edge_costs, memory, problem.usage_limit, problem.name)
    owner = np.full(problem.num_nodes, -1, dtype=np.int64)
    maps: list[np.ndarray] = [np.zeros(1, dtype=np.int64)] * problem.num_nodes
    for x, s in w.fixed.items():
        maps[x] = np.array([s])
    for v in alive:
        for x, m in w.members[v]:
            owner[x], maps[x] = index[v], m
    base = tuple(np.array([b[k] for b in w.base], dtype=np.int64 if k < 2 else np.float64) for k in range(3))
    return Presolved(reduced, w.offset, base, owner, Ragged.from_rows(maps, dtype=np.int64))
