"""Simulate training a model on a cluster: the auto plan, its prediction, and the baselines.

Input: a TrainingJob and a Cluster. Output: a Simulation with the auto plan (TrainingPlan),
the data-parallel, ZeRO-2 and best Megatron-style baselines priced by the same cost model,
and the planner's time per phase.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from meshplan.cluster.cluster import Cluster
from meshplan.inter.baselines import Baseline, evaluate_data_parallel, evaluate_megatron
from meshplan.inter.placement import place_submeshes
from meshplan.inter.planner import (
    PipelinePlan,
    PlannerOptions,
    PlannerStats,
    Progress,
    TrainingJob,
    plan_training,
    planned_microbatch_sizes,
)
from meshplan.plan import Prediction, StagePlan, TrainingPlan


@dataclass(frozen=True, slots=True)
class BaselineResult:
    name: str
    config: str
    plan: TrainingPlan | None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Simulation:
    plan: TrainingPlan
    baselines: tuple[BaselineResult, ...]
    phases: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(),
                "baselines": [{"name": b.name, "config": b.config, "reason": b.reason,
                               "plan": b.plan.to_dict() if b.plan else None} for b in self.baselines],
                "planner_seconds": self.phases}


def to_training_plan(plan: PipelinePlan, job: TrainingJob, cluster: Cluster, label: str = "auto") -> TrainingPlan:
    origins = place_submeshes([s.shape for s in plan.stages], cluster.nodes, cluster.devices_per_node)
    if origins is None:  # baselines and DP plans are checked before; keep the plan readable anyway
        origins = [(0, 0)] * len(plan.stages)
    stages = tuple(StagePlan(s.first, s.last, s.shape, s.view, "fastest" if s.menu == 0 else f"lean-{s.menu}",
                             s.recompute, s.latency, s.memory, s.inflight, s.sync_time, s.update_time, origin)
                   for s, origin in zip(plan.stages, origins, strict=True))
    seconds = plan.iteration_time
    tflops = job.model_flops / seconds / cluster.num_devices / 1e12
    prediction = Prediction(seconds, plan.pipeline_time, plan.sync_time, job.tokens / seconds, tflops,
                            tflops * 1e12 / cluster.device.peak_flops, max(s.memory for s in plan.stages))
    return TrainingPlan(job.model.name, job.model.num_params(), (cluster.nodes, cluster.devices_per_node),
                        cluster.device.name, job.global_batch, job.seq_len, plan.microbatch_size,
                        plan.num_microbatches, stages, prediction, label,
                        schedule="1f1b" if plan.chunks == 1 else f"interleaved-1f1b-{plan.chunks}")


def simulate(job: TrainingJob, cluster: Cluster, options: PlannerOptions | None = None,
             progress: Progress | None = None, baselines: bool = True) -> Simulation:
    """Plan `job` on `cluster` and price the baselines; raises InfeasiblePlanError when no
    plan fits."""
    options = options or PlannerOptions()
    stats = PlannerStats()
    priced: dict = {}
    best = plan_training(job, cluster, options, progress, stats, priced)
    found: list[Baseline] = []
    if baselines:
        start = time.perf_counter()
        sizes = planned_microbatch_sizes(job, cluster, options)
        found.append(evaluate_megatron(job, cluster, sizes, options, priced, progress))
        found.extend(evaluate_data_parallel(job, cluster, options, priced))
        stats.timed("baselines", start)
    results = tuple(BaselineResult(b.name, b.config, to_training_plan(b.plan, job, cluster, b.name) if b.plan
                                   else None, b.reason) for b in found)
    auto = to_training_plan(best, job, cluster)
    grid = next((b for b in found if b.name == "megatron" and b.plan is not None), None)
    if grid is not None and grid.plan.iteration_time < best.iteration_time:
        # Uniform grid points are plans of the auto search space too; the stage DP prices sync
        # per stage approximately and can miss them by a little.
        auto = replace(to_training_plan(grid.plan, job, cluster), label="auto",
                       notes=(f"taken from the Megatron grid ({grid.config}): "
                              f"{best.iteration_time:.4f} s from the stage DP",))
    return Simulation(auto, results, dict(stats.phases))
