"""Baselines priced by the same cost model: data parallel, ZeRO-2, Megatron-style (tp, pp, dp),
and its pipeline and data-parallel part alone (PP-DP: tp = 1) for models without a Megatron
recipe (convolutional networks).

Each baseline is a fixed family of plans evaluated with the same per-layer ILP prices and
stage estimates as the auto plan, so the comparison isolates the search, not the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.cluster.cluster import Cluster
from meshplan.cost.kernels import ADAM_STATE_BYTES
from meshplan.distributed import TaskRunner
from meshplan.inter import InterPlan, LayerCosts, ViewCosts, get_schedule
from meshplan.inter.search import iteration_comm
from meshplan.inter.stages import (
    RECOMPUTE_CHOICES,
    IterationComm,
    StageEstimate,
    estimate_stage,
    handoff_time,
    leanest_memory,
)
from meshplan.simulator.job import PlannerOptions, TrainingJob
from meshplan.simulator.planner import PipelinePlan, Priced, capacity, inter_options, planned_microbatch_sizes
from meshplan.simulator.pricing import PricingTask, ViewKey, handoff_bytes, planner_views, price_tasks

_ONE_F_ONE_B = get_schedule("1f1b")


@dataclass(frozen=True, slots=True)
class Baseline:
    """A baseline's best plan, or why none fits."""

    name: str
    plan: PipelinePlan | None
    reason: str = ""
    config: str = ""


def megatron_grid(cluster: Cluster) -> list[tuple[int, int, int]]:
    """(tp, pp, dp) with tp inside a node and each stage on whole nodes or part of one node."""
    points = []
    devices, per_node = cluster.num_devices, cluster.devices_per_node
    for tp in (t for t in range(1, per_node + 1) if per_node % t == 0):
        for pp in range(1, devices // tp + 1):
            if devices % (tp * pp) == 0 and _stage_shape(cluster, devices // pp) is not None:
                points.append((tp, pp, devices // (tp * pp)))
    return points


def _stage_shape(cluster: Cluster, devices: int) -> tuple[int, int] | None:
    m = cluster.devices_per_node
    if devices >= m and devices % m == 0:
        return (devices // m, m)
    if devices < m and (1, devices) in cluster.submesh_shapes():
        return (1, devices)
    return None


def _view_index(cluster: Cluster, shape: tuple[int, int], logical: tuple[int, int]) -> int | None:
    """The planner view (data-parallel, tensor-parallel) = `logical` of the sub-mesh."""
    return next((i for i, view in enumerate(planner_views(cluster, shape)) if view.shape == logical), None)


def _task(job: TrainingJob, cluster: Cluster, key: ViewKey, options: PlannerOptions, lean: bool = True) -> PricingTask:
    return PricingTask(key, job, cluster, job.global_batch // key.microbatch_size, options, lean)


def evaluate_megatron(job: TrainingJob, cluster: Cluster, sizes: tuple[int, ...], options: PlannerOptions,
                      priced: Priced, progress=None, runner: TaskRunner | None = None,
                      tensor_parallel: bool = True) -> Baseline:
    """The best feasible (tp, pp, dp) grid point: equal layer counts per stage, data parallel over
    axis 0 and the intra-op ILP free on the tensor-parallel axis; without `tensor_parallel`, the
    grid points of tp = 1 ("pp-dp")."""
    name = "megatron" if tensor_parallel else "pp-dp"
    tasks, points = {}, []
    for tp, pp, dp in megatron_grid(cluster):
        if pp > job.model.layers or (tp > 1 and not tensor_parallel):
            continue
        shape = _stage_shape(cluster, cluster.num_devices // pp)
        index = _view_index(cluster, shape, (dp, tp))
        if index is None:
            continue
        for b in sizes:
            if b % dp:
                continue
            key = ViewKey("view", b, shape, index)
            points.append((tp, pp, dp, b, key))
            if key not in priced:
                tasks[key] = _task(job, cluster, key, options)
    priced.update(price_tasks(list(tasks.values()), runner, progress, f"pricing {name} grid"))
    best, best_config = None, ""
    for tp, pp, dp, b, key in points:
        costs = priced[key].costs
        plan = uniform_pipeline(job, cluster, costs, pp, b, options) if costs else None
        if plan is not None and (best is None or plan.iteration_time < best.iteration_time):
            best, best_config = plan, f"tp={tp} pp={pp} dp={dp} micro-batch={b}"
    if best is None:
        return Baseline(name, None, f"no {'(tp, pp, dp)' if tensor_parallel else '(pp, dp)'} grid point fits in memory")
    return Baseline(name, replace(best, label=name), config=best_config)


def uniform_pipeline(job: TrainingJob, cluster: Cluster, view: ViewCosts, pp: int, b: int,
                     options: PlannerOptions, recompute: tuple[str, ...] = RECOMPUTE_CHOICES,
                     chunks: int = 1) -> PipelinePlan | None:
    """pp stages with (nearly) equal layer counts, all on `view`; with `chunks` > 1 the
    interleaved schedule, whose extra sends are priced too."""
    layers, num_microbatches = job.model.layers, job.global_batch // b
    costs = LayerCosts((view,), handoff_bytes(job, b))
    bounds = [round(j * layers / pp) for j in range(pp + 1)]
    per_node = cluster.devices_per_node
    stages = []
    for j in range(pp):
        last = bounds[j + 1] - 1
        # Stages take consecutive devices: a partial-node stage hands off inside its node unless
        # the next stage starts a new one.
        in_node = view.devices < per_node and ((j + 1) * view.devices) % per_node != 0
        transfer = handoff_time(costs, view, last, cluster, in_node, options.kernels.link)
        estimate = estimate_stage(view, bounds[j], last, pp - j, num_microbatches, capacity(cluster, options),
                                  transfer, _ONE_F_ONE_B, recompute, _iteration(cluster, options))
        if estimate is None:
            return None
        if chunks > 1 and j < pp - 1:  # each chunk boundary is one more send and receive
            estimate = replace(estimate, latency=estimate.latency + (chunks - 1) * transfer)
        stages.append(estimate)
    schedule = "1f1b" if chunks == 1 else "interleaved-1f1b"
    return PipelinePlan(InterPlan(tuple(stages), num_microbatches, schedule, chunks), b)


def evaluate_configuration(job: TrainingJob, cluster: Cluster, tp: int, pp: int, microbatch_size: int,
                           options: PlannerOptions, recompute: tuple[str, ...] = RECOMPUTE_CHOICES,
                           priced: Priced | None = None, chunks: int = 1) -> PipelinePlan | None:
    """Predict one given Megatron-style configuration (to compare with published runs)."""
    priced = priced if priced is not None else {}
    dp = cluster.num_devices // (tp * pp)
    shape = _stage_shape(cluster, cluster.num_devices // pp)
    index = None if shape is None else _view_index(cluster, shape, (dp, tp))
    if index is None or microbatch_size % dp or job.global_batch % microbatch_size:
        return None
    key = ViewKey("view", microbatch_size, shape, index)
    if key not in priced:
        priced.update(price_tasks([_task(job, cluster, key, options)], None, None, "pricing configuration"))
    costs = priced[key].costs
    return uniform_pipeline(job, cluster, costs, pp, microbatch_size, options, recompute, chunks) if costs else None


def evaluate_data_parallel(job: TrainingJob, cluster: Cluster, options: PlannerOptions,
                           priced: Priced, runner: TaskRunner | None = None) -> tuple[Baseline, Baseline]:
    """Pure data parallelism over every device (weights replicated) and ZeRO-2 (gradients and
    optimizer state sharded over all devices, the same communication volume), each at the
    fastest of `data_parallel_microbatches` that fits."""
    devices = cluster.num_devices
    shape = (cluster.nodes, cluster.devices_per_node)
    index = _view_index(cluster, shape, (devices, 1))
    sizes = data_parallel_microbatches(job, cluster, options)
    if index is None or not sizes:
        reason = f"the global batch {job.global_batch} cannot be split evenly over {devices} devices"
        return Baseline("data-parallel", None, reason), Baseline("zero-2", None, reason)
    tasks = [_task(job, cluster, key, replace(options, reduce_scatter=False), lean=False)
             for key in (ViewKey("dp", b, shape, index) for b in sizes) if key not in priced]
    # gradients all-reduced: reduce-scattering them would be ZeRO-2 already
    priced.update(price_tasks(tasks, runner, None, "pricing data parallel"))
    found = [_data_parallel_at(job, cluster, options, priced[ViewKey("dp", b, shape, index)].costs, b) for b in sizes]
    return _fastest([plain for plain, _ in found]), _fastest([zero for _, zero in found])


def data_parallel_microbatches(job: TrainingJob, cluster: Cluster, options: PlannerOptions) -> tuple[int, ...]:
    """Micro-batch sizes the data-parallel baselines try: the smallest even split of the global
    batch over the devices (a transformer's sequences fill a device already); for image models
    also the planner's micro-batch sizes that split evenly (one image per device would leave
    every convolution a thin matrix)."""
    devices = cluster.num_devices
    smallest = next((d for d in range(devices, job.global_batch + 1, devices) if job.global_batch % d == 0), None)
    if smallest is None:
        return ()
    if job.model.sample_unit == "tokens":
        return (smallest,)
    planned = [b for b in planned_microbatch_sizes(job, cluster, options) if b % devices == 0]
    return tuple(sorted({smallest, *planned}))


def _data_parallel_at(job: TrainingJob, cluster: Cluster, options: PlannerOptions, view: ViewCosts,
                      b: int) -> tuple[Baseline, Baseline]:
    """Data parallel and ZeRO-2 at micro-batch size b."""
    devices = cluster.num_devices
    num_microbatches = job.global_batch // b
    usable = capacity(cluster, options)
    config = f"dp={devices} micro-batch={b} ({b // devices} per device)"
    last = job.model.layers - 1
    iteration = _iteration(cluster, options)
    plain = estimate_stage(view, 0, last, 1, num_microbatches, usable, 0.0, _ONE_F_ONE_B, iteration=iteration)
    # ZeRO-2 keeps the weights and shards the gradients and optimizer state over every device.
    weight, held = job.dtype.itemsize, job.dtype.itemsize + _gradient_bytes(job, options) + _state_bytes(job)
    saved = _static(view) * (1 - (weight + (held - weight) / devices) / held)
    zero = estimate_stage(view, 0, last, 1, num_microbatches, usable + saved, 0.0, _ONE_F_ONE_B, iteration=iteration)
    need = leanest_memory(view, 0, last, 1, num_microbatches, _ONE_F_ONE_B)
    results = []
    for name, stage, extra in (("data-parallel", plain, 0.0), ("zero-2", zero, saved)):
        if stage is None:
            results.append(Baseline(name, None, f"needs {(need - extra) / 1e9:.1f} GB per device, "
                                                f"{usable / 1e9:.1f} GB usable", config))
        else:
            stage = replace(stage, memory=stage.memory - extra)
            results.append(Baseline(name, _single_stage(stage, b, num_microbatches, name), config=config))
    return results[0], results[1]


def _fastest(found: list[Baseline]) -> Baseline:
    """The fastest baseline that fits, else the first (whose reason says what it needs)."""
    fits = [b for b in found if b.plan is not None]
    return min(fits, key=lambda b: b.plan.iteration_time) if fits else found[0]


def _iteration(cluster: Cluster, options: PlannerOptions) -> IterationComm:
    return iteration_comm(cluster, inter_options(cluster, options))


def _state_bytes(job: TrainingJob) -> int:
    """Optimizer state per parameter: Adam's (fp32 master copy with low-precision weights, m, v),
    the momentum trace, or none for plain SGD."""
    if job.optimizer == "adam":
        return ADAM_STATE_BYTES if job.dtype.itemsize < 4 else 2 * job.dtype.itemsize
    return job.dtype.itemsize if job.optimizer == "momentum" else 0


def _gradient_bytes(job: TrainingJob, options: PlannerOptions) -> int:
    return 4 if options.fp32_grads and job.dtype.itemsize < 4 else job.dtype.itemsize


def _single_stage(stage: StageEstimate, b: int, num_microbatches: int, label: str) -> PipelinePlan:
    return PipelinePlan(InterPlan((stage,), num_microbatches), b, label)


def _static(view: ViewCosts) -> float:
    return sum(menu[0].static_bytes for menu in view.layers)
