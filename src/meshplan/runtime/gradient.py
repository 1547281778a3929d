"""Gradients inside a traced train step: `jax.grad`/`jax.value_and_grad` calls -> one marked equation.

A whole train step computes its gradient itself. To pipeline it, meshplan must see the loss
function apart from the rest of the step. `trace_with_gradients` traces the step with
`jax.grad` and `jax.value_and_grad` temporarily replaced (only during that trace; restored in a
`finally`): each gradient call traces its loss into a jaxpr and binds one `gradient` primitive
that carries it. The loss's closed-over values (outer tracers, or arrays) become the
primitive's leading operands, so the outer jaxpr says exactly what the loss reads.
The primitive also runs (value_and_grad of the carried jaxpr), so the traced step stays a
valid program.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Primitive, jaxpr_as_fun
from jax.interpreters import mlir

from meshplan.errors import OptionsError
from meshplan.runtime.replay import subjaxprs

gradient_p = Primitive("meshplan_gradient")
gradient_p.multiple_results = True


def _value_and_grad_of(*operands: Any, loss: ClosedJaxpr, differentiated: tuple[bool, ...]) -> list[Any]:
    """[loss value, *grads of the differentiated operands] of `loss` at `operands`."""
    fixed = list(operands)
    wrt = [i for i, d in enumerate(differentiated) if d]

    def of_differentiated(*values: Any) -> Any:
        args = list(fixed)
        for i, v in zip(wrt, values, strict=True):
            args[i] = v
        return jaxpr_as_fun(loss)(*args)[0]

    value, grads = jax.value_and_grad(of_differentiated, argnums=tuple(range(len(wrt))))(*(fixed[i] for i in wrt))
    return [value, *grads]


def _abstract(*avals: Any, loss: ClosedJaxpr, differentiated: tuple[bool, ...]) -> list[Any]:
    return [loss.out_avals[0], *(a for a, d in zip(avals, differentiated, strict=True) if d)]


gradient_p.def_impl(_value_and_grad_of)
gradient_p.def_abstract_eval(_abstract)
mlir.register_lowering(gradient_p, mlir.lower_fun(_value_and_grad_of, multiple_results=True))


@dataclass(frozen=True, slots=True)
class GradientCall:
    """One gradient equation of a traced step.

    Attributes:
        index: its position among the step jaxpr's top-level equations.
        loss: the loss as a closed jaxpr of all operands (closed-over values first).
        differentiated: per operand, whether the gradient is taken with respect to it.
    """

    index: int
    loss: ClosedJaxpr
    differentiated: tuple[bool, ...]


def is_gradient(primitive: Any) -> bool:
    """True for the primitive a traced gradient call leaves in a jaxpr."""
    return primitive is gradient_p


def gradient_calls(jaxpr: Any) -> list[GradientCall]:
    """The top-level gradient equations of `jaxpr`, in order."""
    return [GradientCall(i, eqn.params["loss"], eqn.params["differentiated"])
            for i, eqn in enumerate(jaxpr.eqns) if is_gradient(eqn.primitive)]


def nested_gradient(jaxpr: Any) -> str | None:
    """The primitive name of a top-level equation that holds a gradient equation inside, if any."""
    for eqn in jaxpr.eqns:
        for sub in subjaxprs(eqn.params):
            if any(is_gradient(e.primitive) for e in sub.eqns) or nested_gradient(sub):
                return eqn.primitive.name
    return None


def trace_with_gradients(fn: Callable[..., Any], args: Sequence[Any]) -> Any:
    """`jax.make_jaxpr(fn, return_shape=True)(*args)` with every `jax.grad`/`jax.value_and_grad`
    call made while tracing left as one `gradient` equation."""
    fresh = lambda *a: fn(*a)  # a new function: JAX's trace cache must neither serve nor keep this trace
    with _marked_gradients():
        return jax.make_jaxpr(fresh, return_shape=True)(*args)


@contextlib.contextmanager
def _marked_gradients() -> Iterator[None]:
    original = jax.grad, jax.value_and_grad
    jax.grad = _marking(original[0], with_value=False)
    jax.value_and_grad = _marking(original[1], with_value=True)
    try:
        yield
    finally:
        jax.grad, jax.value_and_grad = original


def _marking(original: Callable[..., Any], with_value: bool) -> Callable[..., Any]:
    """A stand-in for jax.grad (with_value=False) or jax.value_and_grad that binds gradient_p."""

    def transform(fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False,
                  **options: Any) -> Callable[..., Any]:
        if has_aux or any(options.values()):  # holomorphic, allow_int, ...: JAX's own gradient
            return original(fun, argnums, has_aux=has_aux, **options)

        def marked(*args: Any, **kwargs: Any) -> Any:
            if kwargs:
                raise OptionsError(f"{getattr(fun, '__name__', 'the loss')} was differentiated with keyword "
                                   f"arguments {sorted(kwargs)}; pass them positionally (jax.grad differentiates "
                                   f"positional arguments only)")
            return _bind(fun, args, argnums, with_value, original)

        return marked

    return transform


def _bind(fun: Callable[..., Any], args: tuple[Any, ...], argnums: int | Sequence[int], with_value: bool,
          original: Callable[..., Any]) -> Any:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if any(not 0 <= n < len(args) for n in nums):
        return original(fun, argnums)(*args)  # JAX's own error message
    leaves, tree = jax.tree_util.tree_flatten(args)
    closed = jax.make_jaxpr(lambda *flat: fun(*jax.tree_util.tree_unflatten(tree, flat)))(*leaves)
    out = closed.out_avals
    if len(out) != 1 or out[0].shape != () or not np.issubdtype(out[0].dtype, np.floating):
        return original(fun, argnums)(*args)  # not a scalar float loss: JAX's own error message
    owners = [n for n, arg in enumerate(args) for _ in jax.tree_util.tree_leaves(arg)]
    consts = list(closed.consts)
    loss = ClosedJaxpr(_consts_as_inputs(closed.jaxpr), ())
    differentiated = (False,) * len(consts) + tuple(n in nums for n in owners)
    value, *grads = gradient_p.bind(*consts, *leaves, loss=loss, differentiated=differentiated)
    per_arg: list[list[Any]] = [[] for _ in args]
    for n, g in zip((n for n in owners if n in nums), grads, strict=True):
        per_arg[n].append(g)
    trees = [jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(args[n]), per_arg[n]) for n in nums]
    grad = trees[0] if isinstance(argnums, int) else tuple(trees)
    return (value, grad) if with_value else grad


def _consts_as_inputs(jaxpr: Any) -> Any:
    """`jaxpr` with its constants turned into leading inputs."""
    return jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars])
