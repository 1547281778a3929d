"""A plan given to PipeshardParallel(plan=...): read, checked against the program, turned into stages.

Two kinds of plans run:

* one `get_plan()` returned (source "pipeshard"), e.g. from another process or an earlier run: its
  stages (layers, devices, logical meshes) and each stage's intra-op plan are reused as they are,
  after checking that the program cuts into as many layers and that every stage's captured
  forward + backward has, node by node, the operators and shapes the plan was made for;
* one `meshplan simulate --out` wrote (source "simulate"), made for a model description: its stages
  (layers, devices, logical meshes), schedule and micro-batches are run, each stage re-planned by
  the intra-op ILP on the captured program (the simulator's graphs are not the program's), after
  checking the device count and, where the plan records them, the batch size and the parameter
  count.

Anything that does not fit raises PlanMismatchError naming the first difference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from meshplan.errors import OptionsError, PlanMismatchError
from meshplan.intra.plan import IntraPlan
from meshplan.ir import Graph
from meshplan.parallel.pipeshard import PipeshardParallel, StageAssignment
from meshplan.plan import Plan

RUNNABLE_SOURCES = ("pipeshard", "simulate")


@dataclass(frozen=True, slots=True)
class GivenPlan:
    """A plan to run: its stages, and per stage the intra-op plan to reuse (None: plan it here)."""

    plan: Plan
    where: str  # the file it came from, or "a Plan object"
    stages: tuple[StageAssignment, ...]
    intra_plans: tuple[IntraPlan | None, ...]

    @property
    def num_layers(self) -> int:
        return self.stages[-1].last + 1


def read_given_plan(method: PipeshardParallel, num_devices: int, name: str) -> GivenPlan:
    """`method.plan` read and checked against what the call runs on.

    Raises:
        OptionsError: the file cannot be read.
        PlanValidationError: the file is not a plan of this schema.
        PlanMismatchError: the plan was made for other devices, micro-batches or schedule, or by a
            planner whose stages do not run here.
    """
    plan, where = _load(method.plan)
    refuse = lambda why, fix: _mismatch(name, where, why, fix)  # noqa: E731
    if plan.source not in RUNNABLE_SOURCES:
        refuse(f"it was written by '{plan.source}', which plans one mesh, not pipeline stages",
               "give a plan from `meshplan simulate --out` or from get_plan() of a PipeshardParallel function")
    if plan.num_devices != num_devices:
        refuse(f"its stages use {plan.num_devices} devices but {name} runs on {num_devices}",
               f"plan for {num_devices} devices (e.g. `meshplan simulate --cluster NODESxDEVICES`)")
    if plan.num_microbatches != method.num_micro_batches:
        refuse(f"it runs {plan.num_microbatches} micro-batches but PipeshardParallel(num_micro_batches="
               f"{method.num_micro_batches})", f"pass num_micro_batches={plan.num_microbatches}")
    if plan.schedule != method.schedule:
        refuse(f"it runs the '{plan.schedule}' schedule but PipeshardParallel(schedule='{method.schedule}')",
               f"pass schedule='{plan.schedule}'" + ("" if plan.schedule in ("1f1b", "gpipe") else
                                                     " (the runtime runs '1f1b' and 'gpipe' only: re-plan with "
                                                     "one model chunk, `meshplan simulate --chunks 1`)"))
    if plan.source == "pipeshard" and plan.option("stage_sharding", "auto") != method.stage_sharding:
        refuse(f"its stages were laid out with stage_sharding='{plan.option('stage_sharding')}' but "
               f"PipeshardParallel(stage_sharding='{method.stage_sharding}')",
               f"pass stage_sharding='{plan.option('stage_sharding')}'")
    if method.layers != "auto" and method.layers != plan.stages[-1].last_layer + 1:
        refuse(f"it cuts the program into {plan.stages[-1].last_layer + 1} layers but PipeshardParallel("
               f"layers={method.layers})", "pass layers='auto' (the plan's cut is used)")
    stages = tuple(StageAssignment(s.first_layer, s.last_layer, tuple(s.devices), tuple(s.logical_mesh))
                   for s in plan.stages)
    reuse = plan.source == "pipeshard" and method.stage_sharding == "auto"
    return GivenPlan(plan, where, stages, tuple(s.intra_plan if reuse else None for s in plan.stages))


def check_program(given: GivenPlan, name: str, kind: str, num_layers: int, batch_rows: int | None,
                  num_params: int) -> None:
    """Raise PlanMismatchError unless the program fits the plan: `kind` "whole" (a train step),
    "forward" (inference) or "loss" (a loss function cut by marks); `num_layers` the layers it was
    cut into; `batch_rows` its examples per call; `num_params` its weights' element count."""
    plan = given.plan
    refuse = lambda why, fix: _mismatch(name, given.where, why, fix)  # noqa: E731
    if num_layers != given.num_layers:
        refuse(f"it has {given.num_layers} layers but {name} has {num_layers} (its mark_pipeline_boundary "
               f"calls, or the params entries of a loss function)", "re-plan for this program")
    if plan.source == "pipeshard":
        planned = plan.option("step", "loss")
        if planned != kind:
            refuse(f"it was made for a {_KINDS[planned]} but {name} is a {_KINDS[kind]}",
                   "give the plan of this function")
        return
    if plan.global_batch is not None and batch_rows is not None and plan.global_batch != batch_rows:
        refuse(f"it was made for a batch of {plan.global_batch} sequences but {name} gets {batch_rows}",
               f"re-plan with `meshplan simulate --global-batch {batch_rows}`")
    if plan.num_params is not None and not _close(plan.num_params, num_params):
        refuse(f"it was made for a model of {plan.num_params:,} parameters but {name} trains {num_params:,}",
               "re-plan with the model's own config (`meshplan simulate --model config.json`)")


def check_stage_graph(given: GivenPlan, stage: int, graph: Graph, name: str) -> IntraPlan:
    """Stage `stage`'s intra-op plan, after checking that `graph` (its captured forward + backward)
    is the graph it was made for, operator by operator."""
    intra = given.intra_plans[stage]
    assert intra is not None
    refuse = lambda why: _mismatch(name, given.where, why, "re-plan for this program's shapes")  # noqa: E731
    if len(intra.nodes) != len(graph):
        refuse(f"stage {stage} was planned over {len(intra.nodes)} operators but {name}'s stage {stage} has "
               f"{len(graph)}")
    for chosen in intra.nodes:
        node = graph[chosen.node]
        if chosen.op != node.op or tuple(chosen.shape) != tuple(node.shape):
            refuse(f"stage {stage}'s operator {chosen.node} ({chosen.name}) was planned as {chosen.op} "
                   f"{list(chosen.shape)} but is {node.op} {list(node.shape)} in {name}")
    return intra


_KINDS = {"whole": "whole train step", "forward": "inference step", "loss": "loss function cut by marks"}


def _close(planned: int, actual: int) -> bool:
    """Parameter counts agree within 1 % (the simulator's model may count a bias or a norm apart)."""
    return abs(planned - actual) <= 0.01 * max(planned, actual)


def _load(source: str | os.PathLike[str] | Plan) -> tuple[Plan, str]:
    if isinstance(source, Plan):
        return source, "the Plan given"
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as exc:
        raise OptionsError(f"PipeshardParallel(plan='{path}'): cannot read it ({exc.strerror}); write it with "
                           f"`meshplan simulate --out {path}` or from get_plan().to_json()") from None
    return Plan.from_json(text), f"'{path}'"


def _mismatch(name: str, where: str, why: str, fix: str) -> None:
    raise PlanMismatchError(f"PipeshardParallel(plan={where}) does not fit {name}: {why}; {fix}")
