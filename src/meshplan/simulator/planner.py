"""Plan training of a model on a cluster: price the layers, run the inter-op pass, pick B.

Input: a TrainingJob, a Cluster, PlannerOptions. Output: the fastest `PipelinePlan` over the
candidate micro-batch sizes, found as in Alpa §5: for every candidate micro-batch size the
pricer (meshplan.simulator.pricing) plans each block, the embedding and the head on every view
of every sub-mesh shape, and the inter-op pass (meshplan.inter) cuts the layers into stages.
With `mesh_axes="refine"` the best plan is refined: the 3-D views of its stages' sub-meshes are
priced at its micro-batch size and its stage DP runs again with them (`refined`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from meshplan.cluster.cluster import Cluster
from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.kernels import WORKSPACE_BYTES
from meshplan.distributed import TaskRunner, make_executor
from meshplan.errors import InfeasiblePlanError, OptionsError
from meshplan.inter import InterOptions, InterPlan, LayerCosts, plan_pipeline
from meshplan.simulator.job import PlannerOptions, TrainingJob
from meshplan.simulator.pricing import (
    PricingResult,
    PricingTask,
    Progress,
    ViewKey,
    batch_axis,
    build_pieces,
    handoff_bytes,
    planner_views,
    price_tasks,
)


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    """A simulated pipeline: the inter-op plan, its micro-batch size and what produced it."""

    inter: InterPlan
    microbatch_size: int
    label: str = "auto"

    @property
    def stages(self):
        return self.inter.stages

    @property
    def num_microbatches(self) -> int:
        return self.inter.num_microbatches

    @property
    def iteration_time(self) -> float:
        return self.inter.iteration_time


@dataclass(slots=True)
class PlannerStats:
    """Seconds per planner phase, for the report."""

    phases: dict[str, float] = field(default_factory=dict)

    def timed(self, phase: str, start: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - start


Priced = dict[ViewKey, PricingResult]


def microbatch_candidates(global_batch: int, nodes: int, limit: int) -> tuple[int, ...]:
    """Divisors of the global batch spread log-uniformly, favouring sizes near the node count
    (a micro-batch must be split over a stage's nodes)."""
    divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
    useful = [d for d in divisors if max(1, nodes // 8) <= d <= max(2 * nodes, 8)] or divisors
    if len(useful) <= limit:
        return tuple(useful)
    picks = {useful[round(i * (len(useful) - 1) / (limit - 1))] for i in range(limit)} if limit > 1 else {useful[-1]}
    return tuple(sorted(picks))


def capacity(cluster: Cluster, options: PlannerOptions) -> float:
    """Bytes per device a stage's tensors may take: the usable share of the device less the
    runtime's workspace (the closed form counts the same WORKSPACE_BYTES)."""
    return cluster.device.memory_bytes * options.memory_fraction - WORKSPACE_BYTES


def auto_view_tasks(job: TrainingJob, cluster: Cluster, b: int, options: PlannerOptions) -> list[PricingTask]:
    """One task per sub-mesh view whose data axis (axis 0) takes equal shares of a micro-batch
    of size b (uneven shares leave devices idle; Megatron-style data parallelism needs the same).
    A 2-D view's axis 0 is a multiple of its nodes, so its nodes take equal shares too; a 3-D
    view's may span fewer, its other axes splitting the sequence or the tensors across nodes."""
    return [task for shape in cluster.submesh_shapes()
            for task in view_tasks(job, cluster, b, shape, options, planner_views(cluster, shape, options.view_axes))]


def view_tasks(job: TrainingJob, cluster: Cluster, b: int, shape: tuple[int, int], options: PlannerOptions,
               views: tuple[LogicalMesh, ...], first: int = 0) -> list[PricingTask]:
    """Tasks for `views` (view indices from `first` on) of sub-mesh `shape` whose data axis
    splits b evenly."""
    return [PricingTask(ViewKey("view", b, shape, index), job, cluster, job.global_batch // b, options)
            for index, view in enumerate(views, start=first) if b % view.shape[batch_axis(view)] == 0]


def refinement_tasks(job: TrainingJob, cluster: Cluster, plan: PipelinePlan,
                     options: PlannerOptions) -> list[PricingTask]:
    """The 3-D views (`mesh_axes="refine"`) of the sub-mesh shapes of 8 or more devices that the
    plan's stages use, at the plan's micro-batch size: where a 3-D view could replace a chosen
    2-D one for far fewer views than pricing every shape's (a 3-D view refines 2-D views of its
    sub-mesh, so these are the views most likely to beat the plan's)."""
    b, three = plan.microbatch_size, replace(options, mesh_axes=3)
    shapes = sorted({s.submesh for s in plan.stages if s.submesh[0] * s.submesh[1] >= 8})
    tasks = []
    for shape in shapes:
        first = len(planner_views(cluster, shape, 2))  # 3-D views follow the 2-D ones
        tasks += view_tasks(job, cluster, b, shape, three, planner_views(cluster, shape, 3)[first:], first)
    return tasks


def layer_costs(job: TrainingJob, b: int, priced: Priced, kind: str = "view") -> LayerCosts:
    """The priced views of micro-batch size b as the inter-op pass takes them."""
    views = tuple(r.costs for key, r in priced.items()
                  if key.kind == kind and key.microbatch_size == b and r.costs is not None)
    return LayerCosts(views, handoff_bytes(job, b))


def inter_options(cluster: Cluster, options: PlannerOptions) -> InterOptions:
    return InterOptions(capacity_bytes=capacity(cluster, options), relative_bucket=options.relative_bucket,
                        chunks=options.chunks, node_local_sends=options.node_local_sends,
                        link_efficiency=options.kernels.link, bucket_collectives=options.gemm_curve,
                        overlap_tail=options.kernels.dp_overlap_tail if options.overlap else None)


def plan_training(job: TrainingJob, cluster: Cluster, options: PlannerOptions | None = None,
                  progress: Progress | None = None, stats: PlannerStats | None = None,
                  priced: Priced | None = None, runner: TaskRunner | None = None) -> PipelinePlan:
    """The fastest pipeline plan over the candidate micro-batch sizes.

    Args:
        priced: a cache of priced views, filled in place (baselines reuse it).
        runner: runs the pricing tasks (default: a process pool of `options.workers`).

    Raises:
        InfeasiblePlanError: no plan fits in the devices' memory (the message says how much
            the model needs and what to change).
    """
    options = options or PlannerOptions()
    cluster = job.on(cluster)
    stats = stats if stats is not None else PlannerStats()
    priced = priced if priced is not None else {}
    with default_runner(runner, options) as tasks_runner:
        return _plan_training(job, cluster, options, progress, stats, priced, tasks_runner)


@contextmanager
def default_runner(runner: TaskRunner | None, options: PlannerOptions) -> Iterator[TaskRunner]:
    """The runner given, or (closed on exit) one with a process pool of `options.workers`."""
    if runner is not None:
        yield runner
        return
    with TaskRunner(make_executor("auto", options.workers)) as made:
        yield made


def _plan_training(job: TrainingJob, cluster: Cluster, options: PlannerOptions, progress: Progress | None,
                   stats: PlannerStats, priced: Priced, runner: TaskRunner) -> PipelinePlan:
    sizes = planned_microbatch_sizes(job, cluster, options)
    start = time.perf_counter()
    for b in sizes:
        build_pieces(job, b)  # workers build their own copies
    stats.timed("training graphs", start)
    tasks = [t for b in sizes for t in auto_view_tasks(job, cluster, b, options) if t.key not in priced]
    # The stage DP of a micro-batch size runs in a thread as soon as its views are priced, while
    # the workers price the next sizes (it used to leave them idle); plans are the same.
    with ThreadPoolExecutor(max_workers=1) as dp_thread:
        dps = _StageDPs(job, cluster, options, priced, tasks, dp_thread)
        start = time.perf_counter()
        for b in sizes:
            dps.start_if_priced(b)
        results = price_tasks(dispatch_order(tasks), runner, progress, "pricing sub-meshes, micro-batches "
                              + ", ".join(map(str, sizes)), dps.priced_one)
        stats.timed("intra-op ILPs", start)
        priced.update((t.key, results[t.key]) for t in tasks)  # in task order: the DPs and baselines read it so
        best = None
        for b in sizes:
            inter, seconds = dps.running[b].result()
            stats.phases["stage DP"] = stats.phases.get("stage DP", 0.0) + seconds
            if inter is not None and (best is None or inter.iteration_time < best.iteration_time):
                best = PipelinePlan(inter, b)
    if best is None:
        raise InfeasiblePlanError(no_fit_message_without_layouts(job, cluster, options))
    if options.mesh_axes == "refine":
        return refined(job, cluster, options, best, progress, stats, priced, runner)
    return best


def dispatch_order(tasks: list[PricingTask]) -> list[PricingTask]:
    """The order tasks are handed to the workers: micro-batch sizes in turn (each size's stage
    DP starts once its views are priced), and within a size the costliest first, so that no
    worker is left with a long task while the other idles at the end. A task's cost is
    estimated by its view: views that split both axes price many more strategies than a
    one-axis view, and more devices mean more ways to split each op."""
    first_seen = {b: i for i, b in reversed(list(enumerate(t.key.microbatch_size for t in tasks)))}
    shapes = {}
    for t in tasks:
        if t.key.submesh not in shapes:
            shapes[t.key.submesh] = [v.shape for v in planner_views(t.cluster, t.key.submesh, t.options.view_axes)]

    def order(task: PricingTask) -> tuple[int, int, int]:
        shape = shapes[task.key.submesh][task.key.view_index]
        return first_seen[task.key.microbatch_size], -sum(n > 1 for n in shape), -math.prod(shape)

    return sorted(tasks, key=order)


def refined(job: TrainingJob, cluster: Cluster, options: PlannerOptions, plan: PipelinePlan,
            progress: Progress | None, stats: PlannerStats, priced: Priced, runner: TaskRunner) -> PipelinePlan:
    """The 2-D plan, or a faster one from the stage DP at its micro-batch size over the same
    views plus the 3-D views of its stages' sub-meshes (`refinement_tasks`). The DP is exact
    over the views it is given, so it finds the 2-D plan again or a better one."""
    b = plan.microbatch_size
    tasks = [t for t in refinement_tasks(job, cluster, plan, options) if t.key not in priced]
    if not tasks:
        return plan
    start = time.perf_counter()
    priced.update(price_tasks(tasks, runner, progress, f"pricing 3-D views of the plan's sub-meshes, micro-batch {b}"))
    stats.timed("3-D refinement ILPs", start)
    start = time.perf_counter()
    inter = plan_pipeline(layer_costs(job, b, priced), cluster, job.global_batch // b, inter_options(cluster, options))
    stats.timed("3-D refinement stage DP", start)
    if inter is None or inter.iteration_time >= plan.iteration_time:
        return plan
    return PipelinePlan(inter, b, plan.label)


def image_microbatch_candidates(global_batch: int, devices: int, limit: int) -> tuple[int, ...]:
    """Micro-batch sizes for an image model: divisors of the global batch giving 8 to 64
    micro-batches (Alpa's Wide-ResNet runs used 24 to 42) that split evenly over the devices
    where possible, spread log-uniformly. Image models need micro-batches of many samples: one
    image is a small matrix for every convolution."""
    divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
    useful = [d for d in divisors if 8 <= global_batch // d <= 64] or divisors
    even = [d for d in useful if d % devices == 0]
    useful = even or useful
    if len(useful) <= limit:
        return tuple(useful)
    return tuple(sorted({useful[round(i * (len(useful) - 1) / (limit - 1))] for i in range(limit)})) \
        if limit > 1 else (useful[len(useful) // 2],)


class _StageDPs:
    """Starts the stage DP of each micro-batch size once all its views are priced; its views
    enter the DP in task order, as they would after pricing every size."""

    def __init__(self, job: TrainingJob, cluster: Cluster, options: PlannerOptions, priced: Priced,
                 tasks: list[PricingTask], thread: ThreadPoolExecutor) -> None:
        self.job, self.cluster, self.options, self.priced, self.thread = job, cluster, options, priced, thread
        self.order = {t.key: i for i, t in enumerate(tasks)}
        self.waiting: dict[int, int] = {}
        for t in tasks:
            self.waiting[t.key.microbatch_size] = self.waiting.get(t.key.microbatch_size, 0) + 1
        self.results: dict[int, list[PricingResult]] = {}
        self.running: dict[int, Future] = {}

    def priced_one(self, result: PricingResult) -> None:
        b = result.key.microbatch_size
        self.results.setdefault(b, []).append(result)
        self.waiting[b] -= 1
        self.start_if_priced(b)

    def start_if_priced(self, b: int) -> None:
        if self.waiting.get(b, 0) or b in self.running:
            return
        fresh = sorted(self.results.get(b, []), key=lambda r: self.order[r.key])
        views = {**{k: r for k, r in self.priced.items() if k.microbatch_size == b}, **{r.key: r for r in fresh}}
        self.running[b] = self.thread.submit(self._stage_dp, layer_costs(self.job, b, views), b)

    def _stage_dp(self, costs: LayerCosts, b: int) -> tuple[InterPlan | None, float]:
        start = time.perf_counter()
        options = inter_options(self.cluster, self.options)
        inter = plan_pipeline(costs, self.cluster, self.job.global_batch // b, options)
        return inter, time.perf_counter() - start


def planned_microbatch_sizes(job: TrainingJob, cluster: Cluster, options: PlannerOptions) -> tuple[int, ...]:
    if options.microbatch_sizes:
        sizes = options.microbatch_sizes
    elif job.model.sample_unit == "images":
        sizes = image_microbatch_candidates(job.global_batch, cluster.num_devices, options.max_microbatch_sizes)
    else:
        sizes = microbatch_candidates(job.global_batch, cluster.nodes, options.max_microbatch_sizes)
    _check_sizes(job, sizes)
    return tuple(sizes)


def _check_sizes(job: TrainingJob, sizes: Iterable[int]) -> None:
    for b in sizes:
        if b < 1 or job.global_batch % b:
            raise OptionsError(f"micro-batch size {b} does not divide the global batch {job.global_batch}; "
                               "pick a divisor or change --global-batch")


def no_fit_message_without_layouts(job: TrainingJob, cluster: Cluster, options: PlannerOptions) -> str:
    """Why the stage DP found no plan, with what the weights and optimizer state alone need."""
    params = job.model.num_params()
    per_param = bytes_per_parameter(job)
    need = per_param * params / cluster.num_devices  # weights, gradients and optimizer state fully sharded
    have = capacity(cluster, options)
    shorter = "a shorter sequence" if job.model.sample_unit == "tokens" else "fewer images per micro-batch"
    return (f"{job.model.name} ({params / 1e9:.1f}B parameters) does not fit on {cluster.name}: its weights, "
            f"gradients and {job.optimizer} state alone need {per_param * params / 1e9:.1f} GB, {need / 1e9:.1f} GB "
            f"per device even fully sharded over {cluster.num_devices} devices, before activations; devices offer "
            f"{have / 1e9:.1f} GB. Use more or larger devices, {shorter}, or a smaller global batch.")


def bytes_per_parameter(job: TrainingJob) -> int:
    """Weights, gradients and optimizer state per parameter: mixed-precision Adam 16 (2 + 2 + 12),
    fp32 Adam 16; SGD with momentum three times the weight's bytes (weight, gradient, trace);
    plain SGD twice."""
    size = job.dtype.itemsize
    if job.optimizer == "adam":
        return 16 if size < 4 else 4 * size
    return 3 * size if job.optimizer == "momentum" else 2 * size
