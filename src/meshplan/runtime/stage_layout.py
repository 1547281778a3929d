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
from meshplan.capture.backward import Backward, forward_only, with_backward
from meshplan.capture.flatten import Scope
from meshplan.cluster.mesh import LogicalMesh
from meshplan.intra.options import IntraOptions
from meshplan.intra.plan import IntraPlan
from meshplan.intra.solve import solve_intra
from meshplan.ir import Graph
from meshplan.ir.node import OpKind
from meshplan.runtime.replay import read, replay
from meshplan.runtime.sharded import is_placeable, partition_spec, placeable_spec
from meshplan.sharding.spec import conversion_path

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
        output_grads: the sharding of the cotangent of `y` the backward takes (default: `outputs`).
        plan: the stage's IntraPlan when the layout was planned.
    """

    fn: StageFn
    params: Any
    inputs: Any
    outputs: Any
    targets: Any = None
    param_grads: Any = None
    input_grads: Any = None
    output_grads: Any = None
    plan: IntraPlan | None = None

    def __post_init__(self) -> None:
        if self.param_grads is None:
            object.__setattr__(self, "param_grads", self.params)
        if self.input_grads is None:
            object.__setattr__(self, "input_grads", self.inputs)
        if self.output_grads is None:
            object.__setattr__(self, "output_grads", self.outputs)


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
    graph, grads = planned.graph, planned.grads
    specs = {c.node: c.output for c in plan.nodes}
    num_params, num_x = (len(jax.tree_util.tree_leaves(a)) for a in (params, x))

    def sharding(node: int) -> NamedSharding:
        return NamedSharding(mesh, partition_spec(placeable_spec(specs[node], graph[node].shape, logical)))

    inputs = [sharding(n) for n in captured.input_nodes]
    grad_of = [sharding(grads[i]) if i in grads else where for i, where in enumerate(inputs)]
    tree = lambda example, leaves: jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(example), leaves)
    param_part, x_part = slice(0, num_params), slice(num_params, num_params + num_x)
    outputs, output_grads = (NamedSharding(mesh, PartitionSpec()),) * 2 if targets is not None else (
        jax.tree_util.tree_unflatten(captured.out_tree, [sharding(m) for m in nodes])
        for nodes in (captured.output_nodes, [planned.seeds.get(n) or n for n in captured.output_nodes]))
    fn = _constrained(captured, _Layouts(planned, plan, logical, mesh))
    return StageLayout(fn, tree(params, inputs[param_part]), tree(x, inputs[x_part]), outputs,
                       None if targets is None else tree(targets, inputs[num_params + num_x:]),
                       tree(params, grad_of[param_part]), tree(x, grad_of[x_part]), output_grads, plan)


def plan_stage(fn: StageFn, logical: LogicalMesh, options: IntraOptions, params: Any, x: Any, targets: Any = None,
               differentiate_input: bool = True, name: str = "stage", backward: bool = True,
               given: Callable[[Graph], IntraPlan] | None = None,
               ) -> tuple[Captured, Backward, IntraPlan]:
    """Capture the stage, append its VJP and solve the intra-op ILP (or take `given`'s plan);
    arguments as `planned_layout`.

    Returns:
        (the captured forward; the planned graph, forward + VJP (or the forward alone when some
        op has no VJP rule) with which nodes differentiate what; the plan).
    """
    args = (params, x) if targets is None else (params, x, targets)
    captured = capture(fn, *args, name=name)
    num_params, num_x = (len(jax.tree_util.tree_leaves(a)) for a in (params, x))
    planned = with_backward(captured, range(num_params + num_x if differentiate_input else num_params)) if backward \
        else None
    planned = planned or forward_only(captured.graph)
    return captured, planned, given(planned.graph) if given else solve_intra(planned.graph, logical, options)


def _constrained(captured: Captured, layouts: _Layouts) -> StageFn:
    """The captured function replayed at its top level, each value pinned to its planned layout
    and its cotangent, in the backward JAX derives, to the layout the plan gives that cotangent.

    Every value is pinned, replicated ones too, and so is every cotangent: the backward is JAX's
    transpose of the replayed forward, whose values XLA's sharding propagation lays out where
    nothing pins them; it spread the gradients' splits into them and gathered them again
    (collectives the plan never priced). A plain sharding constraint would pin a cotangent to its
    value's forward layout (its transpose), while the plan may lay the two out differently. A
    dot's transposes are pinned inside too (`_planned_dot`), and so are the values of a
    `jax.checkpoint` body (`_replayed_remat`): its forward recomputed in the backward lays out as
    the plan's forward."""
    closed = captured.jaxpr
    jaxpr = closed.jaxpr
    program = captured.program
    scope = Scope(program.top_vars, program.top_remats)
    run = _pinned_replay(jaxpr.eqns, scope, captured.value_nodes, layouts)

    def stage(*args: Any) -> Any:
        flat = jax.tree_util.tree_leaves(args)
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, flat, strict=True))
        env = run(env, jaxpr.invars)
        return jax.tree_util.tree_unflatten(captured.out_tree, [read(env, v) for v in jaxpr.outvars])

    return stage


def _pinned_replay(eqns: Any, scope: Scope, value_nodes: dict[int, int], layouts: _Layouts,
                   ) -> Callable[[dict[Any, Any], Any], dict[Any, Any]]:
    """`run(env, inputs, cotangents)`: pin the `inputs` Vars' values in `env`, then replay `eqns`
    (one call site's, `scope`) pinning every result, with planned dots and remat bodies in place."""
    var_nodes = {var: value_nodes[vid] for var, vid in scope.values.items() if vid in value_nodes}
    planned = layouts.planned
    pins, holds = {}, {}
    for var, n in var_nodes.items():
        forward, backward = layouts.sharding(n, var), layouts.sharding(planned.cotangents.get(n), var)
        if forward is not None or backward is not None:
            pins[var] = _pin(forward, backward)
        holds[var] = _pin(forward, None)
    instead = {k: dot for k, eqn in enumerate(eqns) if (dot := _planned_dot(eqn, var_nodes, layouts)) is not None}
    instead.update((k, _replayed_remat(eqns[k], inner, value_nodes, layouts)) for k, inner in scope.remats.items())

    def pin(var: Any, value: Any) -> Any:
        where = pins.get(var)
        return value if where is None else where(value)

    def run(env: dict[Any, Any], inputs: Any, cotangents: bool = True) -> dict[Any, Any]:
        """`cotangents=False`: the inputs' forward layouts alone, their cotangents left free (a
        body's input gets only part of its value's cotangent, which the caller's pin lays out
        once summed; a plain sharding constraint would pin it to the forward layout)."""
        env.update((var, pin(var, env[var]) if cotangents else holds.get(var, _pin(None, None))(env[var]))
                   for var in inputs)
        return replay(eqns, env, pin, instead)

    return run


def _replayed_remat(eqn: Any, scope: Scope, value_nodes: dict[int, int], layouts: _Layouts) -> Callable[..., Any]:
    """The remat call of `eqn` re-bound with its body replayed pinned (`_pinned_replay`), under
    the same checkpoint policy: the recomputed forward and its backward follow the plan. Its
    inputs are pinned inside too: else XLA lays them out for their first use in the recompute
    (a whole input sliced, then gathered again for a transposed dot)."""
    body = eqn.params["jaxpr"]
    run = _pinned_replay(body.eqns, scope, value_nodes, layouts)

    def replayed(*args: Any) -> list[Any]:
        env = run(dict(zip(body.invars, args, strict=True)), body.invars, cotangents=False)
        return [read(env, v) for v in body.outvars]

    return jax.checkpoint(replayed, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])


@dataclass(frozen=True)
class _Layouts:
    """The stage plan's layouts as JAX shardings (no slots: the lookups are cached on the instance)."""

    planned: Backward
    plan: IntraPlan
    logical: LogicalMesh
    mesh: Mesh

    @functools.cached_property
    def chosen(self) -> dict[int, Any]:
        return {c.node: c for c in self.plan.nodes}

    @functools.cached_property
    def specs(self) -> dict[int, Any]:
        return {n: c.output for n, c in self.chosen.items()}

    def operand_specs(self, node: int) -> tuple[Any, ...]:
        """The layouts `node`'s strategy reads its operands in."""
        return self.chosen[node].operands

    def sharding(self, node: int | None, var: Any) -> NamedSharding | None:
        """Node's planned layout for the value of `var` (None: no node, or one it cannot take)."""
        if node is None or not is_placeable(self.specs[node], tuple(var.aval.shape), self.planned.graph[node].shape,
                                            self.logical):
            return None
        return NamedSharding(self.mesh, partition_spec(self.specs[node]))

    def path(self, src: int, dst: Any, var: Any) -> tuple[NamedSharding, ...] | None:
        """The layouts node `src`'s value passes through to reach spec `dst` (`conversion_path`)."""
        shape = tuple(var.aval.shape)
        steps = conversion_path(self.specs[src], dst, self.logical)
        if not all(is_placeable(s, shape, self.planned.graph[src].shape, self.logical) for s in steps):
            return None
        return tuple(NamedSharding(self.mesh, partition_spec(s)) for s in steps)


def _planned_dot(eqn: Any, var_nodes: dict[Any, int], layouts: _Layouts) -> Callable[..., Any] | None:
    """A float `dot_general` whose VJP makes each operand's cotangent as its contribution in the
    plan: the other operand and the output's cotangent converted step by step to the layouts the
    plan's backward dot reads them in, the result pinned to the contribution's layout (so XLA's
    partitioner does not pick its own algorithm for the transposed dot); None when the plan has
    no such dot for it. An operand the plan sends no cotangent gets zeros (nothing reads it)."""
    planned = layouts.planned
    node = var_nodes.get(eqn.outvars[0])
    if eqn.primitive.name != "dot_general" or node is None or node not in planned.cotangents or not all(
            jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.invars):
        return None
    operands = [var_nodes.get(v) for v in eqn.invars]
    recipes = []
    for i in range(2):
        recipe = _contribution_recipe(node, i, operands, eqn, layouts)
        if recipe is False:
            return None
        recipes.append(recipe)
    params = eqn.primitive.get_bind_params(eqn.params)
    return _dot_with_vjp(eqn.primitive, tuple(params.items()), tuple(recipes))


def _contribution_recipe(node: int, i: int, operands: list[int | None], eqn: Any, layouts: _Layouts) -> Any:
    """(path of the other operand, path of the output's cotangent, the result's layout) for
    operand i's cotangent; None when the plan sends it none; False when it cannot be read off."""
    planned, graph = layouts.planned, layouts.planned.graph
    contribution = planned.contributions.get((node, i))
    if contribution is None:
        return None
    dot = contribution
    while graph[dot].kind is not OpKind.DOT and len(graph[dot].operands) == 1:
        dot = graph[dot].operands[0]
    other, g = operands[1 - i], planned.cotangents[node]
    if graph[dot].kind is not OpKind.DOT or other is None or set(graph[dot].operands) != {other, g}:
        return False
    required = dict(zip(graph[dot].operands, layouts.operand_specs(dot), strict=True))
    paths = (layouts.path(other, required[other], eqn.invars[1 - i]), layouts.path(g, required[g], eqn.outvars[0]))
    result = layouts.sharding(contribution, eqn.invars[i])
    return False if None in paths else (*paths, result)


@functools.cache
def _pin(forward: NamedSharding | None, backward: NamedSharding | None) -> Callable[[Any], Any]:
    """The identity that constrains its value to `forward` and its cotangent to `backward` (None:
    left as it is); on values without cotangents (integers) only the forward constraint."""

    @jax.custom_vjp
    def pinned(value: Any) -> Any:
        return _through(value, (forward,) if forward else ())

    pinned.defvjp(lambda value: (pinned(value), None),
                  lambda _, cotangent: (_through(cotangent, (backward,) if backward else ()),))

    def pin(value: Any) -> Any:
        if not jnp.issubdtype(value.dtype, jnp.inexact):
            return _through(value, (forward,) if forward else ())
        return pinned(value)

    return pin


def _dot_with_vjp(primitive: Any, params: tuple[tuple[str, Any], ...], recipes: tuple[Any, ...]) -> Callable[..., Any]:
    """`dot_general` whose cotangents are made as `recipes` say (see `_contribution_recipe`)."""
    bind = lambda a, b: primitive.bind(a, b, **dict(params))  # noqa: E731

    @jax.custom_vjp
    def dot(a: Any, b: Any) -> Any:
        return bind(a, b)

    def backward(operands: tuple[Any, Any], g: Any) -> tuple[Any, Any]:
        cotangents = []
        for i, recipe in enumerate(recipes):
            if recipe is None:
                cotangents.append(jnp.zeros_like(operands[i]))
                continue
            other_path, g_path, result = recipe
            other, ct = _through(operands[1 - i], other_path), _through(g, g_path)
            _, vjp = jax.vjp(lambda x, i=i, other=other: bind(x, other) if i == 0 else bind(other, x), operands[i])
            cotangents.append(_through(vjp(ct)[0], (result,) if result is not None else ()))
        return tuple(cotangents)

    dot.defvjp(lambda a, b: (dot(a, b), (a, b)), backward)
    return dot


def _through(value: Any, path: tuple[NamedSharding, ...]) -> Any:
    """`value` constrained to each layout of `path` in turn."""
    for where in path:
        value = jax.lax.with_sharding_constraint(value, where)
    return value
