"""Pipeline boundaries: user JAX code -> marked jaxpr -> one function per pipeline stage.

`mark_pipeline_boundary` is an identity that survives `jax.make_jaxpr` as its own primitive, so
`split_into_stages` can cut a traced forward function there. It is transparent to `jit`, `grad`,
`vmap` and lowering: the tangent passes through unmarked, so no transpose rule is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import Literal, Primitive
from jax.interpreters import ad, batching, mlir

from meshplan.errors import GraphError, OptionsError
from meshplan.runtime.replay import read, replay

pipeline_boundary_p = Primitive("pipeline_boundary")
pipeline_boundary_p.multiple_results = True
pipeline_boundary_p.def_impl(lambda *xs: xs)
pipeline_boundary_p.def_abstract_eval(lambda *avals: avals)
mlir.register_lowering(pipeline_boundary_p, lambda ctx, *xs: xs)


def _boundary_jvp(primals: Any, tangents: Any) -> tuple[Any, list[Any]]:
    # Only the primal keeps the marker: the cut is a forward-pass notion.
    return pipeline_boundary_p.bind(*primals), list(tangents)


def _boundary_batch(values: Any, dims: Any) -> tuple[Any, Any]:
    return pipeline_boundary_p.bind(*values), dims


ad.primitive_jvps[pipeline_boundary_p] = _boundary_jvp
batching.primitive_batchers[pipeline_boundary_p] = _boundary_batch


def mark_pipeline_boundary(*xs: Any) -> Any:
    """Mark the end of a pipeline stage; returns its arguments unchanged.

    Args:
        *xs: the activations (any pytrees of arrays) that flow into the next stage.

    Returns:
        The arguments, unchanged: a single value if one was given, else a tuple.

    Raises:
        OptionsError: no array was given (Alpa's `mark_pipeline_boundary()` form): the boundary is
            marked on the values that cross it, so a call without any would mark nothing.

    Example:
        h = mark_pipeline_boundary(jnp.tanh(x @ w1))
    """
    leaves, tree = jax.tree_util.tree_flatten(xs)
    if not leaves:
        raise OptionsError(
            "mark_pipeline_boundary() was given no arrays, so it marks nothing: meshplan marks a pipeline boundary "
            "on the activations that cross it. Pass them through it and use what it returns, e.g. "
            "`x = mark_pipeline_boundary(x)` (Alpa's no-argument form `mark_pipeline_boundary()` is not supported)")
    out = jax.tree_util.tree_unflatten(tree, pipeline_boundary_p.bind(*leaves))
    return out[0] if len(xs) == 1 else out


def is_boundary(primitive: Any) -> bool:
    """True for the primitive `mark_pipeline_boundary` leaves in a jaxpr."""
    return primitive is pipeline_boundary_p


def split_into_stages(fn: Callable[..., Any], params: Sequence[Any], x: Any, targets: Any) -> list[Callable[..., Any]]:
    """Cut `fn(params, x, targets) -> loss` at its boundary markers into pipeline stage functions.

    Contract: `params` has one pytree per stage; stage k reads only `params[k]` and what crossed
    the previous boundary (`x` for stage 0); the last stage also reads `targets`. Markers must be
    at the top level of `fn` (not inside a nested `jax.jit`).

    Args:
        fn: the forward-and-loss function, with `len(params) - 1` calls of `mark_pipeline_boundary`.
        params: example params, one entry per stage (shapes and dtypes are what matter).
        x: an example input micro-batch.
        targets: an example targets micro-batch.

    Returns:
        Stage functions for `Pipeline`: `stage_k(params_k, act)`, where `act` is the tuple of
        arrays marked by boundary k-1 (a single array if one was marked); the last is
        `stage(params, act, targets) -> loss`.

    Raises:
        GraphError: the markers do not match `params`, or a stage reads another stage's values.
    """
    closed = jax.make_jaxpr(fn)(list(params), x, targets)
    jaxpr = closed.jaxpr
    counts = [len(jax.tree_util.tree_leaves(p)) for p in params]
    n_x = len(jax.tree_util.tree_leaves(x))
    cut = [i for i, eqn in enumerate(jaxpr.eqns) if is_boundary(eqn.primitive)]
    if len(cut) != len(params) - 1:
        raise GraphError(f"fn has {len(cut)} top-level pipeline boundaries but params has {len(params)} "
                           f"entries; call mark_pipeline_boundary {len(params) - 1} times outside any jax.jit, "
                           f"or pass one params entry per stage")
    starts = [0] + [i + 1 for i in cut]
    ends = cut + [len(jaxpr.eqns)]
    offsets = [sum(counts[:k]) for k in range(len(counts) + 1)]
    targets_vars = jaxpr.invars[offsets[-1] + n_x:]
    stages = []
    for k in range(len(params)):
        param_vars = jaxpr.invars[offsets[k]:offsets[k + 1]]
        act_vars = jaxpr.invars[offsets[-1]:offsets[-1] + n_x] if k == 0 else jaxpr.eqns[cut[k - 1]].outvars
        last = k == len(params) - 1
        in_vars = [*param_vars, *act_vars, *(targets_vars if last else [])]
        out_vars = jaxpr.outvars if last else jaxpr.eqns[cut[k]].invars
        eqns = jaxpr.eqns[starts[k]:ends[k]]
        _check_reads(k, eqns, out_vars, set(in_vars) | set(jaxpr.constvars))
        stages.append(_stage_fn(closed, in_vars, eqns, out_vars, last))
    return stages


def _check_reads(stage: int, eqns: Sequence[Any], out_vars: Sequence[Any], known: set[Any]) -> None:
    defined = set(known)
    for eqn in eqns:
        missing = [v for v in eqn.invars if not isinstance(v, Literal) and v not in defined]
        if missing:
            raise GraphError(f"stage {stage} op {eqn.primitive.name} reads {missing}, which stage {stage} "
                               f"neither owns nor receives across its boundary; pass such values through "
                               f"mark_pipeline_boundary, or keep each stage's params in its own params entry")
        defined.update(eqn.outvars)
    missing = [v for v in out_vars if not isinstance(v, Literal) and v not in defined]
    if missing:
        raise GraphError(f"stage {stage} outputs {missing}, which it neither computes nor receives; "
                           f"mark only values computed after the previous boundary")


def _stage_fn(closed: Any, in_vars: list[Any], eqns: Sequence[Any], out_vars: Sequence[Any],
              last: bool) -> Callable[..., Any]:
    consts = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))

    def run(*flat: Any) -> list[Any]:
        env = replay(eqns, {**consts, **dict(zip(in_vars, flat, strict=True))})
        return [read(env, v) for v in out_vars]

    def stage(stage_params: Any, act: Any, *targets: Any) -> Any:
        outs = run(*jax.tree_util.tree_leaves((stage_params, act, targets)))
        return outs[0] if last or len(outs) == 1 else tuple(outs)

    return stage
