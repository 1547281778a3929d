"""Inter-op runtime: stage functions on disjoint sub-meshes + a batch -> pipelined loss and grads.

Each stage is jitted on its own sub-mesh; a micro-batch's forward saves the stage's `jax.vjp`
function, activations and cotangents hop between sub-meshes (runtime.handoff: `jax.device_put` in
one process, a jitted program over both stages' devices across processes), and a GPipe or 1F1B
schedule orders the forward (F) and backward (B) steps. Dispatch is asynchronous, so steps of
different stages that the schedule puts side by side overlap on their devices. In a job of several
processes every process walks the whole schedule in the same order and runs the steps of the stages
it holds devices of, and the hand-offs it sends or receives: collectives meet in one order
everywhere, so none waits for a peer that waits for it (each program is waited for there:
runtime.handoff.settled).

Where a stage keeps its params, activations and targets is its StageLayout
(runtime.stage_layout): replicated by default; with `data_parallel=True` activations, targets and
cotangents are split along dim 0 over the stage's devices (XLA all-reduces the param grads
inside the backward); a planned layout follows the stage's intra-op plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshplan.errors import MeshError, OptionsError
from meshplan.inter.schedules import Event, Phase, make_schedule
from meshplan.runtime.handoff import absent, absent_like, is_multi_process, move, move_tree, owns, settled
from meshplan.runtime.stage_layout import StageFn, StageLayout, data_parallel_layout, replicated_layout


@dataclass(frozen=True, slots=True)
class Pipeline:
    """Stage functions, each run on its own sub-mesh.

    `stage_fns[k](params_k, x) -> y` for every stage but the last, which is
    `stage_fns[-1](params, x, targets) -> scalar loss`. Sub-meshes must not share devices.
    `layouts[k]` says where stage k keeps its values and gives the function actually run (a
    planned layout's carries sharding constraints); by default every stage is replicated on its
    sub-mesh, or with `data_parallel=True` splits activations, targets and cotangents along dim 0.
    With `last_has_aux=True` the last stage returns `(loss, aux)`: aux values are kept per
    micro-batch and not differentiated. With `forward_only=True` (inference) every stage is
    `stage_fns[k](params_k, x) -> y`, run forward only (`run_forward`); the last stage's `y` is
    the result.
    """

    stage_fns: tuple[StageFn, ...]
    stage_meshes: tuple[Mesh, ...]
    data_parallel: bool = False
    layouts: tuple[StageLayout, ...] | None = None
    last_has_aux: bool = False
    forward_only: bool = False
    _forwards: tuple[Any, ...] = field(init=False, repr=False, compare=False)
    _backwards: tuple[Any, ...] = field(init=False, repr=False, compare=False)
    _declared: dict[Any, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_fns", tuple(self.stage_fns))
        object.__setattr__(self, "stage_meshes", tuple(self.stage_meshes))
        _check_stages(self.stage_fns, self.stage_meshes)
        last = len(self.stage_fns) - 1
        if self.layouts is None:
            default = data_parallel_layout if self.data_parallel else replicated_layout
            layouts = tuple(default(fn, mesh, k == last)
                            for k, (fn, mesh) in enumerate(zip(self.stage_fns, self.stage_meshes, strict=True)))
            object.__setattr__(self, "layouts", layouts)
        elif len(self.layouts) != len(self.stage_fns):
            raise OptionsError(f"Pipeline got {len(self.layouts)} layouts for {len(self.stage_fns)} stages; "
                               f"give one StageLayout per stage")
        object.__setattr__(self, "layouts", tuple(self.layouts))
        forwards, backwards = zip(*(_jit_stage(layout, k == last, self.last_has_aux and k == last, self.forward_only)
                                    for k, layout in enumerate(self.layouts)), strict=True)
        object.__setattr__(self, "_forwards", forwards)
        object.__setattr__(self, "_backwards", backwards)
        object.__setattr__(self, "_declared", {})

    def run_forward_step(self, stage: int, params: Any, x: Any, *targets: Any) -> tuple[Any, Any]:
        """Stage `stage`'s jitted forward: `(y, vjp_fn)`. In a job of several processes, a process
        that owns none of the stage's devices skips it and gets `y` as arrays with no shards here
        (`vjp_fn` None); the owners' `y` is laid out as declared, so every process knows where it is."""
        run = self._forwards[stage]
        if self.forward_only:
            run = lambda *args: (self._forwards[stage](*args), None)  # noqa: E731
        if not is_multi_process():
            return run(params, x, *targets)
        shapes = self._declared_shapes(("forward", stage), lambda: jax.eval_shape(
            lambda p, x_: run(p, x_, *targets)[0], params, x), self.output_sharding(stage), stage)
        if not owns(self.stage_meshes[stage]):
            return absent_like(shapes), None
        y, vjp_fn = run(params, x, *targets)
        return settled(_as_declared(y, shapes)), vjp_fn

    def run_backward_step(self, stage: int, vjp_fn: Any, cotangent: Any, params: Any, x: Any) -> tuple[Any, Any]:
        """Stage `stage`'s jitted backward: `(param grads, input cotangent)`; `params` and `x` (the
        forward's arguments, arrays or shapes) give the results' shapes to processes that skip it."""
        if not is_multi_process():
            return self._backwards[stage](vjp_fn, cotangent)
        grads = self._declared_shapes(("grads", stage), lambda: jax.eval_shape(lambda p: p, params),
                                      self.layouts[stage].param_grads, stage)
        dx = self._declared_shapes(("dx", stage), lambda: jax.eval_shape(lambda x_: _split_float(x_)[0], x),
                                   self.layouts[stage].input_grads, stage)
        if not owns(self.stage_meshes[stage]):
            return absent_like(grads), absent_like(dx)
        grad, dx_value = self._backwards[stage](vjp_fn, cotangent)
        return settled((_as_declared(grad, grads), _as_declared(dx_value, dx)))

    def _declared_shapes(self, key: Any, shapes: Callable[[], Any], shardings: Any, stage: int) -> Any:
        """ShapeDtypeStructs of a stage step's results with their declared shardings (a pytree
        prefix; None: replicated on the stage's mesh), computed once."""
        if key not in self._declared:
            whole = NamedSharding(self.stage_meshes[stage], PartitionSpec())
            self._declared[key] = jax.tree_util.tree_map(
                lambda where, sub: jax.tree_util.tree_map(
                    lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where or whole), sub),
                shardings, shapes(), is_leaf=lambda v: v is None)
        return self._declared[key]

    @property
    def num_stages(self) -> int:
        """How many stages the pipeline has."""
        return len(self.stage_fns)

    def sharding(self, stage: int) -> Any:
        """Where stage `stage` keeps its params and grads (a sharding or a pytree of them)."""
        return self.layouts[stage].params

    def activation_sharding(self, stage: int) -> Any:
        """Where stage `stage` takes its input activations (and returns their cotangents)."""
        return self.layouts[stage].inputs

    def output_sharding(self, stage: int) -> Any:
        """Where stage `stage` leaves its output activations (its loss, for the last stage)."""
        return self.layouts[stage].outputs

    def targets_sharding(self) -> Any:
        """Where the last stage takes its targets."""
        return self.layouts[-1].targets

    def lower_forward(self, stage: int, *args: Any) -> Any:
        """Lower stage `stage`'s jitted forward for `args` (arrays or ShapeDtypeStructs)."""
        return self._forwards[stage].lower(*args)

    def lower_backward(self, stage: int, forward: Any, *args: Any) -> Any:
        """Lower stage `stage`'s jitted backward for the forward's arguments `args` (arrays or
        ShapeDtypeStructs), given `forward`, its compiled forward: the saved VJP takes the layouts
        that executable gives it, the cotangent its layout's `output_grads`."""
        shapes = jax.eval_shape(self._forwards[stage], *args)
        placed = jax.tree_util.tree_map(lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where),
                                        shapes, forward.output_shardings)
        y, vjp_fn = placed
        if self.last_has_aux and stage == self.num_stages - 1:
            y = y[0]
        cotangent = jax.tree_util.tree_map(
            lambda where, sub: jax.tree_util.tree_map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), sub),
            self.layouts[stage].output_grads, _split_float(y)[0])
        return self._backwards[stage].lower(vjp_fn, cotangent)

    def check_batch_split(self, stage: int, tree: Any, what: str) -> None:
        """Raise OptionsError if `data_parallel` cannot split `tree`'s leaves over stage `stage`'s devices."""
        count = self.stage_meshes[stage].devices.size
        if not self.data_parallel:
            return
        for leaf in jax.tree_util.tree_leaves(tree):
            where = f"Pipeline(data_parallel=True) splits stage {stage}'s {what} (shape {leaf.shape}) along dim 0"
            if not leaf.ndim:
                raise OptionsError(f"{where}, but it is a scalar; give every activation leaf a leading batch dim, "
                                   f"or use data_parallel=False")
            if leaf.shape[0] % count:
                raise OptionsError(
                    f"{where} over its {count} devices, but {leaf.shape[0]} rows are not divisible by {count}; use a "
                    f"micro-batch size (batch / num_micro_batches) divisible by every stage's device count, "
                    f"or data_parallel=False")


class PipelineResult(NamedTuple):
    """What `run_pipeline` returns: mean loss, grads per stage, and the steps in executed order."""

    loss: jax.Array
    grads: list[Any]
    events: tuple[Event, ...]
    aux: tuple[Any, ...] = ()  # per micro-batch, the last stage's aux values (Pipeline.last_has_aux)


def _check_stages(fns: tuple[StageFn, ...], meshes: tuple[Mesh, ...]) -> None:
    if not fns or len(fns) != len(meshes):
        raise OptionsError(f"Pipeline got {len(fns)} stage functions and {len(meshes)} meshes; "
                           f"pass one sub-mesh per stage function (at least one stage)")
    seen: dict[Any, int] = {}
    for k, mesh in enumerate(meshes):
        for device in mesh.devices.flat:
            if device in seen:
                raise MeshError(f"device {device} is in the meshes of stages {seen[device]} and {k}; "
                                f"give each stage a disjoint subset of devices")
            seen[device] = k


def _jit_stage(layout: StageLayout, is_last: bool, has_aux: bool = False,
               forward_only: bool = False) -> tuple[Any, Any]:
    """The stage's jitted forward (saving its vjp) and backward, pinned to its layout; with
    `forward_only`, the forward alone (no vjp, no targets) and no backward.

    Residuals in the vjp function keep whatever sharding XLA picks (`None`); the backward's
    grad output shardings are what make XLA sum (or reduce-scatter) the partial grads.
    """
    fn = layout.fn
    if forward_only:
        return jax.jit(fn, in_shardings=(layout.params, layout.inputs), out_shardings=layout.outputs), None
    if is_last:
        forward = jax.jit(lambda p, x, t: _vjp(lambda p_, x_: fn(p_, x_, t), p, x, has_aux),
                          in_shardings=(layout.params, layout.inputs, layout.targets),
                          out_shardings=(layout.outputs, None))
    else:
        forward = jax.jit(lambda p, x: _vjp(fn, p, x), in_shardings=(layout.params, layout.inputs),
                          out_shardings=(layout.outputs, None))
    backward = jax.jit(lambda vjp_fn, cotangent: vjp_fn(cotangent), in_shardings=(None, layout.output_grads),
                       out_shardings=(layout.param_grads, layout.input_grads))
    return forward, backward


def _vjp(fn: Callable[..., Any], params: Any, x: Any, has_aux: bool = False) -> tuple[Any, Any]:
    """`jax.vjp(fn, params, x)` over the floating-point leaves of `x` and of the output only.

    Integer and boolean values (token ids, masks) ride along between stages but have no
    cotangent: they are None in the cotangents the backward takes and returns. With `has_aux`,
    `fn` returns `(y, aux)` and the result is `((y, aux), vjp_fn)`.
    """
    x_float, x_rest = _split_float(x)
    y_structure: list[Any] = []

    def differentiable(p: Any, xf: Any) -> tuple[Any, Any]:
        out = fn(p, _join(xf, x_rest))
        y, aux = out if has_aux else (out, None)
        y_float, (structure, leaves) = _split_float(y)
        y_structure.append(structure)
        return y_float, ([None if _is_float(a) else a for a in leaves], aux)

    y_float, vjp_fn, (y_rest, aux) = jax.vjp(differentiable, params, x_float, has_aux=True)
    y = _join(y_float, (y_structure[0], y_rest))
    return ((y, aux) if has_aux else y), vjp_fn


def _split_float(tree: Any) -> tuple[Any, tuple[Any, list[Any]]]:
    """`tree` with None in place of its non-float leaves; and (its structure, every leaf) to rejoin."""
    leaves, structure = jax.tree_util.tree_flatten(tree)
    floats = [leaf if _is_float(leaf) else None for leaf in leaves]
    return jax.tree_util.tree_unflatten(structure, floats), (structure, leaves)


def _join(float_tree: Any, rest: tuple[Any, list[Any]]) -> Any:
    """The tree `_split_float` cut: its float leaves from `float_tree`, the others (None where a
    float leaf was) from `rest`."""
    structure, leaves = rest
    values = iter(jax.tree_util.tree_leaves(float_tree))
    return jax.tree_util.tree_unflatten(structure, [next(values) if a is None or _is_float(a) else a
                                                    for a in leaves])


def _is_float(leaf: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


_accumulate = jax.jit(lambda a, b: jax.tree_util.tree_map(jnp.add, a, b))


# --- execution ---------------------------------------------------------------------------------

def place_params(pipeline: Pipeline, params_per_stage: Sequence[Any]) -> list[Any]:
    """Put each stage's params (a pytree) on that stage's sub-mesh, laid out as its layout says."""
    if len(params_per_stage) != pipeline.num_stages:
        raise OptionsError(f"got params for {len(params_per_stage)} stages but the pipeline has "
                           f"{pipeline.num_stages}; pass one params pytree per stage")
    return [move_tree(p, pipeline.sharding(k)) for k, p in enumerate(params_per_stage)]


def _micro_batches(tree: Any, count: int, name: str) -> list[Any]:
    if count < 1:
        raise OptionsError(f"num_micro_batches is {count}; use at least 1")
    sizes = {leaf.shape[0] for leaf in jax.tree_util.tree_leaves(tree)}
    if len(sizes) != 1 or next(iter(sizes)) % count:
        raise OptionsError(f"{name} has leading sizes {sorted(sizes)} which do not split into {count} equal "
                           f"micro-batches; use a num_micro_batches that divides the batch size")
    size = next(iter(sizes)) // count
    return [jax.tree_util.tree_map(lambda a, m=m: a[m * size:(m + 1) * size], tree) for m in range(count)]


@dataclass(slots=True)
class _Run:
    """Mutable state of one `run_pipeline` call, keyed by (stage, micro-batch)."""

    pipeline: Pipeline
    params: list[Any]
    inputs: list[Any]
    targets: list[Any]
    seed: jax.Array
    outputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    vjps: dict[tuple[int, int], Any] = field(default_factory=dict)
    cotangents: dict[tuple[int, int], Any] = field(default_factory=dict)
    saved: dict[tuple[int, int], Any] = field(default_factory=dict)  # forward inputs (several processes only)
    losses: list[Any] = field(default_factory=list)
    auxes: list[Any] = field(default_factory=list)
    grads: dict[int, Any] = field(default_factory=dict)

    def forward(self, s: int, m: int) -> None:
        pipeline = self.pipeline
        x = self.inputs[m] if s == 0 else self.outputs.pop((s - 1, m))
        pipeline.check_batch_split(s, x, "input")
        x = move_tree(x, pipeline.activation_sharding(s))
        last = s == pipeline.num_stages - 1
        if last:
            pipeline.check_batch_split(s, self.targets[m], "targets")
        extra = (move_tree(self.targets[m], pipeline.targets_sharding()),) if last else ()
        if is_multi_process():  # the backward's result shapes, for the processes that skip it
            self.saved[(s, m)] = x
        y, self.vjps[(s, m)] = pipeline.run_forward_step(s, self.params[s], x, *extra)
        if last and pipeline.last_has_aux:
            self.losses.append(y[0])
            self.auxes.append(y[1])
        elif last:
            self.losses.append(y)
        else:
            self.outputs[(s, m)] = y

    def backward(self, s: int, m: int) -> None:
        last = s == self.pipeline.num_stages - 1
        if last:  # the seed takes the loss's dtype: a bf16 loss needs a bf16 cotangent
            ct = self.seed.astype(self.losses[0].dtype)
        else:
            ct = move_tree(self.cotangents.pop((s + 1, m)), self.pipeline.layouts[s].output_grads)
        grad, dx = self.pipeline.run_backward_step(s, self.vjps.pop((s, m)), ct, self.params[s],
                                                   self.saved.pop((s, m), None))
        if s not in self.grads:
            self.grads[s] = grad
        elif not is_multi_process():
            self.grads[s] = _accumulate(self.grads[s], grad)
        elif owns(self.pipeline.stage_meshes[s]):
            self.grads[s] = settled(_as_declared(_accumulate(self.grads[s], grad), self.grads[s]))
        if s:
            self.cotangents[(s, m)] = dx


def run_pipeline(pipeline: Pipeline, params_per_stage: Sequence[Any], batch: Any, targets: Any,
                 num_micro_batches: int, schedule: str = "1f1b") -> PipelineResult:
    """Loss and grads of the pipelined model, micro-batch by micro-batch.

    The loss is the mean of the micro-batch losses and the grads are those of that mean (each
    backward is seeded with `1 / num_micro_batches`), so with a per-example mean loss they equal
    `jax.value_and_grad` on the whole batch.

    Args:
        pipeline: the stages and their sub-meshes.
        params_per_stage: one params pytree per stage; moved to the stage's sub-mesh.
        batch: the first stage's input (pytree; leading axis is the batch).
        targets: the last stage's extra input (pytree; leading axis is the batch).
        num_micro_batches: how many equal micro-batches to cut the batch into.
        schedule: "1f1b" or "gpipe" (see `make_schedule`).

    Returns:
        PipelineResult(loss, grads, events): grads[k] lives on stage k's sub-mesh; events are
        the steps in the order they were dispatched.
    """
    inputs = _micro_batches(batch, num_micro_batches, "batch")
    for k in range(pipeline.num_stages):  # fail before any step runs; activations keep the batch rows
        pipeline.check_batch_split(k, inputs[0], "micro-batch")
    return run_micro_batches(pipeline, params_per_stage, inputs, _micro_batches(targets, num_micro_batches, "targets"),
                             schedule)


def run_micro_batches(pipeline: Pipeline, params_per_stage: Sequence[Any], inputs: Sequence[Any],
                      targets: Sequence[Any], schedule: str = "1f1b", loss: str = "mean") -> PipelineResult:
    """`run_pipeline` on micro-batches already cut: `inputs[m]` and `targets[m]` are micro-batch m's
    first-stage input and last-stage targets (values that are not per example, such as a
    random key, may be the same in every micro-batch).

    `loss="mean"`: the loss is the mean of the micro-batches' losses and each backward is seeded
    with `1 / B`; `"sum"`: their sum, each backward seeded with 1 (micro-batch losses that are
    contributions to the full loss, meshplan.runtime.micro_batching).
    """
    if loss not in ("mean", "sum"):
        raise OptionsError(f"run_micro_batches(loss={loss!r}): use 'mean' or 'sum'")
    num_micro_batches = len(inputs)
    events = make_schedule(schedule, pipeline.num_stages, num_micro_batches)
    last = pipeline.output_sharding(pipeline.num_stages - 1)
    seed = 1.0 if loss == "sum" else 1.0 / num_micro_batches
    run = _Run(pipeline, place_params(pipeline, params_per_stage), list(inputs), list(targets),
               jax.device_put(jnp.float32(seed), last))
    executed: list[Event] = []
    for event in events:
        step = run.forward if event.phase is Phase.FORWARD else run.backward
        step(event.stage, event.micro_batch)
        executed.append(event)
    total = _on_owners(sum_of if loss == "sum" else _mean, run.losses)
    return PipelineResult(total, [run.grads[k] for k in range(pipeline.num_stages)], tuple(executed), tuple(run.auxes))


def _as_declared(values: Any, shapes: Any) -> Any:
    """`values` laid out as the shardings of `shapes` (arrays or ShapeDtypeStructs): in a job of
    several processes every process must know where a stage's results are, so owners fix them."""
    return jax.tree_util.tree_map(lambda v, s: move(v, s.sharding), values, shapes)


def _on_owners(fn: Callable[[list[Any]], Any], values: list[Any]) -> Any:
    """`fn(values)` (arrays of one shape on one stage), laid out as `values[0]`; skipped by the
    processes owning none of their devices."""
    first = values[0]
    if not is_multi_process():
        return fn(values)
    if not owns(first.sharding):
        return absent(first.shape, first.dtype, first.sharding)
    return settled(move(fn(values), first.sharding))


@jax.jit
def _mean(losses: list[jax.Array]) -> jax.Array:
    return sum(losses) / len(losses)


@jax.jit
def sum_of(values: list[Any]) -> Any:
    """The sum of `values` (arrays of one shape and dtype, integers included), jitted."""
    return sum(values[1:], values[0])


class ForwardResult(NamedTuple):
    """What `run_forward` returns: the last stage's result per micro-batch, and the steps run."""

    outputs: tuple[Any, ...]
    events: tuple[Event, ...]


def run_forward(pipeline: Pipeline, params_per_stage: Sequence[Any], inputs: Sequence[Any]) -> ForwardResult:
    """Run micro-batches `inputs` forward through a `forward_only` pipeline (inference).

    Steps are dispatched diagonal by diagonal (stage s runs micro-batch m at step s + m), so
    stages work on different micro-batches side by side.
    """
    if not pipeline.forward_only:
        raise OptionsError("run_forward runs a Pipeline(forward_only=True); use run_micro_batches to train")
    params = place_params(pipeline, params_per_stage)
    stages, count = pipeline.num_stages, len(inputs)
    acts = dict(enumerate(inputs))
    outputs: list[Any] = [None] * count
    events = []
    for t in range(stages + count - 1):
        for s in range(max(0, t - count + 1), min(stages, t + 1)):
            m = t - s
            y, _ = pipeline.run_forward_step(s, params[s], move_tree(acts.pop(m), pipeline.activation_sharding(s)))
            if s == stages - 1:
                outputs[m] = y
            else:
                acts[m] = y
            events.append(Event(s, m, Phase.FORWARD))
    return ForwardResult(tuple(outputs), tuple(events))


def apply_update(params_per_stage: Sequence[Any], grads_per_stage: Sequence[Any],
                 update_fn: Callable[[Any, Any], Any]) -> list[Any]:
    """One optimizer step per stage, each on the sub-mesh that holds the stage's grads.

    Args:
        params_per_stage: one params pytree per stage; each leaf is moved to its grad's sharding.
        grads_per_stage: the matching grads, e.g. `run_pipeline(...).grads`.
        update_fn: `update_fn(params, grads) -> new_params` (e.g. SGD), jitted once.

    Returns:
        The new params per stage; stage k's stay on stage k's sub-mesh.
    """
    if len(params_per_stage) != len(grads_per_stage):
        raise OptionsError(f"got params for {len(params_per_stage)} stages and grads for "
                           f"{len(grads_per_stage)}; pass one params and one grads pytree per stage")
    update = jax.jit(update_fn)
    # Move params next to their grads first: an update that forwards a param must not leave it elsewhere.
    on_grads = lambda p, g: jax.tree_util.tree_map(lambda a, b: jax.device_put(a, b.sharding), p, g)
    return [update(on_grads(p, g), g) for p, g in zip(params_per_stage, grads_per_stage, strict=True)]
