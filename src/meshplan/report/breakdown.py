"""Where a plan's time goes: collectives per stage and mesh axis, and an iteration split into
compute, communication, hand-offs, pipeline bubble, gradient sync and optimizer.

Input: a Plan. Output: rows for the text and HTML reports. Collectives are read off the stages'
intra-op plans: a collective of a node tagged `accumulated` (a weight gradient summed over
micro-batches) runs once per iteration as gradient sync, one of a `per_iteration` node (the
optimizer step) once per iteration, any other once per micro-batch; a piece plan counts once per
layer it covers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from meshplan.cost.collectives import Collective
from meshplan.intra.plan import ChosenStrategy, IntraPlan
from meshplan.plan import Plan, Stage

MICRO_BATCH, GRADIENT_SYNC, OPTIMIZER = "per micro-batch", "gradient sync", "optimizer"


@dataclass(frozen=True, slots=True)
class CollectiveRow:
    """Collectives of one kind on one set of mesh axes in one stage, over one iteration.

    Attributes:
        when: MICRO_BATCH, GRADIENT_SYNC or OPTIMIZER.
        count: how many run per iteration; nbytes: bytes per device over the iteration;
        seconds: their predicted time (the plan's cost unit for `meshplan intra` plans).
    """

    stage: int
    kind: str
    axes: tuple[int, ...]
    when: str
    count: int
    nbytes: float
    seconds: float


@dataclass(frozen=True, slots=True)
class TimeRow:
    """One stage's iteration: seconds busy computing, communicating and handing off, idle in
    the pipeline bubble, then synchronising gradients and updating (None where unknown)."""

    stage: int
    compute: float | None
    communication: float | None
    handoff: float | None
    bubble: float | None
    sync: float
    update: float


def stage_plans(stage: Stage) -> Iterator[tuple[str, int, IntraPlan]]:
    """(piece name, layers it covers, plan) of a stage: its pieces, or its one intra-op plan."""
    for piece in stage.pieces:
        yield piece.name, piece.last_layer - piece.first_layer + 1, piece.intra_plan
    if not stage.pieces and stage.intra_plan is not None:
        yield "stage", 1, stage.intra_plan


def _when(chosen: ChosenStrategy) -> str:
    if "accumulated" in chosen.tags:
        return GRADIENT_SYNC
    return OPTIMIZER if "per_iteration" in chosen.tags else MICRO_BATCH


def _collectives(plan: IntraPlan) -> Iterator[tuple[str, Collective]]:
    for chosen in plan.nodes:
        for c in chosen.collectives:
            yield _when(chosen), c
    by_id = {c.node: c for c in plan.nodes}
    for r in plan.reshardings:
        consumer = by_id.get(r.consumer_id)
        for c in r.collectives:
            yield (_when(consumer) if consumer is not None else MICRO_BATCH), c


def collective_rows(plan: Plan) -> tuple[CollectiveRow, ...]:
    """Per stage, per (kind, axes, when): counts, bytes and seconds over one iteration, largest first."""
    totals: dict[tuple[int, str, tuple[int, ...], str], list[float]] = {}
    for k, stage in enumerate(plan.stages):
        for _, layers, intra in stage_plans(stage):
            for when, c in _collectives(intra):
                times = layers * (plan.num_microbatches if when == MICRO_BATCH else 1)
                row = totals.setdefault((k, c.kind.value, c.axes, when), [0, 0.0, 0.0])
                row[0] += times
                row[1] += times * c.nbytes
                row[2] += times * c.cost
    rows = [CollectiveRow(k, kind, axes, when, int(v[0]), v[1], v[2]) for (k, kind, axes, when), v in totals.items()]
    return tuple(sorted(rows, key=lambda r: (r.stage, -r.seconds)))


def time_rows(plan: Plan) -> tuple[TimeRow, ...]:
    """Each stage's iteration (see TimeRow); empty when the plan predicts no stage latency."""
    if any(s.latency_s is None for s in plan.stages):
        return ()
    b = plan.num_microbatches
    pipeline = plan.prediction.pipeline_time_s if plan.prediction else max(b * s.latency_s for s in plan.stages)
    rows = []
    for k, s in enumerate(plan.stages):
        compute, communication = _split(s)
        handoff = None if compute is None else max(0.0, s.latency_s - compute - communication) * b
        rows.append(TimeRow(k, None if compute is None else compute * b,
                            None if communication is None else communication * b, handoff,
                            max(0.0, pipeline - b * s.latency_s), s.sync_s, s.update_s))
    return tuple(rows)


def _split(stage: Stage) -> tuple[float | None, float | None]:
    """Compute and communication seconds of one micro-batch: recorded by the planner, or the
    stage's latency split in the proportions of its intra-op plan's cost breakdown."""
    if stage.compute_s is not None and stage.communication_s is not None:
        return stage.compute_s, stage.communication_s
    if stage.intra_plan is None:
        return None, None
    b = stage.intra_plan.breakdown
    total = b.compute + b.communication + b.resharding
    share = b.compute / total if total > 0 else 1.0
    return stage.latency_s * share, stage.latency_s * (1 - share)
