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

from meshplan.intra.problem.arrays import MemoryTerms, Ragged, StrategyProblem, ragged_arange
from meshplan.intra.problem.contract import Contraction, contract

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

    def reduce(self, choice: np.ndarray) -> np.ndarray | None:
        """An assignment of the original problem -> the reduced problem's that expands to it
        (None when presolve dropped one of its strategies or it breaks a fixed node's choice)."""
        keep = [np.ones(k, dtype=bool) for k in self.problem.sizes]
        for node, owner in enumerate(self.owner.tolist()):
            row = self.maps.row(node)
            if owner < 0:
                if row[0] != choice[node]:
                    return None
                continue
            keep[owner] &= row == choice[node]
        if not all(k.any() for k in keep):
            return None
        return np.array([int(np.argmax(k)) for k in keep], dtype=np.int64)


class _Work:
    """The problem as mutable per-node and per-edge arrays while reductions run."""

    def __init__(self, c: Contraction, members: list[list[tuple[int, np.ndarray]]], fixed: dict[int, int]) -> None:
        p = c.problem
        n = p.num_nodes
        self.alive = np.ones(n, dtype=bool)
        self.adj: list[dict[int, int]] = [{} for _ in range(n)]
        self.ends: dict[int, tuple[int, int]] = {}
        self.mat: dict[int, np.ndarray] = {}
        self.next_edge = 0
        self.offset = c.offset
        self.clean: set[int] = set()  # edges checked since their matrix last changed
        self.touched: set[int] | None = None  # nodes changed since the last dominance pass (None: all)
        peeled = _bulk_peel(p)
        flat = peeled.node_costs
        self.cost = [flat[p.costs.ptr[v]:p.costs.ptr[v + 1]].copy() for v in range(n)]
        sizes, ptr = p.sizes, p.edge_costs.ptr
        for e, (u, v) in enumerate(p.edge_nodes.tolist()):
            if peeled.zero[e]:
                continue
            matrix = peeled.values[ptr[e]:ptr[e + 1]].reshape(sizes[u], sizes[v]).copy()
            self.add_edge(u, v, matrix, clean=bool(peeled.clean[e]))
        m = p.memory
        self.lo, self.hi = m.lo.copy(), m.hi.copy()
        self.use = [m.usages.row(t).copy() for t in range(len(m))]
        self.terms: list[list[int]] = [[] for _ in range(n)]
        for t, v in enumerate(m.node.tolist()):
            self.terms[v].append(t)
        self.base: list[tuple[int, int, float]] = list(zip(*(x.tolist() for x in c.base), strict=True))
        self.members = members
        self.fixed = fixed
        self.queue: deque[int] = deque(range(n))
        self.queued = np.ones(n, dtype=bool)

    # -- structure -------------------------------------------------------------------------

    def add_edge(self, u: int, v: int, matrix: np.ndarray, clean: bool = False) -> None:
        """Add matrix [u, v] to the edge u-v, creating it if absent (`clean`: a new edge whose
        matrix needs no check)."""
        e = self.adj[u].get(v)
        if e is not None:
            a, _ = self.ends[e]
            self.mat[e] = self.mat[e] + (matrix if a == u else matrix.T)
            self.clean.discard(e)
            return
        e = self.next_edge
        self.next_edge += 1
        self.ends[e], self.mat[e] = (u, v), matrix
        self.adj[u][v] = e
        self.adj[v][u] = e
        if clean:
            self.clean.add(e)

    def oriented(self, e: int, u: int) -> np.ndarray:
        """Edge e's matrix with u's strategies as rows."""
        return self.mat[e] if self.ends[e][0] == u else self.mat[e].T

    def drop_edge(self, e: int) -> None:
        self.clean.discard(e)
        u, v = self.ends.pop(e)
        del self.mat[e], self.adj[u][v], self.adj[v][u]
        self.push(u)
        self.push(v)

    def push(self, v: int) -> None:
        if self.touched is not None:
            self.touched.add(v)
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
            self.clean.discard(e)
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
        self.clean.discard(e)
        for w, f in list(self.adj[v].items()):
            moved = self.oriented(f, v)[mapping]
            del self.mat[f], self.ends[f], self.adj[v][w], self.adj[w][v]
            self.clean.discard(f)
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
    restricted, kept = _arc_consistent(problem)
    w = _followers_contracted(restricted, kept)
    _run_queue(w, deadline)
    for _ in range(dominance_passes):
        if _late(deadline) or not _dominance_pass(w, deadline):
            break
        _run_queue(w, deadline)
    reduced = _collect(w, problem)
    return _consistent(reduced) if _late(deadline) else reduced


def _consistent(pre: Presolved) -> Presolved:
    """A presolve cut short by its deadline may leave strategies that an edge allows no
    partner of (the searches' messages would meet inf - inf there): remove them now."""
    q, kept = _arc_consistent(pre.problem)
    if q is pre.problem:
        return pre
    maps = [pre.maps.row(x) if pre.owner[x] < 0 else pre.maps.row(x)[kept[pre.owner[x]]]
            for x in range(len(pre.owner))]
    return Presolved(q, pre.offset, pre.base, pre.owner, Ragged.from_rows(maps, dtype=np.int64))


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
            return


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
    if e in w.clean:
        return
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
    else:
        w.clean.add(e)


@dataclass(frozen=True, slots=True)
class _BulkPeel:
    """Every edge checked at once before the queue starts (as `_check_edge` would, one by one).

    Attributes:
        node_costs: the flat node costs plus the row and column minima of the clean edges.
        values: the flat edge costs, minima moved out of the clean edges.
        zero: per edge, nothing is left of it (it can go).
        clean: per edge, nothing more to do with it (no forbidden row or column, no mapping).
        rows_map, cols_map: per edge, every row (column) allows exactly one partner: the
            first (second) node's strategy decides the other's.
        row_partner, col_partner: per row (column) of every edge, numbered over all edges as
            from `edge_rows` (`edge_cols`), the index of its last finite entry.
    """

    node_costs: np.ndarray
    values: np.ndarray
    zero: np.ndarray
    clean: np.ndarray
    rows_map: np.ndarray
    cols_map: np.ndarray
    row_partner: np.ndarray
    col_partner: np.ndarray
    edge_rows: np.ndarray
    edge_cols: np.ndarray


@dataclass(frozen=True, slots=True)
class _Entries:
    """Every edge matrix entry of a problem located: its row and column (numbered over all
    edges), the flat strategy of each row and column, rows' and columns' starts, and the
    column-major order of each matrix (`transposed[c]`: the entry at column-major place c)."""

    row_of: np.ndarray
    col_of: np.ndarray
    row_strategy: np.ndarray
    col_strategy: np.ndarray
    row_starts: np.ndarray
    col_starts: np.ndarray
    transposed: np.ndarray
    edge_rows: np.ndarray
    edge_cols: np.ndarray


def _entries(p: StrategyProblem) -> _Entries:
    eu, ev = p.edge_nodes[:, 0], p.edge_nodes[:, 1]
    ku, kv, eptr = p.sizes[eu], p.sizes[ev], p.edge_costs.ptr[:-1]
    span = ku * kv
    k = ragged_arange(span)
    kv_flat = np.repeat(kv, span)
    i, j = k // kv_flat, k % kv_flat
    edge_rows, edge_cols = np.cumsum(ku) - ku, np.cumsum(kv) - kv
    transposed = np.empty(len(k), dtype=np.int64)
    transposed[np.repeat(eptr, span) + j * np.repeat(ku, span) + i] = np.arange(len(k))
    return _Entries(np.repeat(edge_rows, span) + i, np.repeat(edge_cols, span) + j,
                    np.repeat(p.costs.ptr[eu], ku) + ragged_arange(ku),
                    np.repeat(p.costs.ptr[ev], kv) + ragged_arange(kv),
                    np.repeat(eptr, ku) + ragged_arange(ku) * np.repeat(kv, ku),
                    np.repeat(eptr, kv) + ragged_arange(kv) * np.repeat(ku, kv), transposed, edge_rows, edge_cols)


def _arc_consistent(p: StrategyProblem) -> tuple[StrategyProblem, list[np.ndarray]]:
    """Forbidden strategies, and strategies some edge allows no partner of, removed all at once
    (repeated until none is left): the problem without them and, per node, the original
    indices of the strategies kept. IOPDDL's D forbids 23,310 strategies and 55 % of its edge
    entries; removing them one node at a time left most edges to be checked twice."""
    alive = np.isfinite(p.costs.values)
    at = _entries(p) if p.num_edges else None
    if at is not None:
        finite = np.isfinite(p.edge_costs.values)
        while True:
            live = finite & alive[at.row_strategy[at.row_of]] & alive[at.col_strategy[at.col_of]]
            dead = np.zeros(len(alive), dtype=bool)
            dead[at.row_strategy[~np.logical_or.reduceat(live, at.row_starts)]] = True
            dead[at.col_strategy[~np.logical_or.reduceat(live[at.transposed], at.col_starts)]] = True
            dead &= alive
            if not dead.any():
                break
            alive &= ~dead
    empty = np.flatnonzero(np.logical_or.reduceat(alive, p.costs.ptr[:-1]) == 0) if p.num_nodes else []
    if len(empty):
        raise Infeasible(int(empty[0]))
    local = np.arange(len(alive)) - np.repeat(p.costs.ptr[:-1], p.sizes)
    kept = np.split(local[alive], np.cumsum(np.add.reduceat(alive, p.costs.ptr[:-1]))[:-1]) if p.num_nodes else []
    return (p if alive.all() else _restricted(p, alive, at)), kept


def _restricted(p: StrategyProblem, alive: np.ndarray, at: _Entries | None) -> StrategyProblem:
    """`p` with only the strategies `alive` (a mask over its flat strategies); `at`: its entries."""
    counts = np.add.reduceat(alive, p.costs.ptr[:-1])
    costs = Ragged(p.costs.values[alive], np.r_[0, np.cumsum(counts)])
    edge_costs = p.edge_costs
    if at is not None:
        keep = alive[at.row_strategy[at.row_of]] & alive[at.col_strategy[at.col_of]]
        spans = counts[p.edge_nodes[:, 0]] * counts[p.edge_nodes[:, 1]]
        edge_costs = Ragged(p.edge_costs.values[keep], np.r_[0, np.cumsum(spans)])
    m = p.memory
    if len(m):
        strategy = np.repeat(p.costs.ptr[m.node], m.usages.lengths) + ragged_arange(m.usages.lengths)
        usage = Ragged(m.usages.values[alive[strategy]], np.r_[0, np.cumsum(counts[m.node])])
        m = MemoryTerms(m.node, m.lo, m.hi, usage)
    return StrategyProblem(costs, p.edge_nodes, edge_costs, m, p.usage_limit, p.name)


def _bulk_peel(p: StrategyProblem) -> _BulkPeel:
    """Row then column minima of every edge into node costs with flat segment operations: one
    pass instead of ~10 NumPy calls per edge (most of presolve's time on 68,635-edge D)."""
    values, costs = p.edge_costs.values.copy(), p.costs.values.copy()
    if p.num_edges == 0:
        none, z = np.zeros(0, bool), np.zeros(0, np.int64)
        return _BulkPeel(costs, values, none, none, none, none, z, z, z, z)
    at = _entries(p)
    ku, kv = p.sizes[p.edge_nodes[:, 0]], p.sizes[p.edge_nodes[:, 1]]
    span, eptr = ku * kv, p.edge_costs.ptr[:-1]
    finite = np.isfinite(values)
    rows_single = np.add.reduceat(finite, at.row_starts) == 1
    cols_single = np.add.reduceat(finite[at.transposed], at.col_starts) == 1
    rows_ok = np.logical_or.reduceat(finite, at.row_starts)
    cols_ok = np.logical_or.reduceat(finite[at.transposed], at.col_starts)
    ok = np.logical_and.reduceat(rows_ok, at.edge_rows) & np.logical_and.reduceat(cols_ok, at.edge_cols)
    rows_map = ok & np.logical_and.reduceat(rows_single, at.edge_rows)
    cols_map = ok & np.logical_and.reduceat(cols_single, at.edge_cols)
    with np.errstate(invalid="ignore"):  # inf - inf in rows of edges that are not ok (left alone)
        row_min = np.minimum.reduceat(values, at.row_starts)
        row_min[~np.repeat(ok, ku)] = 0.0
        peeled = values - row_min[at.row_of]
        col_min = np.minimum.reduceat(peeled[at.transposed], at.col_starts)
        col_min[~np.repeat(ok, kv)] = 0.0
        peeled -= col_min[at.col_of]
    values = np.where(np.repeat(ok, span), peeled, values)
    costs += np.bincount(at.row_strategy, weights=row_min, minlength=len(costs))
    costs += np.bincount(at.col_strategy, weights=col_min, minlength=len(costs))
    zero = ok & np.logical_and.reduceat(values == 0, eptr)
    at_finite = np.flatnonzero(finite)
    row_partner = np.zeros(len(at.row_starts), dtype=np.int64)
    col_partner = np.zeros(len(at.col_starts), dtype=np.int64)
    row_partner[at.row_of[at_finite]] = at.col_of[at_finite]  # global column numbers, made local below
    col_partner[at.col_of[at_finite]] = at.row_of[at_finite]
    row_partner -= np.repeat(at.edge_cols, ku)
    col_partner -= np.repeat(at.edge_rows, kv)
    return _BulkPeel(costs, values, zero, ok & ~rows_map & ~cols_map & ~zero, rows_map & ~zero, cols_map & ~zero,
                     row_partner, col_partner, at.edge_rows, at.edge_cols)


def _followers_contracted(p: StrategyProblem, kept: list[np.ndarray]) -> _Work:
    """The work arrays of `p` with every follower merged into the node that decides it, and
    every node with one strategy fixed, all at once (`contract`); `kept`: per node of `p`, its
    strategies' indices in the original problem."""
    peeled = _bulk_peel(p)
    root, maps = _follower_maps(p, peeled)
    flat = StrategyProblem(Ragged(peeled.node_costs, p.costs.ptr), p.edge_nodes,
                           Ragged(peeled.values, p.edge_costs.ptr), p.memory, p.usage_limit, p.name)
    c = contract(flat, root, maps)
    members: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(c.problem.num_nodes)]
    fixed: dict[int, int] = {}
    for x, r in enumerate(c.root.tolist()):
        original = kept[x][maps.row(x)]
        if r < 0:
            fixed[x] = int(original[0])
        else:
            members[r].append((x, original))
    return _Work(c, members, fixed)


def _follower_maps(p: StrategyProblem, peeled: _BulkPeel) -> tuple[np.ndarray, Ragged]:
    """A forest of mapping edges (each node follows at most one other, no cycles: union-find
    over the candidate edges) and, per node, its root and the map from the root's strategies
    to its own. A tree whose root has one strategy is fixed (root -1)."""
    n = p.num_nodes
    parent = np.full(n, -1, dtype=np.int64)
    link: list[np.ndarray | None] = [None] * n
    group = list(range(n))

    def find(x: int) -> int:
        while group[x] != x:
            group[x] = group[group[x]]
            x = group[x]
        return x

    sizes = p.sizes
    for e in np.flatnonzero(peeled.rows_map | peeled.cols_map).tolist():
        u, v = p.edge_nodes[e].tolist()
        if sizes[u] == 1 or sizes[v] == 1 or find(u) == find(v):
            continue
        for lead, follow, by_rows in ((u, v, True), (v, u, False)):
            if parent[follow] < 0 and (peeled.rows_map[e] if by_rows else peeled.cols_map[e]):
                first = (peeled.edge_rows if by_rows else peeled.edge_cols)[e]
                link[follow] = (peeled.row_partner if by_rows else peeled.col_partner)[first:first + sizes[lead]]
                parent[follow] = lead
                group[find(follow)] = find(lead)
                break
    return _compose(parent, link, sizes)


def _compose(parent: np.ndarray, link: list[np.ndarray | None], sizes: np.ndarray) -> tuple[np.ndarray, Ragged]:
    """Per node its root and its strategy per strategy of the root, parents before children."""
    n = len(parent)
    children: list[list[int]] = [[] for _ in range(n)]
    for x, up in enumerate(parent.tolist()):
        if up >= 0:
            children[up].append(x)
    root = np.arange(n, dtype=np.int64)
    maps: list[np.ndarray] = [np.zeros(0, np.int64)] * n
    stack = np.flatnonzero(parent < 0).tolist()
    for r in stack:
        maps[r] = np.arange(sizes[r], dtype=np.int64)
    while stack:
        x = stack.pop()
        for y in children[x]:
            root[y] = root[x]
            maps[y] = link[y][maps[x]]
            stack.append(y)
    root[sizes[root] == 1] = -1
    return root, Ragged.from_rows(maps, dtype=np.int64)


def _dominance_pass(w: _Work, deadline: float | None) -> bool:
    """Dominated strategies out of every node (first pass) or of the nodes that changed since
    the last pass (later ones: nothing else can have gained a dominated strategy)."""
    changed = False
    nodes = np.flatnonzero(w.alive) if w.touched is None else sorted(v for v in w.touched if w.alive[v])
    w.touched = set()
    for v in nodes:
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
    if k == 1 or sum(p.shape[1] for p in parts) * k > DOMINANCE_WIDTH * 8:
        return None
    table = np.hstack(parts)
    order = np.lexsort((np.arange(k), table.sum(axis=1, where=np.isfinite(table)), w.cost[v]))
    rank = np.empty(k, dtype=np.int64)
    rank[order] = np.arange(k)
    candidates = order[:DOMINANCE_CANDIDATES]
    # all candidates at once: a beats b when no worse anywhere and better somewhere, or equal
    # and earlier in the order (a strict order, so removing everything beaten keeps one of
    # every group of equals and, by transitivity, equals comparing candidates one at a time)
    rows = table[candidates][:, None, :]
    no_worse = (rows <= table[None, :, :]).all(axis=2)
    better = (rows < table[None, :, :]).any(axis=2) | (rank[candidates][:, None] < rank[None, :])
    keep = ~(no_worse & better).any(axis=0)
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
