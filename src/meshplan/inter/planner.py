"""Plan training of a transformer on a cluster: profile pieces, run the stage DP, pick B.

Input: a model, a cluster, the global batch and sequence length. Output: a TrainingPlan
(pipeline stages with their sub-meshes, logical views, recomputation and memory; the micro-
batch count; the predicted iteration time), found as in Alpa §5: for every candidate
micro-batch size, the intra-op ILP prices each block, the embedding and the head on every
sub-mesh view (in a process pool), and the stage DP cuts the blocks into stages.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from meshplan.cluster.cluster import Cluster
from meshplan.cluster.mesh import LogicalMesh
from meshplan.errors import InfeasiblePlanError, ModelSpecError, OptionsError
from meshplan.inter.placement import place_submeshes
from meshplan.inter.profile import MEMORY_PRICES, profile_menu, profile_piece
from meshplan.inter.stage_dp import pipeline_latency, plan_stages
from meshplan.inter.stages import StageEstimate, ViewCosts, best_estimate, latency_table
from meshplan.ir import DType
from meshplan.models.training import (
    OPTIMIZERS,
    block_training_graph,
    embedding_training_graph,
    head_training_graph,
)
from meshplan.models.transformer import TransformerConfig


@dataclass(frozen=True, slots=True)
class TrainingJob:
    """What to train: the model, the global batch (sequences per iteration), the sequence length."""

    model: TransformerConfig
    global_batch: int
    seq_len: int
    dtype: DType = DType.BF16
    optimizer: str = "adam"

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.seq_len < 1:
            raise ModelSpecError(f"global batch ({self.global_batch}) and sequence length ({self.seq_len}) "
                                 "must be at least 1")
        if self.optimizer not in OPTIMIZERS:
            raise ModelSpecError(f"unknown optimizer {self.optimizer!r}; use one of {', '.join(OPTIMIZERS)}")

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def model_flops(self) -> float:
        """Training FLOPs per iteration by the usual 6 N T rule (N parameters, T tokens)."""
        return 6.0 * self.model.num_params() * self.tokens


@dataclass(frozen=True, slots=True)
class PlannerOptions:
    """Knobs of the planner.

    Attributes:
        efficiency: fraction of the device's peak FLOP/s sustained by its kernels.
        memory_fraction: share of device memory plans may use (the rest: runtime, fragmentation).
        microbatch_sizes: sequences per micro-batch to try; empty = chosen from the batch.
        max_microbatch_sizes: how many to try when chosen automatically.
        workers: processes pricing candidates in parallel (1 = in this process).
        relative_bucket: t_max values of the DP closer than this ratio are merged.
        time_limit: seconds per ILP.
        reduce_scatter: contractions may reduce-scatter their partial sums (IntraOptions); the
            data-parallel and ZeRO-2 baselines never do (they all-reduce by definition). On by
            default: GPU collectives run it as such, and it predicts published runs better
            (docs/validation.md).
    """

    efficiency: float = 0.5
    memory_fraction: float = 0.9
    microbatch_sizes: tuple[int, ...] = ()
    max_microbatch_sizes: int = 3
    workers: int = 2
    relative_bucket: float = 0.01
    time_limit: float = 30.0
    reduce_scatter: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.efficiency <= 1 or not 0 < self.memory_fraction <= 1:
            raise OptionsError("efficiency and memory_fraction must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    """A pipeline plan and its predicted time per iteration."""

    stages: tuple[StageEstimate, ...]
    microbatch_size: int
    num_microbatches: int
    iteration_time: float
    label: str = "auto"
    chunks: int = 1  # model chunks per device (interleaved 1F1B when > 1)

    @property
    def pipeline_time(self) -> float:
        return pipeline_latency([s.latency for s in self.stages], self.num_microbatches, self.chunks)

    @property
    def sync_time(self) -> float:
        return max(s.sync_time + s.update_time for s in self.stages)


@dataclass(slots=True)
class PlannerStats:
    """Seconds per planner phase, for the report."""

    phases: dict[str, float] = field(default_factory=dict)

    def timed(self, phase: str, start: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - start


Progress = Callable[[str, int, int], None]


def microbatch_candidates(global_batch: int, nodes: int, limit: int) -> tuple[int, ...]:
    """Divisors of the global batch spread log-uniformly, favouring sizes near the node count
    (a micro-batch must be split over a stage's nodes)."""
    divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
    useful = [d for d in divisors if max(1, nodes // 8) <= d <= max(2 * nodes, 8)] or divisors
    if len(useful) <= limit:
        return tuple(useful)
    picks = {useful[round(i * (len(useful) - 1) / (limit - 1))] for i in range(limit)} if limit > 1 else {useful[-1]}
    return tuple(sorted(picks))


# -- pricing views (runs in worker processes) ----------------------------------------------------


@functools.lru_cache(maxsize=64)
def _pieces(model: TransformerConfig, b: int, seq: int, dtype: DType, optimizer: str):
    kinds = sorted({model.is_moe_layer(i) for i in range(model.layers)})
    blocks = {moe: block_training_graph(model, _layer_of_kind(model, moe), b, seq, dtype, optimizer) for moe in kinds}
    return (blocks, embedding_training_graph(model, b, seq, dtype, optimizer),
            head_training_graph(model, b, seq, dtype, optimizer))


def _layer_of_kind(model: TransformerConfig, moe: bool) -> int:
    return next(i for i in range(model.layers) if model.is_moe_layer(i) == moe)


def price_view(job: TrainingJob, cluster: Cluster, shape: tuple[int, int], view_index: int, b: int,
               num_microbatches: int, options: PlannerOptions, lean: bool = True) -> ViewCosts:
    """Profile the block(s), embedding and head of `job` on one view of sub-mesh `shape`."""
    mesh = cluster.logical_views(shape)[view_index]
    flops = cluster.device.peak_flops * options.efficiency
    axis = batch_axis(mesh)
    blocks, embed, head = _pieces(job.model, b, job.seq_len, job.dtype, job.optimizer)
    def menu(graph) -> tuple:
        if lean:
            return profile_menu(graph, mesh, flops, num_microbatches, MEMORY_PRICES[:2], axis, options.reduce_scatter)
        return (profile_piece(graph, mesh, flops, num_microbatches, force_batch_axis=axis,
                              reduce_scatter=options.reduce_scatter)[0],)

    menus = {moe: menu(g) for moe, g in blocks.items()}
    per_block = tuple(menus[job.model.is_moe_layer(i)] for i in range(job.model.layers))
    return ViewCosts(shape, mesh.shape, per_block, menu(embed), menu(head), transfer_time(job, cluster, mesh, b))


def batch_axis(mesh: LogicalMesh) -> int:
    """The axis a stage splits its micro-batch over: the first axis with several devices."""
    return next((a for a, s in enumerate(mesh.shape) if s > 1), 0)


def transfer_time(job: TrainingJob, cluster: Cluster, mesh: LogicalMesh, b: int) -> float:
    """Activations to the next stage and their gradient back, each device sending its share
    over the inter-node link (the placement of neighbouring stages is not known here)."""
    nbytes = b * job.seq_len * job.model.hidden * job.dtype.itemsize / mesh.num_devices
    device = cluster.device
    return 2 * (device.inter_latency + nbytes / device.inter_bandwidth)


def _price_task(args) -> tuple[tuple, ViewCosts | None, str]:
    key, job, cluster, shape, view_index, b, num_microbatches, options, lean = args
    try:
        return key, price_view(job, cluster, shape, view_index, b, num_microbatches, options, lean), ""
    except InfeasiblePlanError as exc:  # pragma: no cover - pricing runs without a memory limit
        return key, None, str(exc)


def run_tasks(tasks: list[tuple], workers: int, progress: Progress | None, label: str) -> dict[tuple, ViewCosts | None]:
    """Price views, in a process pool when `workers` > 1; results keyed by each task's key."""
    results = {}
    if workers > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for done, (key, costs, _) in enumerate(pool.map(_price_task, tasks), start=1):
                results[key] = costs
                if progress:
                    progress(label, done, len(tasks))
    else:
        for done, task in enumerate(tasks, start=1):
            key, costs, _ = _price_task(task)
            results[key] = costs
            if progress:
                progress(label, done, len(tasks))
    return results


# -- the auto plan -------------------------------------------------------------------------------


def auto_view_tasks(job: TrainingJob, cluster: Cluster, b: int, options: PlannerOptions) -> list[tuple]:
    """One task per sub-mesh whose nodes take equal shares of a micro-batch of size b (uneven
    shares leave devices idle; Megatron-style data parallelism needs the same)."""
    num_microbatches = job.global_batch // b
    tasks = []
    for shape in cluster.submesh_shapes():
        if b % shape[0]:
            continue
        for index, view in enumerate(cluster.logical_views(shape)):
            if b % view.shape[batch_axis(view)] == 0:
                tasks.append((("view", b, shape, index), job, cluster, shape, index, b, num_microbatches,
                              options, True))
    return tasks


def views_by_shape(cluster: Cluster, b: int, priced: dict) -> list[list[ViewCosts]]:
    return [[costs for (_, bb, shape, _), costs in priced.items() if bb == b and shape == s and costs is not None]
            for s in cluster.submesh_shapes()]


def plan_from_costs(job: TrainingJob, cluster: Cluster, b: int, per_shape: list[list[ViewCosts]],
                    options: PlannerOptions, stats: PlannerStats) -> PipelinePlan | None:
    """Run the stage DP on priced views and turn its answer into stage estimates."""
    num_microbatches = job.global_batch // b
    capacity = cluster.device.memory_bytes * options.memory_fraction
    start = time.perf_counter()
    table = latency_table(per_shape, job.model.layers, num_microbatches, capacity)
    shapes = cluster.submesh_shapes()
    sizes = [s[0] * s[1] for s in shapes]
    found = plan_stages(table, sizes, cluster.num_devices, num_microbatches, options.relative_bucket)
    stats.timed("stage DP", start)
    if found is None:
        return None
    if place_submeshes([shapes[s.submesh] for s in found.stages], cluster.nodes, cluster.devices_per_node) is None:
        return None  # the sub-meshes do not tile this cluster (possible when M is not a power of two)
    stages = []
    for j, slot in enumerate(found.stages):
        estimate = best_estimate(per_shape[slot.submesh], slot.first, slot.last, len(found.stages) - j,
                                 num_microbatches, capacity)
        stages.append(estimate)
    return pipeline_plan(stages, b, num_microbatches)


def pipeline_plan(stages: list[StageEstimate], b: int, num_microbatches: int, label: str = "auto",
                  chunks: int = 1) -> PipelinePlan:
    latency = pipeline_latency([s.latency for s in stages], num_microbatches, chunks)
    sync = max(s.sync_time + s.update_time for s in stages)
    return PipelinePlan(tuple(stages), b, num_microbatches, latency + sync, label, chunks)


def plan_training(job: TrainingJob, cluster: Cluster, options: PlannerOptions | None = None,
                  progress: Progress | None = None, stats: PlannerStats | None = None,
                  priced: dict | None = None) -> PipelinePlan:
    """The fastest pipeline plan over the candidate micro-batch sizes.

    Args:
        priced: a cache of priced views, filled in place (baselines reuse it).

    Raises:
        InfeasiblePlanError: no plan fits in the devices' memory (the message says how much
            the model needs and what to change).
    """
    options = options or PlannerOptions()
    stats = stats if stats is not None else PlannerStats()
    priced = priced if priced is not None else {}
    best = None
    for b in planned_microbatch_sizes(job, cluster, options):
        start = time.perf_counter()
        _pieces(job.model, b, job.seq_len, job.dtype, job.optimizer)  # workers build their own copies
        stats.timed("training graphs", start)
        start = time.perf_counter()
        tasks = [t for t in auto_view_tasks(job, cluster, b, options) if t[0] not in priced]
        priced.update(run_tasks(tasks, options.workers, progress, f"pricing sub-meshes, micro-batch {b}"))
        stats.timed("intra-op ILPs", start)
        plan = plan_from_costs(job, cluster, b, views_by_shape(cluster, b, priced), options, stats)
        if plan is not None and (best is None or plan.iteration_time < best.iteration_time):
            best = plan
    if best is None:
        raise InfeasiblePlanError(_no_fit_message(job, cluster, options))
    return best


def planned_microbatch_sizes(job: TrainingJob, cluster: Cluster, options: PlannerOptions) -> tuple[int, ...]:
    sizes = options.microbatch_sizes or microbatch_candidates(job.global_batch, cluster.nodes,
                                                              options.max_microbatch_sizes)
    _check_sizes(job, sizes)
    return tuple(sizes)


def _check_sizes(job: TrainingJob, sizes: Iterable[int]) -> None:
    for b in sizes:
        if b < 1 or job.global_batch % b:
            raise OptionsError(f"micro-batch size {b} does not divide the global batch {job.global_batch}; "
                               "pick a divisor or change --global-batch")


def _no_fit_message(job: TrainingJob, cluster: Cluster, options: PlannerOptions) -> str:
    params = job.model.num_params()
    need = 16 * params / cluster.num_devices  # weights, gradients and Adam state fully sharded
    have = cluster.device.memory_bytes * options.memory_fraction
    return (f"{job.model.name} ({params / 1e9:.1f}B parameters) does not fit on {cluster.name}: mixed-precision "
            f"Adam alone needs {16 * params / 1e9:.1f} GB, {need / 1e9:.1f} GB per device even fully sharded over "
            f"{cluster.num_devices} devices, before activations; devices offer {have / 1e9:.1f} GB. Use more or "
            "larger devices, a shorter sequence, or a smaller global batch.")

