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
from jax.extend.core import ClosedJaxpr, Literal, Primitive, jaxpr_as_fun
from jax.interpreters import mlir

from meshplan.errors import OptionsError
from meshplan.runtime.replay import subjaxprs

gradient_p = Primitive("meshplan_gradient")
gradient_p.multiple_results = True
_value_and_grad = jax.value_and_grad  # JAX's own, also while a trace has it replaced


def _value_and_grad_of(*operands: Any, loss: ClosedJaxpr, differentiated: tuple[bool, ...]) -> list[Any]:
    """[loss value, *aux values, *grads of the differentiated operands] of `loss` at `operands`
    (the loss jaxpr's first result is the loss, the others are aux values)."""
    fixed = list(operands)
    wrt = [i for i, d in enumerate(differentiated) if d]

    def of_differentiated(*values: Any) -> Any:
        args = list(fixed)
        for i, v in zip(wrt, values, strict=True):
            args[i] = v
        out = jaxpr_as_fun(loss)(*args)
        return out[0], out[1:]

    (value, aux), grads = _value_and_grad(of_differentiated, argnums=tuple(range(len(wrt))),
                                             has_aux=True)(*(fixed[i] for i in wrt))
    return [value, *aux, *grads]


def _abstract(*avals: Any, loss: ClosedJaxpr, differentiated: tuple[bool, ...]) -> list[Any]:
    return [*loss.out_avals, *(a for a, d in zip(avals, differentiated, strict=True) if d)]


gradient_p.def_impl(_value_and_grad_of)
gradient_p.def_abstract_eval(_abstract)
mlir.register_lowering(gradient_p, mlir.lower_fun(_value_and_grad_of, multiple_results=True))


@dataclass(frozen=True, slots=True)
class GradientCall:
    """One gradient equation of a traced step.

    Attributes:
        index: its position among the step jaxpr's top-level equations.
        loss: the loss as a closed jaxpr of all operands (closed-over values first); its first
            result is the loss, the others the flat aux values (`has_aux=True`).
        differentiated: per operand, whether the gradient is taken with respect to it.
    """

    index: int
    loss: ClosedJaxpr
    differentiated: tuple[bool, ...]

    @property
    def num_aux(self) -> int:
        """How many flat aux values the loss returns besides the loss."""
        return len(self.loss.out_avals) - 1


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
        if any(options.values()):  # holomorphic, allow_int, ...: not pipelined
            return _refusing(fun, argnums, has_aux, options, original)

        def marked(*args: Any, **kwargs: Any) -> Any:
            if kwargs:
                raise OptionsError(f"{getattr(fun, '__name__', 'the loss')} was differentiated with keyword "
                                   f"arguments {sorted(kwargs)}; pass them positionally (jax.grad differentiates "
                                   f"positional arguments only)")
            return _bind(fun, args, argnums, has_aux, with_value, original)

        return marked

    return transform


def _refusing(fun: Callable[..., Any], argnums: Any, has_aux: bool, options: dict[str, Any],
              original: Callable[..., Any]) -> Callable[..., Any]:
    """JAX's own gradient on constants; on the step's values an error (the step would otherwise
    look like one without a gradient, and run forward only)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves((args, kwargs))):
            used = sorted(k for k, v in options.items() if v)
            raise OptionsError(f"{getattr(fun, '__name__', 'the loss')} is differentiated with {used}; "
                               f"PipeshardParallel pipelines gradients of real-valued losses with respect to "
                               f"float weights: drop {used} (or use another method)")
        return original(fun, argnums, has_aux=has_aux, **options)(*args, **kwargs)

    return call


def _bind(fun: Callable[..., Any], args: tuple[Any, ...], argnums: int | Sequence[int], has_aux: bool,
          with_value: bool, original: Callable[..., Any]) -> Any:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    jax_own = lambda: original(fun, argnums, has_aux=has_aux)(*args)  # for JAX's own error messages
    if any(not 0 <= n < len(args) for n in nums):
        return jax_own()
    leaves, tree = jax.tree_util.tree_flatten(args)
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        return jax_own()  # on constants, computed while tracing: not the step's gradient
    closed, shape = jax.make_jaxpr(lambda *flat: fun(*jax.tree_util.tree_unflatten(tree, flat)),
                                   return_shape=True)(*leaves)
    if has_aux and not (isinstance(shape, (tuple, list)) and len(shape) == 2):
        return jax_own()
    loss_shape, aux_tree = (shape[0], jax.tree_util.tree_structure(shape[1])) if has_aux else (shape, None)
    if (not isinstance(loss_shape, jax.ShapeDtypeStruct) or loss_shape.shape != ()
            or not jax.numpy.issubdtype(loss_shape.dtype, jax.numpy.floating)):
        return jax_own()  # not a scalar float loss
    owners = [n for n, arg in enumerate(args) for _ in jax.tree_util.tree_leaves(arg)]
    consts = list(closed.consts)
    operands = [*consts, *leaves]
    jaxpr = _consts_as_inputs(closed.jaxpr)
    passed = _passed_through(jaxpr)
    loss = ClosedJaxpr(jaxpr.replace(outvars=[v for j, v in enumerate(jaxpr.outvars) if j not in passed]), ())
    differentiated = (False,) * len(consts) + tuple(n in nums for n in owners)
    value, *rest = gradient_p.bind(*operands, loss=loss, differentiated=differentiated)
    num_aux = len(closed.out_avals) - 1 - len(passed)
    computed = iter(rest[:num_aux])
    aux = [operands[passed[j]] if j in passed else next(computed) for j in range(1, len(closed.out_avals))]
    grads = rest[num_aux:]
    if has_aux:
        value = (value, jax.tree_util.tree_unflatten(aux_tree, aux))
    per_arg: list[list[Any]] = [[] for _ in args]
    for n, g in zip((n for n in owners if n in nums), grads, strict=True):
        per_arg[n].append(g)
    trees = [jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(args[n]), per_arg[n]) for n in nums]
    grad = trees[0] if isinstance(argnums, int) else tuple(trees)
    if with_value:
        return value, grad
    return (grad, value[1]) if has_aux else grad


def _passed_through(jaxpr: Any) -> dict[int, int]:
    """Aux results (result index >= 1) that are inputs of the loss as they came in -> the input's
    position. nnx.value_and_grad returns its objects' whole state as aux values: they are the step's
    own values, left out of the loss so that a pipeline need not carry weights to its last stage."""
    position = {v: i for i, v in enumerate(jaxpr.invars)}
    return {j: position[v] for j, v in enumerate(jaxpr.outvars)
            if j >= 1 and not isinstance(v, Literal) and v in position}


def _consts_as_inputs(jaxpr: Any) -> Any:
    """`jaxpr` with its constants turned into leading inputs."""
    return jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars])
