"""The 3-D refinement (PlannerOptions.mesh_axes="refine"): what it adds to planning and what it
finds. For each job: plan on 2-D views (one worker), then refine with the same priced views (so
only the refinement is timed: pricing the 3-D views of the 2-D plan's stages' sub-meshes at its
micro-batch size and the stage DP again); record both plans, the added tasks and CPU seconds
(this process and the solver's forked children; the refining run also repeats the 2-D
stage DPs, `refine_phases_s` splits it), against the tasks pricing every 3-D view
(mesh_axes=3) would add. `--count-only` prices nothing: it counts each job's tasks by sub-mesh
shape (the refinement's are those of the shapes a 2-D plan uses, at one micro-batch size).
Writes benchmarks/results/refine.json.
Run: python benchmarks/bench_refine.py [--count-only] [MODEL ...]
"""

from __future__ import annotations

import resource
import sys
import time
import warnings

from meshplan.cluster import Cluster, get_device
from meshplan.models.transformer import PRESETS
from meshplan.simulator import PlannerOptions, TrainingJob
from meshplan.simulator.planner import (
    PlannerStats,
    auto_view_tasks,
    plan_training,
    planned_microbatch_sizes,
    refinement_tasks,
)

from common import save

# The planner-time jobs of bench_scale.py: (preset, nodes, devices per node, device, global batch, sequence)
JOBS = (
    ("llama2-13b", 50, 4, "v100-32gb", 1000, 4096),
    ("llama2-70b", 128, 8, "a100-80gb", 1024, 4096),
    ("llama3.1-405b", 288, 8, "h100-80gb", 2304, 8192),
    ("mixtral-8x7b", 4, 8, "h100-80gb", 256, 4096),
)


def main(args: list[str]) -> None:
    warnings.simplefilter("ignore")
    count_only = "--count-only" in args
    names = [a for a in args if not a.startswith("--")]
    jobs = [j for j in JOBS if not names or j[0] in names]
    cases = [_counts(*j) if count_only else _case(*j) for j in jobs]
    print("wrote", save("refine_counts" if count_only else "refine", cases))


def _job(preset: str, nodes: int, per_node: int, device: str, batch: int, seq: int) -> tuple[TrainingJob, Cluster]:
    return TrainingJob(PRESETS[preset], batch, seq), Cluster(nodes, per_node, get_device(device))


def _counts(*spec) -> dict:
    """Tasks by mesh_axes, and the 3-D views per sub-mesh shape and micro-batch size (what the
    refinement adds for each shape a 2-D plan's stages use)."""
    job, cluster = _job(*spec)
    sizes = planned_microbatch_sizes(job, cluster, PlannerOptions())
    total = {axes: sum(len(auto_view_tasks(job, cluster, b, PlannerOptions(mesh_axes=axes))) for b in sizes)
             for axes in (2, 3)}
    per_shape = {}
    for b in sizes:
        two = {t.key for t in auto_view_tasks(job, cluster, b, PlannerOptions(mesh_axes=2))}
        for t in auto_view_tasks(job, cluster, b, PlannerOptions(mesh_axes=3)):
            if t.key not in two:
                name = f"b={b} {t.key.submesh[0]}x{t.key.submesh[1]}"
                per_shape[name] = per_shape.get(name, 0) + 1
    case = {"name": spec[0], "cluster": f"{spec[1]}x{spec[2]}", "microbatch_sizes": list(sizes),
            "tasks_2d": total[2], "tasks_3d": total[3], "three_axis_views_per_shape": per_shape}
    print(case, flush=True)
    return case


def _case(*spec) -> dict:
    job, cluster = _job(*spec)
    priced: dict = {}
    start, cpu = time.perf_counter(), _cpu_seconds()
    two = plan_training(job, cluster, PlannerOptions(workers=1), None, PlannerStats(), priced, None)
    two_s, two_cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    added = refinement_tasks(job, cluster, two, PlannerOptions(mesh_axes="refine"))
    start, cpu, stats = time.perf_counter(), _cpu_seconds(), PlannerStats()
    refined = plan_training(job, cluster, PlannerOptions(workers=1, mesh_axes="refine"), None, stats, priced, None)
    refine_s, refine_cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    counts = _counts(*spec)
    case = {**counts, "tasks_2d_priced": len(priced) - len(added),
            "refine_added_tasks": len(added), "planner_2d_s": two_s, "planner_2d_cpu_s": two_cpu,
            "refine_added_s": refine_s, "refine_added_cpu_s": refine_cpu,
            "refine_added_cpu_share": refine_cpu / two_cpu, "refine_phases_s": stats.phases,
            "plan_2d": _plan(two), "plan_refine": _plan(refined)}
    print(case, flush=True)
    return case


def _plan(plan) -> dict:
    return {"iteration_time_s": plan.iteration_time, "microbatch_size": plan.microbatch_size,
            "stages": [{"layers": [s.first, s.last], "submesh": list(s.submesh), "view": list(s.view)}
                       for s in plan.stages]}


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (the ILP's forked exact side)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if __name__ == "__main__":
    main(sys.argv[1:])
