"""A plan's simulated iteration: every forward and backward step of every stage on every
micro-batch, then each stage's gradient sync and optimizer step; and that as Chrome trace JSON
(opens in Perfetto or chrome://tracing).

The steps are placed by the schedule's own replay (`meshplan.inter.schedules.timeline`) from each
stage's predicted time per micro-batch, split into forward and backward by the stage's recorded
forward seconds (a third of the step when the plan does not record them: a backward costs about
twice its forward). Schedules the runtime cannot execute (interleaved 1F1B) are replayed as 1F1B.
A stage without a predicted latency uses its intra-op plan's objective (the runtime's cost model).

The replay's pipeline span equals the plan's predicted pipeline time (the stage DP's closed form,
B * max_s t_s + sum of the other stages) for GPipe and for stages of equal time. Under 1F1B with
unequal stages the replay can be shorter: a slow early stage runs its warm-up forwards while the
first micro-batch fills the pipeline, which the closed form does not credit (it is an upper bound
there; `meshplan.inter.schedules`). The trace shows the replay and names both figures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from meshplan.errors import PlanValidationError
from meshplan.inter.schedules import RUNNABLE_SCHEDULES, Phase, timeline
from meshplan.plan import Plan, Stage

_DEFAULT_FORWARD_SHARE = 1 / 3


@dataclass(frozen=True, slots=True)
class Span:
    """One step on one stage's track (seconds from the start of the iteration)."""

    stage: int
    name: str
    category: str  # "forward", "backward", "gradient sync" or "optimizer"
    micro_batch: int | None
    start: float
    end: float


def step_seconds(stage: Stage) -> float:
    """Forward + backward of one micro-batch on the stage."""
    if stage.latency_s is not None:
        return stage.latency_s
    if stage.intra_plan is not None:
        return stage.intra_plan.objective
    raise PlanValidationError("the plan predicts no time for its stages (no latency and no intra-op plan); the "
                              "schedule needs them: use a plan from `meshplan simulate` or the runtime")


def iteration_spans(plan: Plan) -> tuple[Span, ...]:
    """The simulated iteration of `plan` (module docstring)."""
    schedule = plan.schedule if plan.schedule in RUNNABLE_SCHEDULES else "1f1b"
    steps = [step_seconds(s) for s in plan.stages]
    forward = [s.forward_s if s.forward_s is not None else t * _DEFAULT_FORWARD_SHARE
               for s, t in zip(plan.stages, steps, strict=True)]
    backward = [t - f for t, f in zip(steps, forward, strict=True)]
    spans = []
    for timed in timeline(schedule, forward, backward, plan.num_microbatches):
        e = timed.event
        category = "forward" if e.phase is Phase.FORWARD else "backward"
        spans.append(Span(e.stage, f"{e.phase.value}{e.micro_batch}", category, e.micro_batch, timed.start,
                          timed.end))
    end = max(s.end for s in spans)
    if plan.prediction is not None:  # gradient sync starts once the pipeline drains, as the prediction has it
        end = max(end, plan.prediction.pipeline_time_s)
    for k, stage in enumerate(plan.stages):
        if stage.sync_s > 0:
            spans.append(Span(k, "gradient sync", "gradient sync", None, end, end + stage.sync_s))
        if stage.update_s > 0:
            start = end + stage.sync_s
            spans.append(Span(k, "optimizer", "optimizer", None, start, start + stage.update_s))
    return tuple(spans)


def chrome_trace(plan: Plan) -> dict:
    """Chrome trace JSON (the "JSON object" format): one process, one thread (track) per stage,
    complete ("X") events in microseconds."""
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": f"{plan.model} iteration"}}]
    for k, stage in enumerate(plan.stages):
        mesh = "x".join(map(str, stage.logical_mesh))
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": k,
                       "args": {"name": f"stage {k}: layers {stage.layers}, mesh {mesh}"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": k, "args": {"sort_index": k}})
    for span in iteration_spans(plan):
        args = {} if span.micro_batch is None else {"micro_batch": span.micro_batch}
        events.append({"ph": "X", "name": span.name, "cat": span.category, "pid": 0, "tid": span.stage,
                       "ts": span.start * 1e6, "dur": (span.end - span.start) * 1e6, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"model": plan.model, "schedule": plan.schedule,
                          "num_microbatches": plan.num_microbatches,
                          "pipeline_time_s": plan.prediction.pipeline_time_s if plan.prediction else None,
                          "replayed_pipeline_time_s": replayed_pipeline_time(plan)}}


def replayed_pipeline_time(plan: Plan) -> float:
    """The span of every forward and backward step in the replay (module docstring)."""
    steps = [s for s in iteration_spans(plan) if s.category in ("forward", "backward")]
    return max(s.end for s in steps) - min(s.start for s in steps)


def chrome_trace_text(plan: Plan) -> str:
    return json.dumps(chrome_trace(plan)) + "\n"
