"""3-D logical views in the stage search: plan a job with the stage DP on 2-D views only
(PlannerOptions.mesh_axes=2, Alpa's views) and with the 3-D views of stages of 8 or more devices
too (mesh_axes=3); record both plans, the per-view price of one transformer block (the stage
DP's input) and the planner seconds: wall and CPU (this process and the solver's forked children;
on a shared machine the wall time counts other jobs). Writes benchmarks/results/ndmesh.json.
Run: python benchmarks/bench_ndmesh.py [CASE ...]
"""

from __future__ import annotations

import resource
import sys
import time
import warnings

from meshplan.cluster import Cluster, get_device
from meshplan.models.transformer import PRESETS
from meshplan.simulator import PlannerOptions, TrainingJob
from meshplan.simulator.planner import PlannerStats, plan_training
from meshplan.simulator.pricing import (
    ViewKey,
    batch_axis,
    piece_graphs,
    piece_pricing,
    planner_views,
    profile_piece,
)

from common import save

# name: (preset, nodes, devices per node, device, sequence length, global batch, micro-batch sizes)
CASES = {
    # Two sequences of 32k tokens per iteration on 4 nodes of 8: a 2-D view of the 4 nodes puts
    # axis 0 across all of them, 4 or more ways, more than a micro-batch of 2 can split.
    "gpt3-1.3b-seq32k-batch2-4x8-a100": ("gpt3-1.3b", 4, 8, "a100-80gb", 32768, 2, (2,)),
}


def main(names: list[str]) -> None:
    warnings.simplefilter("ignore")
    cases = [_case(name, *CASES[name]) for name in names or CASES]
    print("wrote", save("ndmesh", cases))


def _case(name: str, preset: str, nodes: int, per_node: int, device: str, seq: int, batch: int,
          sizes: tuple[int, ...]) -> dict:
    job = TrainingJob(PRESETS[preset], global_batch=batch, seq_len=seq)
    cluster = Cluster(nodes, per_node, get_device(device))
    case = {"name": name, "model": preset, "cluster": cluster.name, "seq_len": seq, "global_batch": batch}
    # The stage DP's default chunks (1, 2, 4), and plain 1F1B (chunks 1): the interleaved
    # schedule's bubble formula assumes more micro-batches than stages.
    for label, axes, chunks in (("2d", 2, (1, 2, 4)), ("3d", 3, (1, 2, 4)), ("2d_1f1b", 2, (1,))):
        options = PlannerOptions(mesh_axes=axes, workers=1, microbatch_sizes=sizes, chunks=chunks)
        priced: dict[ViewKey, object] = {}
        start, cpu = time.perf_counter(), _cpu_seconds()
        best = plan_training(job, cluster, options, None, PlannerStats(), priced, None)
        seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
        stages = [{"layers": [s.first, s.last], "submesh": list(s.submesh), "view": list(s.view),
                   "menu": s.menu, "recompute": s.recompute} for s in best.inter.stages]
        case[label] = {"iteration_time_s": best.iteration_time, "microbatch_size": best.microbatch_size,
                       "schedule": best.inter.schedule, "chunks": best.inter.chunks, "stages": stages,
                       "planner_s": seconds, "planner_cpu_s": cpu, "views": _block_prices(priced)}
        print(f"{name} {label}: {best.iteration_time:.4f} s, stages {stages}, planner {seconds:.0f} s "
              f"({cpu:.0f} s CPU)")
    case["speedup_3d_over_2d"] = case["2d"]["iteration_time_s"] / case["3d"]["iteration_time_s"]
    case["speedup_3d_over_2d_1f1b"] = case["2d_1f1b"]["iteration_time_s"] / case["3d"]["iteration_time_s"]
    first = case["3d"]["stages"][0]
    if len(first["view"]) == 3:
        case["3d"]["block_layout"] = _block_layout(job, cluster, tuple(first["submesh"]), tuple(first["view"]),
                                                   case["3d"]["microbatch_size"])
    return case


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (the ILP's forked exact side)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _block_layout(job: TrainingJob, cluster: Cluster, submesh: tuple[int, int], view: tuple[int, ...],
                  b: int) -> dict:
    """How the stage DP's 3-D view splits a transformer block: the layout of each forward product
    (output = lhs x rhs, dims per mesh axis as the plan names them, e.g. S0S12R: dim 0 over axis
    0, dim 1 over axes 1 and 2) and of the inputs (activations, weights, optimizer state)."""
    options = PlannerOptions(mesh_axes=3)
    mesh = next(v for v in planner_views(cluster, submesh, 3) if v.shape == view)
    piece = piece_graphs(job.model, b, job.seq_len, job.dtype, job.optimizer)[0][False]
    flops = cluster.device.peak_flops * options.efficiency
    _, plan = profile_piece(piece, mesh, flops, job.global_batch // b, force_batch_axis=batch_axis(mesh),
                            reduce_scatter=True, pricing=piece_pricing(job, cluster, options))
    products = {f"{c.name} {list(c.shape)}": f"{c.output} = {' x '.join(map(str, c.operands))}"
                for c in plan.nodes if c.op == "dot" and c.name.startswith("layer")}
    inputs = {f"{c.name} {list(c.shape)}": str(c.output) for c in plan.nodes
              if c.op == "parameter" and len(c.shape) >= 2}
    return {"forward_products": products, "inputs": inputs}


def _block_prices(priced: dict) -> list[dict]:
    """One transformer block's menu on every priced view: time per micro-batch, gradient sync per
    iteration, bytes held."""
    rows = []
    for key, result in priced.items():
        if result.costs is None:
            continue
        menu = result.costs.layers[len(result.costs.layers) // 2]
        rows.append({"microbatch_size": key.microbatch_size, "submesh": list(key.submesh),
                     "view": list(result.costs.view),
                     "menu": [{"time_ms": c.time * 1e3, "sync_ms": c.sync_time * 1e3, "static_gb": c.static_bytes / 1e9,
                               "activation_gb": c.activation_bytes / 1e9} for c in menu]})
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
