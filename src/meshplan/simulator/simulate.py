"""Simulate training a model on a cluster: the auto plan, its prediction, and the baselines.

Input: a TrainingJob and a Cluster. Output: a Simulation: the auto plan as a `Plan` (with the
baselines' predictions and the planner's seconds per phase inside it, so one file tells the
whole story), and each baseline's own `Plan`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from meshplan.cluster.cluster import Cluster
from meshplan.distributed import TaskRunner
from meshplan.inter.placement import place_submeshes
from meshplan.plan import BaselineSummary, Plan, Prediction, Stage
from meshplan.simulator.baselines import Baseline, evaluate_data_parallel, evaluate_megatron
from meshplan.simulator.job import PlannerOptions, TrainingJob
from meshplan.simulator.planner import (
    PipelinePlan,
    PlannerStats,
    Progress,
    default_runner,
    plan_training,
    planned_microbatch_sizes,
)
from meshplan.simulator.pricing import task_name


@dataclass(frozen=True, slots=True)
class BaselineResult:
    """A baseline: its name and configuration, its plan or why none fits."""

    name: str
    config: str
    plan: Plan | None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Simulation:
    """The auto plan (baseline predictions and planner seconds included) and the baselines' plans."""

    plan: Plan
    baselines: tuple[BaselineResult, ...]

    @property
    def phases(self) -> dict[str, float]:
        """Planner seconds per phase."""
        return self.plan.metrics_under("planner_s.")

    def to_dict(self) -> dict:
        return self.plan.to_dict()


def to_plan(pipeline: PipelinePlan, job: TrainingJob, cluster: Cluster) -> Plan:
    """A simulated pipeline as a Plan, its stages placed on the cluster."""
    stages = _placed(pipeline, cluster)
    inter = pipeline.inter
    seconds = inter.iteration_time
    tflops = job.model_flops / seconds / cluster.num_devices / 1e12
    prediction = Prediction(seconds, inter.pipeline_time, inter.sync_time, job.tokens / seconds, tflops,
                            tflops * 1e12 / cluster.device.peak_flops, max(s.memory for s in inter.stages))
    return Plan("simulate", job.model.name, stages, inter.schedule, inter.num_microbatches, inter.chunks,
                pipeline.microbatch_size, job.global_batch, job.seq_len, job.model.num_params(),
                (cluster.nodes, cluster.devices_per_node), cluster.device.name, prediction, pipeline.label,
                options=(("dtype", job.dtype.short_name), ("optimizer", job.optimizer)))


def _placed(pipeline: PipelinePlan, cluster: Cluster) -> tuple[Stage, ...]:
    estimates = pipeline.stages
    devices = [s.devices for s in estimates]
    if not all(devices):  # baselines are priced unplaced; the DP's plans come placed
        origins = place_submeshes([s.submesh for s in estimates], cluster.nodes, cluster.devices_per_node)
        origins = origins or [(0, 0)] * len(estimates)  # tiling was checked before; keep the plan readable
        devices = [cluster.submesh_ids(s.submesh, o) for s, o in zip(estimates, origins, strict=True)]
    return tuple(Stage(s.first, s.last, ids, s.view, s.submesh, None, "fastest" if s.menu == 0 else f"lean-{s.menu}",
                       s.recompute, s.latency, s.memory, s.inflight, s.sync_time, s.update_time)
                 for s, ids in zip(estimates, devices, strict=True))


def simulate(job: TrainingJob, cluster: Cluster, options: PlannerOptions | None = None,
             progress: Progress | None = None, baselines: bool = True, runner: TaskRunner | None = None) -> Simulation:
    """Plan `job` on `cluster` and price the baselines; raises InfeasiblePlanError when no
    plan fits. `runner` runs the pricing tasks (default: a process pool of `options.workers`);
    a task that fails every attempt is named in the plan's notes and its view left out."""
    options = options or PlannerOptions()
    with default_runner(runner, options) as tasks_runner:
        return _simulate(job, cluster, options, progress, baselines, tasks_runner)


def _simulate(job: TrainingJob, cluster: Cluster, options: PlannerOptions, progress: Progress | None,
              baselines: bool, runner: TaskRunner) -> Simulation:
    stats = PlannerStats()
    priced: dict = {}
    best = plan_training(job, cluster, options, progress, stats, priced, runner)
    found: list[Baseline] = []
    if baselines:
        start = time.perf_counter()
        sizes = planned_microbatch_sizes(job, cluster, options)
        found.append(evaluate_megatron(job, cluster, sizes, options, priced, progress, runner))
        found.extend(evaluate_data_parallel(job, cluster, options, priced, runner))
        stats.timed("baselines", start)
    results = tuple(BaselineResult(b.name, b.config, to_plan(b.plan, job, cluster) if b.plan else None, b.reason)
                    for b in found)
    auto = to_plan(best, job, cluster)
    grid = next((b for b in found if b.name == "megatron" and b.plan is not None), None)
    if grid is not None and grid.plan.iteration_time < best.iteration_time:
        # Uniform grid points are plans of the auto search space too; the stage DP prices sync
        # per stage approximately and can miss them by a little.
        auto = replace(to_plan(replace(grid.plan, label="auto"), job, cluster),
                       notes=(f"taken from the Megatron grid ({grid.config}): "
                              f"{best.iteration_time:.4f} s from the stage DP",))
    summaries = tuple(BaselineSummary(r.name, r.config, r.plan.prediction if r.plan else None, r.reason)
                      for r in results)
    metrics = tuple((f"planner_s.{phase}", seconds) for phase, seconds in stats.phases.items())
    failed = tuple(f"pricing task {task_name(r.key)!r} failed ({r.error}); not a candidate"
                   for r in priced.values() if r.costs is None)
    return Simulation(replace(auto, baselines=summaries, metrics=metrics, notes=auto.notes + failed), results)
