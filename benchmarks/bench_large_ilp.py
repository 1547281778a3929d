"""Intra-op planning at production graph size: the shared IOPDDL instances and large synthetic
training graphs, through `solve_problem`; writes benchmarks/results/large_ilp.json.

Cases:
- iopddl-B/S/U: the three shared contest instances at the contest's time limits (60/240/300 s):
  read time, solve time, cost, gap to the best known cost and to the proven bound.
- llama80-train-2d/3d: an unshared 80-layer LLaMA2-70B training step (embedding, blocks, LM
  head, backward, Adam) built by meshplan itself, on a (8, 8) and a (4, 4, 4) mesh with a
  memory budget: graph build, strategy enumeration, array-problem build (memory terms), and
  solve times.

Each case runs in its own process so that its peak RSS is its own. Note the machine's load
(`uptime`) with the figures: solution quality within a time limit depends on it.
Run: python benchmarks/bench_large_ilp.py [case ...] [--scale 0.1]  (scale shortens limits)
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import save

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "iopddl"
INSTANCES = {"B": (60.0, 532_843), "S": (240.0, 1_521_949_307), "U": (300.0, 2_443_995_952)}
MESHES = {"2d": (8, 8), "3d": (4, 4, 4)}
GRAPH_LIMIT = 120.0


def iopddl_case(name: str, scale: float) -> dict:
    from meshplan.intra import ProblemOptions, read_iopddl, solve_problem

    limit, best = INSTANCES[name]
    start = time.perf_counter()
    problem = read_iopddl(SHARED / f"asplos-2025-iopddl-{name}.json.gz")
    read_s = time.perf_counter() - start
    solution = solve_problem(problem, ProblemOptions(time_limit=limit * scale - read_s - 1.0))
    total_s = time.perf_counter() - start
    feasible = solution.choice is not None and problem.is_feasible(solution.choice)
    rescored = _rescore(name, solution.choice) if solution.choice is not None else None
    return {"name": f"iopddl-{name}", "nodes": problem.num_nodes, "edges": problem.num_edges,
            "time_limit_s": limit * scale, "read_s": read_s, "solve_s": solution.wall_s,
            "total_s": total_s, "status": solution.status.value, "feasible": feasible,
            "rescored": rescored,
            "cost": solution.cost, "best_known": best,
            "gap_to_best_known": None if solution.cost is None else solution.cost / best - 1.0,
            "bound": solution.bound, "gap_to_bound": solution.gap, "stats": solution.stats}


def _rescore(name: str, choice) -> dict:
    """Cost and feasibility by the independent scorer of the tests (written from the format
    description, no meshplan code)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from iopddl_score import load, score

    cost, feasible = score(load(str(SHARED / f"asplos-2025-iopddl-{name}.json.gz")), [int(c) for c in choice])
    return {"cost": cost, "feasible": feasible}


def llama_training_graph(layers: int = 80, batch: int = 2, seq: int = 2048):
    """An unshared LLaMA2-70B-shaped training step: forward, backward and Adam, one graph."""
    from meshplan.ir import DType, GraphBuilder, OpKind
    from meshplan.ir.autodiff import append_backward
    from meshplan.models.blocks import block, embedding, lm_head_loss
    from meshplan.models.optimizers import append_adam
    from meshplan.models.transformer import model_config

    cfg = model_config("llama2-70b").replace(layers=layers)
    b = GraphBuilder(f"llama80-train-{layers}")
    x, _ = embedding(b, cfg, batch, seq, DType.BF16)
    for index in range(layers):
        with b.layer(index):
            x = block(b, x, cfg, index)
    loss = lm_head_loss(b, x, cfg)
    weights = [n for n in range(len(b)) if b.node(n).kind is OpKind.PARAMETER
               and b.node(n).dtype in (DType.BF16, DType.F16, DType.F32)]
    grads = append_backward(b, loss, weights)
    updated = append_adam(b, weights, grads, master_dtype=DType.F32)
    b.outputs(*updated.values())
    return b.build()


def llama_case(mesh_name: str, scale: float) -> dict:
    from meshplan import IntraOptions, LogicalMesh
    from meshplan.intra import ProblemOptions, solve_problem
    from meshplan.intra.graph_problem import graph_problem
    from meshplan.intra.solve import build_strategies

    shape = MESHES[mesh_name]
    mesh = LogicalMesh(shape, (1e-5,) * len(shape), (1e-10,) * len(shape), memory_per_device=80e9)
    options = IntraOptions(share_layers=False)
    start = time.perf_counter()
    graph = llama_training_graph()
    graph_s = time.perf_counter() - start
    sg, _ = build_strategies(graph, mesh, options)
    strategies_s = time.perf_counter() - start - graph_s
    mark = time.perf_counter()
    gp = graph_problem(sg, mesh.memory_per_device)
    problem_s = time.perf_counter() - mark
    rss_build = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    solution = solve_problem(gp.problem, ProblemOptions(time_limit=GRAPH_LIMIT * scale))
    return {"name": f"llama80-train-{mesh_name}", "mesh": list(shape), "nodes": len(graph),
            "decisions": gp.problem.num_nodes, "edges": gp.problem.num_edges,
            "strategies": int(gp.problem.sizes.sum()), "memory_terms": len(gp.problem.memory),
            "graph_build_s": graph_s, "strategy_enumeration_s": strategies_s, "problem_build_s": problem_s,
            "peak_rss_after_build_gb": rss_build, "time_limit_s": GRAPH_LIMIT * scale,
            "solve_s": solution.wall_s, "status": solution.status.value, "cost": solution.cost,
            "bound": solution.bound, "gap_to_bound": solution.gap, "stats": solution.stats}


def synthetic_case(nodes: int, scale: float) -> dict:
    """Build-only scaling of the memory model: a random layered problem of `nodes` nodes (8-16
    strategies, edges to the previous two nodes, training-like live ranges: most short, one
    in ten to the end), validated into a StrategyProblem, its memory rows and the sparse
    chain of the memory constraint over every (term, strategy)."""
    import numpy as np

    from meshplan.intra.memory import chain_block, memory_rows
    from meshplan.intra.problem import strategy_problem

    rng = np.random.default_rng(0)
    sizes = rng.integers(8, 17, size=nodes)
    costs = [rng.integers(0, 1000, size=k).astype(float) for k in sizes]
    pairs = [(v - d, v) for v in range(2, nodes) for d in (1, 2)]
    matrices = [rng.integers(0, 500, size=sizes[u] * sizes[v]).astype(float) for u, v in pairs]
    lo = np.arange(nodes)
    hi = np.minimum(nodes, lo + 1 + np.where(rng.random(nodes) < 0.1, nodes, rng.integers(1, 50, nodes)))
    usages = [rng.integers(1, 100, size=k) * 1000 for k in sizes]
    start = time.perf_counter()
    problem = strategy_problem(costs, usages=usages, intervals=np.stack([lo, hi], axis=1).tolist(), edges=pairs,
                               edge_costs=matrices, usage_limit=1e12)
    problem_s = time.perf_counter() - start
    mark = time.perf_counter()
    m = problem.memory
    empty = tuple(np.zeros(0, dtype=t) for t in (np.int64, np.int64, np.float64))
    rows = memory_rows(m.lo, m.hi, empty, problem.usage_limit)
    counts = m.usages.lengths
    term_var = np.repeat(problem.costs.ptr[m.node] - m.usages.ptr[:-1], counts) + np.arange(len(m.usages.values))
    chain = chain_block(rows, term_var, m.usages.ptr, m.usages.values, len(problem.costs.values))
    memory_s = time.perf_counter() - mark
    return {"name": f"synthetic-{nodes}", "nodes": nodes, "edges": len(pairs),
            "strategies": int(problem.sizes.sum()), "problem_build_s": problem_s, "memory_build_s": memory_s,
            "build_s": problem_s + memory_s, "memory_rows": len(rows), "memory_nonzeros": len(chain.values),
            "naive_memory_nonzeros": int(((rows.last - rows.first + 1) * counts).sum())}


CASES = ({f"iopddl-{k}": (iopddl_case, k) for k in INSTANCES} | {f"llama80-train-{k}": (llama_case, k) for k in MESHES}
         | {"synthetic-65000": (synthetic_case, 65_000)})


def run_one(case: str, scale: float) -> None:
    fn, arg = CASES[case]
    result = fn(arg, scale)
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    result["load_average"] = list(os.getloadavg())
    sys.stdout.write(json.dumps(result) + "\n")


def main(argv: list[str]) -> None:
    scale = float(argv[argv.index("--scale") + 1]) if "--scale" in argv else 1.0
    names = [a for a in argv if a in CASES] or list(CASES)
    cases = []
    for name in names:
        proc = subprocess.run([sys.executable, __file__, "--one", name, "--scale", str(scale)], capture_output=True,
                              text=True, check=False, env=os.environ | {"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        if proc.returncode != 0:
            cases.append({"name": name, "error": proc.stderr.strip().splitlines()[-1:]})
            print(name, "failed:", proc.stderr[-2000:], flush=True)
            continue
        case = json.loads(proc.stdout.strip().splitlines()[-1])
        cases.append(case)
        print(json.dumps({k: v for k, v in case.items() if k != "stats"}), flush=True)
    print("wrote", save("large_ilp", _merge(cases)))


def _merge(cases: list[dict]) -> list[dict]:
    """Keep earlier results of the cases not run this time."""
    from common import RESULTS

    path = RESULTS / "large_ilp.json"
    old = json.loads(path.read_text())["cases"] if path.exists() else []
    fresh = {c["name"] for c in cases}
    return [c for c in old if c["name"] not in fresh] + cases


if __name__ == "__main__":
    if "--one" in sys.argv:
        run_one(sys.argv[sys.argv.index("--one") + 1],
                float(sys.argv[sys.argv.index("--scale") + 1]) if "--scale" in sys.argv else 1.0)
    else:
        main(sys.argv[1:])
