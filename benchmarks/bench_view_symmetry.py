"""Why the (4, 2, 2) view of a 2 x 8 sub-mesh is slow to price, and what exact symmetry breaking
does about it. One transformer block of the ndmesh job (GPT-3 1.3B, 32k tokens, 4 nodes of 8
A100, micro-batch 2) on the 3-D views of a 2 x 8 sub-mesh:

- plain: the planner's problem solved as the planner solves it (30 s limit);
- mirrors: how many strategies lack a mirror image under swapping the two in-node axes of 2
  (multi-axis splits keep ascending axis order), and how many resharding entries differ when the
  mirrors are re-sorted (so no exact mirror pruning exists on the planner's lists);
- closed: the lists closed under the swap (each missing mirror added with its strategy's costs,
  collectives relabelled), checked exactly symmetric, then solved with one lex-leader cut (the
  second of every mirror pair forbidden at one node, which keeps the optimum);
- fixing: strategies left by reduced-cost fixing with the message-passing bound (a strategy
  whose bound with it chosen exceeds the best plan cannot be optimal) and the MIP columns left.

Also the pricing tasks of the four planner-time jobs of bench_scale.py with 2-D and 3-D views.
Writes benchmarks/results/view_symmetry.json. Run: python benchmarks/bench_view_symmetry.py
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import replace

import numpy as np

from meshplan.cluster import Cluster, get_device
from meshplan.intra.layers import shared_groups
from meshplan.intra.problem.arrays import FORBIDDEN, Ragged
from meshplan.intra.problem.graph_problem import graph_problem
from meshplan.intra.problem.presolve import presolve
from meshplan.intra.search.dual import EdgeDual
from meshplan.intra.search.pairwise import pairwise_index
from meshplan.intra.search.problem_solver import ProblemOptions, solve_problem
from meshplan.intra.strategy_graph import build_strategy_graph
from meshplan.models.transformer import PRESETS
from meshplan.sharding.enumerate import enumerate_strategies
from meshplan.sharding.spec import ShardingSpec
from meshplan.simulator import PlannerOptions, TrainingJob
from meshplan.simulator.planner import auto_view_tasks, planned_microbatch_sizes
from meshplan.simulator.pricing import piece_graphs, piece_options, piece_pricing, planner_views

from common import save

SWAP = {1: 2, 2: 1}  # the two in-node axes of 2 of (4, 2, 2)
SCALE_JOBS = (("llama2-13b", 50, 4, "v100-32gb", 1000, 4096), ("llama2-70b", 128, 8, "a100-80gb", 1024, 4096),
              ("llama3.1-405b", 288, 8, "h100-80gb", 2304, 8192), ("mixtral-8x7b", 4, 8, "h100-80gb", 256, 4096))


def main() -> None:
    warnings.simplefilter("ignore")
    job = TrainingJob(PRESETS["gpt3-1.3b"], global_batch=2, seq_len=32768)
    cluster = Cluster(4, 8, get_device("a100-80gb"))
    cases = [_view(job, cluster, view) for view in ((2, 2, 4), (2, 4, 2), (4, 2, 2))]
    cases.append({"name": "pricing tasks, 2-D and 3-D views", "jobs": [_tasks(*j) for j in SCALE_JOBS]})
    print("wrote", save("view_symmetry", cases))


def _view(job: TrainingJob, cluster: Cluster, shape: tuple[int, ...]) -> dict:
    options = PlannerOptions(mesh_axes=3)
    mesh = next(v for v in planner_views(cluster, (2, 8), 3) if v.shape == shape).with_memory(None)
    graph = piece_graphs(job.model, 2, job.seq_len, job.dtype, job.optimizer)[0][False].graph
    intra = piece_options(cluster.device.peak_flops * options.efficiency, 1, 0.0, 30.0, 0, True,
                          piece_pricing(job, cluster, options))
    nodes = enumerate_strategies(graph, mesh, intra.cost, intra.rules)
    case = {"view": list(shape), "load_average": os.getloadavg()[0], "plain": _solve(graph, mesh, intra, nodes)}
    if shape == (4, 2, 2):
        case["mirrors"] = _mirror_counts(graph, mesh, intra, nodes)
        case["closed"] = _solve(graph, mesh, intra, _closed(graph, nodes), cut=True)
    print(shape, case, flush=True)
    return case


def _solve(graph, mesh, intra, nodes, cut: bool = False) -> dict:
    sg = build_strategy_graph(graph, mesh, intra.cost, nodes)
    gp = graph_problem(sg, None, shared_groups(sg))
    problem, out = gp.problem, {}
    if cut:
        perms = _problem_mirrors(sg, gp)
        out["asymmetric_entries"] = _asymmetry(problem, perms)
        problem, out["cut_node"] = _lex_leader_cut(problem, perms)
    start = time.perf_counter()
    solution = solve_problem(problem, ProblemOptions(time_limit=30.0, mip_gap=1e-4))
    out.update(strategies=int(problem.sizes.sum()), reduced_strategies=solution.stats["reduced_strategies"],
               wall_s=time.perf_counter() - start, status=solution.status.value, cost=solution.cost,
               bound=solution.bound, gap=solution.gap)
    if not cut and solution.gap:
        out["fixing"] = _reduced_cost_fixing(problem, solution.cost)
    return out


def _mirror(spec: ShardingSpec, sort: bool = False) -> tuple:
    dims = tuple(tuple(SWAP.get(a, a) for a in d) for d in spec.dims)
    return tuple(tuple(sorted(d)) for d in dims) if sort else dims


def _key(s, sort: bool = False, mirrored: bool = False) -> tuple:
    turn = (lambda spec: _mirror(spec, sort)) if mirrored else (lambda spec: spec.dims)
    def axes(c: tuple[int, ...]) -> tuple[int, ...]:
        c = tuple(SWAP.get(a, a) for a in c) if mirrored else c
        return tuple(sorted(c)) if sort else c

    return turn(s.output), tuple(turn(o) for o in s.operands), tuple((c.kind, axes(c.axes)) for c in s.collectives)


def _mirror_counts(graph, mesh, intra, nodes) -> dict:
    """Strategies without a mirror, and resharding entries that differ when mirrors are re-sorted."""
    missing = sum(_key(s, mirrored=True) not in {_key(t) for t in ns.strategies}
                  for ns in nodes for s in ns.strategies)
    sg = build_strategy_graph(graph, mesh, intra.cost, nodes)
    perm = {}
    for g in sg.groups:
        index = {_key(s, sort=True): i for i, s in enumerate(sg.nodes[g].strategies)}
        perm[g] = np.array([index[_key(s, sort=True, mirrored=True)] for s in sg.nodes[g].strategies])
    differ = sum(int((~np.isclose(m[np.ix_(perm[a], perm[b])], m, rtol=1e-9, atol=0)).sum())
                 for (a, b), m in sg.edges.items())
    return {"strategies": sum(len(ns.strategies) for ns in nodes), "without_mirror": int(missing),
            "resharding_entries": sum(m.size for m in sg.edges.values()), "differ_sorted": differ}


def _closed(graph, nodes) -> tuple:
    """Each node's list with the missing mirrors appended (a follower's in its leader's order)."""
    added, out = {}, []
    for ns in nodes:
        strategies = list(ns.strategies)
        if ns.follows is None:
            keys = {_key(s) for s in strategies}
            missing = [i for i, s in enumerate(strategies) if _key(s, mirrored=True) not in keys]
        else:
            missing = added[graph[ns.node].operands[ns.follows]]
        added[ns.node] = missing
        out.append(replace(ns, strategies=tuple(strategies + [_mirrored(strategies[i]) for i in missing])))
    return tuple(out)


def _mirrored(s):
    def turn(spec: ShardingSpec) -> ShardingSpec:
        return ShardingSpec(_mirror(spec))

    return replace(s, name=s.name + " (mirror)", output=turn(s.output), operands=tuple(turn(o) for o in s.operands),
                   collectives=tuple(replace(c, axes=tuple(SWAP.get(a, a) for a in c.axes)) for c in s.collectives))


def _problem_mirrors(sg, gp) -> list[np.ndarray]:
    """Per problem node, the index of each strategy's mirror (read off its first group)."""
    first: dict[int, int] = {}
    for g, node in gp.node_of.items():
        first.setdefault(node, g)
    perms = []
    for node in range(gp.problem.num_nodes):
        strategies = sg.nodes[first[node]].strategies
        index = {_key(s): i for i, s in enumerate(strategies)}
        perms.append(np.array([index[_key(s, mirrored=True)] for s in strategies]))
    return perms


def _asymmetry(problem, perms) -> int:
    bad = sum(int((~np.isclose(problem.costs.row(v)[p], problem.costs.row(v), rtol=1e-9, atol=0)).sum())
              for v, p in enumerate(perms))
    for e in range(problem.num_edges):
        u, v = problem.edge_nodes[e]
        m = problem.edge_matrix(e)
        bad += int((~np.isclose(m[np.ix_(perms[u], perms[v])], m, rtol=1e-9, atol=0)).sum())
    for t in range(len(problem.memory)):
        row = problem.memory.usages.row(t)
        bad += int((row[perms[problem.memory.node[t]]] != row).sum())
    return bad


def _lex_leader_cut(problem, perms):
    """Forbid the second of each mirror pair at the node whose self-mirrored strategies are
    dearest (any node keeps the optimum: a plan or its mirror passes the cut)."""
    def margin(v: int) -> float:
        row, fixed = problem.costs.row(v), perms[v] == np.arange(len(perms[v]))
        return -1.0 if fixed.all() else (row[fixed].min() if fixed.any() else np.inf) - row.min()

    node = max(range(problem.num_nodes), key=margin)
    rows = [problem.costs.row(v).copy() for v in range(problem.num_nodes)]
    rows[node][perms[node] < np.arange(len(perms[node]))] = FORBIDDEN
    return replace(problem, costs=Ragged.from_rows(rows)), node


def _reduced_cost_fixing(problem, best: float, sweeps: int = 100) -> dict:
    pre = presolve(problem)
    q = pre.problem
    ix = pairwise_index(q)
    dual, unary = EdgeDual(ix), q.costs.values
    for _ in range(sweeps):
        dual.sweep(unary)
    bound = dual.bound(unary)
    part = unary - np.bincount(ix.target, weights=dual.y, minlength=len(unary))
    excess = part - np.repeat(np.minimum.reduceat(part, ix.ptr[:-1]), np.diff(ix.ptr))
    keep = excess <= (best - pre.offset - bound) * (1 + 1e-9)
    sizes = np.add.reduceat(keep.astype(np.int64), ix.ptr[:-1])
    columns = int(sizes.sum() + sum(sizes[a] * sizes[b] for a, b in q.edge_nodes))
    return {"sweeps": sweeps, "bound": bound + pre.offset, "kept": int(keep.sum()), "of": len(unary),
            "mip_columns": columns}


def _tasks(model: str, nodes: int, per_node: int, device: str, batch: int, seq: int) -> dict:
    job, cluster = TrainingJob(PRESETS[model], batch, seq), Cluster(nodes, per_node, get_device(device))
    row = {"model": model, "cluster": cluster.name}
    for axes in (2, 3):
        options = PlannerOptions(mesh_axes=axes)
        sizes = planned_microbatch_sizes(job, cluster, options)
        row[f"{axes}d"] = {"microbatch_sizes": list(sizes),
                           "views": [len(auto_view_tasks(job, cluster, b, options)) for b in sizes]}
    return row


if __name__ == "__main__":
    main()
