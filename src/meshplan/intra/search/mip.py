"""The MIP of a strategy (sub)problem as sparse arrays, solved by HiGHS with a warm start.

Block (nodes, edge matrices, memory terms over rows) -> MipModel (CSC matrix, bounds,
integrality) -> MipOutcome (choice, objective, bound).

Columns: s[v, i] binary per strategy (one_hot: sum_i s[v, i] = 1); per edge, after its row and
column minima moved into the node costs, e[p, q] in [0, 1] per (row class, column class) pair
of finite cost (classes: strategies with identical rows or columns), tied to s by
sum_q e[p, q] = sum_{i in p} s[u, i] and sum_p e[p, q] = sum_{j in q} s[v, j]; this forces e to
0/1 at integer s (a missing pair is forbidden). M[r] in [0, capacity[r]]: the memory chain of
`memory.chain_block`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sparse

from meshplan.intra.problem.arrays import Ragged
from meshplan.intra.problem.memory import MemoryRows, chain_block, row_loads
from meshplan.intra.program import LinearProgram
from meshplan.intra.solvers import COST_TARGET, power_of_two_scale, quiet_highs


@dataclass(frozen=True, slots=True)
class Block:
    """A strategy problem ready for the MIP (the whole reduced problem, or an LNS window).

    Attributes:
        costs: per node, its strategies' costs (finite).
        offset: constant cost added to every assignment.
        edges: (E, 2) node pairs; matrices: per edge its [k_u, k_v] cost matrix (inf = forbidden).
        term_node, usage: per memory term, its node and its usage per strategy.
        rows: memory rows with capacities and each term's row range.
    """

    costs: Ragged
    offset: float
    edges: np.ndarray
    matrices: tuple[np.ndarray, ...]
    term_node: np.ndarray
    usage: Ragged
    rows: MemoryRows

    @property
    def sizes(self) -> np.ndarray:
        return self.costs.lengths

    def cost_of(self, choice: np.ndarray) -> float:
        """Node and edge costs of an assignment of the block's nodes, plus its offset."""
        total = float(self.costs.values[self.costs.ptr[:-1] + choice].sum()) + self.offset
        for (u, v), m in zip(self.edges.tolist(), self.matrices, strict=True):
            total += float(m[choice[u], choice[v]])
        return total


@dataclass(frozen=True, slots=True)
class _EdgeVars:
    """Where an edge's pair variables are: e[p, q] column, and the class of each strategy."""

    u: int
    v: int
    row_class: np.ndarray
    col_class: np.ndarray
    column: np.ndarray  # [p, q] -> column, -1 where the pair is forbidden


@dataclass(frozen=True, slots=True)
class MipModel:
    """minimize offset + cost . x / cost_scale, row_lower <= A x <= row_upper, bounds, some x
    integer.

    Scaled for HiGHS's tolerances: contest costs reach 1e13 and usages 1e11, which left HiGHS
    warning of bad scaling and spending 15-24 s in presolve on IOPDDL's D; costs are scaled
    so the largest is about 1e6, memory columns and usages so the largest capacity is at most
    1e4 (by powers of two, which round nothing). Costs are scaled up as well: plans priced in
    seconds cost 1e-8..1e-4, below HiGHS's absolute tolerances (a gap of 1e-6, reduced costs of
    1e-7); unscaled, a conv net's plan 0.3 % above the optimum was reported optimal.
    `objective` undoes the cost scale.
    """

    block: Block
    cost: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    integer: np.ndarray
    matrix: sparse.csc_matrix
    row_lower: np.ndarray
    row_upper: np.ndarray
    offset: float
    s_ptr: np.ndarray  # node v's strategy columns are s_ptr[v] .. s_ptr[v + 1] - 1
    edge_vars: tuple[_EdgeVars, ...]
    first_m: int
    cost_scale: float = 1.0
    memory_scale: float = 1.0

    def objective(self, scaled: float) -> float:
        """The block's cost for a scaled objective value (HiGHS's objective or bound)."""
        return scaled / self.cost_scale + self.offset

    @property
    def num_cols(self) -> int:
        return len(self.cost)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)

    def start_values(self, choice: np.ndarray) -> np.ndarray:
        """The full column vector of an assignment (for a warm start)."""
        x = np.zeros(self.num_cols)
        x[self.s_ptr[:-1] + choice] = 1.0
        for ev in self.edge_vars:
            col = ev.column[ev.row_class[choice[ev.u]], ev.col_class[choice[ev.v]]]
            if col >= 0:
                x[col] = 1.0
        b = self.block
        use = b.usage.values[b.usage.ptr[:-1] + choice[b.term_node]] if len(b.term_node) else np.zeros(0)
        x[self.first_m:] = row_loads(b.rows, use) * self.memory_scale
        return x

    def choice(self, x: np.ndarray) -> np.ndarray:
        starts = self.s_ptr[:-1]
        return np.array([int(np.argmax(x[a:b])) for a, b in zip(starts, self.s_ptr[1:], strict=True)],
                        dtype=np.int64)

    def to_linear_program(self) -> LinearProgram:
        """The same program as a LinearProgram (for the CBC backend and LP-format dumps)."""
        lp = LinearProgram(offset=self.offset)
        for i in range(self.num_cols):
            lp.add_var(f"x{i}", float(self.cost[i] / self.cost_scale), float(self.lower[i]), float(self.upper[i]),
                       bool(self.integer[i]))
        rows = self.matrix.tocsr()
        for r in range(self.num_rows):
            a, b = rows.indptr[r], rows.indptr[r + 1]
            lp.add_row(dict(zip(rows.indices[a:b].tolist(), rows.data[a:b].tolist(), strict=True)),
                       float(self.row_lower[r]), float(self.row_upper[r]), "r")
        return lp


@dataclass(frozen=True, slots=True)
class EdgePart:
    """The columns and coupling rows of a block's nodes and edges, which do not depend on its
    memory rows (so a model re-built with other rows reuses them)."""

    cost: np.ndarray
    entries: tuple[np.ndarray, np.ndarray, np.ndarray]
    edge_vars: tuple[_EdgeVars, ...]
    s_ptr: np.ndarray
    num_rows: int


def edge_part(block: Block) -> EdgePart:
    """One-hot rows, node costs (with the edges' row and column minima) and edge pair columns."""
    sizes = block.sizes
    n_s = int(sizes.sum())
    s_ptr = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=s_ptr[1:])
    cost = [block.costs.values.copy()]
    entries = [(np.repeat(np.arange(len(sizes)), sizes), np.arange(n_s), np.ones(n_s))]  # one_hot rows
    n_rows, n_cols = len(sizes), n_s
    edge_vars = []
    for k, (u, v) in enumerate(block.edges):
        peeled = _peel(block.matrices[k])
        cost[0][s_ptr[u]:s_ptr[u + 1]] += peeled.row_min
        cost[0][s_ptr[v]:s_ptr[v + 1]] += peeled.col_min
        if peeled.residual is None:
            continue
        ev, e_cost, e_entries = _edge_columns(peeled, int(u), int(v), s_ptr, n_rows, n_cols)
        edge_vars.append(ev)
        cost.append(e_cost)
        entries.extend(e_entries)
        n_rows += len(peeled.row_members) + len(peeled.col_members)
        n_cols += len(e_cost)
    r, c, val = (np.concatenate([e[k] for e in entries]) for k in range(3))
    return EdgePart(np.concatenate(cost), (r, c, val), tuple(edge_vars), s_ptr, n_rows)


def edge_part_size(block: Block) -> tuple[int, int]:
    """(columns, rows) of `edge_part(block)`, without building its entries."""
    cols, rows = int(block.sizes.sum()), len(block.sizes)
    for matrix in block.matrices:
        peeled = _peel(matrix)
        if peeled.residual is not None:
            cols += int(np.isfinite(peeled.residual).sum())
            rows += len(peeled.row_members) + len(peeled.col_members)
    return cols, rows


def build_mip(block: Block, edges: EdgePart | None = None) -> MipModel:
    """Assemble the block's MIP (see the module docstring); `edges`: the block's `edge_part`,
    when already built for the same nodes and edges."""
    edges = edges or edge_part(block)
    sizes, s_ptr = block.sizes, edges.s_ptr
    n_s, n_rows, first_m = int(s_ptr[-1]), edges.num_rows, len(edges.cost)
    rows = block.rows
    term_var = (np.repeat(s_ptr[block.term_node], block.usage.lengths)
                + np.arange(len(block.usage.values)) - np.repeat(block.usage.ptr[:-1], block.usage.lengths))
    memory_scale = power_of_two_scale(rows.capacity, 1e4, up=False)
    chain = chain_block(rows, term_var, block.usage.ptr, block.usage.values * memory_scale, first_m)
    n_m = len(rows)
    lower = np.zeros(first_m + n_m)
    upper = np.concatenate([np.ones(first_m), rows.capacity * memory_scale])
    integer = np.zeros(first_m + n_m, dtype=bool)
    integer[:n_s] = True
    row_lower = np.concatenate([np.ones(len(sizes)), np.zeros(n_rows - len(sizes) + n_m)])
    r, c, val = (np.concatenate([edges.entries[k], part]) for k, part in
                 enumerate((chain.rows + n_rows, chain.cols, chain.values)))
    matrix = sparse.coo_matrix((val, (r, c)), shape=(n_rows + n_m, first_m + n_m)).tocsc()
    cost_scale = power_of_two_scale(edges.cost, COST_TARGET)
    return MipModel(block, np.concatenate([edges.cost * cost_scale, np.zeros(n_m)]), lower, upper, integer, matrix,
                    row_lower, row_lower.copy(), block.offset, s_ptr, edges.edge_vars, first_m, cost_scale,
                    memory_scale)


@dataclass(frozen=True, slots=True)
class _Peeled:
    row_min: np.ndarray
    col_min: np.ndarray
    residual: np.ndarray | None  # class-pair costs [p, q] (inf = forbidden); None: nothing left
    row_class: np.ndarray
    col_class: np.ndarray
    row_members: list[np.ndarray]
    col_members: list[np.ndarray]


def _peel(m: np.ndarray) -> _Peeled:
    """Move row then column minima out of an edge matrix and merge identical rows/columns."""
    row_min = m.min(axis=1)
    r = m - row_min[:, None]
    col_min = r.min(axis=0)
    r = r - col_min[None, :]
    if not r.any():
        return _Peeled(row_min, col_min, None, np.zeros(0, np.int64), np.zeros(0, np.int64), [], [])
    if np.isnan(r).any():  # a row or column forbidden throughout: NaN never equals itself
        rows, row_class = np.unique(r, axis=0, return_inverse=True)
        cols, col_class = np.unique(rows, axis=1, return_inverse=True)
        row_class, col_class = row_class.ravel(), col_class.ravel()
        return _Peeled(row_min, col_min, cols, row_class, col_class,
                       [np.flatnonzero(row_class == p) for p in range(cols.shape[0])],
                       [np.flatnonzero(col_class == q) for q in range(cols.shape[1])])
    rows, row_class, row_members = _distinct_rows(r)
    cols_t, col_class, col_members = _distinct_rows(rows.T)
    return _Peeled(row_min, col_min, cols_t.T, row_class, col_class, row_members, col_members)


def _distinct_rows(m: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """`np.unique(m, axis=0, return_inverse=True)` (distinct rows in lexicographic order, each
    row's class) and each class's rows, for NaN-free `m`: with Python tuples, which order floats
    as NumPy's structured sort does, several times faster on the small matrices of edges."""
    keys = list(map(tuple, m.tolist()))
    distinct = sorted(set(keys))
    rank = {key: i for i, key in enumerate(distinct)}
    inverse = np.fromiter((rank[key] for key in keys), dtype=np.intp, count=len(keys))
    members: list[list[int]] = [[] for _ in distinct]
    for i, key in enumerate(keys):
        members[rank[key]].append(i)
    return (np.array(distinct, dtype=m.dtype).reshape(len(distinct), m.shape[1]), inverse,
            [np.array(found, dtype=np.intp) for found in members])


def _edge_columns(peeled: _Peeled, u: int, v: int, s_ptr: np.ndarray, row0: int, col0: int):
    """Columns e[p, q] of one edge and the entries of its row and column coupling rows."""
    res = peeled.residual
    finite = np.isfinite(res)
    column = np.full(res.shape, -1, dtype=np.int64)
    column[finite] = col0 + np.arange(int(finite.sum()))
    e_cost = res[finite]
    p_idx, q_idx = np.nonzero(finite)
    n_p = res.shape[0]
    # row p: sum_q e[p, q] - sum_{i in p} s[u, i] = 0 ; row n_p + q: sum_p e[p, q] - sum_{j in q} s[v, j] = 0
    e_cols = column[p_idx, q_idx]
    r = [row0 + p_idx, row0 + n_p + q_idx, row0 + peeled.row_class, row0 + n_p + peeled.col_class]
    c = [e_cols, e_cols, s_ptr[u] + np.arange(len(peeled.row_class)), s_ptr[v] + np.arange(len(peeled.col_class))]
    val = [np.ones(len(e_cols)), np.ones(len(e_cols)), -np.ones(len(peeled.row_class)),
           -np.ones(len(peeled.col_class))]
    entries = [(np.concatenate(r), np.concatenate(c), np.concatenate(val))]
    return _EdgeVars(u, v, peeled.row_class, peeled.col_class, column), e_cost, entries


@dataclass(frozen=True, slots=True)
class MipOutcome:
    """What HiGHS returned: an assignment (None if none found), its objective, the bound."""

    choice: np.ndarray | None
    objective: float | None
    bound: float | None
    optimal: bool
    infeasible: bool
    wall_s: float


# relative (costs in seconds are 1e-8..1e-4): how far HiGHS's objective and its values' cost may differ
_VALUES_RTOL = 1e-6


def solve_mip(model: MipModel, time_limit: float, start: np.ndarray | None = None, mip_gap: float = 0.0,
              threads: int = 1) -> MipOutcome:
    """Solve with HiGHS; `start` (an assignment of the block) is passed as the incumbent.

    HiGHS 1.16 can report a better objective than the start's yet return the start's column
    values (seen when presolve alone solves the model); the values are checked against the
    objective, and on a mismatch the model is solved again without the start.
    """
    begin = time.perf_counter()
    outcome, values = _run_highs(model, time_limit, start, mip_gap, threads)
    if start is not None and values is not None and outcome.objective is not None:
        found = model.objective(_dot(model.cost, values))
        if abs(found - outcome.objective) > _VALUES_RTOL * abs(outcome.objective):
            remaining = time_limit - (time.perf_counter() - begin)
            retry, retry_values = _run_highs(model, max(remaining, 0.5), None, mip_gap, threads)
            if retry.choice is not None and abs(model.objective(_dot(model.cost, retry_values))
                                                - retry.objective) <= _VALUES_RTOL * abs(retry.objective):
                outcome = retry
            else:  # keep the start, whose cost is known; the bound still holds
                outcome = MipOutcome(start.copy(), found, outcome.bound, False, False, outcome.wall_s)
    return MipOutcome(outcome.choice, outcome.objective, outcome.bound, outcome.optimal, outcome.infeasible,
                      time.perf_counter() - begin)


def _run_highs(model: MipModel, time_limit: float, start: np.ndarray | None, mip_gap: float,
               threads: int) -> tuple[MipOutcome, np.ndarray | None]:
    import highspy

    begin = time.perf_counter()
    h = quiet_highs()
    h.setOptionValue("time_limit", max(float(time_limit), 0.01))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    h.setOptionValue("threads", int(threads))
    h.setOptionValue("primal_feasibility_tolerance", 1e-9)
    h.setOptionValue("presolve", "off")  # slow on these models, see lazy_rows
    h.passModel(_highs_lp(highspy, model))
    if start is not None:
        h.setSolution(len(model.cost), np.arange(len(model.cost), dtype=np.int32), model.start_values(start))
    h.run()
    wall = time.perf_counter() - begin
    info, status = h.getInfo(), h.getModelStatus()
    ms = highspy.HighsModelStatus
    if status == ms.kInfeasible:
        return MipOutcome(None, None, None, False, True, wall), None
    bound = model.objective(info.mip_dual_bound) if np.isfinite(info.mip_dual_bound) else None
    if info.primal_solution_status != 2:  # no feasible solution
        return MipOutcome(None, None, bound, False, False, wall), None
    x = np.asarray(h.getSolution().col_value)
    objective = model.objective(info.objective_function_value)
    return MipOutcome(model.choice(x), objective, bound, status == ms.kOptimal, False, wall), x


def _dot(cost: np.ndarray, values: np.ndarray) -> float:
    """cost . values over the nonzero values (a forbidden strategy's infinite cost times 0 is 0)."""
    used = values != 0
    return float(cost[used] @ values[used])


def _highs_lp(highspy, model: MipModel):
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = model.num_cols, model.num_rows
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = model.cost, model.lower, model.upper
    lp.row_lower_, lp.row_upper_ = model.row_lower, model.row_upper
    a = model.matrix
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = a.indptr.astype(np.int32)
    lp.a_matrix_.index_ = a.indices.astype(np.int32)
    lp.a_matrix_.value_ = a.data.astype(np.float64)
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = model.num_cols, model.num_rows
    kinds = (highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger)
    lp.integrality_ = [kinds[k] for k in model.integer.tolist()]
    return lp
