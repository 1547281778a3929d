"""Pipeshard method: a loss function with pipeline boundaries -> pipelined (loss, grads).

`parallelize(loss_fn, method=PipeshardParallel(...))` cuts `loss_fn(params, x, targets)` at its
`mark_pipeline_boundary` calls (runtime.boundary.split_into_stages), puts each stage on its own
sub-mesh of devices and runs micro-batches through runtime.pipeline.run_pipeline. The split
stages and the Pipeline are cached per input signature. Params are replicated on their stage's
sub-mesh; with `data_parallel_stages=True` each stage also splits its micro-batch along the batch
dim over its devices (data parallelism inside the stage). No other intra-op sharding yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from meshplan.errors import MeshError, OptionsError
from meshplan.files import write_json_atomic, write_text_atomic
from meshplan.runtime.boundary import split_into_stages
from meshplan.runtime.pipeline import SCHEDULES, Event, Pipeline, apply_update, run_pipeline

__all__ = ["PipeshardFunction", "PipeshardParallel", "PipeshardPlan", "apply_update", "stage_device_indices"]

SCHEMA_VERSION = 1
StageDevices = tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class PipeshardParallel:
    """Inter-op (pipeline) parallelism for a loss function with `mark_pipeline_boundary` calls.

    Attributes:
        num_micro_batches: how many equal micro-batches each call cuts the batch into.
        stages: "auto" (the devices split into equal contiguous groups, one per stage) or, per
            stage, the indices (into the device list, `jax.devices()` by default) of its devices.
        schedule: "1f1b" or "gpipe".
        data_parallel_stages: split each micro-batch's activations, targets and cotangents along
            the batch dim over the stage's devices (params stay replicated, grads are summed);
            the micro-batch size must be divisible by every stage's device count.
    """

    num_micro_batches: int
    stages: Literal["auto"] | StageDevices = "auto"
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    data_parallel_stages: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.num_micro_batches, int) or self.num_micro_batches < 1:
            raise OptionsError(f"PipeshardParallel(num_micro_batches={self.num_micro_batches!r}): use an int >= 1")
        if self.schedule not in SCHEDULES:
            raise OptionsError(f"PipeshardParallel(schedule={self.schedule!r}): use one of {sorted(SCHEDULES)}")
        if not isinstance(self.data_parallel_stages, bool):
            raise OptionsError(f"PipeshardParallel(data_parallel_stages={self.data_parallel_stages!r}): "
                               f"use True or False")
        if self.stages != "auto":
            if isinstance(self.stages, str) or not all(isinstance(s, Sequence) for s in self.stages):
                raise OptionsError(f"PipeshardParallel(stages={self.stages!r}): use 'auto' or a tuple of "
                                   f"device-index tuples, one per stage, e.g. ((0, 1), (2, 3))")
            object.__setattr__(self, "stages", tuple(tuple(int(i) for i in s) for s in self.stages))


def stage_device_indices(stages: Literal["auto"] | StageDevices, num_stages: int, num_devices: int) -> StageDevices:
    """The device indices of each stage's sub-mesh; pure Python.

    Raises:
        MeshError: "auto" with a device count not divisible by `num_stages`, or explicit stages
            whose count does not match, that are empty, out of range or share a device.
    """
    if stages == "auto":
        if num_devices % num_stages:
            raise MeshError(f"PipeshardParallel(stages='auto') splits {num_devices} devices into {num_stages} "
                            f"equal stages, but {num_devices} is not divisible by {num_stages}; use a device "
                            f"count divisible by {num_stages} or give explicit stages=((...), ...)")
        per = num_devices // num_stages
        return tuple(tuple(range(k * per, (k + 1) * per)) for k in range(num_stages))
    _check_explicit(stages, num_stages, num_devices)
    return stages


def _check_explicit(stages: StageDevices, num_stages: int, num_devices: int) -> None:
    if len(stages) != num_stages:
        raise MeshError(f"PipeshardParallel(stages=...) gives {len(stages)} stages but the function has "
                        f"{num_stages} (one per params entry); give one device tuple per stage")
    owner: dict[int, int] = {}
    for k, indices in enumerate(stages):
        if not indices:
            raise MeshError(f"PipeshardParallel stage {k} has no devices; give every stage at least one")
        for i in indices:
            if not 0 <= i < num_devices:
                raise MeshError(f"PipeshardParallel stage {k} uses device index {i}, but only {num_devices} "
                                f"devices exist; use indices in [0, {num_devices})")
            if i in owner:
                raise MeshError(f"PipeshardParallel device index {i} is in stages {owner[i]} and {k}; "
                                f"give each stage a disjoint set of devices")
            owner[i] = k


@dataclasses.dataclass(frozen=True, slots=True)
class PipeshardPlan:
    """What a pipeshard call ran: the stages' devices, the schedule and the executed steps."""

    num_stages: int
    stage_devices: StageDevices  # indices into the device list, per stage
    schedule: str
    num_micro_batches: int
    events: tuple[Event, ...] = ()  # the last call's steps, in dispatch order
    data_parallel_stages: bool = False  # micro-batches split over each stage's devices

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; events as "F0.1" (phase, stage, micro-batch)."""
        return {"schema_version": SCHEMA_VERSION, "num_stages": self.num_stages,
                "stage_devices": [list(s) for s in self.stage_devices], "schedule": self.schedule,
                "num_micro_batches": self.num_micro_batches, "data_parallel_stages": self.data_parallel_stages,
                "events": [f"{e.phase.value}{e.stage}.{e.micro_batch}" for e in self.events]}


@dataclasses.dataclass(frozen=True, slots=True)
class _Compiled:
    """Everything one input signature produced."""

    pipeline: Pipeline
    plan: PipeshardPlan
    example_inputs: tuple[tuple[Any, ...], ...]  # per stage: ShapeDtypeStructs of its forward's arguments


class PipeshardFunction:
    """`loss_fn` run as a pipeline; call `f(params, x, targets) -> (loss, grads)`."""

    def __init__(self, fn: Callable[..., Any], method: PipeshardParallel, devices: Sequence[Any] | None) -> None:
        self.fn, self.method = fn, method
        self.devices = None if devices is None else tuple(devices)
        self._cache: dict[Any, _Compiled] = {}
        self._last: _Compiled | None = None
        self.__name__ = getattr(fn, "__name__", "pipeshard")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, params: Sequence[Any], x: Any, targets: Any) -> tuple[jax.Array, Any]:
        """Loss and grads, equal to `jax.value_and_grad(loss_fn)(params, x, targets)`.

        Grads come back as a list (a tuple if `params` is one); stage k's live on its sub-mesh.
        """
        compiled = self._compiled(params, x, targets)
        result = run_pipeline(compiled.pipeline, list(params), x, targets,
                              self.method.num_micro_batches, self.method.schedule)
        self._last = dataclasses.replace(compiled, plan=dataclasses.replace(compiled.plan, events=result.events))
        grads = tuple(result.grads) if isinstance(params, tuple) else result.grads
        return result.loss, grads

    def get_plan(self) -> PipeshardPlan:
        """The PipeshardPlan of the last call, with that call's events.

        Raises:
            OptionsError: the function has not been called yet.
        """
        return self._require_last().plan

    def dump_debug_info(self, folder: str | Path) -> tuple[Path, ...]:
        """Write stage_<k>_forward.hlo.txt (each stage's lowered forward, micro-batch shapes) and
        pipeshard.json (`PipeshardPlan.to_dict`) into `folder`; return the paths."""
        last = self._require_last()
        folder = Path(folder)
        paths = []
        for k, (fn, example) in enumerate(zip(last.pipeline.stage_fns, last.example_inputs, strict=True)):
            paths.append(folder / f"stage_{k}_forward.hlo.txt")
            write_text_atomic(paths[-1], jax.jit(fn).lower(*example).as_text())
        paths.append(folder / "pipeshard.json")
        write_json_atomic(paths[-1], last.plan.to_dict())
        return tuple(paths)

    def _require_last(self) -> _Compiled:
        if self._last is None:
            raise OptionsError(f"{self.__name__} has no pipeshard plan yet; call it once with example arguments first")
        return self._last

    def _compiled(self, params: Sequence[Any], x: Any, targets: Any) -> _Compiled:
        if not isinstance(params, (list, tuple)) or not params:
            raise OptionsError(f"{self.__name__} was called with params of type {type(params).__name__}; "
                               f"PipeshardParallel needs a non-empty list with one params pytree per stage")
        key = _signature((params, x, targets))
        if key not in self._cache:
            self._cache[key] = self._build(params, x, targets)
        return self._cache[key]

    def _build(self, params: Sequence[Any], x: Any, targets: Any) -> _Compiled:
        devices = list(self.devices) if self.devices is not None else jax.devices()
        indices = stage_device_indices(self.method.stages, len(params), len(devices))
        micro_x, micro_t = (_micro_example(t, name, self.method.num_micro_batches)
                            for t, name in ((x, "x"), (targets, "targets")))
        if self.method.data_parallel_stages:
            _check_data_parallel(indices, jax.tree_util.tree_leaves(micro_x)[0].shape[0], self.method)
        stage_fns = split_into_stages(self.fn, list(params), micro_x, micro_t)
        meshes = [Mesh(np.array([devices[i] for i in idx]), ("devices",), axis_types=(AxisType.Auto,))
                  for idx in indices]
        pipeline = Pipeline(stage_fns, meshes, data_parallel=self.method.data_parallel_stages)
        plan = PipeshardPlan(len(params), indices, self.method.schedule, self.method.num_micro_batches,
                             data_parallel_stages=self.method.data_parallel_stages)
        return _Compiled(pipeline, plan, _stage_examples(pipeline, params, micro_x, micro_t))


def _check_data_parallel(indices: StageDevices, micro_batch: int, method: PipeshardParallel) -> None:
    for k, stage in enumerate(indices):
        if micro_batch % len(stage):
            raise OptionsError(
                f"PipeshardParallel(data_parallel_stages=True) splits each micro-batch of {micro_batch} examples "
                f"(batch / num_micro_batches={method.num_micro_batches}) over the devices of each stage, but stage "
                f"{k} has {len(stage)} devices and {micro_batch} is not divisible by {len(stage)}; use a "
                f"micro-batch size divisible by every stage's device count, or data_parallel_stages=False")


def _stage_examples(pipeline: Pipeline, params: Sequence[Any], x: Any, targets: Any) -> tuple[tuple[Any, ...], ...]:
    """Per stage, ShapeDtypeStructs (placed on the stage's sub-mesh) of its forward's arguments."""
    examples, act = [], _shapes(x)
    for k, fn in enumerate(pipeline.stage_fns):
        last = k == pipeline.num_stages - 1
        args = (_shapes(params[k]), act, *((_shapes(targets),) if last else ()))
        shardings = (pipeline.sharding(k), *[pipeline.activation_sharding(k)] * (len(args) - 1))
        examples.append(tuple(_placed(a, where) for a, where in zip(args, shardings, strict=True)))
        act = jax.eval_shape(fn, *args)
    return tuple(examples)


def _placed(tree: Any, sharding: Any) -> Any:
    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)


def _micro_example(tree: Any, name: str, count: int) -> Any:
    """The first micro-batch of `tree`, the shapes the stages are traced at."""
    sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in jax.tree_util.tree_leaves(tree)}
    if len(sizes) != 1 or None in sizes or next(iter(sizes)) % count:
        raise OptionsError(f"{name} has leading sizes {sorted(sizes, key=str)} which do not split into {count} "
                           f"equal micro-batches; use a PipeshardParallel(num_micro_batches=...) that divides "
                           f"the batch size")
    size = next(iter(sizes)) // count
    return jax.tree_util.tree_map(lambda a: a[:size], tree)


def _shapes(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _signature(args: Any) -> Any:
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, tuple((tuple(np.shape(a)), str(getattr(a, "dtype", None) or np.asarray(a).dtype)) for a in leaves)
