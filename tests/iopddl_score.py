"""An independent scorer of IOPDDL solutions, written from the format description alone.

It reads the raw JSON object (no meshplan code): a solution's cost is the sum of the chosen
node costs and of the chosen entries of every edge's row-major matrix; it is infeasible when a
chosen cost is 10^18 or more, or when at some time point the usages of the nodes live then
(half-open intervals [lo, hi)) add up to more than the usage limit.
"""

from __future__ import annotations

import gzip
import json

FORBIDDEN_AT = 10**18


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        return json.load(handle)["problem"]


def score(problem: dict, solution: list[int]) -> tuple[int, bool]:
    """(cost, feasible) of a solution: one strategy index per node."""
    nodes, edges = problem["nodes"], problem["edges"]
    assert len(solution) == len(nodes["costs"])
    cost, feasible = 0, True
    for node, s in enumerate(solution):
        c = nodes["costs"][node][s]
        feasible &= c < FORBIDDEN_AT
        cost += c
    for (u, v), matrix in zip(edges["nodes"], edges["costs"], strict=True):
        c = matrix[solution[u] * len(nodes["costs"][v]) + solution[v]]
        feasible &= c < FORBIDDEN_AT
        cost += c
    return cost, feasible and peak_usage(problem, solution) <= problem["usage_limit"]


def peak_usage(problem: dict, solution: list[int]) -> int:
    nodes = problem["nodes"]
    events: dict[int, int] = {}
    for node, interval in enumerate(nodes["intervals"]):
        if len(interval) == 2 and interval[0] < interval[1]:
            use = nodes["usages"][node][solution[node]]
            events[interval[0]] = events.get(interval[0], 0) + use
            events[interval[1]] = events.get(interval[1], 0) - use
    peak = level = 0
    for t in sorted(events):
        level += events[t]
        peak = max(peak, level)
    return peak
