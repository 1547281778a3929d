"""Build the intra-op ILP from a StrategyGraph (StrategyGraph -> LinearProgram + variable map).

Families of variables and constraints:
- s[g, i] binary: group g takes choice i; one_hot: sum_i s[g, i] = 1.
- e[a, b, p, q] continuous in [0, 1]: edge a-b takes (row class p, column class q);
  edge_row / edge_col tie them to s, which forces them to 0/1 (see NOTES: no binaries needed).
- mem_params continuous: bytes of all parameters (live at every point); memory: per live set,
  local bytes of live values + mem_params <= budget.
- alias: a parameter and its update take equal specs.
Repeated layers may share variables (`canon` maps a group to the group whose variables it
uses); shared edges add their cost matrices together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from meshplan.intra.program import LinearProgram
from meshplan.intra.strategy_graph import StrategyGraph, dominated_choices
from meshplan.ir.node import OpKind


@dataclass(slots=True)
class VariableMap:
    """Where each group's choice lives in the program."""

    canon: dict[int, int]
    s: dict[int, list[int]]  # canonical group -> its variables (empty for one-choice groups)
    excluded: dict[int, set[int]] = field(default_factory=dict)  # choices fixed to 0

    def alive(self, group: int, size: int) -> list[int]:
        bad = self.excluded.get(self.canon[group], set())
        return [i for i in range(size) if i not in bad]

    def choice(self, group: int, values) -> int:
        variables = self.s[self.canon[group]]
        return int(np.argmax([values[v] for v in variables])) if variables else 0


class _Expr:
    """Linear expressions over choices: (group, choice) -> variable or the constant 1."""

    def __init__(self, lp: LinearProgram, vm: VariableMap) -> None:
        self.lp, self.vm = lp, vm

    def add(self, terms: dict[int, float], group: int, choice: int, coef: float) -> float:
        """Add coef * s[group, choice] to `terms`; return the constant part it contributes."""
        variables = self.vm.s[self.vm.canon[group]]
        if not variables:
            return coef if choice == 0 else 0.0
        terms[variables[choice]] = terms.get(variables[choice], 0.0) + coef
        return 0.0


def build_ilp(sg: StrategyGraph, budget: float | None, canon: dict[int, int] | None = None,
              minimize_memory: bool = False) -> tuple[LinearProgram, VariableMap]:
    """The ILP of `sg` under a per-device memory `budget` (None: no memory constraint).

    With `minimize_memory`, costs are dropped and the program minimizes the peak memory
    instead (it finds the smallest budget that any plan meets).
    """
    canon = canon or {g: g for g in sg.groups}
    lp = LinearProgram()
    vm = VariableMap(canon, {})
    for g in sg.groups:
        c = canon[g]
        if c in vm.s:
            continue
        n = sg.size(c)
        vm.s[c] = [lp.add_var(f"s_{c}_{i}", integer=True) for i in range(n)] if n > 1 else []
        if n > 1:
            lp.add_row({v: 1.0 for v in vm.s[c]}, 1.0, 1.0, "one_hot")
    expr = _Expr(lp, vm)
    excluded: dict[int, set[int]] = {}
    for g, bad in sg.forbidden.items():
        excluded.setdefault(canon[g], set()).update(bad)
    if not minimize_memory:
        for c, bad in dominated_choices(sg, canon, excluded).items():
            excluded.setdefault(c, set()).update(bad)
    for c, bad in excluded.items():
        for i in bad:
            if vm.s[c]:
                lp.upper[vm.s[c][i]] = 0.0
    vm.excluded = excluded
    if not minimize_memory:
        _add_node_costs(sg, lp, expr)
        _add_edges(sg, lp, vm, expr)
    _add_aliases(sg, lp, expr)
    if budget is not None or minimize_memory:
        _add_memory(sg, lp, expr, budget, minimize_memory)
    return lp, vm


def _add_linear(lp: LinearProgram, expr: _Expr, group: int, costs: np.ndarray) -> None:
    terms: dict[int, float] = {}
    for i, cost in enumerate(costs):
        if cost:
            lp.offset += expr.add(terms, group, i, float(cost))
    for v, coef in terms.items():
        lp.cost[v] += coef


def _add_node_costs(sg: StrategyGraph, lp: LinearProgram, expr: _Expr) -> None:
    for g in sg.groups:
        _add_linear(lp, expr, g, sg.compute[g] + sg.communication[g] + sg.resharding[g])


def _add_edges(sg: StrategyGraph, lp: LinearProgram, vm: VariableMap, expr: _Expr) -> None:
    merged: dict[tuple[int, int], np.ndarray] = {}
    for (a, b), matrix in sg.edges.items():
        ca, cb = vm.canon[a], vm.canon[b]
        if ca == cb:  # both ends share one decision: only the diagonal can occur
            _add_linear(lp, expr, a, np.diag(matrix).copy())
            continue
        key, m = ((ca, cb), matrix) if ca < cb else ((cb, ca), matrix.T)
        merged[key] = merged[key] + m if key in merged else m.copy()
    for (a, b), matrix in merged.items():
        _add_edge(lp, vm, expr, a, b, matrix)


def _add_edge(lp: LinearProgram, vm: VariableMap, expr: _Expr, a: int, b: int, matrix: np.ndarray) -> None:
    rows_alive, cols_alive = vm.alive(a, matrix.shape[0]), vm.alive(b, matrix.shape[1])
    matrix = matrix[np.ix_(rows_alive, cols_alive)]
    # Peel off what depends on one end only: those parts are linear in that end's choice.
    row_min = matrix.min(axis=1)
    matrix = matrix - row_min[:, None]
    col_min = matrix.min(axis=0)
    matrix = matrix - col_min[None, :]
    _add_linear(lp, expr, a, _spread(row_min, rows_alive, len(vm.s[vm.canon[a]]) or 1))
    _add_linear(lp, expr, b, _spread(col_min, cols_alive, len(vm.s[vm.canon[b]]) or 1))
    if not matrix.any():
        return
    # Choices with identical cost rows (columns) are interchangeable on this edge.
    row_classes = [[rows_alive[i] for i in cls] for cls in _classes(matrix)]
    col_classes = [[cols_alive[j] for j in cls] for cls in _classes(matrix.T)]
    matrix = _expand(matrix, rows_alive, cols_alive)
    e: dict[tuple[int, int], int] = {}
    for p, rows in enumerate(row_classes):
        for q, cols in enumerate(col_classes):
            e[p, q] = lp.add_var(f"e_{a}_{b}_{p}_{q}", cost=float(matrix[rows[0], cols[0]]))
    for p, rows in enumerate(row_classes):
        terms = {e[p, q]: 1.0 for q in range(len(col_classes))}
        constant = sum(expr.add(terms, a, i, -1.0) for i in rows)
        lp.add_row(terms, -constant, -constant, "edge_row")
    for q, cols in enumerate(col_classes):
        terms = {e[p, q]: 1.0 for p in range(len(row_classes))}
        constant = sum(expr.add(terms, b, j, -1.0) for j in cols)
        lp.add_row(terms, -constant, -constant, "edge_col")


def _spread(values: np.ndarray, alive: list[int], size: int) -> np.ndarray:
    """Values over the alive choices, placed back at their indices (0 elsewhere)."""
    out = np.zeros(size)
    out[alive] = values
    return out


def _expand(matrix: np.ndarray, rows: list[int], cols: list[int]) -> np.ndarray:
    out = np.zeros((max(rows) + 1, max(cols) + 1))
    out[np.ix_(rows, cols)] = matrix
    return out


def _classes(matrix: np.ndarray) -> list[list[int]]:
    seen: dict[bytes, list[int]] = {}
    for i, row in enumerate(matrix):
        seen.setdefault(row.tobytes(), []).append(i)
    return list(seen.values())


def _add_aliases(sg: StrategyGraph, lp: LinearProgram, expr: _Expr) -> None:
    for a, b, equal in sg.aliases:
        for i in range(equal.shape[0]):
            terms: dict[int, float] = {}
            constant = expr.add(terms, a, i, 1.0)
            for j in np.flatnonzero(equal[i]):
                constant += expr.add(terms, b, int(j), -1.0)
            lp.add_row(terms, float("-inf"), -constant, "alias")


def _add_memory(sg: StrategyGraph, lp: LinearProgram, expr: _Expr, budget: float | None,
                minimize_memory: bool) -> None:
    graph = sg.graph
    # Parameters held for the whole step are live at every point: count them once, in one
    # auxiliary variable. Under Alpa's liveness they are ordinary values of the live sets.
    params = {n.id for n in graph.nodes if n.kind is OpKind.PARAMETER} if sg.model.parameters_held else set()
    mem_params = lp.add_var("mem_params", upper=float("inf"))
    terms: dict[int, float] = {mem_params: 1.0}
    constant = 0.0
    for v in params:
        for i, m in enumerate(sg.memory(v)):
            constant += expr.add(terms, sg.leader[v], i, -float(m))
    lp.add_row(terms, -constant, -constant, "mem_params")
    peak = lp.add_var("peak_memory", cost=1.0, upper=float("inf")) if minimize_memory else None
    for live in _dominant_sets([s - params for s in sg.live_sets]):
        terms = {mem_params: 1.0}
        constant = 0.0
        for v in live:
            for i, m in enumerate(sg.memory(v)):
                if m:
                    constant += expr.add(terms, sg.leader[v], i, float(m))
        if peak is not None:
            terms[peak] = -1.0
            lp.add_row(terms, float("-inf"), -constant, "memory")
        else:
            lp.add_row(terms, float("-inf"), budget - constant, "memory")


def _dominant_sets(sets: list[frozenset[int]]) -> list[frozenset[int]]:
    """Drop live sets contained in a neighbour's: their memory rows can never bind first."""
    kept: list[frozenset[int]] = []
    for t, live in enumerate(sets):
        if t + 1 < len(sets) and live <= sets[t + 1]:
            continue
        if kept and live <= kept[-1]:
            continue
        kept.append(live)
    return kept
