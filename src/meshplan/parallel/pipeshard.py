"""PipeshardParallel: the options of Alpa's pipeshard method, and the stages they give.

`parallelize(step, method=PipeshardParallel(...))` on a whole train step (gradient and optimizer
update inside) cuts the step's loss into layers, at its `mark_pipeline_boundary` calls or
automatically by FLOPs (`layers`), and applies the update per stage
(meshplan.parallel.pipeshard_step). On a loss function `loss_fn(params, x, targets)` it cuts at
the marks (`params[k]` is layer k's) and returns `(loss, grads)`. Either way consecutive layers
are grouped into stages, each stage gets its own sub-mesh and micro-batches run through them
(meshplan.parallel.pipeshard_function). Stages are one per layer on equal device groups
("uniform"), chosen by the inter-op pass (meshplan.parallel.stage_pricing, "auto"), or explicit.
Pure Python: no JAX here.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Literal

from meshplan.cluster.costs import DeviceCosts, default_mesh_shape
from meshplan.cost.model import CostModel
from meshplan.errors import MeshError, OptionsError
from meshplan.inter.schedules import RUNNABLE_SCHEDULES
from meshplan.intra.options import IntraOptions
from meshplan.plan import Plan

STAGE_SHARDINGS = ("auto", "data_parallel", "replicated")


@dataclasses.dataclass(frozen=True, slots=True)
class StageAssignment:
    """One pipeline stage: layers `first..last` (inclusive) on `devices` viewed as `mesh_shape`."""

    first: int
    last: int
    devices: tuple[int, ...]  # indices into the device list
    mesh_shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class PipeshardStage:
    """An explicit stage: layers `layers[0]..layers[1]` (inclusive) on the devices `devices`
    (indices into the device list) viewed as a logical mesh of `mesh_shape` (default
    `default_mesh_shape(len(devices))`)."""

    layers: tuple[int, int]
    devices: tuple[int, ...]
    mesh_shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        object.__setattr__(self, "devices", tuple(int(i) for i in self.devices))
        if len(self.layers) != 2:
            raise OptionsError(f"PipeshardStage(layers={self.layers}): give (first, last) layer indices")
        if self.mesh_shape is not None:
            object.__setattr__(self, "mesh_shape", tuple(int(i) for i in self.mesh_shape))


StageSpec = PipeshardStage | tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class PipeshardParallel:
    """Inter-op (pipeline) parallelism with intra-op parallelism inside every stage.

    Attributes:
        num_micro_batches: how many equal micro-batches each call cuts the batch into.
        layers: how a whole train step's loss is cut into layers. "auto": at its
            `mark_pipeline_boundary` calls if it has any, else by FLOPs into one layer per
            explicit stage, the smallest divisor > 1 of the device count for "uniform" stages,
            or min(devices, 4) layers for "auto" stages; an int N: N layers balanced by FLOPs
            (Alpa's AutoLayerOption(layer_num=N)). A loss function's layers are its params entries.
        stages: "uniform": one stage per layer, the devices split into equal contiguous groups;
            "auto": the inter-op search groups layers into stages and sizes their sub-meshes;
            or one entry per stage: a PipeshardStage, or a tuple of device indices (then stage
            k is layer k).
        schedule: "1f1b" or "gpipe".
        stage_sharding: "auto": the intra-op ILP plans each stage's forward and backward on its
            sub-mesh; "data_parallel": micro-batch activations, targets and cotangents split
            along dim 0 over the stage's devices (params replicated, grads summed); "replicated".
        stage_mesh_shape: the logical mesh of every stage for "uniform" stages (default
            `default_mesh_shape` of the stage's device count).
        mesh_axes: the logical views "auto" stages are priced on: 2, Alpa's 2-D views; 3, also
            the 3-D views of sub-meshes of 8 or more devices (`Cluster.logical_views`), as
            `meshplan simulate --mesh-axes 3` prices them.
        plan: a plan to run instead of planning (a JSON file's path or a Plan): one `get_plan()`
            returned (stages and stage layouts reused) or `meshplan simulate --out` wrote (stages,
            devices and logical meshes run, stage layouts planned here); refused with the reason
            (PlanMismatchError) when it was made for another program (meshplan.parallel.given_plan).
    """

    num_micro_batches: int
    layers: Literal["auto"] | int = "auto"
    stages: Literal["uniform", "auto"] | tuple[StageSpec, ...] = "uniform"
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    stage_sharding: Literal["auto", "data_parallel", "replicated"] = "auto"
    stage_mesh_shape: tuple[int, ...] | None = None
    plan: str | os.PathLike[str] | Plan | None = None
    mesh_axes: Literal[2, 3] = 2

    def __post_init__(self) -> None:
        if not isinstance(self.num_micro_batches, int) or self.num_micro_batches < 1:
            raise OptionsError(f"PipeshardParallel(num_micro_batches={self.num_micro_batches!r}): use an int >= 1")
        if self.layers != "auto" and (isinstance(self.layers, bool) or not isinstance(self.layers, int)
                                      or self.layers < 1):
            raise OptionsError(f"PipeshardParallel(layers={self.layers!r}): use 'auto' or an int >= 1 (how many "
                               f"layers the loss is cut into, balanced by FLOPs)")
        if self.schedule not in RUNNABLE_SCHEDULES:
            raise OptionsError(f"PipeshardParallel(schedule={self.schedule!r}): use one of {list(RUNNABLE_SCHEDULES)}")
        if self.stage_sharding not in STAGE_SHARDINGS:
            raise OptionsError(f"PipeshardParallel(stage_sharding={self.stage_sharding!r}): use one of "
                               f"{list(STAGE_SHARDINGS)}")
        if self.mesh_axes not in (2, 3):
            raise OptionsError(f"PipeshardParallel(mesh_axes={self.mesh_axes!r}): use 2 (2-D logical views) or 3 "
                               f"(also 3-D views of stages of 8 or more devices)")
        if self.mesh_axes == 3 and self.stages != "auto":
            raise OptionsError("PipeshardParallel(mesh_axes=3) chooses among 3-D views for stages='auto'; give "
                               "other stages a 3-D mesh_shape instead")
        if self.plan is not None:
            if not isinstance(self.plan, (str, os.PathLike, Plan)):
                raise OptionsError(f"PipeshardParallel(plan={self.plan!r}): give a plan file's path or a Plan")
            if self.stages != "uniform" or self.stage_mesh_shape is not None:
                raise OptionsError("PipeshardParallel(plan=...) runs the plan's stages; drop stages= and "
                                   "stage_mesh_shape=")
        if self.stage_mesh_shape is not None:
            if self.stages != "uniform":
                raise OptionsError("PipeshardParallel(stage_mesh_shape=...) applies to stages='uniform'; give "
                                   "explicit stages a PipeshardStage(..., mesh_shape=...) instead")
            object.__setattr__(self, "stage_mesh_shape", tuple(int(i) for i in self.stage_mesh_shape))
        if self.stages not in ("uniform", "auto"):
            if isinstance(self.stages, str) or not all(isinstance(s, (Sequence, PipeshardStage)) for s in self.stages):
                raise OptionsError(f"PipeshardParallel(stages={self.stages!r}): use 'uniform', 'auto' or one "
                                   f"entry per stage: PipeshardStage(layers, devices) or a device-index tuple, "
                                   f"e.g. ((0, 1), (2, 3))")
            object.__setattr__(self, "stages", tuple(s if isinstance(s, PipeshardStage) else tuple(int(i) for i in s)
                                                     for s in self.stages))

    def options(self, costs: DeviceCosts) -> IntraOptions:
        """The ILP options stages are planned with: a stage's backward is JAX's, partitioned by
        XLA, so max pooling's gradient keeps no halo split the runtime would have to run."""
        return IntraOptions(cost=CostModel(flops_per_second=costs.flops_per_second), runtime_exchanges=False)


def stage_assignments(method: PipeshardParallel, num_layers: int, num_devices: int) -> tuple[StageAssignment, ...]:
    """The stages of "uniform" or explicit `method.stages`; pure Python.

    Raises:
        MeshError: "uniform" with a device count not divisible by the layer count; explicit
            stages that do not cover the layers in order, are empty, out of range, share a
            device, or whose mesh shape does not hold their devices.
    """
    if method.stages == "uniform":
        if num_devices % num_layers:
            raise MeshError(f"PipeshardParallel(stages='uniform') splits {num_devices} devices into {num_layers} "
                            f"equal stages (one per layer), but {num_devices} is not divisible by {num_layers}; "
                            f"use a device count divisible by {num_layers}, stages='auto', or explicit stages")
        per = num_devices // num_layers
        shape = method.stage_mesh_shape or default_mesh_shape(per)
        stages = tuple(StageAssignment(k, k, tuple(range(k * per, (k + 1) * per)), shape) for k in range(num_layers))
    else:
        stages = tuple(_explicit(spec, k) for k, spec in enumerate(method.stages))
        _check_explicit(stages, num_layers, num_devices)
    for k, stage in enumerate(stages):
        if math.prod(stage.mesh_shape) != len(stage.devices):
            raise MeshError(f"PipeshardParallel stage {k} has {len(stage.devices)} devices but mesh shape "
                            f"{stage.mesh_shape} holds {math.prod(stage.mesh_shape)}; give a mesh shape whose "
                            f"product is {len(stage.devices)}")
    return stages


def _explicit(spec: StageSpec, k: int) -> StageAssignment:
    if isinstance(spec, PipeshardStage):
        shape = spec.mesh_shape or default_mesh_shape(max(len(spec.devices), 1))
        return StageAssignment(spec.layers[0], spec.layers[1], spec.devices, shape)
    return StageAssignment(k, k, spec, default_mesh_shape(max(len(spec), 1)))


def _check_explicit(stages: tuple[StageAssignment, ...], num_layers: int, num_devices: int) -> None:
    expected = 0
    for k, stage in enumerate(stages):
        if stage.first != expected or stage.last < stage.first:
            raise MeshError(f"PipeshardParallel stage {k} holds layers {stage.first}..{stage.last}, but stages must "
                            f"cover layers 0..{num_layers - 1} in order; stage {k} should start at layer {expected}")
        expected = stage.last + 1
    if expected != num_layers:
        raise MeshError(f"PipeshardParallel(stages=...) covers {expected} layers but the function has {num_layers} "
                        f"(one per params entry of a loss function, or PipeshardParallel(layers=...) of a train "
                        f"step); give stages covering every layer (a device tuple per layer, or "
                        f"PipeshardStage(layers=(first, last), devices=...))")
    owner: dict[int, int] = {}
    for k, stage in enumerate(stages):
        if not stage.devices:
            raise MeshError(f"PipeshardParallel stage {k} has no devices; give every stage at least one")
        for i in stage.devices:
            if not 0 <= i < num_devices:
                raise MeshError(f"PipeshardParallel stage {k} uses device index {i}, but only {num_devices} "
                                f"devices exist; use indices in [0, {num_devices})")
            if i in owner:
                raise MeshError(f"PipeshardParallel device index {i} is in stages {owner[i]} and {k}; "
                                f"give each stage a disjoint set of devices")
            owner[i] = k


def auto_layer_count(method: PipeshardParallel, num_devices: int) -> int:
    """How many layers `layers="auto"` clusters an unmarked train step's loss into (see PipeshardParallel)."""
    if method.stages == "uniform":
        return next((d for d in range(2, num_devices + 1) if num_devices % d == 0), 1)
    if method.stages == "auto":
        return min(num_devices, 4)
    return max(s.layers[1] + 1 if isinstance(s, PipeshardStage) else k + 1 for k, s in enumerate(method.stages))
