"""Each stage's piece plans: the intra-op plans behind a simulated plan's stages, kept for reports.

Pricing runs in worker processes and returns only costs. Once the stages are chosen, every piece
of every stage (the first piece, each kind of block, the last piece) is planned again here, on the
stage's logical view and with its menu entry: the same deterministic ILP the pricer solved, so
the plans are those the costs were read from. Each distinct (piece, sub-mesh, view, menu entry)
is solved once, as a task of the pricing's `TaskRunner` (the pool's workers are idle by then: two
solves at a time on two workers), results read in task order. The stage also gets its forward
seconds and its compute / communication split, read off the plans the way
`meshplan.inter.costs.layer_cost` reads its times.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.cluster.cluster import Cluster
from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.fusion import BOUNDARY
from meshplan.distributed import Task, TaskRunner, run_tasks
from meshplan.errors import SolverError
from meshplan.inter.costs import layer_cost, resharding_seconds
from meshplan.inter.schedules import RUNNABLE_SCHEDULES, replayed_latency
from meshplan.intra.plan import IntraPlan
from meshplan.models.training import PieceGraph
from meshplan.plan import Plan, Stage, StagePiece
from meshplan.simulator.analytic import TIME_PARTS
from meshplan.simulator.job import PlannerOptions, TrainingJob
from meshplan.simulator.pricing import (
    LEAN_PRICES,
    batch_axis,
    layer_overhead,
    menu_plans,
    piece_graphs,
    piece_pricing,
    planner_views,
    training_parts,
)


@dataclass(frozen=True, slots=True)
class PieceTimes:
    """One micro-batch of one piece on one device: forward and backward, compute and communication."""

    forward_compute: float
    forward_communication: float
    backward_compute: float
    backward_communication: float


def piece_times(piece: PieceGraph, plan: IntraPlan) -> PieceTimes:
    """Per micro-batch seconds of the plan (gradient sync and the optimizer step, once per
    iteration, are left out as `layer_cost` leaves them out of a layer's time)."""
    reshard = resharding_seconds(piece.graph, plan, piece.forward_end)
    times = [0.0, 0.0, 0.0, 0.0]
    for chosen in plan.nodes:
        if chosen.node > piece.backward_end:
            continue  # the optimizer step
        node = piece.graph[chosen.node]
        silent = node.attr("accumulated") or node.attr("kernel") == BOUNDARY
        own = 0.0 if silent else sum(c.cost for c in chosen.collectives)
        backward = 2 if chosen.node > piece.forward_end else 0
        times[backward] += chosen.compute
        times[backward + 1] += own + reshard[chosen.node]
    return PieceTimes(*times)


def with_stage_plans(plan: Plan, job: TrainingJob, cluster: Cluster, options: PlannerOptions,
                     runner: TaskRunner | None = None) -> Plan:
    """`plan` with every stage's pieces, forward seconds and compute / communication split, and
    its time breakdown (metrics `time.*`, the parts the closed form reports). `runner` solves
    the pieces (in this process when None)."""
    runs = [_piece_runs(stage, plan, job) for stage in plan.stages]
    solves = list(dict.fromkeys(solve for stage_runs in runs for solve, _, _ in stage_runs))
    solved = dict(zip(solves, _solve_pieces(solves, plan.microbatch_size, job, cluster, options, runner),
                      strict=True))
    overhead = layer_overhead(options)
    split = [with_pieces(stage, [(solved[solve], first, last) for solve, first, last in stage_runs], overhead)
             for stage, stage_runs in zip(plan.stages, runs, strict=True)]
    timed = replayed(replace(plan, stages=tuple(stage for stage, _ in split)))
    breakdown = time_breakdown(timed, [again for _, again in split])
    return replace(timed, metrics=timed.metrics + tuple((f"time.{n}", v) for n, v in breakdown))


def time_breakdown(plan: Plan, recompute_s: list[float]) -> tuple[tuple[str, float], ...]:
    """Seconds per iteration by part (analytic.TIME_PARTS): the critical stage's compute,
    collectives, recomputation (`recompute_s` per micro-batch and stage) and hand-offs over
    every micro-batch, the pipeline bubble, and the data-parallel sync and optimizer step of the
    stage whose once-per-iteration work is longest."""
    m, stages = plan.num_microbatches, plan.stages
    critical = max(range(len(stages)), key=lambda k: stages[k].latency_s)
    stage, again = stages[critical], recompute_s[critical]
    share = again / (stage.compute_s + stage.communication_s) if again else 0.0
    compute, communication = stage.compute_s * (1 - share), stage.communication_s * (1 - share)
    handoff = max(0.0, stage.latency_s - stage.compute_s - stage.communication_s)
    last = max(stages, key=lambda s: s.sync_s + s.update_s)
    parts = (m * compute, m * communication, m * again, m * handoff,
             plan.prediction.pipeline_time_s - m * stage.latency_s, last.sync_s, last.update_s)
    return tuple(zip(TIME_PARTS, parts, strict=True))


def replayed(plan: Plan) -> Plan:
    """`plan` with its pipeline time from replaying its schedule on the stages' forward and
    backward seconds (what the Chrome trace of a report shows) instead of the stage DP's closed
    form, which it never exceeds; the closed form stays in the metrics."""
    p = plan.prediction
    if p is None or plan.schedule not in RUNNABLE_SCHEDULES or plan.chunks > 1:
        return plan
    steps = [s.latency_s for s in plan.stages]
    forward = [s.forward_s for s in plan.stages]
    pipeline = replayed_latency(plan.schedule, forward, [t - f for t, f in zip(steps, forward, strict=True)],
                                plan.num_microbatches)
    iteration = pipeline + p.sync_time_s
    speedup = p.iteration_time_s / iteration
    scaled = replace(p, iteration_time_s=iteration, pipeline_time_s=pipeline,
                     tokens_per_s=_times(p.tokens_per_s, speedup),
                     tflops_per_device=_times(p.tflops_per_device, speedup),
                     mfu=_times(p.mfu, speedup))
    return replace(plan, prediction=scaled, metrics=plan.metrics + (("pipeline_s.closed_form", p.pipeline_time_s),))


def _times(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


@dataclass(frozen=True, slots=True)
class PieceSolve:
    """One piece to plan: `part` is ("first",), ("last",) or ("block", layer kind); on the
    sub-mesh's view of shape `mesh_shape`, with menu entry `menu` (0: the fastest)."""

    name: str
    part: tuple
    submesh: tuple[int, int]
    mesh_shape: tuple[int, ...]
    menu: int
    num_microbatches: int


@dataclass(frozen=True, slots=True)
class PieceSolveTask:
    """A `PieceSolve` with what solving it needs, for a worker process."""

    solve: PieceSolve
    microbatch_size: int
    job: TrainingJob
    cluster: Cluster
    options: PlannerOptions


def _piece_runs(stage: Stage, plan: Plan, job: TrainingJob) -> list[tuple[PieceSolve, int, int]]:
    """The stage's pieces in layer order, each with its first and last layer."""
    menu = 0 if stage.memory_plan == "fastest" else int(stage.memory_plan.removeprefix("lean-"))
    model, m = job.model, plan.num_microbatches
    blocks, _, _ = piece_graphs(model, plan.microbatch_size, job.seq_len, job.dtype, job.optimizer)

    def solve(name: str, part: tuple) -> PieceSolve:
        return PieceSolve(name, part, stage.submesh, stage.logical_mesh, menu, m)

    runs = [(solve(model.first_piece, ("first",)), 0, 0)] if stage.first_layer == 0 else []
    runs += [(solve(name, ("block", model.layer_kind(first))), first, last)
             for name, _, first, last in block_runs(job, blocks, stage.first_layer, stage.last_layer)]
    if stage.last_layer == model.layers - 1:
        runs.append((solve(model.last_piece, ("last",)), stage.last_layer, stage.last_layer))
    return runs


def _solve_pieces(solves: list[PieceSolve], microbatch_size: int, job: TrainingJob, cluster: Cluster,
                  options: PlannerOptions, runner: TaskRunner | None) -> list[PlannedPiece]:
    """Every solve's planned piece, in the order given; the solves run as `runner`'s tasks."""
    tasks = [Task(f"{s.name} on sub-mesh {'x'.join(map(str, s.submesh))} view {s.mesh_shape} menu {s.menu}", "",
                  PieceSolveTask(s, microbatch_size, job, cluster, options)) for s in solves]
    planned = []
    for task, outcome in zip(tasks, run_tasks(solve_piece, tasks, runner, label="stage plans"), strict=True):
        if not outcome.ok:
            raise SolverError(f"the stage plan of {task.name} failed: {outcome.error}")
        intra, attention_forward_s = outcome.value
        graph = _piece_graph(task.payload)
        planned.append(PlannedPiece(task.payload.solve.name, graph, intra, attention_forward_s))
    return planned


def _piece_graph(task: PieceSolveTask) -> PieceGraph:
    job, part = task.job, task.solve.part
    blocks, first_piece, last_piece = piece_graphs(job.model, task.microbatch_size, job.seq_len, job.dtype,
                                                   job.optimizer)
    if part[0] == "block":
        return blocks[part[1]]
    return first_piece if part[0] == "first" else last_piece


def solve_piece(task: PieceSolveTask) -> tuple[IntraPlan, float]:
    """A task: the piece's plan (the menu entry the stage chose, the same deterministic ILP
    pricing solved) and its attention cores' forward seconds."""
    solve, options, cluster = task.solve, task.options, task.cluster
    graph, mesh = _piece_graph(task), _mesh(cluster, solve.submesh, solve.mesh_shape)
    pricing = piece_pricing(task.job, cluster, options)
    entries = menu_plans(graph, mesh, cluster.device.peak_flops * options.efficiency, solve.num_microbatches,
                         LEAN_PRICES, batch_axis(mesh), options.reduce_scatter, pricing)
    intra = entries[min(solve.menu, len(entries) - 1)][1]
    cost = layer_cost(graph.graph, intra, training_parts(graph, pricing), solve.num_microbatches)
    return intra, cost.attention_forward_time


@dataclass(frozen=True, slots=True)
class PlannedPiece:
    """A piece's plan on a stage's view, and its attention cores' forward seconds (what
    selective recomputation runs again)."""

    name: str
    graph: PieceGraph
    plan: IntraPlan
    attention_forward_s: float


def with_pieces(stage: Stage, planned: list[tuple[PlannedPiece, int, int]], overhead: float) -> tuple[Stage, float]:
    """The stage with its pieces (each with its first and last layer), its forward seconds and
    compute / communication split per micro-batch (`overhead`: launch seconds per layer), and
    its recomputation seconds per micro-batch."""
    totals, attention = [0.0, 0.0, 0.0, 0.0], 0.0
    for piece, first, last in planned:
        times, count = piece_times(piece.graph, piece.plan), last - first + 1
        attention += count * piece.attention_forward_s
        for i, value in enumerate((times.forward_compute, times.forward_communication, times.backward_compute,
                                   times.backward_communication)):
            totals[i] += count * value
    totals[2] += stage.num_layers * overhead  # launch and framework time, as priced
    forward = totals[0] + totals[1]
    # Recomputation runs the forward (full) or the attention cores (selective) again.
    again = {"full": forward, "selective": attention}.get(stage.recompute, 0.0)
    share = totals[0] / forward if forward else 1.0
    pieces = tuple(StagePiece(piece.name, first, last, piece.plan) for piece, first, last in planned)
    return replace(stage, pieces=pieces, forward_s=forward, compute_s=totals[2] + totals[0] + again * share,
                   communication_s=totals[3] + totals[1] + again * (1 - share)), again


def block_runs(job: TrainingJob, blocks: dict, first: int, last: int) -> list[tuple[str, PieceGraph, int, int]]:
    """Consecutive layers of one block kind (`layer_kind`: dense or MoE, a ResNet's block shape)
    as one piece each, named by `kind_name`."""
    runs: list[tuple[str, PieceGraph, int, int]] = []
    for layer in range(first, last + 1):
        kind = job.model.layer_kind(layer)
        name = job.model.kind_name(kind)
        if runs and runs[-1][0] == name and runs[-1][3] == layer - 1:
            runs[-1] = (name, blocks[kind], runs[-1][2], layer)
        else:
            runs.append((name, blocks[kind], layer, layer))
    return runs


def _mesh(cluster: Cluster, submesh: tuple[int, int], shape: tuple[int, ...]) -> LogicalMesh:
    return next(v for v in planner_views(cluster, submesh, max_axes=3) if v.shape == shape)
