"""Pipeshard method: a loss function with pipeline boundaries -> pipelined (loss, grads).

`parallelize(loss_fn, method=PipeshardParallel(...))` cuts `loss_fn(params, x, targets)` at its
`mark_pipeline_boundary` calls into layers (runtime.boundary.split_into_stages; `params[k]` is
layer k's), groups consecutive layers into stages, gives each stage its own sub-mesh and runs
micro-batches through runtime.pipeline.run_pipeline. Stages are one per layer on equal device
groups ("uniform"), chosen by the inter-op search (runtime.stage_search, "auto"), or explicit.
Inside each stage the intra-op ILP plans the sharding of its forward and backward
(runtime.stage_layout; Alpa's pipeshard), or the stage is data parallel or replicated.
Everything is cached per input signature.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from meshplan.cost.model import CostModel
from meshplan.errors import MeshError, OptionsError
from meshplan.files import write_json_atomic, write_text_atomic
from meshplan.intra.options import IntraOptions
from meshplan.runtime.abstract import chain_inputs, shapes_of, signature
from meshplan.runtime.boundary import split_into_stages
from meshplan.runtime.defaults import DeviceCosts, default_mesh_shape
from meshplan.runtime.diagnostics import compile_lowered, warn_if_rematerialized
from meshplan.runtime.pipeline import SCHEDULES, Event, Pipeline, apply_update, run_pipeline
from meshplan.runtime.sharded import axis_names
from meshplan.runtime.stage_layout import StageLayout, data_parallel_layout, planned_layout, replicated_layout
from meshplan.runtime.stage_search import StageAssignment, StageSearch, search_stages

__all__ = ["PipeshardFunction", "PipeshardParallel", "PipeshardPlan", "PipeshardStage", "apply_update",
           "stage_assignments"]

SCHEMA_VERSION = 2
STAGE_SHARDINGS = ("auto", "data_parallel", "replicated")


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
    """

    num_micro_batches: int
    stages: Literal["uniform", "auto"] | tuple[StageSpec, ...] = "uniform"
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    stage_sharding: Literal["auto", "data_parallel", "replicated"] = "auto"
    stage_mesh_shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_micro_batches, int) or self.num_micro_batches < 1:
            raise OptionsError(f"PipeshardParallel(num_micro_batches={self.num_micro_batches!r}): use an int >= 1")
        if self.schedule not in SCHEDULES:
            raise OptionsError(f"PipeshardParallel(schedule={self.schedule!r}): use one of {sorted(SCHEDULES)}")
        if self.stage_sharding not in STAGE_SHARDINGS:
            raise OptionsError(f"PipeshardParallel(stage_sharding={self.stage_sharding!r}): use one of "
                               f"{list(STAGE_SHARDINGS)}")
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

    def intra_options(self, costs: DeviceCosts) -> IntraOptions:
        """The ILP options stages are planned with."""
        return IntraOptions(cost=CostModel(flops_per_second=costs.flops_per_second))


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
                        f"(one per params entry); give stages covering every layer (a device tuple per layer, or "
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


@dataclasses.dataclass(frozen=True, slots=True)
class PipeshardPlan:
    """What a pipeshard call ran: stages (layers, devices, logical mesh, intra-op plan), schedule
    and executed steps; with stages="auto" also the search's prediction."""

    stages: tuple[StageAssignment, ...]
    schedule: str
    num_micro_batches: int
    stage_sharding: str
    layouts: tuple[StageLayout, ...] = dataclasses.field(repr=False, compare=False, default=())
    search: StageSearch | None = None
    events: tuple[Event, ...] = ()  # the last call's steps, in dispatch order

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stage_devices(self) -> tuple[tuple[int, ...], ...]:
        """Per stage, its device indices."""
        return tuple(s.devices for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; events as "F0.1" (phase, stage, micro-batch); each stage's intra-op
        plan as IntraPlan.to_dict when the stage was planned."""
        stages = []
        for k, stage in enumerate(self.stages):
            plan = self.layouts[k].plan if self.layouts else None
            stages.append({"layers": [stage.first, stage.last], "devices": list(stage.devices),
                           "mesh_shape": list(stage.mesh_shape),
                           "intra_plan": None if plan is None else plan.to_dict()})
        search = None if self.search is None else {
            "predicted_latency_s": self.search.latency, "stage_latencies_s": list(self.search.stage_latencies),
            "layer_costs_s": [{"x".join(map(str, shape)): cost for shape, cost in c.items()}
                              for c in self.search.layer_costs]}
        return {"schema_version": SCHEMA_VERSION, "num_stages": self.num_stages, "stages": stages,
                "schedule": self.schedule, "num_micro_batches": self.num_micro_batches,
                "stage_sharding": self.stage_sharding, "search": search,
                "events": [f"{e.phase.value}{e.stage}.{e.micro_batch}" for e in self.events]}


@dataclasses.dataclass(frozen=True, slots=True)
class _Compiled:
    """Everything one input signature produced."""

    pipeline: Pipeline
    plan: PipeshardPlan
    example_inputs: tuple[tuple[Any, ...], ...]  # per stage: ShapeDtypeStructs of its forward's arguments


class PipeshardFunction:
    """`loss_fn` run as a pipeline; call `f(params, x, targets) -> (loss, grads)`."""

    def __init__(self, fn: Callable[..., Any], method: PipeshardParallel, devices: Sequence[Any] | None,
                 costs: DeviceCosts | None = None) -> None:
        self.fn, self.method = fn, method
        self.costs = costs or DeviceCosts()
        self.devices = None if devices is None else tuple(devices)
        self._cache: dict[Any, _Compiled] = {}
        self._last: _Compiled | None = None
        self.__name__ = getattr(fn, "__name__", "pipeshard")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, params: Sequence[Any], x: Any, targets: Any) -> tuple[jax.Array, Any]:
        """Loss and grads, equal to `jax.value_and_grad(loss_fn)(params, x, targets)`.

        Grads come back as a list (a tuple if `params` is one), one entry per layer; layer k's
        live on the sub-mesh of the stage that holds it, laid out like its params.
        """
        compiled = self._compiled(params, x, targets)
        stages = compiled.plan.stages
        per_stage = [tuple(params[s.first:s.last + 1]) for s in stages]
        result = run_pipeline(compiled.pipeline, per_stage, x, targets, self.method.num_micro_batches,
                              self.method.schedule)
        self._last = dataclasses.replace(compiled, plan=dataclasses.replace(compiled.plan, events=result.events))
        grads = [g for stage_grads in result.grads for g in stage_grads]
        return result.loss, tuple(grads) if isinstance(params, tuple) else grads

    def get_plan(self) -> PipeshardPlan:
        """The PipeshardPlan of the last call, with that call's events.

        Raises:
            OptionsError: the function has not been called yet.
        """
        return self._require_last().plan

    def dump_debug_info(self, folder: str | Path) -> tuple[Path, ...]:
        """Write, per stage k, stage_<k>_forward.hlo.txt (the compiled forward at micro-batch
        shapes) and stage_<k>_memory.txt (its memory analysis), and pipeshard.json
        (`PipeshardPlan.to_dict` plus, per stage, its forward's input and output shardings and
        compile diagnostics); return the paths. A stage whose forward XLA had to fully
        rematerialize raises a RematerializationWarning."""
        last = self._require_last()
        folder = Path(folder)
        paths, placements = [], []
        for k, example in enumerate(last.example_inputs):
            compiled, diagnostics = compile_lowered(last.pipeline.lower_forward(k, *example))
            warn_if_rematerialized(diagnostics, f"{self.__name__} stage {k} forward")
            paths.append(folder / f"stage_{k}_forward.hlo.txt")
            write_text_atomic(paths[-1], compiled.as_text())
            paths.append(folder / f"stage_{k}_memory.txt")
            write_text_atomic(paths[-1], f"{compiled.memory_analysis()}\n")
            placements.append({"inputs": [str(s) for s in jax.tree_util.tree_leaves(compiled.input_shardings)],
                               "outputs": [str(s) for s in jax.tree_util.tree_leaves(compiled.output_shardings)],
                               **diagnostics.to_dict()})
        paths.append(folder / "pipeshard.json")
        write_json_atomic(paths[-1], {**last.plan.to_dict(), "placements": placements})
        return tuple(paths)

    def _require_last(self) -> _Compiled:
        if self._last is None:
            raise OptionsError(f"{self.__name__} has no pipeshard plan yet; call it once with example arguments first")
        return self._last

    def _compiled(self, params: Sequence[Any], x: Any, targets: Any) -> _Compiled:
        if not isinstance(params, (list, tuple)) or not params:
            raise OptionsError(f"{self.__name__} was called with params of type {type(params).__name__}; "
                               f"PipeshardParallel needs a non-empty list with one params pytree per layer")
        key = signature((params, x, targets))
        if key not in self._cache:
            self._cache[key] = self._build(params, x, targets)
        return self._cache[key]

    def _build(self, params: Sequence[Any], x: Any, targets: Any) -> _Compiled:
        method = self.method
        if jax.process_count() > 1:  # hand-offs are device_puts, which cannot cross processes
            raise OptionsError(f"{self.__name__}: PipeshardParallel runs in one process, but JAX runs "
                               f"{jax.process_count()} (jax.distributed); use ShardParallel, DataParallel, "
                               f"Zero2Parallel, Zero3Parallel or TensorParallel across processes")
        devices = list(self.devices) if self.devices is not None else jax.devices()
        self.costs.check_devices(len(devices), f"parallelize({self.__name__})")
        micro_x, micro_t = (_micro_example(t, name, method.num_micro_batches)
                            for t, name in ((x, "x"), (targets, "targets")))
        layer_fns = split_into_stages(self.fn, list(params), micro_x, micro_t)
        search = None
        if method.stages == "auto":
            search = search_stages(layer_fns, [shapes_of(p) for p in params], micro_x, micro_t, len(devices),
                                   method.num_micro_batches, method.intra_options(self.costs), self.costs)
            stages = search.stages
        else:
            stages = stage_assignments(method, len(params), len(devices))
        if method.stage_sharding == "data_parallel":
            _check_data_parallel(stages, jax.tree_util.tree_leaves(micro_x)[0].shape[0], method)
        stage_fns = [_compose(layer_fns, s.first, s.last, k == len(stages) - 1) for k, s in enumerate(stages)]
        meshes = [Mesh(np.array([devices[i] for i in s.devices]).reshape(s.mesh_shape), axis_names(len(s.mesh_shape)),
                       axis_types=(AxisType.Auto,) * len(s.mesh_shape)) for s in stages]
        stage_params = [tuple(shapes_of(p) for p in params[s.first:s.last + 1]) for s in stages]
        acts, targets_shapes = chain_inputs(stage_fns, stage_params, micro_x), shapes_of(micro_t)
        layouts = self._layouts(stage_fns, meshes, stages, stage_params, acts, targets_shapes)
        pipeline = Pipeline(stage_fns, meshes, layouts=layouts)
        plan = PipeshardPlan(stages, method.schedule, method.num_micro_batches, method.stage_sharding,
                             layouts, search)
        return _Compiled(pipeline, plan, _stage_examples(pipeline, stage_params, acts, targets_shapes))

    def _layouts(self, stage_fns: list[Callable[..., Any]], meshes: list[Mesh], stages: Sequence[StageAssignment],
                 stage_params: list[Any], acts: list[Any], targets: Any) -> tuple[StageLayout, ...]:
        """Each stage's layout; `acts[k]` is stage k's input (ShapeDtypeStructs)."""
        last, layouts = len(stage_fns) - 1, []
        for k, (fn, mesh, stage) in enumerate(zip(stage_fns, meshes, stages, strict=True)):
            if self.method.stage_sharding == "auto":
                logical = self.costs.mesh(stage.mesh_shape, stage.devices)
                layouts.append(planned_layout(fn, mesh, logical, self.method.intra_options(self.costs),
                                              stage_params[k], acts[k], targets if k == last else None,
                                              differentiate_input=k > 0, name=f"{self.__name__}.stage{k}"))
            else:
                default = data_parallel_layout if self.method.stage_sharding == "data_parallel" else replicated_layout
                layouts.append(default(fn, mesh, k == last))
        return tuple(layouts)


def _compose(layer_fns: Sequence[Callable[..., Any]], first: int, last: int, is_last: bool) -> Callable[..., Any]:
    """Stage function of layers first..last: `stage(params_tuple, act[, targets])`."""
    fns = layer_fns[first:last + 1]

    def stage(params: tuple[Any, ...], act: Any, *targets: Any) -> Any:
        for j, fn in enumerate(fns):
            act = fn(params[j], act, *targets) if is_last and j == len(fns) - 1 else fn(params[j], act)
        return act

    return stage


def _check_data_parallel(stages: Sequence[StageAssignment], micro_batch: int, method: PipeshardParallel) -> None:
    for k, stage in enumerate(stages):
        if micro_batch % len(stage.devices):
            raise OptionsError(
                f"PipeshardParallel(stage_sharding='data_parallel') splits each micro-batch of {micro_batch} examples "
                f"(batch / num_micro_batches={method.num_micro_batches}) over the devices of each stage, but stage "
                f"{k} has {len(stage.devices)} devices and {micro_batch} is not divisible by {len(stage.devices)}; "
                f"use a micro-batch size divisible by every stage's device count, or stage_sharding='auto'")


def _stage_examples(pipeline: Pipeline, params: Sequence[Any], acts: Sequence[Any],
                    targets: Any) -> tuple[tuple[Any, ...], ...]:
    """Per stage, ShapeDtypeStructs (placed as the stage's layout says) of its forward's arguments."""
    examples = []
    for k in range(pipeline.num_stages):
        last = k == pipeline.num_stages - 1
        args = (params[k], acts[k], *((targets,) if last else ()))
        shardings = (pipeline.sharding(k), pipeline.activation_sharding(k),
                     *((pipeline.targets_sharding(),) if last else ()))
        examples.append(tuple(_placed(a, where) for a, where in zip(args, shardings, strict=True)))
    return tuple(examples)


def _placed(tree: Any, shardings: Any) -> Any:
    """`tree`'s ShapeDtypeStructs carrying `shardings` (one sharding, or a pytree prefix of them)."""
    return jax.tree_util.tree_map(
        lambda where, sub: jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where),
                                                  sub), shardings, tree)


def _micro_example(tree: Any, name: str, count: int) -> Any:
    """The first micro-batch of `tree`, the shapes the stages are traced at."""
    sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in jax.tree_util.tree_leaves(tree)}
    if len(sizes) != 1 or None in sizes or next(iter(sizes)) % count:
        raise OptionsError(f"{name} has leading sizes {sorted(sizes, key=str)} which do not split into {count} "
                           f"equal micro-batches; use a PipeshardParallel(num_micro_batches=...) that divides "
                           f"the batch size")
    size = next(iter(sizes)) // count
    return jax.tree_util.tree_map(lambda a: a[:size], tree)


