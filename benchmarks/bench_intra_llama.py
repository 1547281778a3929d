"""Intra-op ILP on the LLaMA2-13B forward graph (40 layers, batch 200, seq 4096) on mesh (50, 4).

Times graph build, problem build and solve for HiGHS and CBC, with and without layer
sharing; writes benchmarks/results/intra_llama.json. Run: python benchmarks/bench_intra_llama.py
"""

from __future__ import annotations

import sys
import time

from meshplan import IntraOptions, LogicalMesh, llama_forward, solve_intra

from common import save

MESH = LogicalMesh((50, 4), (1.0, 1.0), (1.0, 0.01), memory_per_device=32e9)
BUDGETS = {"32GB": 32e9, "16GB": 16e9}  # 16 GB binds: weights must be sharded and gathered


def run_case(solver: str, share: bool, time_limit: float, budget: str) -> dict:
    start = time.perf_counter()
    graph = llama_forward(batch=200, seq_len=4096, hidden=5120, heads=40, layers=40, ffn=13824)
    graph_s = time.perf_counter() - start
    options = IntraOptions(solver=solver, share_layers=share, time_limit=time_limit, memory_budget=BUDGETS[budget])
    plan = solve_intra(graph, MESH, options)
    total = time.perf_counter() - start
    return {"name": f"{budget}-{solver}-{'shared' if share else 'unshared'}", "solver": solver,
            "share_layers": share, "memory_budget": budget,
            "nodes": len(graph), "graph_build_s": graph_s, "problem_build_s": plan.build_s,
            "solve_s": plan.solve.wall_s, "total_s": total, "objective": plan.objective,
            "status": plan.solve.status.value, "gap": plan.solve.gap, "variables": plan.num_variables,
            "constraints": plan.num_constraints, "peak_memory_gb": plan.peak_memory / 1e9}


def main(time_limit: float = 60.0) -> None:
    cases = []
    for budget in BUDGETS:
        for solver in ("highs", "cbc"):
            for share in (True, False):
                case = run_case(solver, share, time_limit, budget)
                print(f"{case['name']:22s} total {case['total_s']:6.2f} s (solve {case['solve_s']:6.2f} s) "
                      f"objective {case['objective']:.4f} {case['status']} vars {case['variables']}", flush=True)
                cases.append(case)
    print("wrote", save("intra_llama", cases))


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 60.0)
