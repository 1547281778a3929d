"""The simulator's pricer: model pieces + the intra-op ILP -> LayerCosts for the inter-op pass.

A model's training graph is cut into pieces (each block; the first piece (a transformer's
embedding, a ResNet's stem), stacked onto the first layer; the last (the LM head, the
classifier), stacked onto the last). Every piece is planned by the intra-op ILP on each logical
view of each candidate sub-mesh, once per memory price (a menu: the fastest plan, then plans
that hold less memory for more time), and its costs are read off the plan
(meshplan.inter.costs.layer_cost). Blocks of one kind (`layer_kind`: dense or MoE; a ResNet's
block shape) are planned once. The work is a list of independent `PricingTask`s, run through a
`meshplan.distributed.TaskRunner` (`price_tasks`): in this process, a process pool or Ray, with
retries and an optional resume cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

from meshplan.cluster.cluster import Cluster
from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.collectives import CollectiveCosts
from meshplan.cost.fusion import FORWARD, fused, is_attention, training_pass
from meshplan.cost.kernels import KernelCosts
from meshplan.cost.model import CostModel
from meshplan.distributed import Task, TaskOutcome, TaskRunner, run_tasks
from meshplan.errors import InfeasiblePlanError
from meshplan.inter.costs import LayerCost, TrainingParts, ViewCosts, layer_cost
from meshplan.intra.options import IntraOptions
from meshplan.intra.plan import IntraPlan
from meshplan.intra.solve import solve_intra, solve_intra_prices
from meshplan.ir import DType, OpKind
from meshplan.models.training import ModelConfig, PieceGraph, training_pieces
from meshplan.simulator.job import PlannerOptions, TrainingJob

# Memory prices tried per mesh, in units of the slowest axis' seconds per byte (holding a byte
# costs as much as moving it once over that axis): 0 gives the fastest plan, larger prices
# plans that shard optimizer state and weights further.
MEMORY_PRICES = (0.0, 1.0, 16.0)
LEAN_PRICES = MEMORY_PRICES[:2]  # the menu the simulator's views are priced with
# Seconds per byte charged on every value: breaks ties between equally fast plans towards the
# one that holds less (100 GB weigh 1 ms), so unpriced choices never replicate big tensors.
ACTIVATION_PRICE = 1e-14
_PASS_THROUGH = (OpKind.TRANSPOSE, OpKind.RESHAPE, OpKind.BROADCAST)
_PER_MICROBATCH_INPUTS = ("activations", "skip", "cotangent", "tokens", "images", "labels", "targets")
_ACTIVATION_INPUTS = ("activations", "skip")  # a U-Net's up block also takes its skip connection

Progress = Callable[[str, int, int], None]
# Part of every task's cache key: raise it when pricing changes what a task returns.
CACHE_VERSION = 3  # 3: ViewCosts carries its layers' largest working memory
# The op-level cost model's name and version (Prediction.cost_model): per-op strategies priced on
# the operator graph with the kernel and link models of meshplan.cost; FLAT: every op at one
# efficiency (`gemm_curve` off).
GRAPH = "graph/1"
FLAT = "flat/1"


@dataclass(frozen=True, slots=True)
class PiecePricing:
    """How pieces are priced beyond the flat rate.

    Attributes:
        kernels: the device's kernel models (GEMM curve, fused attention, memory-bound kernels
            under fusion, node-aware links); None: every op at `flops_per_second` and the
            per-axis alpha-beta links (the uncalibrated model, `--no-gemm-curve`).
        gradient_bytes: bytes per element of accumulated gradients (4: fp32 main gradients);
            None: the gradients' own dtype.
    """

    kernels: KernelCosts | None = None
    gradient_bytes: int | None = None


def training_parts(piece: PieceGraph, pricing: PiecePricing = PiecePricing()) -> TrainingParts:
    """Where a piece's training graph splits, and what it holds across micro-batches (with
    kernel models: the values fused kernels keep for the backward pass, meshplan.cost.fusion)."""
    graph = piece.graph
    inputs = tuple(n.id for n in graph.parameters() if n.name in _PER_MICROBATCH_INPUTS)
    held = tuple(v for v in range(len(graph)) if graph[v].attr("accumulated") and graph[v].kind not in _PASS_THROUGH)
    activations = tuple(v for v in inputs if graph[v].name in _ACTIVATION_INPUTS)
    parts = TrainingParts(piece.forward_end, piece.backward_end, piece.weights, inputs, activations, held)
    if pricing.kernels is None:
        return parts
    fusion = fused(graph, pricing.kernels.flash)
    arriving = set(inputs) - set(activations)  # cotangents, labels: they come with the step that reads them
    saved = tuple(sorted(v for v in fusion.kept if v not in set(piece.weights) | arriving))
    attention = tuple(n.id for n in graph.nodes[: piece.forward_end + 1] if is_attention(n))
    fp8 = tuple(v for v in saved if pricing.kernels.fp8 and _gemm_input(graph, v)) if pricing.kernels.fp8 else ()
    return replace(parts, saved=saved, attention_saved=tuple(sorted(fusion.kept_by_attention)), attention=attention,
                   fp8_saved=fp8)


def _gemm_input(graph, value: int) -> bool:
    """A value a forward GEMM reads (saved in fp8 when GEMMs run in fp8, as Transformer Engine
    keeps the cast copy)."""
    return any(graph[u].kind is OpKind.DOT and not is_attention(graph[u]) and training_pass(graph[u]) == FORWARD
               for u in graph.users(value))


def profile_piece(piece: PieceGraph, mesh: LogicalMesh, flops_per_second: float, num_microbatches: int,
                  memory_price: float = 0.0, time_limit: float = 30.0,
                  force_batch_axis: int | None = 0, reduce_scatter: bool = False,
                  pricing: PiecePricing = PiecePricing()) -> tuple[LayerCost, IntraPlan]:
    """Solve the piece's sharding on `mesh` (no memory limit: the stage DP checks memory) and
    read its costs off the plan; `reduce_scatter` as in IntraOptions; `pricing` the kernel
    models (meshplan.cost.kernels)."""
    options = piece_options(flops_per_second, num_microbatches, memory_price, time_limit, force_batch_axis,
                            reduce_scatter, pricing)
    plan = solve_intra(piece.graph, mesh.with_memory(None), options)
    return layer_cost(piece.graph, plan, training_parts(piece, pricing), num_microbatches), plan


def piece_options(flops_per_second: float, num_microbatches: int, memory_price: float, time_limit: float,
                  force_batch_axis: int | None, reduce_scatter: bool, pricing: PiecePricing) -> IntraOptions:
    """The intra-op options a piece is priced with."""
    kernels = pricing.kernels
    links = CollectiveCosts(link_efficiency=kernels.efficiency.link if kernels else None)
    return IntraOptions(cost=CostModel(links, flops_per_second=flops_per_second,
                                       accumulation_weight=1.0 / num_microbatches, memory_price=memory_price,
                                       activation_price=ACTIVATION_PRICE, kernels=kernels,
                                       gradient_bytes=pricing.gradient_bytes),
                        force_batch_dim_to_mesh_dim=force_batch_axis, time_limit=time_limit, mip_gap=1e-4,
                        reduce_scatter=reduce_scatter)


def profile_menu(piece: PieceGraph, mesh: LogicalMesh, flops_per_second: float, num_microbatches: int,
                 prices: tuple[float, ...] = MEMORY_PRICES, force_batch_axis: int | None = 0,
                 reduce_scatter: bool = False, pricing: PiecePricing = PiecePricing()) -> tuple[LayerCost, ...]:
    """Pareto-style menu: the fastest plan and plans that hold less memory for more time."""
    return tuple(cost for cost, _ in menu_plans(piece, mesh, flops_per_second, num_microbatches, prices,
                                                force_batch_axis, reduce_scatter, pricing))


def menu_plans(piece: PieceGraph, mesh: LogicalMesh, flops_per_second: float, num_microbatches: int,
               prices: tuple[float, ...] = MEMORY_PRICES, force_batch_axis: int | None = 0,
               reduce_scatter: bool = False,
               pricing: PiecePricing = PiecePricing()) -> tuple[tuple[LayerCost, IntraPlan], ...]:
    """`profile_menu`'s entries with the intra-op plan each was read from (one enumeration of
    strategies for every price: `solve_intra_prices`)."""
    unit = max(mesh.beta)
    factors = (0.0, *(f for f in prices if f > 0))
    options = piece_options(flops_per_second, num_microbatches, 0.0, 30.0, force_batch_axis, reduce_scatter, pricing)
    plans = solve_intra_prices(piece.graph, mesh.with_memory(None), options, tuple(f * unit for f in factors))
    parts = training_parts(piece, pricing)
    menu: list[tuple[LayerCost, IntraPlan]] = []
    for plan in plans:
        cost = layer_cost(piece.graph, plan, parts, num_microbatches)
        if not menu or cost.static_bytes < menu[-1][0].static_bytes * 0.999:
            menu.append((cost, plan))
    return tuple(menu)


@dataclass(frozen=True, slots=True)
class ViewKey:
    """Which priced view: the baseline family or "view" (the auto plan), micro-batch, sub-mesh, view."""

    kind: str
    microbatch_size: int
    submesh: tuple[int, int]
    view_index: int


@dataclass(frozen=True, slots=True)
class PricingTask:
    """Price every layer of `job` on one view of one sub-mesh: one independent unit of work.

    Attributes:
        lean: also price the leaner menu entries (memory prices > 0); otherwise only the fastest.
    """

    key: ViewKey
    job: TrainingJob
    cluster: Cluster
    num_microbatches: int
    options: PlannerOptions
    lean: bool = True


@dataclass(frozen=True, slots=True)
class PricingResult:
    """A task's costs, or None with the reason it failed."""

    key: ViewKey
    costs: ViewCosts | None
    error: str = ""


def price_task(task: PricingTask) -> PricingResult:
    """Run one task (in a worker process or here); a failure is returned, not raised."""
    try:
        return PricingResult(task.key, price_view(task))
    except InfeasiblePlanError as exc:  # pragma: no cover - pricing runs without a memory limit
        return PricingResult(task.key, None, str(exc))


def price_view(task: PricingTask) -> ViewCosts:
    """Profile the block(s), first and last pieces of the job on one view; the first piece is
    stacked onto the first layer and the last onto the last."""
    job, cluster, key, options = task.job, task.cluster, task.key, task.options
    mesh = planner_views(cluster, key.submesh, options.view_axes)[key.view_index]
    flops = cluster.device.peak_flops * options.efficiency
    pricing = piece_pricing(job, cluster, options)
    axis = batch_axis(mesh)
    blocks, embed, head = piece_graphs(job.model, key.microbatch_size, job.seq_len, job.dtype, job.optimizer)

    def menu(graph: PieceGraph) -> tuple[LayerCost, ...]:
        if task.lean:
            return profile_menu(graph, mesh, flops, task.num_microbatches, LEAN_PRICES, axis, options.reduce_scatter,
                                pricing)
        return (profile_piece(graph, mesh, flops, task.num_microbatches, force_batch_axis=axis,
                              reduce_scatter=options.reduce_scatter, pricing=pricing)[0],)

    overhead = layer_overhead(options)
    menus = {kind: tuple(replace(c, time=c.time + overhead) for c in menu(g)) for kind, g in blocks.items()}
    layers = [menus[job.model.layer_kind(i)] for i in range(job.model.layers)]
    layers[0] = _stacked(menu(embed), layers[0])
    layers[-1] = _stacked(layers[-1], menu(head))
    return ViewCosts(key.submesh, mesh.shape, tuple(layers))


def _stacked(first: tuple[LayerCost, ...], second: tuple[LayerCost, ...]) -> tuple[LayerCost, ...]:
    """Two pieces' menus as one layer's: entry i of each (a shorter menu repeats its last)."""
    size = max(len(first), len(second))
    return tuple(first[min(i, len(first) - 1)].stacked(second[min(i, len(second) - 1)]) for i in range(size))


def handoff_bytes(job: TrainingJob, microbatch_size: int) -> tuple[float, ...]:
    """Activations one micro-batch sends across each block boundary."""
    per_sample = job.model.boundary_elements(job.seq_len)
    return tuple(float(microbatch_size * n * job.dtype.itemsize) for n in per_sample)


def layer_overhead(options: PlannerOptions) -> float:
    """Launch and framework seconds per block and micro-batch, paid in its backward pass as the
    closed form pays them (KernelEfficiency.per_layer_overhead_s; none under the flat rate)."""
    return options.kernels.per_layer_overhead_s if options.gemm_curve else 0.0


def cost_model_name(options: PlannerOptions) -> str:
    """The name and version of the cost model the planner prices with."""
    return GRAPH if options.gemm_curve else FLAT


def piece_pricing(job: TrainingJob, cluster: Cluster, options: PlannerOptions) -> PiecePricing:
    """The kernel models the planner prices pieces with (the flat rate without `gemm_curve`):
    fused attention where the device has it, fp32 main gradients unless turned off."""
    if not options.gemm_curve:
        return PiecePricing()
    kernels = KernelCosts(cluster.device, options.kernels, flash=cluster.device.flash_attention)
    low_precision = job.dtype.itemsize < 4
    return PiecePricing(kernels, 4 if options.fp32_grads and low_precision else None)


def batch_axis(mesh: LogicalMesh) -> int:
    """The axis a stage splits its micro-batch over (Alpa's force_batch_dim_to_mesh_dim): the
    first; a view with one device there keeps its micro-batch whole."""
    del mesh
    return 0


def planner_views(cluster: Cluster, shape: tuple[int, int], max_axes: int = 2) -> tuple[LogicalMesh, ...]:
    """The logical views the planner prices sub-mesh `shape` on (the micro-batch split over
    axis 0): those of `Cluster.logical_views`, the one-axis view read as data parallelism over
    every device, (D, 1); and for a sub-mesh inside one node also (1, D): every device on the
    second axis with the micro-batch whole, i.e. tensor parallelism alone (Megatron's stage of
    one node at micro-batch 1). With `max_axes` = 3 the 3-D views follow the 2-D ones (whose
    indices stay the same): data over axis 0, the other two for the ILP to give to tensor,
    sequence or optimizer-state splits."""
    views = []
    for view in cluster.logical_views(shape, max_axes=max_axes):
        if view.shape[0] == 1 and view.shape[1] > 1:
            views.append(LogicalMesh((view.shape[1], 1), view.alpha[::-1], view.beta[::-1], view.memory_per_device,
                                     view.device_ids, view.topology))
            if shape[0] == 1:
                views.append(view)
        else:
            views.append(view)
    return tuple(views)


@functools.lru_cache(maxsize=64)
def piece_graphs(model: ModelConfig, b: int, seq: int, dtype: DType, optimizer: str):
    """`training_pieces`, cached: (blocks by kind, first piece, last piece)."""
    return training_pieces(model, b, seq, dtype, optimizer)


def build_pieces(job: TrainingJob, microbatch_size: int) -> None:
    """Build (and cache) the job's piece graphs in this process."""
    piece_graphs(job.model, microbatch_size, job.seq_len, job.dtype, job.optimizer)


def task_name(key: ViewKey) -> str:
    """E.g. "view micro-batch 8 on sub-mesh 2x4 view 0"."""
    return f"{key.kind} micro-batch {key.microbatch_size} on sub-mesh {'x'.join(map(str, key.submesh))} view " \
           f"{key.view_index}"


def task_key(task: PricingTask) -> str:
    """Everything a task's result depends on (the worker count does not), for the task cache."""
    neutral = replace(task, options=replace(task.options, workers=1))
    return f"price_task {CACHE_VERSION} {neutral!r}"


def price_tasks(tasks: list[PricingTask], runner: TaskRunner | None, progress: Progress | None,
                label: str, finished: Callable[[PricingResult], None] | None = None
                ) -> dict[ViewKey, PricingResult]:
    """Run tasks through `runner` (in this process when None); results keyed by each task's key.
    A task that failed every attempt becomes a result without costs (not a candidate).
    `finished` hears of each result as soon as it is in."""

    def tell(index: int, outcome: TaskOutcome) -> None:
        if finished:
            finished(_result(tasks[index], outcome))

    outcomes = run_tasks(price_task, [Task(task_name(t.key), task_key(t), t) for t in tasks], runner, progress,
                         label, tell)
    return {task.key: _result(task, outcome) for task, outcome in zip(tasks, outcomes, strict=True)}


def _result(task: PricingTask, outcome: TaskOutcome) -> PricingResult:
    if outcome.ok:
        return outcome.value
    tries = f" after {outcome.attempts} attempts" if outcome.attempts > 1 else ""
    return PricingResult(task.key, None, f"{outcome.error}{tries}")
