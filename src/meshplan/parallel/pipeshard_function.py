"""PipeshardFunction: a train or inference step, or a loss function with boundaries, run as a pipeline.

On the first call with new argument shapes the function is traced with its gradient marked. A
train step (one that takes a gradient) has its loss cut into layers and its update placed per
stage (meshplan.parallel.pipeshard_step); a loss function is cut at its `mark_pipeline_boundary`
calls into layers (runtime.boundary.split_into_stages); any other function without a gradient
is an inference step, cut like a loss and run forward only. Train and inference steps run, per
micro-batch, the program runtime.micro_batching derives, so results equal the full batch's.
Either way the layers are grouped into stages as the
PipeshardParallel options say (meshplan.parallel.pipeshard, or the inter-op pass for "auto":
meshplan.parallel.stage_pricing), each stage laid out on its sub-mesh (runtime.stage_layout:
planned by the intra-op ILP, data parallel or replicated), and micro-batches run through
runtime.pipeline.run_pipeline. Everything is cached per input signature. `get_plan` gives the
pure `Plan`; the jitted layouts and the executed steps stay here.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from meshplan.capture import capture, check_micro_batchable, find_batch_inputs, given_batch_inputs
from meshplan.cluster.costs import DeviceCosts
from meshplan.errors import OptionsError
from meshplan.inter.schedules import Event
from meshplan.launch.progress import building
from meshplan.parallel.call import CallForm, dynamic_slots, with_fixed_slots
from meshplan.parallel.donation import UnusedDonationWarning
from meshplan.parallel.function import DebugFile, ParallelizedFunction
from meshplan.parallel.given_plan import GivenPlan, check_program, check_stage_graph, read_given_plan
from meshplan.parallel.nnx_objects import has_objects
from meshplan.parallel.pipeshard import PipeshardParallel, StageAssignment, auto_layer_count, stage_assignments
from meshplan.parallel.pipeshard_step import (
    LossProgram,
    TracedStep,
    UpdateRunner,
    loss_program,
    on_mesh,
    same_gradient,
    summed,
    trace_step,
    update_pieces,
)
from meshplan.parallel.stage_pricing import StageSearch, search_stages
from meshplan.plan import Plan, Prediction, Stage
from meshplan.runtime.abstract import chain_inputs, dtype_of, shapes_of
from meshplan.runtime.boundary import split_into_stages
from meshplan.runtime.collective_check import CollectiveCheck, check_collectives
from meshplan.runtime.diagnostics import CompileDiagnostics, compile_lowered, warn_if_rematerialized
from meshplan.runtime.handoff import absent, is_multi_process, move, owns, settled
from meshplan.runtime.loss_layers import LossLayers, count_marks, split_loss
from meshplan.runtime.micro_batching import MicroProgram, Rule, micro_batch_program
from meshplan.runtime.pipeline import Pipeline, run_forward, run_micro_batches, run_pipeline, sum_of
from meshplan.runtime.sharded import axis_names
from meshplan.runtime.stage_layout import StageLayout, data_parallel_layout, planned_layout, replicated_layout


@dataclass(frozen=True, slots=True)
class _Compiled:
    """Everything one input signature produced."""

    pipeline: Pipeline
    stages: tuple[StageAssignment, ...]
    plan: Plan
    search: StageSearch | None
    example_inputs: tuple[tuple[Any, ...], ...]  # per stage: ShapeDtypeStructs of its forward's arguments


@dataclass(frozen=True, slots=True)
class _ForwardCompiled:
    """Everything one input signature of a step without a gradient (inference) produced."""

    parts: _Compiled  # the pipelined step
    program: MicroProgram  # the step each micro-batch runs, and how its results add up
    layers: LossLayers
    batch: dict[int, int]  # flat step input -> its batch dim
    weights: tuple[int, ...]  # flat step inputs the stages hold (float inputs that are not the batch)
    out_tree: Any
    statistics: Callable[..., Any] | None  # the program's full-batch statistics from the step's inputs


@dataclass(frozen=True, slots=True)
class _StepCompiled:
    """Everything one input signature of a whole train step produced."""

    parts: _Compiled  # the pipelined loss
    step: TracedStep  # at full-batch shapes
    loss: LossProgram  # at micro-batch shapes
    program: MicroProgram  # the loss each micro-batch runs, and how its results add up
    layers: LossLayers
    batch: dict[int, int]  # flat step input -> its batch dim
    owners: dict[int, tuple[int, ...]]  # differentiated step input -> the stages whose layers read it
    update: UpdateRunner
    statistics: Callable[..., Any] | None  # the program's full-batch statistics from the step's inputs
    donated: frozenset[int]  # flat step inputs whose buffers the caller hands over (donate_argnums)


class PipeshardFunction(ParallelizedFunction[_Compiled | _StepCompiled | _ForwardCompiled]):
    """A whole train step, an inference step, or a loss function cut by `mark_pipeline_boundary`,
    run as a pipeline.

    Call a train or inference step as the step itself: `f(state, batch) -> (new_state, metrics)`,
    `f(params, batch) -> outputs`; a loss function as `f(params, x, targets) -> (loss, grads)`.
    """

    def __init__(self, fn: Callable[..., Any] | CallForm, method: PipeshardParallel, devices: Sequence[Any] | None,
                 costs: DeviceCosts | None = None, batch_argnums: tuple[int, ...] | None = None,
                 donate_argnums: tuple[int, ...] | str = ()) -> None:
        """`batch_argnums` and `donate_argnums` are slot indices (CallForm.slot)."""
        super().__init__(fn, method, devices, costs)
        self.batch_argnums, self.donate_argnums = batch_argnums, donate_argnums
        self._events: tuple[Event, ...] = ()
        self._given: GivenPlan | None = None
        self._ran: set[int] = set()  # builds that have run once (their programs are compiled)

    def _run(self, args: tuple[Any, ...]) -> Any:
        """The step's results (a train or inference step), or loss and grads equal to
        `jax.value_and_grad(loss_fn)(params, x, targets)` (a loss function).

        A loss function's grads come back as a list (a tuple if `params` is one), one entry per
        layer; layer k's live on the sub-mesh of the stage that holds it, laid out like its
        params. A train step's new weights and optimizer state live on the stage that updated
        them.
        """
        compiled = self._compiled(args)
        # The stages' programs compile on their first run, which is building, not hanging, for the
        # launcher's hang watch: processes holding late stages compile long after the others wait.
        with building() if id(compiled) not in self._ran else contextlib.nullcontext():
            result = self._run_compiled(compiled, args)
        self._ran.add(id(compiled))
        return result

    def _run_compiled(self, compiled: _Compiled | _StepCompiled | _ForwardCompiled, args: tuple[Any, ...]) -> Any:
        if isinstance(compiled, _StepCompiled):
            return _scalars_together(self._run_step(compiled, args), compiled.parts.pipeline.stage_meshes[-1])
        if isinstance(compiled, _ForwardCompiled):
            return self._run_forward(compiled, args)
        params, x, targets = dynamic_slots(args)
        per_stage = [tuple(params[s.first:s.last + 1]) for s in compiled.stages]
        result = run_pipeline(compiled.pipeline, per_stage, x, targets, self.method.num_micro_batches,
                              self.method.schedule)
        self._events = result.events
        grads = [g for stage_grads in result.grads for g in stage_grads]
        loss = _scalars_together(result.loss, compiled.pipeline.stage_meshes[-1])
        return loss, tuple(grads) if isinstance(params, tuple) else grads

    def get_plan(self) -> Plan:
        """The Plan of the last call: stages (layers, devices, logical mesh, intra-op plan),
        schedule, micro-batches; with stages="auto" the inter-op pass's prediction.

        Raises:
            OptionsError: the function has not been called yet.
        """
        return super().get_plan()

    def describe_batch(self) -> str:
        """What the last call cut into micro-batches, along which dim and why, e.g. "args[1]['x'] f32[64, 16]
        (dim 0), inferred: proved independent: ..."."""
        return self.get_plan().option("batch", "none")

    @property
    def last_events(self) -> tuple[Event, ...]:
        """The steps of the last call, in dispatch order."""
        return self._events

    def get_layouts(self) -> tuple[StageLayout, ...]:
        """Where each stage of the last call keeps its values (jitted stage functions included)."""
        return _parts(self._require_last()).pipeline.layouts

    def get_collectives(self) -> tuple[CollectiveCheck, ...]:
        """Per stage of the last call, its planned collectives next to those its compiled programs
        run (kind, mesh axes, bytes per device), after the documented normalisation
        (meshplan.runtime.collective_check): the stage's plan prices its forward and backward in
        one graph, so the collectives of its forward and backward executables (at micro-batch
        shapes) are compared with it together; an inference stage's forward alone. The update of
        a train step is not part of the stage plans (XLA lays it out) and is not compared.

        Raises:
            OptionsError: not called yet, or the stages are not planned (stage_sharding="auto").
        """
        if self.method.stage_sharding != "auto":
            raise OptionsError(f"{self.__name__}.get_collectives() compares each stage's compiled collectives with "
                               f"its intra-op plan, but stage_sharding={self.method.stage_sharding!r} plans none; "
                               f"use PipeshardParallel(stage_sharding='auto')")
        compiled = _parts(self._require_last())
        return tuple(_stage_check(compiled, k, self._stage_programs(compiled, k))
                     for k in range(compiled.pipeline.num_stages))

    def _stage_programs(self, compiled: _Compiled, k: int) -> list[tuple[Any, CompileDiagnostics]]:
        """Stage k's forward and (when it has one) backward executables, compiled for its example
        inputs, each with its compile diagnostics."""
        pipeline, example = compiled.pipeline, compiled.example_inputs[k]
        forward = compile_lowered(pipeline.lower_forward(k, *example))
        if pipeline.forward_only:
            return [forward]
        return [forward, compile_lowered(pipeline.lower_backward(k, forward[0], *example))]

    def get_stage_search(self) -> StageSearch | None:
        """What the inter-op pass chose and from which layer costs (stages="auto"; else None)."""
        return _parts(self._require_last()).search

    def _plan_of(self, compiled: _Compiled | _StepCompiled | _ForwardCompiled) -> Plan:
        return _parts(compiled).plan

    def _debug_files(self, compiled: _Compiled | _StepCompiled | _ForwardCompiled) -> dict[str, DebugFile]:
        """Per stage k, stage_<k>_forward.hlo.txt and stage_<k>_backward.hlo.txt (the compiled
        forward and backward at micro-batch shapes), stage_<k>_memory.txt (the forward's memory
        analysis) and, for a planned stage, stage_<k>_collectives.json (`get_collectives`);
        plan.json (the Plan); placements.json (per stage its forward's input and output shardings
        and compile diagnostics; the last call's steps as "F0.1": phase, stage, micro-batch). A
        stage program XLA had to fully rematerialize raises a RematerializationWarning."""
        step = compiled if isinstance(compiled, _StepCompiled) else None
        compiled = _parts(compiled)
        files: dict[str, DebugFile] = {}
        placements = []
        for k in range(compiled.pipeline.num_stages):
            programs = self._stage_programs(compiled, k)
            for (executable, diagnostics), part in zip(programs, ("forward", "backward"), strict=False):
                warn_if_rematerialized(diagnostics, f"{self.__name__} stage {k} {part}")
                files[f"stage_{k}_{part}.hlo.txt"] = executable.as_text()
            executable, diagnostics = programs[0]
            files[f"stage_{k}_memory.txt"] = f"{executable.memory_analysis()}\n"
            if compiled.pipeline.layouts[k].plan is not None:
                files[f"stage_{k}_collectives.json"] = _stage_check(compiled, k, programs).to_dict()
            placements.append({"inputs": [str(s) for s in jax.tree_util.tree_leaves(executable.input_shardings)],
                               "outputs": [str(s) for s in jax.tree_util.tree_leaves(executable.output_shardings)],
                               **diagnostics.to_dict()})
        files["plan.json"] = compiled.plan.to_dict()
        files["placements.json"] = {"stages": placements, "events": [e.label for e in self._events]}
        if step is not None:  # a train step: where its update runs, and the stages reading each weight
            files["placements.json"]["update"] = [
                {"stage": p.stage, "ops": len(p.eqns), "inputs": len(p.inputs), "outputs": len(p.outputs),
                 "donated": {str(i): j for i, j in d.items()}} for p, d in zip(step.update.pieces,
                                                                                step.update.donations, strict=True)]
            files["placements.json"]["weight_stages"] = {str(w): list(s) for w, s in step.owners.items()}
        return files

    def _build(self, args: tuple[Any, ...]) -> _Compiled | _StepCompiled | _ForwardCompiled:
        devices = list(self.devices) if self.devices is not None else jax.devices()
        self.costs.check_devices(len(devices), f"parallelize({self.__name__})")
        # A given plan shapes every part of the build (layer count, stages, layouts): kept for its duration.
        self._given = None if self.method.plan is None else read_given_plan(self.method, len(devices), self.__name__)
        step = trace_step(self.fn, args, self.__name__)
        if step is not None:
            return self._build_step(args, step, devices)
        if self.donate_argnums and self.donate_argnums != "auto":
            leaves = self._donated_leaves(args, {})
            _warn_not_donated(self.__name__, args, leaves, "only a train step's update writes new values into "
                              "donated buffers; this function takes no gradient")
        if has_objects(args):
            raise OptionsError(f"{self.__name__} is called with nnx objects but computes no gradient; under "
                               f"PipeshardParallel nnx objects are supported in train steps (nnx.value_and_grad). "
                               f"For inference pass nnx.state(model) and nnx.merge it inside the step; a loss "
                               f"function cut by mark_pipeline_boundary takes arrays, f(params, x, targets)")
        dynamic = dynamic_slots(args)
        if not _is_loss_function(with_fixed_slots(self.fn, args), dynamic):
            return self._build_forward(args, devices)
        if self.method.layers != "auto":
            raise OptionsError(f"PipeshardParallel(layers={self.method.layers!r}) cuts a whole train step's loss; "
                               f"{self.__name__} is a loss function, whose layers are its params entries: drop layers")
        params, x, targets = dynamic
        micro_x, micro_t = (_micro_example(t, name, self.method.num_micro_batches)
                            for t, name in ((x, "x"), (targets, "targets")))
        loss_fn = with_fixed_slots(self.fn, args)
        batch = self._loss_batch(loss_fn, dynamic)
        self._check_mean_loss(loss_fn, dynamic, (params, micro_x, micro_t))
        layer_fns = split_into_stages(loss_fn, list(params), micro_x, micro_t)
        return _with_batch_record(self._pipelined(layer_fns, [shapes_of(p) for p in params], micro_x, micro_t,
                                                  devices), batch)

    def _check_mean_loss(self, loss_fn: Callable[..., Any], args: tuple[Any, ...],
                         micro_args: tuple[Any, ...]) -> None:
        """Raise unless averaging a loss function's micro-batch losses gives its full-batch loss."""
        leaves, tree = jax.tree_util.tree_flatten(args)
        flat = lambda *values: loss_fn(*jax.tree_util.tree_unflatten(tree, values))  # noqa: E731
        full, micro = (jax.make_jaxpr(flat)(*shapes_of(jax.tree_util.tree_leaves(a))) for a in (args, micro_args))
        weights = range(len(jax.tree_util.tree_leaves(args[0])))
        name = self.__name__
        if not micro_batch_program(full, micro, weights, self.method.num_micro_batches, f"{name}'s loss").is_mean:
            raise OptionsError(f"{name}'s loss is not a mean over the batch's examples (a sum, a mean over "
                               f"non-padding tokens, a normalizer computed from the batch); PipeshardParallel averages "
                               f"a loss function's micro-batch losses, which gives the full batch's only for a mean. "
                               f"Pass the whole train step (jax.value_and_grad and the update inside), whose loss it "
                               f"splits exactly, or write the loss as a mean")

    def _build_step(self, args: tuple[Any, ...], step: TracedStep, devices: list[Any]) -> _StepCompiled:
        """Cut the step's loss into layers at micro-batch shapes, pipeline them, place the update."""
        leaves, tree = jax.tree_util.tree_flatten(args)
        batch, batch_text = self._batch_dims(args, leaves)
        count = self.method.num_micro_batches
        micro_leaves = [_micro_shape(leaf, batch.get(i), count) for i, leaf in enumerate(leaves)]
        micro = trace_step(self.fn, jax.tree_util.tree_unflatten(tree, micro_leaves), self.__name__)
        same_gradient(step, micro, self.__name__)
        loss, program, layers = self._cut_loss(step, micro, len(devices))
        layer_params = [tuple(micro_leaves[loss.inputs[p]] for p in weights) for weights in layers.weights]
        micro_x = (*(micro_leaves[loss.inputs[p]] for p in range(len(loss.inputs)) if p not in loss.weights),
                   *_extra_inputs(program))
        rows = min(np.shape(micro_leaves[i])[d] for i, d in batch.items())
        parts = _with_layer_record(self._pipelined(layers.fns, layer_params, micro_x, (), devices,
                                                   has_aux=len(program.rules) > 1, micro_rows=rows), layers)
        parts = _with_batch_record(parts, batch_text)
        owners = _weight_stages(loss, layers, parts.stages)
        donated = self._donated_leaves(args, batch)
        update = _update_runner(step, owners, len(program.rules) - 1, parts.pipeline.stage_meshes, donated)
        if update.not_donated and self.donate_argnums != "auto":
            _warn_not_donated(self.__name__, args, update.not_donated, "no new value of its shape and dtype replaces "
                              "it (e.g. the step returns it as it is)")
        statistics = None if program.statistics is None else jax.jit(jaxpr_as_fun(program.statistics))
        return _StepCompiled(parts, step, loss, program, layers, batch, owners, update, statistics,
                             frozenset(donated) - set(update.not_donated))

    def _donated_leaves(self, args: tuple[Any, ...], batch: dict[int, int]) -> tuple[int, ...]:
        """Flat step inputs of the donated arguments ("auto": every argument holding no batch leaf)."""
        spans, start = [], 0
        for arg in args:
            count = len(jax.tree_util.tree_leaves(arg))
            spans.append(range(start, start + count))
            start += count
        if self.donate_argnums == "auto":
            positions = [i for i, span in enumerate(spans) if not any(leaf in batch for leaf in span)]
        else:
            positions = list(self.donate_argnums)
            bad = [i for i in positions if not 0 <= i < len(args)]
            if bad:
                raise OptionsError(f"parallelize(..., donate_argnums={self.donate_argnums}): position(s) {bad} are "
                                   f"out of range for {self.__name__} called with {len(args)} argument(s); give "
                                   f"positions 0..{len(args) - 1}")
        return tuple(leaf for i in positions for leaf in spans[i])

    def _build_forward(self, args: tuple[Any, ...], devices: list[Any]) -> _ForwardCompiled:
        """A step without a gradient (inference): the whole step cut into layers and run forward per
        micro-batch; its results rebuilt exactly from the micro-batches' (runtime.micro_batching)."""
        name, count = self.__name__, self.method.num_micro_batches
        leaves, tree = jax.tree_util.tree_flatten(args)
        batch, batch_text = self._batch_dims(args, leaves)
        micro_leaves = [_micro_shape(leaf, batch.get(i), count) for i, leaf in enumerate(leaves)]
        flat = lambda *values: self.fn(*jax.tree_util.tree_unflatten(tree, values))  # noqa: E731
        full, out_shape = jax.make_jaxpr(flat, return_shape=True)(*shapes_of(leaves))
        weights = tuple(i for i, leaf in enumerate(leaves) if i not in batch and jnp.issubdtype(dtype_of(leaf),
                                                                                                jnp.inexact))
        program = micro_batch_program(full, jax.make_jaxpr(flat)(*micro_leaves), weights, count, name, loss=False)
        layers = split_loss(program.closed, weights, self._layer_count(program.closed, len(devices)))
        layer_params = [tuple(micro_leaves[p] for p in ws) for ws in layers.weights]
        micro_x = (*(micro_leaves[p] for p in range(len(leaves)) if p not in weights), *_extra_inputs(program))
        rows = min(np.shape(micro_leaves[i])[d] for i, d in batch.items())
        parts = _with_layer_record(self._pipelined(layers.fns, layer_params, micro_x, (), devices, micro_rows=rows,
                                                   forward_only=True), layers, "forward")
        parts = _with_batch_record(parts, batch_text)
        statistics = None if program.statistics is None else jax.jit(jaxpr_as_fun(program.statistics))
        return _ForwardCompiled(parts, program, layers, batch, weights, jax.tree_util.tree_structure(out_shape),
                                statistics)

    def _layer_count(self, program: ClosedJaxpr, num_devices: int) -> int | None:
        """How many layers `split_loss` cuts `program` into: None to cut at its marks."""
        method, name = self.method, self.__name__
        marks = count_marks(program)
        if marks and method.layers not in ("auto", marks + 1):
            raise OptionsError(f"{name} marks {marks + 1} layers with mark_pipeline_boundary but "
                               f"PipeshardParallel(layers={method.layers}); use layers='auto' to cut at the marks, "
                               f"or remove the marks to cut into {method.layers} layers by FLOPs")
        if marks:
            return None
        if self._given is not None:
            return self._given.num_layers
        return method.layers if method.layers != "auto" else auto_layer_count(method, num_devices)

    def _cut_loss(self, full: TracedStep, micro: TracedStep,
                  num_devices: int) -> tuple[LossProgram, MicroProgram, LossLayers]:
        """The loss of the micro-batch trace (step input positions), the program each micro-batch
        runs for it (exact against the full batch's loss, meshplan.runtime.micro_batching), cut at
        its marks or into `layers` by FLOPs."""
        method, name = self.method, self.__name__
        whole, loss = loss_program(full, name), loss_program(micro, name)
        if (whole.inputs, whole.weights) != (loss.inputs, loss.weights):
            raise OptionsError(f"{name}'s loss reads other step inputs when its batch is cut into micro-batches; "
                               f"PipeshardParallel needs a step whose structure does not depend on the batch size")
        program = micro_batch_program(whole.closed, loss.closed, loss.weights, method.num_micro_batches,
                                      f"{name}'s loss")
        return loss, program, split_loss(program.closed, loss.weights, self._layer_count(program.closed, num_devices))

    def _batch_dims(self, args: tuple[Any, ...], leaves: list[Any]) -> tuple[dict[int, int], str]:
        """Flat step input -> batch dim, given by batch_argnums or inferred, and why (BatchInputs.explain);
        checked to hold independent examples (check_micro_batchable) and to cut evenly."""
        count = self.method.num_micro_batches
        captured = capture(self.fn, *args, name=self.__name__)
        batch = find_batch_inputs(captured, self.batch_argnums, self.__name__)
        if not batch.dims:
            raise OptionsError(f"PipeshardParallel cuts the batch of {self.__name__} into micro-batches, but no input "
                               f"looks like a batch (all are updated by the step, or hold no array); pass "
                               f"parallelize(..., batch_argnums=(i, ...)) with the positions of the batch arguments")
        for i, d in batch.dims:
            size = np.shape(leaves[i])[d]
            if size % count:
                raise OptionsError(f"{self.__name__}'s batch input {i} (shape {np.shape(leaves[i])}) has {size} "
                                   f"examples along dim {d}, which do not split into {count} equal micro-batches; "
                                   f"use a PipeshardParallel(num_micro_batches=...) that divides {size}")
        check_micro_batchable(batch, captured, self.__name__, count)
        return dict(batch.dims), batch.explain(captured)

    def _loss_batch(self, loss_fn: Any, args: tuple[Any, ...]) -> str:
        """Why a loss function f(params, x, targets) may be cut into micro-batches along dim 0 of x
        and targets (BatchInputs.explain); checked by check_micro_batchable."""
        captured, how = capture(loss_fn, *args, name=self.__name__), "x and targets of a loss function"
        batch = given_batch_inputs(captured, (1, 2))
        check_micro_batchable(batch, captured, self.__name__, self.method.num_micro_batches, how)
        return batch.explain(captured, how)

    def _run_step(self, compiled: _StepCompiled, args: tuple[Any, ...]) -> Any:
        parts, loss, layers = compiled.parts, compiled.loss, compiled.layers
        leaves = jax.tree_util.tree_leaves(args)
        positions = [tuple(tuple(loss.inputs[p] for p in layers.weights[k]) for k in range(s.first, s.last + 1))
                     for s in parts.stages]
        per_stage, weights = _placed_weights(parts.pipeline, positions, leaves, compiled.donated)
        count, program = self.method.num_micro_batches, compiled.program
        rest = [loss.inputs[p] for p in range(len(loss.inputs)) if p not in loss.weights]
        inputs = _micro_inputs(compiled, [leaves[i] for i in loss.inputs], leaves, rest, count)
        result = run_micro_batches(parts.pipeline, per_stage, inputs, [()] * count, self.method.schedule, loss="sum")
        self._events = result.events
        contributions: dict[int, list[Any]] = {}
        for j, s in enumerate(parts.stages):
            for k, grads in zip(range(s.first, s.last + 1), result.grads[j], strict=True):
                for p, g in zip(layers.weights[k], grads, strict=True):
                    contributions.setdefault(loss.inputs[p], []).append(g)
        jaxpr = compiled.step.closed.jaxpr
        gradient = jaxpr.eqns[compiled.step.gradient.index]
        env = {v: weights.get(i, leaf) for i, (v, leaf) in enumerate(zip(jaxpr.invars, leaves, strict=True))}
        env[gradient.outvars[0]] = result.loss
        num_aux = len(program.rules) - 1
        for j, rule in enumerate(program.rules[1:]):
            env[gradient.outvars[1 + j]] = _rebuilt([aux[j] for aux in result.aux], rule)
        for j, leaf in enumerate(compiled.step.differentiated):
            got = contributions.get(leaf)
            env[gradient.outvars[1 + num_aux + j]] = summed(got) if got else on_mesh(
                jnp.zeros(np.shape(leaves[leaf]), leaves[leaf].dtype), parts.pipeline.stage_meshes[0])
        return compiled.update(env)

    def _run_forward(self, compiled: _ForwardCompiled, args: tuple[Any, ...]) -> Any:
        parts, layers, program = compiled.parts, compiled.layers, compiled.program
        leaves = jax.tree_util.tree_leaves(args)
        per_stage = [tuple(tuple(leaves[p] for p in layers.weights[k]) for k in range(s.first, s.last + 1))
                     for s in parts.stages]
        rest = [p for p in range(len(leaves)) if p not in compiled.weights]
        result = run_forward(parts.pipeline, per_stage,
                             _micro_inputs(compiled, leaves, leaves, rest, self.method.num_micro_batches))
        self._events = result.events
        outs = [[y] if len(program.rules) == 1 else [y[0], *y[1]] for y in result.outputs]
        values = [_rebuilt([o[j] for o in outs], rule) for j, rule in enumerate(program.rules)]
        return jax.tree_util.tree_unflatten(compiled.out_tree, values)

    def _pipelined(self, layer_fns: Sequence[Callable[..., Any]], layer_params: list[Any], micro_x: Any,
                   micro_t: Any, devices: list[Any], has_aux: bool = False, micro_rows: int | None = None,
                   forward_only: bool = False) -> _Compiled:
        """The stages, layouts and pipeline of these layers (`layer_params`: ShapeDtypeStructs);
        with `has_aux` the last layer returns `(loss, aux)`; `micro_rows`: examples per
        micro-batch (default: `micro_x`'s first leaf's leading dim); `forward_only`: inference."""
        method, params = self.method, layer_params
        search = None
        if self._given is not None:
            kind = "forward" if forward_only else "whole" if micro_t == () else "loss"
            rows = micro_rows if micro_rows is not None else jax.tree_util.tree_leaves(micro_x)[0].shape[0]
            weights = {id(leaf): leaf for p in params for leaf in jax.tree_util.tree_leaves(p)}
            check_program(self._given, self.__name__, kind, len(layer_fns), rows * method.num_micro_batches,
                          sum(int(np.prod(leaf.shape)) for leaf in weights.values()))
            stages = self._given.stages
        elif method.stages == "auto":
            search = search_stages(layer_fns, params, micro_x, micro_t, len(devices), method.num_micro_batches,
                                   method.options(self.costs), self.costs, method.schedule, method.mesh_axes)
            stages = search.stages
        else:
            stages = stage_assignments(method, len(params), len(devices))
        if method.stage_sharding == "data_parallel":
            rows = jax.tree_util.tree_leaves(micro_x)[0].shape[0] if micro_rows is None else micro_rows
            _check_data_parallel(stages, rows, method)
        stage_fns = [_compose(layer_fns, s.first, s.last, k == len(stages) - 1 and not forward_only)
                     for k, s in enumerate(stages)]
        meshes = [Mesh(np.array([devices[i] for i in s.devices]).reshape(s.mesh_shape), axis_names(len(s.mesh_shape)),
                       axis_types=(AxisType.Auto,) * len(s.mesh_shape)) for s in stages]
        stage_params = [tuple(params[s.first:s.last + 1]) for s in stages]
        acts, targets_shapes = chain_inputs(stage_fns, stage_params, micro_x), shapes_of(micro_t)
        layouts = self._layouts(stage_fns, meshes, stages, stage_params, acts, targets_shapes, forward_only)
        pipeline = Pipeline(stage_fns, meshes, layouts=layouts, last_has_aux=has_aux, forward_only=forward_only)
        return _Compiled(pipeline, stages, self._plan_record(stages, layouts, search), search,
                         _stage_examples(pipeline, stage_params, acts, targets_shapes))

    def _layouts(self, stage_fns: list[Callable[..., Any]], meshes: list[Mesh], stages: Sequence[StageAssignment],
                 stage_params: list[Any], acts: list[Any], targets: Any,
                 forward_only: bool = False) -> tuple[StageLayout, ...]:
        """Each stage's layout; `acts[k]` is stage k's input (ShapeDtypeStructs); `forward_only`:
        planned without backward, the last stage without targets."""
        last, layouts = len(stage_fns) - 1, []
        for k, (fn, mesh, stage) in enumerate(zip(stage_fns, meshes, stages, strict=True)):
            if self.method.stage_sharding == "auto":
                logical = self.costs.mesh(stage.mesh_shape, stage.devices)
                given = None
                if self._given is not None and self._given.intra_plans[k] is not None:
                    given = lambda graph, k=k: check_stage_graph(self._given, k, graph, self.__name__)  # noqa: E731
                layouts.append(planned_layout(fn, mesh, logical, self.method.options(self.costs),
                                              stage_params[k], acts[k],
                                              targets if k == last and not forward_only else None,
                                              differentiate_input=k > 0, name=f"{self.__name__}.stage{k}",
                                              backward=not forward_only, given=given))
            else:
                default = data_parallel_layout if self.method.stage_sharding == "data_parallel" else replicated_layout
                layouts.append(default(fn, mesh, k == last))
        return tuple(layouts)

    def _plan_record(self, stages: Sequence[StageAssignment], layouts: Sequence[StageLayout],
                     search: StageSearch | None) -> Plan:
        """The pure Plan of these stages; with a search, its predicted latencies and memory and
        every layer's planned time per logical mesh (metrics "layer_s.<layer>.<mesh>")."""
        method = self.method
        predicted = search.inter.stages if search else (None,) * len(stages)
        records = tuple(Stage(s.first, s.last, s.devices, s.mesh_shape, intra_plan=layout.plan,
                              latency_s=None if e is None else e.latency, memory_bytes=None if e is None else e.memory,
                              inflight_microbatches=None if e is None else e.inflight)
                        for s, layout, e in zip(stages, layouts, predicted, strict=True))
        prediction, metrics = None, ()
        if search is not None:
            prediction = Prediction(search.inter.iteration_time, search.inter.pipeline_time, search.inter.sync_time)
            metrics = tuple((f"layer_s.{k}.{'x'.join(map(str, view))}", t) for k in range(search.costs.num_layers)
                            for view, t in search.layer_times(k).items())
        kind = "plan" if self._given else method.stages if isinstance(method.stages, str) else "explicit"
        return Plan("pipeshard", self.__name__, records, method.schedule, method.num_micro_batches,
                    prediction=prediction, metrics=metrics,
                    options=(("stages", kind), ("stage_sharding", method.stage_sharding)))


def _with_layer_record(parts: _Compiled, layers: LossLayers, step: str = "whole") -> _Compiled:
    """`parts` whose Plan also says what was pipelined (option "step": "whole" train step or
    "forward" inference) and how it was cut (option "layers", metrics "layer_flops.<k>")."""
    plan = parts.plan
    return replace(parts, plan=replace(
        plan, options=(*plan.options, ("step", step), ("layers", "marked" if layers.marked else "flops")),
        metrics=(*plan.metrics, *((f"layer_flops.{k}", f) for k, f in enumerate(layers.flops)))))


def _with_batch_record(parts: _Compiled, batch: str) -> _Compiled:
    """`parts` whose Plan also says what was cut into micro-batches and why (option "batch")."""
    return replace(parts, plan=replace(parts.plan, options=(*parts.plan.options, ("batch", batch))))


def _weight_stages(loss: LossProgram, layers: LossLayers,
                   stages: Sequence[StageAssignment]) -> dict[int, tuple[int, ...]]:
    """Differentiated step input -> the stages whose layers read it, in order (the first owns it)."""
    stage_of_layer = {k: j for j, s in enumerate(stages) for k in range(s.first, s.last + 1)}
    owners: dict[int, tuple[int, ...]] = {}
    for k, weights in enumerate(layers.weights):
        for p in weights:
            owners[loss.inputs[p]] = (*owners.get(loss.inputs[p], ()), stage_of_layer[k])
    return owners


def _update_runner(step: TracedStep, owners: dict[int, tuple[int, ...]], num_aux: int,
                   meshes: Sequence[Mesh], donated: Sequence[int] = ()) -> UpdateRunner:
    """The update placed on the stages: the loss and aux values live on the last stage, each weight
    and its gradient on its owner (stage 0 for a weight no layer reads)."""
    jaxpr = step.closed.jaxpr
    gradient = jaxpr.eqns[step.gradient.index]
    owner = lambda leaf: owners.get(leaf, (0,))[0]
    homes = {v: len(meshes) - 1 for v in gradient.outvars[:1 + num_aux]}
    homes.update((gradient.outvars[1 + num_aux + j], owner(leaf)) for j, leaf in enumerate(step.differentiated))
    homes.update((jaxpr.invars[leaf], owner(leaf)) for leaf in step.differentiated)
    return UpdateRunner(step, update_pieces(step, homes), meshes, donated)


def _extra_inputs(program: MicroProgram) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The inputs each micro-batch's loss takes after the step's: the statistics, the micro-batch index."""
    stats = () if program.statistics is None else tuple(
        jax.ShapeDtypeStruct(a.shape, a.dtype) for a in program.statistics.out_avals)
    return (*stats, *((jax.ShapeDtypeStruct((), jnp.int32),) if program.indexed else ()))


def _rebuilt(values: list[Any], rule: Rule) -> Any:
    """One result from its micro-batches' values (see micro_batching.Rule)."""
    if rule.how == "sum":
        return sum_of(values)
    return jnp.concatenate(values, axis=rule.dim) if rule.how == "join" else values[0]


def _stage_check(compiled: _Compiled, k: int, programs: Sequence[tuple[Any, CompileDiagnostics]]) -> CollectiveCheck:
    """Stage k's plan next to the collectives of its compiled `programs` together."""
    return check_collectives(compiled.pipeline.layouts[k].plan, [e.as_text() for e, _ in programs],
                             jax.default_backend())


def _parts(compiled: _Compiled | _StepCompiled | _ForwardCompiled) -> _Compiled:
    return compiled if isinstance(compiled, _Compiled) else compiled.parts


def _scalars_together(results: Any, mesh: Mesh) -> Any:
    """`results` with every scalar array on `mesh` (the last stage's, where the loss is): a step's
    metrics are updated on several stages (an nnx metric's total where the loss is, its count
    elsewhere), and code that combines them eagerly (`metrics.compute()`) needs them on one. In a
    job of several processes scalars go whole to every device of the job instead, so that every
    process can read the loss as with the other methods."""
    if is_multi_process():
        everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("devices",)), PartitionSpec())
        return jax.tree_util.tree_map(
            lambda v: move(v, everywhere) if isinstance(v, jax.Array) and v.ndim == 0 else v, results)
    return jax.tree_util.tree_map(lambda v: on_mesh(v, mesh) if isinstance(v, jax.Array) and v.ndim == 0 else v,
                                  results)


def _warn_not_donated(name: str, args: tuple[Any, ...], leaves: Sequence[int], why: str) -> None:
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    warnings.warn(f"{name}: donated argument leaves {', '.join(f'args{paths[i]}' for i in leaves)} are not donated "
                  f"and stay valid: {why}. Drop them from donate_argnums, or pass donate_argnums=\"auto\".",
                  UnusedDonationWarning, stacklevel=4)


def _placed_weights(pipeline: Pipeline, positions: list[tuple[tuple[int, ...], ...]], leaves: list[Any],
                    donated: frozenset[int]) -> tuple[list[Any], dict[int, Any]]:
    """Each stage's weights (step leaves at `positions[stage][layer]`) on its sub-mesh in its layout;
    and per step leaf the copy of its first stage (the one its update reads). A donated leaf not
    yet laid out there is copied first: only meshplan's copy is donated, never the caller's array."""
    per_stage, first = [], {}
    for k, stage_positions in enumerate(positions):
        flat, tree = jax.tree_util.tree_flatten(stage_positions)
        values = [leaves[i] for i in flat]
        shardings = [x.sharding for x in jax.tree_util.tree_leaves(
            _placed(shapes_of(jax.tree_util.tree_unflatten(tree, values)), pipeline.sharding(k)))]
        values = [_caller_copy(v) if i in donated and not _is_placed(v, where) else v
                  for i, v, where in zip(flat, values, shardings, strict=True)]
        placed = jax.device_put(values, shardings) if not is_multi_process() else [
            move(v, where) for v, where in zip(values, shardings, strict=True)]
        for i, value in zip(flat, placed, strict=True):
            first.setdefault(i, value)
        per_stage.append(jax.tree_util.tree_unflatten(tree, placed))
    return per_stage, first


def _caller_copy(value: Any) -> Any:
    """A copy of a caller's value that is about to be donated; a value on another process's devices
    needs none (its hand-off makes new buffers)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return value
    return jnp.array(value, copy=True)


def _is_placed(value: Any, where: Any) -> bool:
    return isinstance(value, jax.Array) and (value.sharding == where or value.sharding.is_equivalent_to(
        where, value.ndim))


def _is_loss_function(fn: Callable[..., Any], args: tuple[Any, ...]) -> bool:
    """Whether `fn(params, x, targets)` is a loss function cut by marks (params: one entry per
    layer, one mark fewer than entries, a scalar float result), rather than an inference step."""
    if len(args) != 3 or not isinstance(args[0], (list, tuple)) or not args[0]:
        return False
    closed, out = jax.make_jaxpr(fn, return_shape=True)(*args)
    scalar = isinstance(out, jax.ShapeDtypeStruct) and out.shape == () and jnp.issubdtype(out.dtype, jnp.floating)
    return scalar and count_marks(closed) == len(args[0]) - 1


def _micro_inputs(compiled: _StepCompiled | _ForwardCompiled, values: Sequence[Any], leaves: Sequence[Any],
                  rest: Sequence[int], count: int) -> list[tuple[Any, ...]]:
    """Per micro-batch, the first stage's inputs: micro-batch m of the step leaves `rest`, then the
    program's full-batch statistics (from its inputs `values`, computed on the last stage), then
    the micro-batch index when the program takes it."""
    stats: tuple[Any, ...] = ()
    if compiled.statistics is not None:
        last = compiled.parts.pipeline.stage_meshes[-1]
        inputs = [on_mesh(values[p], last) for p in compiled.program.statistic_inputs]
        if not is_multi_process():
            stats = tuple(compiled.statistics(*inputs))
        else:  # laid out whole on the last stage, so every process knows where they are
            whole = NamedSharding(last, PartitionSpec())
            stats = settled(tuple(move(v, whole) for v in compiled.statistics(*inputs))) if owns(last) else tuple(
                absent(a.shape, a.dtype, whole) for a in compiled.program.statistics.out_avals)
    index = compiled.program.indexed
    return [(*(_micro_batch(leaves[i], compiled.batch.get(i), m, count) for i in rest), *stats,
             *((np.int32(m),) if index else ())) for m in range(count)]


def _micro_shape(leaf: Any, dim: int | None, count: int) -> Any:
    """`leaf`'s ShapeDtypeStruct, one micro-batch long along `dim` (None: not a batch leaf)."""
    shape = list(np.shape(leaf))
    if dim is not None:
        shape[dim] //= count
    return jax.ShapeDtypeStruct(tuple(shape), dtype_of(leaf))


def _micro_batch(leaf: Any, dim: int | None, m: int, count: int) -> Any:
    """Micro-batch `m` of `leaf` along `dim`; the leaf itself when it is not a batch leaf."""
    if dim is None:
        return leaf
    size = np.shape(leaf)[dim] // count
    return leaf[(slice(None),) * dim + (slice(m * size, (m + 1) * size),)]


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
        last = k == pipeline.num_stages - 1 and not pipeline.forward_only
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


