"""Exact moves on trees: re-choose a whole induced forest at once by dynamic programming.

Incumbent + per-strategy unary costs -> Incumbent no worse under unary + edge costs.
Single-node moves stall where resharding couples neighbours (changing one end alone costs
more than it saves); a forest of nodes whose induced subgraph has no cycle can be re-chosen
jointly and exactly, the nodes outside it held fixed (their edges become unary costs). A
random maximal induced forest covers most nodes, so a few passes move everything in large
coordinated steps. Memory is not seen here: the caller prices it into `unary`.
"""

from __future__ import annotations

import numpy as np

from meshplan.intra.local_search import Incumbent


def random_forest(inc: Incumbent, rng: np.random.Generator) -> np.ndarray:
    """A maximal set of nodes whose induced subgraph is a forest (greedy, random order)."""
    n = inc.problem.num_nodes
    parent = np.arange(n)
    inside = np.zeros(n, dtype=bool)

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return int(x)

    for v in rng.permutation(n).tolist():
        roots = [find(w) for w, _, _ in inc.neighbours[v] if inside[w]]
        if len(roots) == len(set(roots)):
            inside[v] = True
            for r in roots:
                parent[r] = v
    return inside


def forest_descent(inc: Incumbent, unary: np.ndarray, inside: np.ndarray) -> int:
    """Re-choose every node of the forest `inside` optimally for unary + edges; returns moves."""
    q = inc.problem
    ptr = q.costs.ptr
    local = {v: unary[ptr[v]:ptr[v + 1]].copy() for v in np.flatnonzero(inside).tolist()}
    for v in local:
        for w, e, rows_are_v in inc.neighbours[v]:
            if not inside[w]:
                mat = q.edge_matrix(e)
                local[v] += mat[:, inc.choice[w]] if rows_are_v else mat[inc.choice[w], :]
    order, parent_of = _tree_order(inc, inside, list(local))
    best_given_parent: dict[int, np.ndarray] = {}
    for v in reversed(order):  # leaves first: fold each subtree into its parent's costs
        p = parent_of[v]
        if p < 0:
            continue
        e, rows_are_v = next((e, r) for x, e, r in inc.neighbours[v] if x == p)
        mat = q.edge_matrix(e)
        total = (mat.T if rows_are_v else mat) + local[v][None, :]  # [parent strategy, child strategy]
        best_given_parent[v] = np.argmin(total, axis=1)
        local[p] += total[np.arange(total.shape[0]), best_given_parent[v]]
    pick: dict[int, int] = {}
    moves = 0
    for v in order:  # roots first: each child follows its parent
        p = parent_of[v]
        pick[v] = int(np.argmin(local[v])) if p < 0 else int(best_given_parent[v][pick[p]])
        if pick[v] != inc.choice[v]:
            moves += 1
    for v, s in pick.items():
        inc.move(v, s)
    return moves


def _tree_order(inc: Incumbent, inside: np.ndarray, nodes: list[int]) -> tuple[list[int], dict[int, int]]:
    """Breadth-first order of every tree of the forest, and each node's parent (-1: a root)."""
    parent_of: dict[int, int] = {}
    order: list[int] = []
    for root in nodes:
        if root in parent_of:
            continue
        parent_of[root] = -1
        queue = [root]
        while queue:
            v = queue.pop()
            order.append(v)
            for w, _, _ in inc.neighbours[v]:
                if inside[w] and w not in parent_of:
                    parent_of[w] = v
                    queue.append(w)
    return order, parent_of
