"""Contraction of a strategy problem onto the nodes that decide the others, all at once.

(StrategyProblem, per node its root and the map from the root's strategies to its own) ->
Contraction (the problem over the roots, the constant cost and usage of fixed nodes).

A node whose strategy another node's determines (an edge allows it exactly one partner per
strategy of the other) need not be a variable: it follows its root. Presolve used to merge
such nodes one at a time (27,000 merges on IOPDDL's D, each moving edges between Python
dicts); here every node, edge and memory term is re-indexed by one gather over flat arrays:
- a node's costs (and each memory term's usages) through its map add to its root's;
- an edge between two roots becomes the edge of its ends' maps (parallel edges may result:
  they add up), an edge inside one root's group adds its diagonal to the root's costs;
- a fixed node (root -1, one strategy) adds its cost to the offset and its usage to the base,
  and its edges add to the other end's costs.

Exact by construction: every assignment of the roots gives each node one strategy, and the
contracted cost and usage of an assignment are the original ones of the expanded assignment.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.intra.problem.arrays import MemoryTerms, Ragged, StrategyProblem, ragged_arange


@dataclass(frozen=True, slots=True)
class Contraction:
    """A problem contracted onto its roots.

    Attributes:
        problem: the problem over the roots (numbered in the order of the input's nodes).
        root: per input node, its root's index in `problem` (-1: fixed).
        offset: cost every assignment pays (fixed nodes, edges among them).
        base: the fixed nodes' memory terms (lo, hi, usage).
    """

    problem: StrategyProblem
    root: np.ndarray
    offset: float
    base: tuple[np.ndarray, np.ndarray, np.ndarray]


def contract(p: StrategyProblem, root: np.ndarray, maps: Ragged) -> Contraction:
    """Contract `p`: node x follows input node `root[x]` (itself for a root, -1: fixed), taking
    strategy maps.row(x)[i] when its root takes i (a fixed node's row holds its one strategy).
    A root's own map must be the identity."""
    is_root = root == np.arange(p.num_nodes)
    index = np.full(p.num_nodes, -1, dtype=np.int64)
    index[is_root] = np.arange(int(is_root.sum()))
    owner = np.where(root >= 0, index[np.maximum(root, 0)], -1)
    k = maps.lengths  # per node: strategies of its root (1 when fixed)
    new_sizes = p.sizes[is_root]
    new_ptr = np.r_[0, np.cumsum(new_sizes)]
    costs = np.zeros(int(new_ptr[-1]))
    picked = maps.values + np.repeat(p.costs.ptr[:-1], k)  # flat strategy of each map entry
    decided = np.repeat(owner >= 0, k)
    at = np.repeat(new_ptr[np.maximum(owner, 0)], k) + ragged_arange(k)
    np.add.at(costs, at[decided], p.costs.values[picked[decided]])
    offset = float(p.costs.values[picked[~decided]].sum())
    edges, offset = _edges(p, owner, maps, new_ptr, costs, offset)
    memory, base = _memory(p, owner, maps)
    problem = StrategyProblem(Ragged(costs, new_ptr), edges[0], edges[1], memory, p.usage_limit, p.name)
    return Contraction(problem, owner, offset, base)


def _edges(p: StrategyProblem, owner: np.ndarray, maps: Ragged, new_ptr: np.ndarray, costs: np.ndarray,
           offset: float) -> tuple[tuple[np.ndarray, Ragged], float]:
    """Every edge gathered through its ends' maps; edges that touch a fixed node or stay inside
    one root's group go into costs (or the offset), the others are the contracted edges."""
    if p.num_edges == 0:
        return (np.zeros((0, 2), np.int64), Ragged(np.zeros(0), np.zeros(1, np.int64))), offset
    a, b = p.edge_nodes[:, 0], p.edge_nodes[:, 1]
    ra, rb = owner[a], owner[b]
    inner = (ra == rb) & (ra >= 0)
    la, lb = maps.lengths[a], maps.lengths[b]
    span = np.where(inner, la, la * lb)  # inside a group only the diagonal matters
    at = ragged_arange(span)
    lb_each = np.repeat(lb, span)
    inner_each = np.repeat(inner, span)
    i = np.where(inner_each, at, at // lb_each)
    j = np.where(inner_each, at, at % lb_each)
    ma = maps.values[np.repeat(maps.ptr[a], span) + i]
    mb = maps.values[np.repeat(maps.ptr[b], span) + j]
    values = p.edge_costs.values[np.repeat(p.edge_costs.ptr[:-1], span) + ma * np.repeat(p.sizes[b], span) + mb]
    edge = np.repeat(np.arange(p.num_edges), span)
    fa, fb = ra[edge] < 0, rb[edge] < 0
    offset += float(values[fa & fb].sum())
    to_a = (fb & ~fa) | inner_each  # the value depends on a's root's strategy i only
    to_b = fa & ~fb
    np.add.at(costs, new_ptr[ra[edge[to_a]]] + i[to_a], values[to_a])
    np.add.at(costs, new_ptr[rb[edge[to_b]]] + j[to_b], values[to_b])
    between = (ra >= 0) & (rb >= 0) & ~inner
    kept = np.repeat(between, span)
    pairs = np.stack([ra[between], rb[between]], axis=1)
    return (pairs, Ragged(values[kept], np.r_[0, np.cumsum(span[between])])), offset


def _memory(p: StrategyProblem, owner: np.ndarray,
            maps: Ragged) -> tuple[MemoryTerms, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each term re-indexed by its node's map; a fixed node's terms go to the base."""
    m = p.memory
    if len(m) == 0:
        z = np.zeros(0, dtype=np.int64)
        return m, (z, z, np.zeros(0))
    k = maps.lengths[m.node]
    flat = np.repeat(m.usages.ptr[:-1], k) + maps.values[np.repeat(maps.ptr[m.node], k) + ragged_arange(k)]
    usage = m.usages.values[flat]
    term_owner = owner[m.node]
    varies = term_owner >= 0
    keep = np.repeat(varies, k)
    fixed_usage = usage[~keep]  # one entry per fixed term
    memory = MemoryTerms(term_owner[varies], m.lo[varies], m.hi[varies],
                         Ragged(usage[keep], np.r_[0, np.cumsum(k[varies])]))
    used = fixed_usage != 0  # a zero term would only add a point where the base changes
    return memory, (m.lo[~varies][used], m.hi[~varies][used], fixed_usage[used])
