"""The least cost of a small strategy block without memory rows, by variable elimination.

Block (node costs, edge matrices) -> the optimum's cost, or None when eliminating would build
more than a given number of table entries.

A model's pieces reduce (after presolve) to few nodes with a small treewidth: a LLaMA piece's
embedding or head is 3 to 11 nodes whose elimination builds at most 22,000 entries (well under
a millisecond, where one HiGHS run costs about 10 ms of setup), a LLaMA block 47 nodes and 88
edges, 0.8-4 million entries (10-40 ms; HiGHS: 60-200 ms on its MIP).
Summing the tables that hold a node and taking the minimum over its strategies removes it
exactly (min-sum bucket elimination); the order is greedy, the node whose table would be
smallest first. `problem_solver` uses the value to see that its start is already optimal.
"""

from __future__ import annotations

import itertools

import numpy as np

from meshplan.intra.search.mip import Block

Factor = tuple[tuple[int, ...], np.ndarray]  # (nodes, table with one axis per node, in that order)


def least_cost(block: Block, max_work: int) -> float | None:
    """min over assignments of `block.cost_of` (memory rows ignored), offset included; None
    when the tables to build hold more than `max_work` entries in all (found before building
    any). Forbidden pairs (inf) stay inf: a block that admits nothing gives inf."""
    sizes = block.sizes.tolist()
    order = elimination_order(sizes, block.edges.tolist(), max_work)
    if order is None:
        return None
    factors: dict[int, Factor] = {}
    holding: list[set[int]] = [set() for _ in sizes]  # per node, the factors that hold it
    neighbours: list[set[int]] = [set() for _ in sizes]
    keys = itertools.count()

    def add(nodes: tuple[int, ...], table: np.ndarray) -> None:
        key = next(keys)
        factors[key] = (nodes, table)
        for v in nodes:
            holding[v].add(key)
            neighbours[v].update(u for u in nodes if u != v)

    for v in range(len(sizes)):
        add((v,), block.costs.row(v))
    for (u, v), matrix in zip(block.edges.tolist(), block.matrices, strict=True):
        add((u, v), matrix)
    constant = float(block.offset)
    for v in order:
        scope = tuple(sorted(neighbours[v]))
        table = _joined((*scope, v), [factors.pop(k) for k in sorted(holding[v])], sizes).min(axis=-1)
        for u in scope:
            holding[u] -= holding[v]
            neighbours[u].discard(v)
        if scope:
            add(scope, table)
        else:
            constant += float(table)
    return constant


def elimination_order(sizes: list[int], edges: list[list[int]], max_work: int) -> list[int] | None:
    """Nodes in the order eliminated: each time the one whose table (it and its neighbours,
    fill-in included) is smallest; None when the tables would hold more than `max_work` entries."""
    neighbours: list[set[int]] = [set() for _ in sizes]
    for u, v in edges:
        if u != v:
            neighbours[u].add(v)
            neighbours[v].add(u)
    score = {v: _table_size(v, neighbours[v], sizes) for v in range(len(sizes))}
    order, work = [], 0
    while score:
        v = min(score, key=lambda x: (score[x], x))
        work += score.pop(v)
        if work > max_work:
            return None
        order.append(v)
        for u in neighbours[v]:
            neighbours[u].discard(v)
            neighbours[u].update(w for w in neighbours[v] if w != u)
        for u in neighbours[v]:
            score[u] = _table_size(u, neighbours[u], sizes)
    return order


def _table_size(v: int, neighbours: set[int], sizes: list[int]) -> int:
    size = sizes[v]
    for u in neighbours:
        size *= sizes[u]
    return size


def _joined(scope: tuple[int, ...], parts: list[Factor], sizes: list[int]) -> np.ndarray:
    """The sum of `parts` as one table over `scope` (one axis per node, in scope order)."""
    axis = {v: k for k, v in enumerate(scope)}
    total = np.zeros([sizes[v] for v in scope])
    for nodes, table in parts:
        order = sorted(range(len(nodes)), key=lambda k: axis[nodes[k]])
        shape = [1] * len(scope)
        for k in order:
            shape[axis[nodes[k]]] = sizes[nodes[k]]
        total += np.transpose(table, order).reshape(shape)
    return total
