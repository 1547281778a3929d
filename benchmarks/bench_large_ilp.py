"""Intra-op planning at production graph size: the shared IOPDDL instances, generated
contest-shaped instances against the exact MIP, and large synthetic training graphs, through
`solve_problem`; writes benchmarks/results/large_ilp.json.

Cases:
- iopddl-B/S/U/D: the four shared contest instances, each through the command line
  (`meshplan solve-problem --workers 2`) at the contest's time limit (60/240/300/60 s): the
  wall time of the whole process (reading, solving, writing) against the limit, the cost
  against the best known, the proven bound, every plan re-scored by the independent scorer
  of the tests.
- generated: random instances with the contest's structure (`meshplan.intra.problem.generate`), each
  solved exactly by the MIP and by the search alone (memory prices and windows in two
  processes, no whole MIP) at a short limit: the distribution of the search's gap.
- llama80-train-2d/3d: an unshared 80-layer LLaMA2-70B training step (embedding, blocks, LM
  head, backward, Adam) built by meshplan itself, on a (8, 8) and a (4, 4, 4) mesh with a
  memory budget: graph build, strategy enumeration, array-problem build (memory terms), and
  solve times.

Each case runs in its own process so that its peak RSS is its own. The machine's load
(`os.getloadavg`) is recorded with every figure: quality within a time limit depends on it.
Run: python benchmarks/bench_large_ilp.py [case ...] [--scale 0.1] [--instances 200]
(scale shortens limits; instances: how many generated instances)
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import save

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / ".." / "shared" / "iopddl"
INSTANCES = {"B": (60.0, 532_843), "S": (240.0, 1_521_949_307), "U": (300.0, 2_443_995_952),
             "D": (60.0, 309_396_217_429)}
MESHES = {"2d": (8, 8), "3d": (4, 4, 4)}
GRAPH_LIMIT = 120.0
GENERATED_SEARCH_LIMIT = 5.0  # seconds for the search alone on each generated instance
GENERATED_EXACT_LIMIT = 600.0


def iopddl_case(name: str, scale: float) -> dict:
    """The command line on one shared instance, timed from process start to exit."""
    limit, best = INSTANCES[name]
    path = SHARED / f"asplos-2025-iopddl-{name}.json.gz"
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "solution.json"
        load_before = list(os.getloadavg())
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "meshplan.cli", "solve-problem", str(path), "--time-limit",
                               str(limit * scale), "--out", str(out), "--workers", "2"],
                              capture_output=True, text=True, check=False, env=_env())
        wall = time.perf_counter() - start
        data = json.loads(out.read_text()) if out.exists() else {}
    choice = data.get("solution")
    rescored = _rescore(path, choice) if choice else None
    cost = data.get("cost")
    return {"name": f"iopddl-{name}", "time_limit_s": limit * scale, "wall_s": wall,
            "within_limit": wall <= limit * scale, "returncode": proc.returncode,
            "output": proc.stdout.strip()[-300:], "status": data.get("status"), "cost": cost, "rescored": rescored,
            "best_known": best, "cost_over_best_known": None if cost is None else cost / best,
            "bound": data.get("bound"), "gap_to_bound": data.get("gap"), "stats": data.get("stats", {}),
            "load_before": load_before}


def _env() -> dict:
    return os.environ | {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH"))
                                                       if p)}


def _rescore(path: Path, choice) -> dict:
    """Cost and feasibility by the independent scorer of the tests (written from the format
    description, no meshplan code)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from iopddl_score import load, score

    cost, feasible = score(load(str(path)), [int(c) for c in choice])
    return {"cost": cost, "feasible": feasible}


def generated_shape(seed: int):
    """A random shape: 3-16 layers of 2-5 operators, training or inference, a 2-D mesh, a
    memory limit from tight to loose."""
    import numpy as np

    from meshplan.intra.problem.generate import GeneratorOptions

    rng = np.random.default_rng(10_000 + seed)
    return GeneratorOptions(layers=int(rng.integers(3, 17)), ops_per_layer=int(rng.integers(2, 6)),
                            mesh=[(2, 2), (2, 4), (4, 4), (2, 8)][int(rng.integers(4))],
                            training=bool(rng.random() < 0.7), tightness=float(rng.uniform(0.05, 0.6)))


def generated_case(count: int, scale: float) -> dict:
    """Exact MIP against the search alone on `count` generated instances."""
    import numpy as np

    from meshplan.intra import ProblemOptions, SolveStatus, solve_problem
    from meshplan.intra.problem.generate import random_instance
    from meshplan.intra.problem.iopddl import problem_from_iopddl

    sys.path.insert(0, str(ROOT / "tests"))
    from iopddl_score import score

    rows = []
    for seed in range(count):
        raw = random_instance(seed, generated_shape(seed))
        problem = problem_from_iopddl(raw)
        exact = solve_problem(problem, ProblemOptions(time_limit=GENERATED_EXACT_LIMIT))
        limit = GENERATED_SEARCH_LIMIT * scale
        search = solve_problem(problem, ProblemOptions(time_limit=limit, full_mip_columns=0, workers=2, seed=seed))
        proven = exact.status is SolveStatus.OPTIMAL
        feasible = search.choice is not None and score(raw["problem"], search.choice.tolist()) == (search.cost, True)
        gap = None if not (proven and feasible) else search.cost / exact.cost - 1.0 if exact.cost else 0.0
        rows.append({"seed": seed, "nodes": problem.num_nodes, "reduced_nodes": exact.stats.get("reduced_nodes"),
                     "exact": exact.cost, "exact_status": exact.status.value, "exact_s": exact.wall_s,
                     "search": search.cost, "search_feasible": feasible, "search_s": search.wall_s,
                     "within_limit": search.wall_s <= limit, "gap": gap, "load": os.getloadavg()[0]})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    gaps = np.array([r["gap"] for r in rows if r["gap"] is not None])
    summary = {"instances": count, "proven_optimal": int(sum(r["exact_status"] == "optimal" for r in rows)),
               "search_feasible": int(sum(r["search_feasible"] for r in rows)), "compared": len(gaps),
               "search_limit_s": GENERATED_SEARCH_LIMIT * scale,
               "over_limit": int(sum(not r["within_limit"] for r in rows))}
    if len(gaps):
        summary |= {"gap_mean": float(gaps.mean()), "gap_p50": float(np.percentile(gaps, 50)),
                    "gap_p90": float(np.percentile(gaps, 90)), "gap_p99": float(np.percentile(gaps, 99)),
                    "gap_max": float(gaps.max()), "share_optimal": float((gaps <= 1e-9).mean()),
                    "share_within_1pct": float((gaps <= 0.01).mean())}
    return {"name": "generated", **summary, "rows": rows}


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
    from meshplan.intra.problem.graph_problem import graph_problem
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

    from meshplan.intra.problem.arrays import strategy_problem
    from meshplan.intra.problem.memory import chain_block, memory_rows

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
         | {"synthetic-65000": (synthetic_case, 65_000), "generated": (generated_case, None)})


def run_one(case: str, scale: float, instances: int) -> None:
    fn, arg = CASES[case]
    result = fn(instances if case == "generated" else arg, scale)
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    result["load_average"] = list(os.getloadavg())
    sys.stdout.write(json.dumps(result) + "\n")


def _option(argv: list[str], name: str, default: float) -> float:
    return float(argv[argv.index(name) + 1]) if name in argv else default


def main(argv: list[str]) -> None:
    scale, instances = _option(argv, "--scale", 1.0), int(_option(argv, "--instances", 200))
    names = [a for a in argv if a in CASES] or list(CASES)
    cases = []
    for name in names:
        proc = subprocess.run([sys.executable, __file__, "--one", name, "--scale", str(scale), "--instances",
                               str(instances)], stdout=subprocess.PIPE, text=True, check=False, env=_env())
        if proc.returncode != 0:
            cases.append({"name": name, "error": f"exit code {proc.returncode}"})
            print(name, "failed", flush=True)
            continue
        case = json.loads(proc.stdout.strip().splitlines()[-1])
        cases.append(case)
        print(json.dumps({k: v for k, v in case.items() if k not in ("stats", "rows")}), flush=True)
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
        run_one(sys.argv[sys.argv.index("--one") + 1], _option(sys.argv, "--scale", 1.0),
                int(_option(sys.argv, "--instances", 200)))
    else:
        main(sys.argv[1:])
