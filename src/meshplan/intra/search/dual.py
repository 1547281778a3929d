"""Lower bounds for the pairwise problem by message passing: (PairwiseIndex, unary) -> bound.

The pairwise problem min_x sum_v unary_v(x_v) + sum_e theta_e(x_u, x_v) is split into its
nodes and edges: each edge e = (u, v) lends y_e,u(i) from node u's costs and y_e,v(j) from
node v's. For any y,

    sum_v min_i [unary_v(i) - sum_e y_e,v(i)] + sum_e min_ij [theta_e(i, j) + y_e,u(i) + y_e,v(j)]

is a lower bound on the optimum (each part is minimized on its own). Star updates raise it:
for a node v, with mu_e(i) = min_j [theta_e(i, j) + y_e,w(j)] what edge e offers, set
y_e,v = T / (deg + 1) - mu_e where T = unary_v + sum_e mu_e, which makes the star's bound
min_i T(i), its best (block coordinate ascent, as in MPLP). Nodes of one colour class share
no edge, so a class is updated at once with flat array operations.

The bound is the linear-programming (local polytope) bound in the limit; the node beliefs T
also decode into good assignments. Used with memory prices folded into `unary`, it bounds the
memory-constrained problem from below (see `lagrange`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.intra.problem.arrays import ragged_arange
from meshplan.intra.search.pairwise import PairwiseIndex


@dataclass(frozen=True, slots=True)
class _ClassGather:
    """Precomputed gathers of one colour class's star update."""

    matrix: np.ndarray  # per (incidence entry i, other strategy j): index into forward|backward
    lent: np.ndarray  # per (i, j): the other side's y entry
    row_starts: np.ndarray  # where each incidence entry's row of j values starts
    entries: np.ndarray  # the class's incidence entries
    share: np.ndarray  # per entry, 1 / (degree of its node + 1)


class EdgeDual:
    """The lent costs y (one per incidence entry of `PairwiseIndex`) and their updates."""

    def __init__(self, ix: PairwiseIndex) -> None:
        self.ix = ix
        ne = len(ix.edge_u)
        ku, kv = ix.sizes[ix.edge_u], ix.sizes[ix.edge_v]
        u_start = np.cumsum(ku) - ku
        v_start = int(ku.sum()) + np.cumsum(kv) - kv
        self.y = np.zeros(len(ix.target))
        self.matrices = np.concatenate([ix.forward, ix.backward])
        side_node = np.concatenate([ix.edge_u, ix.edge_v])
        degree = np.bincount(side_node, minlength=ix.num_nodes).astype(np.float64)
        sides = _Sides(np.concatenate([u_start, v_start]), np.concatenate([v_start, u_start]), side_node,
                       np.concatenate([ix.edge_v, ix.edge_u]), np.concatenate([np.arange(ne), np.arange(ne)]),
                       np.concatenate([np.zeros(ne, np.int64), np.full(ne, len(ix.forward))]))
        colors = ix.colors[side_node]
        self.classes = [_gather(ix, sides, np.flatnonzero(colors == c), degree)
                        for c in range(int(ix.colors.max(initial=-1)) + 1)]
        span = ku * kv
        k = ragged_arange(span)
        kv_flat = np.repeat(kv, span)
        self.edge_u_lent = (np.repeat(u_start, span) + k // kv_flat).astype(np.int32)
        self.edge_v_lent = (np.repeat(v_start, span) + k % kv_flat).astype(np.int32)
        self.edge_starts = np.cumsum(span) - span

    def sweep(self, unary: np.ndarray) -> None:
        """One star update of every node, a colour class at a time."""
        target = self.ix.target
        for g in self.classes:
            if len(g.entries) == 0:
                continue
            mu = np.minimum.reduceat(self.matrices[g.matrix] + self.y[g.lent], g.row_starts)
            flat = target[g.entries]
            total = unary + np.bincount(flat, weights=mu, minlength=len(unary))
            self.y[g.entries] = total[flat] * g.share - mu

    def bound(self, unary: np.ndarray) -> float:
        """The lower bound for the current y (valid for any y)."""
        ix = self.ix
        node_part = unary - np.bincount(ix.target, weights=self.y, minlength=len(unary))
        total = float(np.minimum.reduceat(node_part, ix.ptr[:-1]).sum()) if ix.num_nodes else 0.0
        if len(ix.edge_u) == 0:
            return total
        values = ix.forward + self.y[self.edge_u_lent] + self.y[self.edge_v_lent]
        return total + float(np.minimum.reduceat(values, self.edge_starts).sum())

    def excess(self, unary: np.ndarray) -> np.ndarray:
        """Per flat strategy, how far its node's part of `bound` rises when it is chosen: every
        assignment that chooses it costs at least bound + excess (the other parts stay minimized)."""
        ix = self.ix
        node_part = unary - np.bincount(ix.target, weights=self.y, minlength=len(unary))
        lows = np.minimum.reduceat(node_part, ix.ptr[:-1]) if ix.num_nodes else np.zeros(0)
        return node_part - np.repeat(lows, np.diff(ix.ptr))

    def beliefs(self, unary: np.ndarray) -> np.ndarray:
        """Per flat strategy: its cost plus what every edge offers it (the star's T)."""
        total = unary.copy()
        for g in self.classes:
            if len(g.entries):
                mu = np.minimum.reduceat(self.matrices[g.matrix] + self.y[g.lent], g.row_starts)
                total += np.bincount(self.ix.target[g.entries], weights=mu, minlength=len(unary))
        return total


@dataclass(frozen=True, slots=True)
class _Sides:
    """Per (edge, end): incidence start of this end and of the other, the nodes, the edge, and
    where its matrix oriented with this end's strategies as rows lives in forward|backward."""

    start: np.ndarray
    other_start: np.ndarray
    node: np.ndarray
    other: np.ndarray
    edge: np.ndarray
    matrix_base: np.ndarray


def _gather(ix: PairwiseIndex, sides: _Sides, chosen: np.ndarray, degree: np.ndarray) -> _ClassGather:
    k_self, k_other = ix.sizes[sides.node[chosen]], ix.sizes[sides.other[chosen]]
    span = k_self * k_other
    k = ragged_arange(span)
    matrix = np.repeat(ix.edge_ptr[sides.edge[chosen]] + sides.matrix_base[chosen], span) + k
    lent = np.repeat(sides.other_start[chosen], span) + k % np.repeat(k_other, span)
    row_starts = np.repeat(np.cumsum(span) - span, k_self) + ragged_arange(k_self) * np.repeat(k_other, k_self)
    entries = np.repeat(sides.start[chosen], k_self) + ragged_arange(k_self)
    share = 1.0 / (degree[ix.node_of[ix.target[entries]]] + 1.0)
    return _ClassGather(matrix.astype(np.int64), lent.astype(np.int32), row_starts, entries, share)
