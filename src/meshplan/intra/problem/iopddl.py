"""The IOPDDL contest format (JSON, optionally gzipped) -> StrategyProblem, and solutions back.

`problem.nodes.intervals[i]` is node i's half-open live range, `nodes.costs[i][s]` and
`nodes.usages[i][s]` its strategies' costs and memory usages; `edges.nodes[e]` is a node pair
and `edges.costs[e]` its cost matrix flattened row-major; `usage_limit` bounds the summed usage
at every time point. A cost of 10^18 or more marks a forbidden choice.
"""

from __future__ import annotations

import gzip
import itertools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from meshplan.files import write_json_atomic
from meshplan.intra.problem.arrays import (
    FORBIDDEN,
    MemoryTerms,
    ProblemError,
    Ragged,
    StrategyProblem,
    strategy_problem,
)

FORBIDDEN_AT = 10**18


def read_iopddl(path: str | Path) -> StrategyProblem:
    """Read an IOPDDL problem file (`.json` or `.json.gz`).

    Raises:
        ProblemError: the file is missing, is not JSON, or does not follow the format.
    """
    path = Path(path)
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as handle:
            data = _parse_json(handle.read())
    except FileNotFoundError:
        raise ProblemError(f"no problem file {str(path)!r}") from None
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as exc:  # JSON errors are ValueErrors
        raise ProblemError(f"not an IOPDDL problem (JSON, optionally gzipped): {exc} in {str(path)!r}") from None
    return problem_from_iopddl(data, default_name=path.name.split(".")[0])


def _parse_json(raw: bytes) -> Any:
    """orjson when installed (1.5 instead of 2.1 CPU seconds on D's 145 MB), else the standard library."""
    try:
        import orjson
    except ImportError:
        return json.loads(raw)
    return orjson.loads(raw)


def problem_from_iopddl(data: Any, default_name: str = "problem") -> StrategyProblem:
    """Convert the parsed JSON object of an IOPDDL problem."""
    try:
        p = data["problem"]
        nodes, edges = p["nodes"], p.get("edges", {"nodes": [], "costs": []})
        costs, usages, intervals = nodes["costs"], nodes["usages"], nodes["intervals"]
        pairs, matrices, limit = edges["nodes"], edges["costs"], p.get("usage_limit")
    except (KeyError, TypeError) as exc:
        raise ProblemError(f"not an IOPDDL problem: missing field {exc}; expected problem.nodes.{{costs, usages, "
                           "intervals}}, problem.edges.{nodes, costs}, problem.usage_limit") from None
    name = str(p.get("name", default_name))
    try:
        if _all_lists(costs, usages, intervals, pairs, matrices):
            return _fast(costs, usages, intervals, pairs, matrices, limit, name)
    except (TypeError, ValueError):
        pass  # malformed somewhere: let the validating constructor say where
    return strategy_problem(_forbid(costs), usages=usages, intervals=intervals, edges=pairs,
                            edge_costs=_forbid(matrices), usage_limit=limit, name=name)


def _all_lists(*fields) -> bool:
    return all(isinstance(f, list) and all(isinstance(x, list) for x in f) for f in fields)


def _forbid(rows: list) -> list[np.ndarray]:
    out = []
    for row in rows:
        a = np.asarray(row, dtype=np.float64)
        a[a >= FORBIDDEN_AT] = FORBIDDEN
        out.append(a)
    return out


def _ragged(rows: list[list], forbid: bool = True) -> Ragged:
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    ptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=ptr[1:])
    values = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.float64, count=int(ptr[-1]))
    if forbid:
        values[values >= FORBIDDEN_AT] = FORBIDDEN
    return Ragged(values, ptr)


def _fast(costs, usages, intervals, pairs, matrices, limit, name: str) -> StrategyProblem:
    """The common case (well-formed lists) without per-row Python validation; checked in bulk."""
    cost, usage = _ragged(costs), _ragged(usages, forbid=False)
    edge_costs = _ragged(matrices)
    if len(costs) != len(usages) or len(costs) != len(intervals) or not np.array_equal(cost.ptr, usage.ptr):
        raise ValueError("node fields disagree")
    edge_nodes = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    sizes = cost.lengths
    n = len(sizes)
    if len(edge_nodes) != len(edge_costs) or (edge_nodes < 0).any() or (edge_nodes >= n).any():
        raise ValueError("edge fields disagree")
    if (edge_nodes[:, 0] == edge_nodes[:, 1]).any() or (sizes == 0).any():
        raise ValueError("self edge or empty node")
    if not np.array_equal(edge_costs.lengths, sizes[edge_nodes[:, 0]] * sizes[edge_nodes[:, 1]]):
        raise ValueError("edge matrix sizes")
    if (np.isnan(cost.values).any() or (cost.values < 0).any() or (edge_costs.values < 0).any()
            or np.isnan(usage.values).any() or (usage.values < 0).any()):
        raise ValueError("negative cost")
    live = np.array([iv if len(iv) == 2 else (0, 0) for iv in intervals], dtype=np.int64).reshape(-1, 2)
    terms = np.flatnonzero(live[:, 0] < live[:, 1])
    memory = MemoryTerms(terms, live[terms, 0], live[terms, 1], _select_rows(usage, terms))
    if limit is not None and not float(limit) >= 0:
        raise ValueError("limit")
    return StrategyProblem(cost, edge_nodes, edge_costs, memory, None if limit is None else float(limit), name)


def _select_rows(r: Ragged, rows: np.ndarray) -> Ragged:
    lengths = r.lengths[rows]
    ptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=ptr[1:])
    index = np.repeat(r.ptr[rows] - ptr[:-1], lengths) + np.arange(ptr[-1])
    return Ragged(r.values[index], ptr)


def solution_to_json(problem: StrategyProblem, solution) -> dict[str, Any]:
    """A solution file: the chosen strategy per node (None: no plan), its cost and how it was found."""
    choice = None if solution.choice is None else [int(s) for s in solution.choice]
    return {"problem": problem.name, "solution": choice, "cost": solution.cost,
            "status": solution.status.value, "bound": solution.bound, "gap": solution.gap,
            "wall_s": solution.wall_s, "stats": solution.stats}


class SolutionWriter:
    """Keeps a solution file up to date while a search runs, so that an interrupted or killed
    run leaves its last good plan behind: every better plan is written (atomically) unless
    one was written less than `every` seconds ago; `flush` writes the one held back."""

    def __init__(self, path: str | Path, problem: StrategyProblem, every: float = 1.0) -> None:
        self.path, self.problem, self.every = path, problem, every
        self.held: tuple[np.ndarray, float] | None = None
        self.written_at = -np.inf
        self.start = time.perf_counter()
        self.pending = False

    def plan(self, choice: np.ndarray, cost: float) -> None:
        """A better feasible plan (one strategy per node of the problem) and its cost."""
        self.held, self.pending = (choice.copy(), float(cost)), True
        if time.perf_counter() - self.written_at >= self.every:
            self.flush("feasible")

    def flush(self, status: str) -> bool:
        """Write the plan held back, if any; whether a plan is on disk."""
        if self.held is not None and self.pending:
            choice, cost = self.held
            write_json_atomic(self.path, {"problem": self.problem.name, "solution": [int(s) for s in choice],
                                          "cost": cost, "status": status, "bound": None, "gap": None,
                                          "wall_s": time.perf_counter() - self.start, "stats": {}})
            self.written_at, self.pending = time.perf_counter(), False
        return self.held is not None
