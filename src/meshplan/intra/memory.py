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

from meshplan.intra.problem import step_profile


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
    delta = np.zeros(len(rows) + 1)
    covers = rows.first <= rows.last
    np.add.at(delta, rows.first[covers], term_use[covers])
    np.add.at(delta, rows.last[covers] + 1, -term_use[covers])
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
