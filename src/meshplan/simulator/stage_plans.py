"""Each stage's piece plans: the intra-op plans behind a simulated plan's stages, kept for reports.

Pricing runs in worker processes and returns only costs. Once the stages are chosen, every piece
of every stage (the embedding, each kind of block, the LM head) is planned again here, on the
stage's logical view and with its menu entry: the same deterministic ILP the pricer solved, so
the plans are those the costs were read from. Each distinct (piece, sub-mesh, view, menu entry)
is solved once. The stage also gets its forward seconds and its compute / communication split,
read off the plans the way `meshplan.inter.costs.layer_cost` reads its times.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.cluster.cluster import Cluster
from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.fusion import BOUNDARY
from meshplan.inter.costs import resharding_seconds
from meshplan.inter.schedules import RUNNABLE_SCHEDULES, replayed_latency
from meshplan.intra.plan import IntraPlan
from meshplan.models.training import PieceGraph
from meshplan.plan import Plan, Stage, StagePiece
from meshplan.simulator.job import PlannerOptions, TrainingJob
from meshplan.simulator.pricing import (
    LEAN_PRICES,
    batch_axis,
    menu_plans,
    piece_graphs,
    piece_pricing,
    planner_views,
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


def with_stage_plans(plan: Plan, job: TrainingJob, cluster: Cluster, options: PlannerOptions) -> Plan:
    """`plan` with every stage's pieces, forward seconds and compute / communication split."""
    solved: dict[tuple, tuple[IntraPlan, PieceTimes]] = {}
    stages = tuple(_stage(stage, plan, job, cluster, options, solved) for stage in plan.stages)
    return _replayed(replace(plan, stages=stages))


def _replayed(plan: Plan) -> Plan:
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


def _stage(stage: Stage, plan: Plan, job: TrainingJob, cluster: Cluster, options: PlannerOptions,
           solved: dict[tuple, tuple[IntraPlan, PieceTimes]]) -> Stage:
    mesh = _mesh(cluster, stage)
    menu = 0 if stage.memory_plan == "fastest" else int(stage.memory_plan.removeprefix("lean-"))
    blocks, embed, head = piece_graphs(job.model, plan.microbatch_size, job.seq_len, job.dtype, job.optimizer)
    ranges = [("embedding", embed, 0, 0)] if stage.first_layer == 0 else []
    ranges += _block_runs(job, blocks, stage.first_layer, stage.last_layer)
    if stage.last_layer == job.model.layers - 1:
        ranges.append(("head", head, stage.last_layer, stage.last_layer))
    pieces, totals = [], [0.0, 0.0, 0.0, 0.0]
    for name, graph, first, last in ranges:
        key = (name, stage.submesh, mesh.shape, menu)
        if key not in solved:
            entries = menu_plans(graph, mesh, cluster.device.peak_flops * options.efficiency, plan.num_microbatches,
                                 LEAN_PRICES, batch_axis(mesh), options.reduce_scatter,
                                 piece_pricing(job, cluster, options))
            intra = entries[min(menu, len(entries) - 1)][1]
            solved[key] = (intra, piece_times(graph, intra))
        intra, times = solved[key]
        pieces.append(StagePiece(name, first, last, intra))
        count = last - first + 1
        for i, value in enumerate((times.forward_compute, times.forward_communication, times.backward_compute,
                                   times.backward_communication)):
            totals[i] += count * value
    again = 1.0 if stage.recompute == "full" else 0.0  # recomputation runs the forward twice
    forward = totals[0] + totals[1]
    return replace(stage, pieces=tuple(pieces), forward_s=forward, compute_s=totals[2] + (1 + again) * totals[0],
                   communication_s=totals[3] + (1 + again) * totals[1])


def _block_runs(job: TrainingJob, blocks: dict[bool, PieceGraph], first: int,
                last: int) -> list[tuple[str, PieceGraph, int, int]]:
    """Consecutive layers of one block kind (dense or MoE) as one piece each."""
    runs: list[tuple[str, PieceGraph, int, int]] = []
    for layer in range(first, last + 1):
        moe = job.model.is_moe_layer(layer)
        name = "moe-block" if moe else "block"
        if runs and runs[-1][0] == name and runs[-1][3] == layer - 1:
            runs[-1] = (name, blocks[moe], runs[-1][2], layer)
        else:
            runs.append((name, blocks[moe], layer, layer))
    return runs


def _mesh(cluster: Cluster, stage: Stage) -> LogicalMesh:
    return next(v for v in planner_views(cluster, stage.submesh) if v.shape == stage.logical_mesh)
