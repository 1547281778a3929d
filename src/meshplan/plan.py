"""TrainingPlan: a pipeline + sharding plan and its prediction, as pure data with a JSON form."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from meshplan.errors import PlanValidationError

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One pipeline stage: blocks first..last on a sub-mesh seen as `logical_mesh`."""

    first_layer: int
    last_layer: int
    submesh: tuple[int, int]
    logical_mesh: tuple[int, ...]
    memory_plan: str  # "fastest" or "lean-N": which intra-op plan of the menu
    recompute: str
    latency_s: float  # per micro-batch, forward + backward (+ sends)
    memory_bytes: float  # peak per device
    inflight_microbatches: int
    sync_s: float
    update_s: float
    origin: tuple[int, int] = (0, 0)  # (first node, first device in that node)

    @property
    def devices(self) -> int:
        return self.submesh[0] * self.submesh[1]

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1


@dataclass(frozen=True, slots=True)
class Prediction:
    """Predicted performance of one iteration."""

    iteration_time_s: float
    pipeline_time_s: float
    sync_time_s: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    peak_memory_bytes: float


@dataclass(frozen=True, slots=True)
class TrainingPlan:
    """Everything needed to run and explain a plan; no devices, no arrays."""

    model: str
    num_params: int
    cluster: tuple[int, int]
    device: str
    global_batch: int
    seq_len: int
    microbatch_size: int
    num_microbatches: int
    stages: tuple[StagePlan, ...]
    prediction: Prediction
    label: str = "auto"
    schedule: str = "1f1b"
    schema_version: int = SCHEMA_VERSION
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> TrainingPlan:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanValidationError(f"plan schema version {version!r} is not supported (this meshplan reads "
                                      f"version {SCHEMA_VERSION}); re-plan with this version")
        try:
            stages = tuple(StagePlan(**{**s, "submesh": tuple(s["submesh"]), "origin": tuple(s["origin"]),
                                        "logical_mesh": tuple(s["logical_mesh"])}) for s in data["stages"])
            fields = {k: v for k, v in data.items() if k not in ("stages", "prediction")}
            fields["cluster"] = tuple(fields["cluster"])
            fields["notes"] = tuple(fields.get("notes", ()))
            return TrainingPlan(**fields, stages=stages, prediction=Prediction(**data["prediction"]))
        except (KeyError, TypeError) as exc:
            raise PlanValidationError(f"plan data is malformed: {exc}") from None

    @staticmethod
    def from_json(text: str) -> TrainingPlan:
        try:
            return TrainingPlan.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise PlanValidationError(f"plan file is not JSON: {exc}") from None
