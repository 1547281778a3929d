"""A MIP block over each node's most promising strategies: the exact side's small first model.

(MIP block, a score per strategy, plans to keep possible) -> Restriction (smaller block, and
the maps between its plans and the whole block's).

IOPDDL's D after presolve has 203 nodes of ~14 strategies and 399 edges of up to 23 x 31
strategy pairs: 78,000 pair columns, whose root LP alone took 10-24 s on a loaded machine, so
in a 60 s limit the branch and bound hardly started. The memory prices score every strategy
(its cost plus what its edges offer it at the current prices: the dual's beliefs); keeping each
node's few best by that score, plus every strategy the given plans use, leaves a model of a
fraction of the columns whose good plans HiGHS finds in moments. It is not a relaxation: its
bounds prove nothing about the whole problem, its plans are feasible plans of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.intra.problem.arrays import Ragged, ragged_arange
from meshplan.intra.search.lazy_rows import Hooks, solve_lazy
from meshplan.intra.search.mip import Block

CANDIDATES = 6  # strategies kept per node besides the start's (on D after 4 pricing rounds: the best
# known cost in 3 CPU s; with 8, in 7 CPU s; with 4, 1.06 times it)
SMALLER = 0.6  # restrict only when at most this share of the strategies is kept


@dataclass(frozen=True, slots=True)
class Restriction:
    """A block restricted to some strategies per node.

    Attributes:
        block: the restricted block (same nodes, edges and memory rows).
        kept: per node, the whole block's indices of the strategies kept (ascending).
    """

    block: Block
    kept: Ragged

    def lift(self, choice: np.ndarray) -> np.ndarray:
        """A plan of the restricted block -> the whole block's."""
        return self.kept.values[self.kept.ptr[:-1] + choice].astype(np.int64)

    def lower(self, choice: np.ndarray) -> np.ndarray | None:
        """A plan of the whole block -> the restricted block's (None: it uses a strategy left out)."""
        out = np.empty(len(choice), dtype=np.int64)
        for v, s in enumerate(choice.tolist()):
            row = self.kept.row(v)
            at = int(np.searchsorted(row, s))
            if at == len(row) or row[at] != s:
                return None
            out[v] = at
        return out


def restrict(block: Block, score: np.ndarray, plans: tuple[np.ndarray, ...], per_node: int) -> Restriction:
    """Keep each node's `per_node` strategies of lowest `score` (per flat strategy of the block)
    and every strategy that one of `plans` uses."""
    sizes, ptr = block.sizes, block.costs.ptr
    node = np.repeat(np.arange(len(sizes)), sizes)
    order = np.lexsort((score, node))  # by node, then by score
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = ragged_arange(sizes)
    keep = rank < per_node
    for plan in plans:
        keep[ptr[:-1] + plan] = True
    counts = np.add.reduceat(keep, ptr[:-1]) if len(sizes) else np.zeros(0, np.int64)
    new_ptr = np.r_[0, np.cumsum(counts)]
    local = np.arange(len(keep)) - np.repeat(ptr[:-1], sizes)
    kept = Ragged(local[keep], new_ptr)
    matrices = tuple(m[np.ix_(kept.row(u), kept.row(v))] for (u, v), m in
                     zip(block.edges.tolist(), block.matrices, strict=True))
    lengths = block.usage.lengths
    usage_keep = keep[np.repeat(ptr[block.term_node], lengths) + ragged_arange(lengths)]
    usage = Ragged(block.usage.values[usage_keep], np.r_[0, np.cumsum(counts[block.term_node])])
    small = Block(Ragged(block.costs.values[keep], new_ptr), block.offset, block.edges, matrices, block.term_node,
                  usage, block.rows)
    return Restriction(small, kept)


class LiftedHooks:
    """Hooks of the whole block seen from a restriction: plans found are lifted, plans offered
    are lowered (dropped when they use a strategy left out), bounds are not passed on (the
    restricted model is no relaxation)."""

    def __init__(self, restriction: Restriction, hooks: Hooks) -> None:
        self.restriction, self.hooks = restriction, hooks

    def found(self, choice: np.ndarray, cost: float) -> None:
        self.hooks.found(self.restriction.lift(choice), cost)

    def offered(self) -> tuple[np.ndarray, float] | None:
        offered = self.hooks.offered()
        if offered is None:
            return None
        lowered = self.restriction.lower(offered[0])
        return None if lowered is None else (lowered, offered[1])

    def proved(self, bound: float) -> None:
        pass


def candidates_first(block: Block, score: np.ndarray, start: np.ndarray | None, until: float, hooks: Hooks,
                     rows: np.ndarray | None, per_node: int = CANDIDATES) -> np.ndarray | None:
    """Row generation on the restricted block until `until`; its best plan (of the whole block;
    None if it found none). Worth it only when the restriction is much smaller."""
    plans = () if start is None else (start,)
    restriction = restrict(block, score, plans, per_node)
    if restriction.block.sizes.sum() > SMALLER * block.sizes.sum():
        return None
    start_low = None if start is None else restriction.lower(start)
    out = solve_lazy(restriction.block, start_low, until, LiftedHooks(restriction, hooks), rows=rows)
    return None if out.choice is None else restriction.lift(out.choice)
