"""Where a pipeline stage keeps its values, and the stage function run under that layout.

Three layouts, from simplest to Alpa's pipeshard:

- replicated: params, activations and targets whole on every device of the stage's sub-mesh;
- data parallel: activations, targets and cotangents split along dim 0 over all devices;
- planned: the intra-op ILP plans the stage's forward *and* backward (the VJP appended to the
  captured forward, meshplan.capture.backward) on a logical mesh of the sub-mesh; params,
  inputs, outputs and gradients take the plan's layouts (a gradient may be split where its
  param is whole: each device then keeps the slice its part of the contraction produced), and
  the stage function replays its jaxpr with a sharding constraint on every top-level value the
  plan splits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshplan.capture import Captured, capture
from meshplan.capture.backward import with_backward
from meshplan.cluster.mesh import LogicalMesh
from meshplan.intra.options import IntraOptions
from meshplan.intra.plan import IntraPlan
from meshplan.intra.solve import solve_intra
from meshplan.ir import Graph
from meshplan.runtime.replay import read, replay
from meshplan.runtime.sharded import is_placeable, partition_spec, placeable_spec

StageFn = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class StageLayout:
    """A stage function and where its values live; shardings are pytree prefixes.

    Attributes:
        fn: `fn(params, x) -> y`, or for the last stage `fn(params, x, targets) -> loss`.
        params: the params' sharding.
        inputs: the sharding of `x`.
        outputs: the sharding of `y` (and of its incoming cotangent); the loss's for the last stage.
        targets: the sharding of `targets` (last stage only; None otherwise).
        param_grads: the sharding of the params' gradients (default: `params`).
        input_grads: the sharding of `x`'s cotangent, the backward's second result (default: `inputs`).
        plan: the stage's IntraPlan when the layout was planned.
    """

    fn: StageFn
    params: Any
    inputs: Any
    outputs: Any
    targets: Any = None
    param_grads: Any = None
    input_grads: Any = None
    plan: IntraPlan | None = None

    def __post_init__(self) -> None:
        if self.param_grads is None:
            object.__setattr__(self, "param_grads", self.params)
        if self.input_grads is None:
            object.__setattr__(self, "input_grads", self.inputs)


def replicated_layout(fn: StageFn, mesh: Mesh, is_last: bool) -> StageLayout:
    """Everything whole on every device of `mesh`."""
    whole = NamedSharding(mesh, PartitionSpec())
    return StageLayout(fn, whole, whole, whole, whole if is_last else None)


def data_parallel_layout(fn: StageFn, mesh: Mesh, is_last: bool) -> StageLayout:
    """Params whole; activations, targets and cotangents split along dim 0 over all of `mesh`."""
    whole = NamedSharding(mesh, PartitionSpec())
    rows = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
    return StageLayout(fn, whole, rows, whole if is_last else rows, rows if is_last else None)


def planned_layout(fn: StageFn, mesh: Mesh, logical: LogicalMesh, options: IntraOptions, params: Any, x: Any,
                   targets: Any = None, differentiate_input: bool = True, name: str = "stage",
                   backward: bool = True, given: Callable[[Graph], IntraPlan] | None = None) -> StageLayout:
    """Plan the stage's forward and backward with the intra-op ILP and lay it out accordingly.

    Args:
        fn: the stage function (see StageLayout.fn).
        mesh: the stage's JAX mesh, of `logical`'s shape (see runtime.sharded.make_jax_mesh).
        logical: the logical mesh the ILP plans on.
        options: the ILP's options.
        params, x, targets: example arguments (arrays or ShapeDtypeStructs); `targets` is None
            for every stage but the last.
        differentiate_input: plan the gradient of `x` too (every stage but the first needs it).
        name: the captured graph's name.
        backward: plan the backward too (False: an inference stage, forward only).
        given: instead of solving, the plan to use for the graph planned (it may check and refuse it).
    """
    captured, planned, plan = plan_stage(fn, logical, options, params, x, targets, differentiate_input, name,
                                         backward, given)
    graph, grads, cotangents = planned
    specs = {c.node: c.output for c in plan.nodes}
    num_params, num_x = (len(jax.tree_util.tree_leaves(a)) for a in (params, x))

    def sharding(node: int) -> NamedSharding:
        return NamedSharding(mesh, partition_spec(placeable_spec(specs[node], graph[node].shape, logical)))

    inputs = [sharding(n) for n in captured.input_nodes]
    grad_of = [sharding(grads[i]) if i in grads else where for i, where in enumerate(inputs)]
    tree = lambda example, leaves: jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(example), leaves)
    param_part, x_part = slice(0, num_params), slice(num_params, num_params + num_x)
    outputs = NamedSharding(mesh, PartitionSpec()) if targets is not None else jax.tree_util.tree_unflatten(
        captured.out_tree, [sharding(n) for n in captured.output_nodes])
    return StageLayout(_constrained(captured, graph, specs, cotangents, logical, mesh), tree(params, inputs[param_part]),
                       tree(x, inputs[x_part]), outputs,
                       None if targets is None else tree(targets, inputs[num_params + num_x:]),
                       tree(params, grad_of[param_part]), tree(x, grad_of[x_part]), plan)


def plan_stage(fn: StageFn, logical: LogicalMesh, options: IntraOptions, params: Any, x: Any, targets: Any = None,
               differentiate_input: bool = True, name: str = "stage", backward: bool = True,
               given: Callable[[Graph], IntraPlan] | None = None,
               ) -> tuple[Captured, tuple[Graph, dict[int, int], dict[int, int]], IntraPlan]:
    """Capture the stage, append its VJP and solve the intra-op ILP (or take `given`'s plan);
    arguments as `planned_layout`.

    Returns:
        (the captured forward; the planned graph, forward + VJP (or the forward alone when some
        op has no VJP rule), with {flat input position: gradient node} and {forward node: its
        cotangent's node}; the plan).
    """
    args = (params, x) if targets is None else (params, x, targets)
    captured = capture(fn, *args, name=name)
    num_params, num_x = (len(jax.tree_util.tree_leaves(a)) for a in (params, x))
    planned = with_backward(captured, range(num_params + num_x if differentiate_input else num_params)) if backward \
        else None
    planned = planned or (captured.graph, {}, {})
    return captured, planned, given(planned[0]) if given else solve_intra(planned[0], logical, options)


def _constrained(captured: Captured, graph: Graph, specs: dict[int, Any], cotangents: dict[int, int],
                 logical: LogicalMesh, mesh: Mesh) -> StageFn:
    """The captured function replayed at its top level, each value pinned to its planned layout
    and its cotangent, in the backward JAX derives, to the layout the plan gives that cotangent.

    Every value is pinned, replicated ones too, and so is every cotangent: the backward is JAX's
    transpose of the replayed forward, whose values XLA's sharding propagation lays out where
    nothing pins them; it spread the gradients' splits into them and gathered them again
    (collectives the plan never priced). A plain sharding constraint would pin a cotangent to its
    value's forward layout (its transpose), while the plan may lay the two out differently."""
    closed = captured.jaxpr
    jaxpr = closed.jaxpr
    named = lambda spec: NamedSharding(mesh, partition_spec(spec))  # noqa: E731
    placeable = lambda n, var: is_placeable(specs[n], tuple(var.aval.shape), graph[n].shape, logical)  # noqa: E731
    pins = {}
    for var, n in captured.var_nodes.items():
        back = cotangents.get(n)
        forward = named(specs[n]) if placeable(n, var) else None
        backward = named(specs[back]) if back is not None and placeable(back, var) else None
        if forward is not None or backward is not None:
            pins[var] = _pin(forward, backward)

    def pin(var: Any, value: Any) -> Any:
        where = pins.get(var)
        return value if where is None else where(value)

    def stage(*args: Any) -> Any:
        flat = jax.tree_util.tree_leaves(args)
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update((var, pin(var, value)) for var, value in zip(jaxpr.invars, flat, strict=True))
        env = replay(jaxpr.eqns, env, pin)
        return jax.tree_util.tree_unflatten(captured.out_tree, [read(env, v) for v in jaxpr.outvars])

    return stage


@functools.cache
def _pin(forward: NamedSharding | None, backward: NamedSharding | None) -> Callable[[Any], Any]:
    """The identity that constrains its value to `forward` and its cotangent to `backward` (None:
    left as it is); on values without cotangents (integers) only the forward constraint."""

    def constrain(value: Any, where: NamedSharding | None) -> Any:
        return value if where is None else jax.lax.with_sharding_constraint(value, where)

    @jax.custom_vjp
    def pinned(value: Any) -> Any:
        return constrain(value, forward)

    pinned.defvjp(lambda value: (pinned(value), None), lambda _, cotangent: (constrain(cotangent, backward),))

    def pin(value: Any) -> Any:
        if not jnp.issubdtype(value.dtype, jnp.inexact):
            return constrain(value, forward)
        return pinned(value)

    return pin
