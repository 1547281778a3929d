"""Compact memory constraints: usage terms over time -> rows only where the live set peaks.

A time point needs a row only if it can hold the most usage among its neighbours: the live
set only grows where a term starts, so every point's live set is contained in the one at the
latest start before it, and a start followed by another start with no end between is
contained in the later one. Rows are therefore the starts that are followed by an end.

Each term covers a contiguous range of rows, so the summed usage at row r is written as a
chain: M[r] = M[r-1] + (usage of terms entering at r) - (usage of terms that left after
r-1), with M[r] <= capacity[r]. That is two nonzeros per (term, strategy) instead of one per
(term, strategy, row it covers), built with NumPy as COO arrays, no Python object per nonzero.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.intra.problem.arrays import step_profile


@dataclass(frozen=True, slots=True)
class MemoryRows:
    """Rows of the memory constraint.

    Attributes:
        points: the time point of each row.
        capacity: the usage the varying terms may add at each row (limit minus the base).
        first, last: per term, the first and last row it covers (last < first: it covers none).
    """

    points: np.ndarray
    capacity: np.ndarray
    first: np.ndarray
    last: np.ndarray

    def __len__(self) -> int:
        return len(self.points)


def memory_rows(lo: np.ndarray, hi: np.ndarray, base: tuple[np.ndarray, np.ndarray, np.ndarray],
                limit: float) -> MemoryRows:
    """Rows for terms [lo, hi) over a constant base usage (base terms: lo, hi, amount)."""
    all_lo = np.concatenate([lo, base[0]])
    all_hi = np.concatenate([hi, base[1]])
    points = _peak_points(all_lo, all_hi)
    change, level = step_profile(base[0], base[1], base[2])
    at = np.searchsorted(change, points, side="right") - 1
    base_load = np.where(at >= 0, level[np.maximum(at, 0)], 0.0) if len(change) else np.zeros(len(points))
    first = np.searchsorted(points, lo, side="left")
    last = np.searchsorted(points, hi, side="left") - 1
    return MemoryRows(points, limit - base_load, first, last)


def _peak_points(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Start points followed by an end before the next start."""
    starts = np.unique(lo)
    if len(starts) == 0:
        return starts
    ends = np.sort(hi)
    # An end e (exclusive) removes a term after point e - 1; it separates starts s < e <= s'.
    nxt = np.r_[starts[1:], np.iinfo(np.int64).max]
    k = np.searchsorted(ends, starts, side="right")  # first end > s
    has_end = (k < len(ends)) & (ends[np.minimum(k, len(ends) - 1)] <= nxt)
    return starts[has_end]


def row_loads(rows: MemoryRows, term_use: np.ndarray) -> np.ndarray:
    """Summed usage per row when term t holds term_use[t]."""
    covers = rows.first <= rows.last
    used = term_use[covers]
    n = len(rows) + 1
    delta = (np.bincount(rows.first[covers], weights=used, minlength=n)
             - np.bincount(rows.last[covers] + 1, weights=used, minlength=n))
    return np.cumsum(delta[:-1])


@dataclass(frozen=True, slots=True)
class ChainBlock:
    """The memory constraint as sparse columns: entries (row, column, value) of the equalities
    M[r] - M[r-1] - entering + leaving = 0; M[r] are extra columns bounded by the capacities."""

    rows: np.ndarray
    cols: np.ndarray
    values: np.ndarray


def chain_block(rows: MemoryRows, term_var: np.ndarray, term_ptr: np.ndarray, usage: np.ndarray,
                first_m: int) -> ChainBlock:
    """Entries of the chain equalities.

    Args:
        rows: the memory rows (capacity, and each term's first/last row).
        term_var: per (term, strategy) entry, the program column of that strategy's variable
            (-1: the strategy is fixed to zero and needs no entry).
        term_ptr: term t's entries are term_var[term_ptr[t]:term_ptr[t+1]].
        usage: the usage of each (term, strategy) entry.
        first_m: the column of M[0]; M[r] is column first_m + r.
    """
    n_rows = len(rows)
    counts = np.diff(term_ptr)
    first = np.repeat(rows.first, counts)
    leave = np.repeat(rows.last + 1, counts)
    keep = (term_var >= 0) & (usage != 0) & (first <= leave - 1)
    enter_r, leave_r = first[keep], leave[keep]
    var, use = term_var[keep], usage[keep]
    inside = leave_r < n_rows  # terms reaching the last row never leave
    m_rows = np.arange(n_rows)
    r = np.concatenate([m_rows, m_rows[1:], enter_r, leave_r[inside]])
    c = np.concatenate([first_m + m_rows, first_m + m_rows[:-1], var, var[inside]])
    v = np.concatenate([np.ones(n_rows), -np.ones(max(n_rows - 1, 0)), -use, use[inside]])
    return ChainBlock(r, c, v)


@dataclass(frozen=True, slots=True)
class TermIndex:
    """Memory terms against a problem's flat strategy array, for vectorized search.

    Attributes:
        rows: the memory rows.
        node: per term, its node; start: per term, where its usages start in `usage`.
        usage: per (term, strategy) entry, the usage; flat: that strategy's flat index.
        num_flat: the number of flat strategies of the problem.
    """

    rows: MemoryRows
    node: np.ndarray
    start: np.ndarray
    usage: np.ndarray
    flat: np.ndarray
    num_flat: int

    @property
    def covers(self) -> np.ndarray:
        return self.rows.first <= self.rows.last

    def term_use(self, choice: np.ndarray) -> np.ndarray:
        return self.usage[self.start + choice[self.node]] if len(self.node) else np.zeros(0)

    def loads(self, choice: np.ndarray) -> np.ndarray:
        """Summed usage per row under `choice`."""
        return row_loads(self.rows, self.term_use(choice))

    def prices(self, lam: np.ndarray) -> np.ndarray:
        """Per flat strategy: its usage times the price of every row it covers."""
        rows = self.rows
        prefix = np.concatenate([[0.0], np.cumsum(lam)])
        per_term = np.where(self.covers, prefix[rows.last + 1] - prefix[np.minimum(rows.first, len(rows))], 0.0)
        lengths = np.diff(np.r_[self.start, len(self.usage)])
        return np.bincount(self.flat, weights=self.usage * np.repeat(per_term, lengths), minlength=self.num_flat)

    def touching(self, row_mask: np.ndarray) -> np.ndarray:
        """Per term, whether it covers any row in `row_mask`."""
        rows = self.rows
        prefix = np.concatenate([[0], np.cumsum(row_mask)])
        return self.covers & (prefix[rows.last + 1] - prefix[np.minimum(rows.first, len(rows))] > 0)


def term_index(rows: MemoryRows, node: np.ndarray, usages, costs_ptr: np.ndarray) -> TermIndex:
    """Index the memory terms (`node`, `usages`: a Ragged per term) of a problem whose node v's
    flat strategies start at costs_ptr[v]."""
    lengths = usages.lengths
    local = np.arange(len(usages.values)) - np.repeat(usages.ptr[:-1], lengths)
    flat = np.repeat(costs_ptr[node], lengths) + local
    return TermIndex(rows, node, usages.ptr[:-1].copy(), usages.values, flat, int(costs_ptr[-1]))


def row_subset(rows: MemoryRows, selected: np.ndarray) -> MemoryRows:
    """The rows `selected` (indices) alone: a relaxation of the memory constraint. Each term
    covers the selected rows inside its range (none when first > last)."""
    selected = np.sort(np.asarray(selected, dtype=np.int64))
    first = np.searchsorted(selected, rows.first, side="left")
    last = np.searchsorted(selected, rows.last, side="right") - 1
    return MemoryRows(rows.points[selected], rows.capacity[selected], first, last)


def peak_rows(excess: np.ndarray, count: int) -> np.ndarray:
    """Up to `count` violated rows, largest excess first, skipping rows next to one already
    taken (neighbouring rows share most of their terms, so one of them stands for the rest)."""
    violated = np.flatnonzero(excess > 0)
    spacing = max(1, len(excess) // (8 * count))
    taken: list[int] = []
    for r in violated[np.argsort(-excess[violated], kind="stable")].tolist():
        if all(abs(r - t) > spacing for t in taken):
            taken.append(r)
            if len(taken) == count:
                break
    return np.array(taken, dtype=np.int64)
