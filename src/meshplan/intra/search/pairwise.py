"""Vectorized moves on the pairwise cost structure: StrategyProblem -> PairwiseIndex.

The search on large problems re-evaluates, thousands of times, what every strategy of every
node would cost given its neighbours' current strategies. Done node by node in Python that is
most of the search's time; here it is one gather and one `bincount` over precomputed index
arrays. On top of it:

- `icm_sweep`: every node of an independent set (a colour class) moves at once to its best
  strategy given its neighbours (iterated conditional modes), class after class;
- `forest_dp`: a whole induced forest re-chosen exactly by dynamic programming, leaves to
  roots one depth level at a time, each level as flat array operations;
- `segment_argmin`: the cheapest strategy of every node from a flat per-strategy array.

Costs are flat per-strategy arrays aligned with `problem.costs.values` (the caller adds memory
prices into them); memory feasibility is the caller's concern.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.intra.problem.arrays import StrategyProblem, ragged_arange


@dataclass(frozen=True, slots=True)
class PairwiseIndex:
    """Index arrays of a problem's edges for vectorized local costs and tree DP.

    Attributes:
        sizes, ptr: strategies per node; node v's flat strategies are ptr[v] .. ptr[v + 1] - 1.
        node_of: the node of every flat strategy.
        edge_ptr: edge e's matrix entries start at edge_ptr[e], in `forward` ([u, v] row-major)
            and in `backward` ([v, u] row-major, the transpose).
        target, base, other, stride: one entry per (edge, end node, strategy i of that end):
            the matrix entry at `base + stride * choice[other]` is what strategy i (flat index
            `target`) pays on that edge given the other end's strategy.
        neighbours: per node, (neighbour, edge) pairs.
        colors: per node, a colour such that no edge joins two nodes of the same colour.
        color_entries: per colour, the incidence entries of its nodes.
    """

    sizes: np.ndarray
    ptr: np.ndarray
    node_of: np.ndarray
    edge_u: np.ndarray
    edge_v: np.ndarray
    edge_ptr: np.ndarray
    forward: np.ndarray
    backward: np.ndarray
    target: np.ndarray
    base: np.ndarray
    other: np.ndarray
    stride: np.ndarray
    neighbours: tuple[tuple[tuple[int, int], ...], ...]
    colors: np.ndarray
    color_entries: tuple[np.ndarray, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.sizes)


def pairwise_index(problem: StrategyProblem) -> PairwiseIndex:
    """Precompute the index arrays of `problem` (linear in its size)."""
    sizes = problem.sizes.astype(np.int64)
    ptr = problem.costs.ptr.astype(np.int64)
    node_of = np.repeat(np.arange(len(sizes)), sizes)
    eu, ev = (problem.edge_nodes[:, k].astype(np.int64) for k in (0, 1))
    ku, kv = sizes[eu], sizes[ev]
    eptr = problem.edge_costs.ptr[:-1].astype(np.int64)
    forward = problem.edge_costs.values
    backward = np.empty_like(forward)
    # backward[eptr + j * ku + i] = forward[eptr + i * kv + j]
    span = ku * kv
    k = ragged_arange(span)
    i, j = k // np.repeat(kv, span), k % np.repeat(kv, span)
    src = np.repeat(eptr, span) + k
    backward[np.repeat(eptr, span) + j * np.repeat(ku, span) + i] = forward[src]
    # u side: strategy i of u pays forward[eptr + i * kv + choice[v]]; v side: strategy j of v
    # pays forward[eptr + j + kv * choice[u]].
    iu, jv = ragged_arange(ku), ragged_arange(kv)
    target = np.concatenate([np.repeat(ptr[eu], ku) + iu, np.repeat(ptr[ev], kv) + jv])
    base = np.concatenate([np.repeat(eptr, ku) + iu * np.repeat(kv, ku), np.repeat(eptr, kv) + jv])
    other = np.concatenate([np.repeat(ev, ku), np.repeat(eu, kv)])
    stride = np.concatenate([np.ones(int(ku.sum()), np.int64), np.repeat(kv, kv)])
    neighbours: list[list[tuple[int, int]]] = [[] for _ in range(len(sizes))]
    for e, (u, v) in enumerate(zip(eu.tolist(), ev.tolist(), strict=True)):
        neighbours[u].append((v, e))
        neighbours[v].append((u, e))
    frozen = tuple(tuple(n) for n in neighbours)
    colors = _greedy_colors(frozen)
    entry_color = colors[node_of[target]]
    color_entries = tuple(np.flatnonzero(entry_color == c) for c in range(int(colors.max(initial=-1)) + 1))
    return PairwiseIndex(sizes, ptr, node_of, eu, ev, eptr, forward, backward, target, base, other, stride,
                         frozen, colors, color_entries)


def _greedy_colors(neighbours: tuple[tuple[tuple[int, int], ...], ...]) -> np.ndarray:
    """Colour nodes (most neighbours first) with the smallest colour no neighbour has."""
    n = len(neighbours)
    colors = np.full(n, -1, dtype=np.int64)
    degree = np.array([len(x) for x in neighbours], dtype=np.int64)
    for v in np.argsort(-degree, kind="stable").tolist():
        used = {int(colors[w]) for w, _ in neighbours[v]}
        c = 0
        while c in used:
            c += 1
        colors[v] = c
    return colors


def local_costs(ix: PairwiseIndex, unary: np.ndarray, choice: np.ndarray) -> np.ndarray:
    """Per flat strategy: its unary cost plus its edges' costs given the neighbours' choice."""
    paid = ix.forward[ix.base + ix.stride * choice[ix.other]]
    return unary + np.bincount(ix.target, weights=paid, minlength=len(unary))


def class_local_costs(ix: PairwiseIndex, unary: np.ndarray, choice: np.ndarray, color: int) -> np.ndarray:
    """`local_costs`, exact only for the nodes of one colour (the others get their unary)."""
    e = ix.color_entries[color]
    paid = ix.forward[ix.base[e] + ix.stride[e] * choice[ix.other[e]]]
    return unary + np.bincount(ix.target[e], weights=paid, minlength=len(unary))


def segment_min(ix: PairwiseIndex, values: np.ndarray) -> np.ndarray:
    return np.minimum.reduceat(values, ix.ptr[:-1])


def segment_argmin(ix: PairwiseIndex, values: np.ndarray) -> np.ndarray:
    """Per node, the first strategy of least value."""
    lowest = np.repeat(segment_min(ix, values), ix.sizes)
    hits = np.flatnonzero(values <= lowest)
    first = hits[np.r_[True, ix.node_of[hits[1:]] != ix.node_of[hits[:-1]]]]
    return first - ix.ptr[ix.node_of[first]]


def icm_sweep(ix: PairwiseIndex, unary: np.ndarray, choice: np.ndarray, movable: np.ndarray | None = None) -> int:
    """One pass of iterated conditional modes, a colour class at a time; `choice` is updated
    in place (only nodes in `movable`, default all). Returns how many nodes moved."""
    moved = 0
    tol = 1e-12
    for c in range(len(ix.color_entries)):
        local = class_local_costs(ix, unary, choice, c)
        best = segment_argmin(ix, local)
        now = local[ix.ptr[:-1] + choice]
        with np.errstate(invalid="ignore"):  # inf - inf (a node with only forbidden choices): no move
            gain = now - local[ix.ptr[:-1] + best]
        go = (ix.colors == c) & (gain > tol * np.maximum(np.abs(now), 1.0))
        if movable is not None:
            go &= movable
        choice[go] = best[go]
        moved += int(go.sum())
    return moved


@dataclass(frozen=True, slots=True)
class Forest:
    """An induced forest: its nodes, and their trees level by level.

    Attributes:
        inside: per node, whether it is in the forest.
        levels: the forest's nodes by depth (levels[0]: the roots).
        parent, parent_edge: per node, its parent in its tree and the edge to it (-1: a root or
            a node outside).
    """

    inside: np.ndarray
    levels: tuple[np.ndarray, ...]
    parent: np.ndarray
    parent_edge: np.ndarray


def random_forest(ix: PairwiseIndex, rng: np.random.Generator) -> Forest:
    """A maximal set of nodes whose induced subgraph is a forest (greedy, random order)."""
    n = ix.num_nodes
    parent = list(range(n))
    inside = [False] * n

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for v in rng.permutation(n).tolist():
        roots = [find(w) for w, _ in ix.neighbours[v] if inside[w]]
        if len(roots) == len(set(roots)):
            inside[v] = True
            for r in roots:
                parent[r] = v
    return _levels(ix, np.array(inside, dtype=bool))


def _levels(ix: PairwiseIndex, inside: np.ndarray) -> Forest:
    n = ix.num_nodes
    parent = np.full(n, -1, dtype=np.int64)
    parent_edge = np.full(n, -1, dtype=np.int64)
    seen = (~inside).tolist()
    levels: list[list[int]] = []
    for root in np.flatnonzero(inside).tolist():
        if seen[root]:
            continue
        seen[root] = True
        frontier, depth = [root], 0
        while frontier:
            if len(levels) <= depth:
                levels.append([])
            levels[depth].extend(frontier)
            nxt = []
            for v in frontier:
                for w, e in ix.neighbours[v]:
                    if not seen[w]:
                        seen[w] = True
                        parent[w], parent_edge[w] = v, e
                        nxt.append(w)
            frontier, depth = nxt, depth + 1
    return Forest(inside, tuple(np.array(level, dtype=np.int64) for level in levels), parent, parent_edge)


def forest_dp(ix: PairwiseIndex, unary: np.ndarray, choice: np.ndarray, forest: Forest) -> None:
    """Re-choose every node of the induced forest optimally for unary + edge costs, the other
    nodes held at `choice`; `choice` is updated in place."""
    inside = forest.inside
    if not inside.any():
        return
    outside_edge = ~inside[ix.other]
    paid = ix.forward[ix.base[outside_edge] + ix.stride[outside_edge] * choice[ix.other[outside_edge]]]
    local = unary + np.bincount(ix.target[outside_edge], weights=paid, minlength=len(unary))
    best_at: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for nodes in reversed(forest.levels[1:]):  # deepest level first: fold children into parents
        best_at.append(_fold_level(ix, local, nodes, forest.parent[nodes], forest.parent_edge[nodes]))
    roots = forest.levels[0]
    masked = np.full(len(unary), np.inf)
    at_roots = np.repeat(ix.ptr[roots], ix.sizes[roots]) + ragged_arange(ix.sizes[roots])
    masked[at_roots] = local[at_roots]
    choice[roots] = segment_argmin(ix, masked)[roots]
    for nodes, offsets, best in reversed(best_at):  # roots down: each child follows its parent
        choice[nodes] = best[offsets + choice[forest.parent[nodes]]]


def _fold_level(ix: PairwiseIndex, local: np.ndarray, child: np.ndarray, parent: np.ndarray,
                edge: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Add to each parent's local costs min over the child's strategies of edge + child local;
    returns (children, offset of each child's rows, best child strategy per parent strategy)."""
    kp, kc = ix.sizes[parent], ix.sizes[child]
    span = kp * kc
    k = ragged_arange(span)
    parent_is_u = ix.edge_u[edge] == parent
    start = np.repeat(ix.edge_ptr[edge], span) + k
    kc_flat = np.repeat(kc, span)
    matrix = np.where(np.repeat(parent_is_u, span), ix.forward[start], ix.backward[start])
    total = matrix + local[np.repeat(ix.ptr[child], span) + k % kc_flat]
    row_starts = np.repeat(np.cumsum(span) - span, kp) + ragged_arange(kp) * np.repeat(kc, kp)
    row_min = np.minimum.reduceat(total, row_starts)
    row_id = np.repeat(np.arange(len(row_starts)), np.repeat(kc, kp))
    hits = np.flatnonzero(total <= row_min[row_id])
    first = hits[np.r_[True, row_id[hits[1:]] != row_id[hits[:-1]]]]
    best = first - row_starts[row_id[first]]
    target = np.repeat(ix.ptr[parent], kp) + ragged_arange(kp)
    local += np.bincount(target, weights=row_min, minlength=len(local))
    offsets = np.cumsum(kp) - kp
    return child, offsets, best
