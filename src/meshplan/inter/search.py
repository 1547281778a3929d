"""The inter-op pass: layer costs -> latency table -> stage DP -> node-aware placement.

Input: `LayerCosts` (every layer priced on the logical views of the cluster's sub-mesh shapes),
the cluster, the micro-batch count and `InterOptions`. Output: an `InterPlan`: stages in
pipeline order, each a layer range on a placed sub-mesh with its view, menu entry,
recomputation, latency and memory; or None when no pipeline that uses every device fits.
Both pricers (meshplan.simulator for model specs, meshplan.parallel for captured programs)
call `plan_pipeline`, so they share the sub-mesh shapes, views, memory rule and placement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from meshplan.cluster.cluster import Cluster
from meshplan.cost.links import Links
from meshplan.errors import OptionsError
from meshplan.inter.costs import LayerCosts, ViewCosts
from meshplan.inter.placement import place_submeshes
from meshplan.inter.schedules import get_schedule
from meshplan.inter.stage_dp import StageCuts, plan_stages
from meshplan.inter.stages import (
    RECOMPUTE_CHOICES,
    IterationComm,
    StageEstimate,
    estimate_stage,
    handoff_in_node,
    handoff_time,
    latency_tables,
    stage_key,
)


@dataclass(frozen=True, slots=True)
class InterOptions:
    """Knobs of the inter-op pass.

    Attributes:
        capacity_bytes: memory each device may use (inf: unlimited).
        schedule: the pipeline schedule, a name in meshplan.inter.schedules.SCHEDULES.
        recompute: recomputation choices a stage may make ("none", "full").
        relative_bucket: bounds on the slowest stage closer than this ratio are merged
            (0 = exact; the plan is then within that ratio of the optimum on the max term).
        chunks: model chunks per device to plan for under 1F1B: 1 is plain 1F1B, v > 1 the
            interleaved schedule (virtual stages, Narayanan et al. 2021: the fill and drain shrink
            v times, each stage hands off v times per micro-batch); the fastest is kept.
        node_local_sends: the DP prices the hand-off of a stage on part of a node on the
            intra-node link and the placement puts consecutive partial-node stages in one node
            where they fit; every hand-off of the placed plan is then priced on the link it
            crosses. Off: the DP prices every hand-off on the inter-node link.
        link_efficiency: fraction of the links' nominal bandwidth hand-offs sustain (the
            simulator's KernelEfficiency.link; 1 for measured costs).
        bucket_collectives: run each stage's once-per-iteration collectives in buckets (one per
            kind and group) on the cluster's links (inter.stages.IterationComm).
        overlap_tail: overlap the once-per-iteration communication with the last micro-batch's
            backward pass, exposing at least this share of it (None: not overlapped).
    """

    capacity_bytes: float = math.inf
    schedule: str = "1f1b"
    recompute: tuple[str, ...] = RECOMPUTE_CHOICES
    relative_bucket: float = 0.0
    chunks: tuple[int, ...] = (1,)
    node_local_sends: bool = False
    link_efficiency: float = 1.0
    bucket_collectives: bool = False
    overlap_tail: float | None = None

    def __post_init__(self) -> None:
        get_schedule(self.schedule)
        if not self.chunks or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.chunks):
            raise OptionsError(f"InterOptions(chunks={self.chunks!r}): give model chunks per device as positive "
                               "integers, e.g. (1, 2, 4)")
        if self.schedule != "1f1b" and set(self.chunks) != {1}:
            raise OptionsError(f"InterOptions(chunks={self.chunks!r}) interleaves 1F1B; the {self.schedule!r} "
                               "schedule takes chunks=(1,)")
        unknown = set(self.recompute) - set(RECOMPUTE_CHOICES)
        if unknown or not self.recompute:
            raise OptionsError(f"InterOptions(recompute={self.recompute!r}): use a non-empty subset of "
                               f"{RECOMPUTE_CHOICES}")


@dataclass(frozen=True, slots=True)
class InterPlan:
    """Stages in pipeline order and the schedule they run with.

    Attributes:
        stages: layer ranges on placed sub-meshes (StageEstimate.devices are global ids).
        num_microbatches: B.
        schedule: the schedule's name.
        chunks: model chunks per device (interleaved 1F1B when > 1).
    """

    stages: tuple[StageEstimate, ...]
    num_microbatches: int
    schedule: str = "1f1b"
    chunks: int = 1

    @property
    def pipeline_time(self) -> float:
        return get_schedule(self.schedule).latency([s.latency for s in self.stages], self.num_microbatches,
                                                   self.chunks)

    @property
    def sync_time(self) -> float:
        """Once per iteration, after the pipeline drains: the slowest stage's gradient sync and update."""
        return max(s.sync_time + s.update_time for s in self.stages)

    @property
    def iteration_time(self) -> float:
        return self.pipeline_time + self.sync_time


def plan_pipeline(costs: LayerCosts, cluster: Cluster, num_microbatches: int,
                  options: InterOptions | None = None) -> InterPlan | None:
    """The stages minimising the iteration time with every device used, placed on the cluster,
    over the schedules `options` allows (1F1B and its interleaved variants); None when no such
    pipeline fits in memory or its sub-meshes do not tile the cluster."""
    options = options or InterOptions()
    # Shapes without a priced view are no candidates: leaving them out keeps the table small.
    shapes = [shape for shape in cluster.submesh_shapes() if costs.views_of(shape)]
    if not shapes:
        return None
    best = None
    schedule = get_schedule(options.schedule)
    per_shape = [costs.views_of(shape) for shape in shapes]
    chunk_counts = sorted(set(options.chunks))
    # With v chunks each stage hands off v times per micro-batch: one table per chunk count.
    tables = latency_tables(costs, per_shape, cluster, num_microbatches, options.capacity_bytes, schedule,
                            options.recompute, chunk_counts, options.node_local_sends, options.link_efficiency,
                            options.overlap_tail)
    sizes = [n * m for n, m in shapes]
    for chunks, table in zip(chunk_counts, tables, strict=True):
        # With v chunks per device the latency B t_max + (sum - t_max) / v is 1/v of the DP's
        # objective for v B micro-batches.
        found = plan_stages(table, sizes, cluster.num_devices, chunks * num_microbatches, options.relative_bucket,
                            chunks)
        if found is None:
            # The tables differ only in finite hand-off seconds, so which stages fit is the same
            # for every chunk count: none has a plan either.
            break
        plan = _placed_plan(costs, cluster, shapes, per_shape, found, num_microbatches, options, chunks)
        if plan is not None and (best is None or plan.iteration_time < best.iteration_time):
            best = plan
    return best


def _placed_plan(costs: LayerCosts, cluster: Cluster, shapes: list[tuple[int, int]],
                 per_shape: list[tuple[ViewCosts, ...]], found: StageCuts, num_microbatches: int,
                 options: InterOptions, chunks: int) -> InterPlan | None:
    """The DP's stages placed on the cluster, each with its best estimate (handing off `chunks`
    times per micro-batch); None when their sub-meshes do not tile the cluster."""
    origins = place_submeshes([shapes[s.submesh] for s in found.stages], cluster.nodes, cluster.devices_per_node,
                              keep_neighbours=options.node_local_sends)
    if origins is None:
        return None  # the sub-meshes do not tile this cluster (possible when M is not a power of two)
    stages = []
    for j, (slot, origin) in enumerate(zip(found.stages, origins, strict=True)):
        estimate = best_estimate(costs, per_shape[slot.submesh], cluster, slot.first, slot.last,
                                 len(found.stages) - j, num_microbatches, options, chunks)
        stages.append(replace(estimate, devices=cluster.submesh_ids(shapes[slot.submesh], origin)))
    if options.node_local_sends:
        stages = _placed_sends(costs, cluster, stages, chunks, options.link_efficiency)
    name = options.schedule if chunks == 1 else "interleaved-1f1b"
    return InterPlan(tuple(stages), num_microbatches, name, chunks)


def _placed_sends(costs: LayerCosts, cluster: Cluster, stages: list[StageEstimate], chunks: int,
                  link_efficiency: float) -> list[StageEstimate]:
    """Re-price every hand-off on the link it crosses once the stages are placed: inside a node
    when both stages sit in one, across nodes otherwise (the DP assumed `handoff_in_node`)."""
    per_node = cluster.devices_per_node
    repriced = []
    for j, stage in enumerate(stages[:-1]):
        nodes = {i // per_node for i in (*stage.devices, *stages[j + 1].devices)}
        view = ViewCosts(stage.submesh, stage.view, ())
        priced = handoff_time(costs, view, stage.last, cluster, handoff_in_node(view, cluster, True), link_efficiency)
        actual = handoff_time(costs, view, stage.last, cluster, len(nodes) == 1, link_efficiency)
        repriced.append(replace(stage, latency=stage.latency + chunks * (actual - priced)))
    return [*repriced, stages[-1]]


def iteration_comm(cluster: Cluster, options: InterOptions) -> IterationComm:
    """How `options` runs the once-per-iteration communication of the stages on `cluster`."""
    links = Links.of(cluster.device, options.link_efficiency) if options.bucket_collectives else None
    return IterationComm(links, options.overlap_tail)


def best_estimate(costs: LayerCosts, views: tuple[ViewCosts, ...], cluster: Cluster, first: int, last: int,
                  stages_left: int, num_microbatches: int, options: InterOptions,
                  chunks: int = 1) -> StageEstimate | None:
    """The fastest fitting estimate of layers first..last over the views of one sub-mesh shape
    (handing off `chunks` times per micro-batch)."""
    schedule = get_schedule(options.schedule)
    found = [estimate_stage(v, first, last, stages_left, num_microbatches, options.capacity_bytes,
                            chunks * handoff_time(costs, v, last, cluster,
                                                  handoff_in_node(v, cluster, options.node_local_sends),
                                                  options.link_efficiency),
                            schedule, options.recompute, iteration_comm(cluster, options))
             for v in views]
    found = [e for e in found if e is not None]
    return min(found, key=lambda e: stage_key(e, num_microbatches)) if found else None
