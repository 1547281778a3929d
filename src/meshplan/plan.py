"""Plan: what every planner emits and every report reads; pure data with an exact JSON round trip.

A Plan is a pipeline of stages (a single stage when there is no pipeline): each stage holds a
layer range, the devices it runs on, its logical mesh and, where the stage was planned
operator by operator, its IntraPlan. Around them: the schedule and micro-batches, what was
planned (model or function, cluster, batch) and, where a planner predicted it, the time and
memory. `simulate`, `intra`, `parallelize` (dump_debug_info) and PipeshardParallel all write
this one schema. No devices, arrays or JAX objects live here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields
from typing import Any

from meshplan.errors import PlanValidationError
from meshplan.intra.plan import IntraPlan

SCHEMA_VERSION = 5  # 4: stage pieces, forward/compute/communication seconds; 5: Prediction.cost_model
SOURCES = ("simulate", "intra", "parallelize", "pipeshard", "cfp")


@dataclass(frozen=True, slots=True)
class StagePiece:
    """A piece of a stage planned on its own (e.g. "embedding", "block", "head"): the layers it
    covers and its intra-op plan (one plan for every identical layer of the range)."""

    name: str
    first_layer: int
    last_layer: int
    intra_plan: IntraPlan


@dataclass(frozen=True, slots=True)
class Stage:
    """One pipeline stage: layers first..last on `devices` viewed as `logical_mesh`.

    Attributes:
        first_layer, last_layer: the layer range (inclusive).
        devices: the stage's devices: global ids on the planned cluster (row-major, node-major),
            or, for a runtime plan, indices into the device list the function ran on.
        logical_mesh: the logical mesh shape the stage's operators are sharded over.
        submesh: (nodes, devices per node) of the physical sub-mesh, when placed on a cluster.
        intra_plan: the stage's operator-level plan, when one was made and kept.
        memory_plan: which intra-op plan of the menu ("fastest" or "lean-N").
        recompute: activation recomputation: "none" or "full".
        latency_s: predicted forward + backward (+ hand-off) time per micro-batch.
        memory_bytes: predicted peak memory per device.
        inflight_microbatches: micro-batches whose activations the stage holds at its peak.
        sync_s, update_s: predicted gradient sync and optimizer step, once per iteration.
        pieces: the intra-op plans of the stage's pieces, when planned piece by piece (simulate).
        forward_s: the forward part of `latency_s` (the rest: backward, recomputation, hand-off).
        compute_s, communication_s: the compute and the collectives and resharding of `latency_s`.
    """

    first_layer: int
    last_layer: int
    devices: tuple[int, ...]
    logical_mesh: tuple[int, ...]
    submesh: tuple[int, int] | None = None
    intra_plan: IntraPlan | None = None
    memory_plan: str = "fastest"
    recompute: str = "none"
    latency_s: float | None = None
    memory_bytes: float | None = None
    inflight_microbatches: int | None = None
    sync_s: float = 0.0
    update_s: float = 0.0
    pieces: tuple[StagePiece, ...] = ()
    forward_s: float | None = None
    compute_s: float | None = None
    communication_s: float | None = None

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1

    @property
    def layers(self) -> str:
        """E.g. "3-7", or "3" for one layer."""
        return str(self.first_layer) if self.num_layers == 1 else f"{self.first_layer}-{self.last_layer}"


@dataclass(frozen=True, slots=True)
class Prediction:
    """Predicted performance of one iteration (fields a planner could not predict are None).

    `cost_model` names the pricer and its version ("graph/1": fixed or chosen per-op strategies
    on the operator graph; "formula/2": the closed form of a layout); predictions are comparable
    when it is equal."""

    iteration_time_s: float
    pipeline_time_s: float
    sync_time_s: float = 0.0
    tokens_per_s: float | None = None
    tflops_per_device: float | None = None
    mfu: float | None = None
    peak_memory_bytes: float | None = None
    cost_model: str = ""


# A baseline's configuration when its recipe does not apply to the model (`reason` says why).
NOT_APPLICABLE = "not applicable"


@dataclass(frozen=True, slots=True)
class BaselineSummary:
    """A reference layout priced by the same cost model: its prediction, or why it does not fit
    (or, with config NOT_APPLICABLE, why it does not apply)."""

    name: str
    config: str
    prediction: Prediction | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Plan:
    """A parallelization plan and, where known, its prediction.

    Attributes:
        source: the planner that wrote it: "simulate", "intra", "parallelize", "pipeshard" or "cfp".
        model: the model preset, config or function planned.
        stages: the pipeline's stages in order (one for an unpipelined plan).
        schedule: the pipeline schedule (see meshplan.inter.schedules), "none" without a pipeline.
        num_microbatches: micro-batches per iteration.
        chunks: model chunks per device (interleaved schedules).
        microbatch_size, global_batch, seq_len: sequences per micro-batch and per iteration,
            tokens per sequence (None where the planner does not know them).
        num_params: parameters of the model.
        cluster: (nodes, devices per node) planned for; device: the device kind.
        prediction: the predicted iteration.
        label: "auto" or the baseline it is ("megatron", "data-parallel", ...).
        options: the planner's settings that shaped the plan, as name -> text.
        baselines: reference layouts priced alongside (simulate).
        metrics: further named figures, e.g. planner seconds per phase.
        notes: remarks for the reader.
    """

    source: str
    model: str
    stages: tuple[Stage, ...]
    schedule: str = "none"
    num_microbatches: int = 1
    chunks: int = 1
    microbatch_size: int | None = None
    global_batch: int | None = None
    seq_len: int | None = None
    num_params: int | None = None
    cluster: tuple[int, int] | None = None
    device: str = ""
    prediction: Prediction | None = None
    label: str = "auto"
    options: tuple[tuple[str, str], ...] = ()
    baselines: tuple[BaselineSummary, ...] = ()
    metrics: tuple[tuple[str, float], ...] = ()
    notes: tuple[str, ...] = ()
    schema_version: int = field(default=SCHEMA_VERSION)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_devices(self) -> int:
        return sum(s.num_devices for s in self.stages)

    def option(self, name: str, default: str = "") -> str:
        return dict(self.options).get(name, default)

    @property
    def sample_unit(self) -> str:
        """What the global batch and `tokens_per_s` count: "tokens", or "images" for image models."""
        return self.option("unit", "tokens")

    def metrics_under(self, prefix: str) -> dict[str, float]:
        """The metrics named `prefix` + something, by that something (e.g. "planner_s.")."""
        return {name.removeprefix(prefix): value for name, value in self.metrics if name.startswith(prefix)}

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}
        piece_plans: list[dict[str, Any]] = []  # each distinct piece plan once; pieces refer to it
        data["stages"] = [_stage_dict(s, piece_plans) for s in self.stages]
        data["piece_plans"] = piece_plans
        data["options"] = dict(self.options)
        data["metrics"] = dict(self.metrics)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def fingerprint(self) -> str:
        """A SHA-256 of the plan's decisions, leaving out the planner's own wall times (solver and
        build seconds, "planner_s." metrics), which differ from run to run: two processes that
        planned the same step have the same fingerprint."""
        data = _without_timings(self.to_dict())
        data["metrics"] = {k: v for k, v in data["metrics"].items() if not k.startswith("planner_s.")}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    @staticmethod
    def from_dict(data: Any) -> Plan:
        """The plan `to_dict` wrote.

        Raises:
            PlanValidationError: not a plan, a schema version this meshplan does not read, or a
                missing or mistyped field (the message names it).
        """
        if not isinstance(data, dict) or "stages" not in data or "source" not in data:
            raise PlanValidationError("this is not a meshplan plan (no 'source' and 'stages'); write one with "
                                      "`meshplan simulate --out`, `meshplan intra --out` or dump_debug_info")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanValidationError(f"plan schema version {version!r} is not supported (this meshplan reads "
                                      f"version {SCHEMA_VERSION}); re-plan with this version")
        try:
            return _plan(data)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise PlanValidationError(f"plan data is malformed ({type(exc).__name__}: {exc}); re-plan with this "
                                      "meshplan version") from None

    @staticmethod
    def from_json(text: str) -> Plan:
        try:
            return Plan.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise PlanValidationError(f"plan file is not JSON ({exc}); it may be truncated: write it again") from None


def single_stage_plan(intra: IntraPlan, source: str, model: str, **fields: Any) -> Plan:
    """An unpipelined Plan: one stage, on the intra-op plan's mesh, holding that plan."""
    mesh = intra.mesh
    last = max((n.layer for n in intra.nodes if n.layer is not None), default=0)
    stage = Stage(0, last, mesh.device_ids, mesh.shape, intra_plan=intra, memory_bytes=intra.peak_memory)
    return Plan(source, model, (stage,), **fields)


_TIMINGS = frozenset({"wall_s", "build_s"})


def _without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in _TIMINGS}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def _plain(value: Any) -> Any:
    """Dataclasses and tuples as JSON-ready dicts and lists."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _stage_dict(stage: Stage, piece_plans: list[dict[str, Any]]) -> dict[str, Any]:
    data = {f.name: _plain(getattr(stage, f.name)) for f in fields(stage) if f.name != "pieces"}
    data["pieces"] = []
    for piece in stage.pieces:
        plan = piece.intra_plan.to_dict()
        if plan not in piece_plans:
            piece_plans.append(plan)
        data["pieces"].append({"name": piece.name, "first_layer": piece.first_layer, "last_layer": piece.last_layer,
                               "intra_plan": piece_plans.index(plan)})
    return data


def _stage(data: dict[str, Any], piece_plans: list[IntraPlan]) -> Stage:
    values = dict(data)
    values["pieces"] = tuple(StagePiece(p["name"], p["first_layer"], p["last_layer"], piece_plans[p["intra_plan"]])
                             for p in values.get("pieces", ()))
    values["devices"] = tuple(values["devices"])
    values["logical_mesh"] = tuple(values["logical_mesh"])
    values["submesh"] = None if values.get("submesh") is None else tuple(values["submesh"])
    values["intra_plan"] = None if values.get("intra_plan") is None else IntraPlan.from_dict(values["intra_plan"])
    return Stage(**values)


def _prediction(data: dict[str, Any] | None) -> Prediction | None:
    return None if data is None else Prediction(**data)


def _plan(data: dict[str, Any]) -> Plan:
    values = dict(data)
    piece_plans = [IntraPlan.from_dict(p) for p in values.pop("piece_plans", ())]
    values["stages"] = tuple(_stage(s, piece_plans) for s in values["stages"])
    values["prediction"] = _prediction(values.get("prediction"))
    values["cluster"] = None if values.get("cluster") is None else tuple(values["cluster"])
    values["options"] = tuple((str(k), str(v)) for k, v in values.get("options", {}).items())
    values["metrics"] = tuple((str(k), float(v)) for k, v in values.get("metrics", {}).items())
    values["baselines"] = tuple(BaselineSummary(b["name"], b["config"], _prediction(b.get("prediction")),
                                                b.get("reason", "")) for b in values.get("baselines", ()))
    values["notes"] = tuple(values.get("notes", ()))
    if values["source"] not in SOURCES:
        raise ValueError(f"source {values['source']!r} is not one of {SOURCES}")
    return Plan(**values)
