"""Replay jaxpr equations on concrete or traced values, optionally touching each result.

Re-binding each top-level equation keeps nested calls as they are (jit, custom_jvp/custom_vjp
rules, remat), so differentiating a replayed function gives JAX's own gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Literal

try:  # private in JAX 0.10: keeps the user's source lines on re-traced equations (for error messages)
    from jax._src.source_info_util import user_context
except ImportError:  # pragma: no cover
    user_context = None

CALLS = ("jit", "pjit", "closed_call", "core_call")  # call primitives whose body inline_calls splices in

# (jaxpr Var, value) -> the value to keep, e.g. with a sharding constraint applied
ValueHook = Callable[[Any, Any], Any]


def replay(eqns: Sequence[Any], env: dict[Any, Any], hook: ValueHook | None = None,
           instead: dict[int, Callable[..., Any]] | None = None) -> dict[Any, Any]:
    """Run `eqns` in order, reading and writing `env` (Var -> value); return `env`.

    `env` must hold the equations' free variables (inputs and constants) on entry. `instead[k]`,
    when given, computes equation k's results from its inputs in place of its primitive (the
    same values, e.g. with a VJP of its own).
    """
    instead = instead or {}
    for k, eqn in enumerate(eqns):
        ins = [read(env, v) for v in eqn.invars]
        outs = instead[k](*ins) if k in instead else eqn.primitive.bind(
            *ins, **eqn.primitive.get_bind_params(eqn.params))
        for var, value in zip(eqn.outvars, outs if eqn.primitive.multiple_results else (outs,), strict=True):
            env[var] = value if hook is None else hook(var, value)
    return env


def read(env: dict[Any, Any], var: Any) -> Any:
    """The value of `var`: a literal's own value, else `env[var]`."""
    return var.val if isinstance(var, Literal) else env[var]


def subjaxprs(params: dict[str, Any]) -> list[Any]:
    """The jaxprs nested in an equation's params (a jit's body, custom_jvp's function, cond branches)."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                found.append(item.jaxpr)
            elif hasattr(item, "eqns") and hasattr(item, "invars"):
                found.append(item)
    return found


def inline_calls(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` with every nested `jax.jit` call (and closed_call) spliced into the top level, recursively.

    The result computes the same values; custom_jvp/custom_vjp calls and remat stay calls (their
    rules matter to gradients). Equations keep their source lines.
    """
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
             for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *args: _run_inlined(closed.jaxpr, closed.consts, args))(*avals)


def _run_inlined(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env = {**dict(zip(jaxpr.constvars, consts, strict=True)), **dict(zip(jaxpr.invars, args, strict=True))}
    for eqn in jaxpr.eqns:
        values = [read(env, v) for v in eqn.invars]
        with source_of(eqn):
            if eqn.primitive.name in CALLS:
                body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                inner, inner_consts = (body.jaxpr, body.consts) if isinstance(body, ClosedJaxpr) else (body, ())
                outs = _run_inlined(inner, inner_consts, values)
            else:
                outs = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results or eqn.primitive.name in CALLS
                       else (outs,), strict=True))
    return [read(env, v) for v in jaxpr.outvars]


def source_of(eqn: Any) -> Any:
    """A context in which equations traced get `eqn`'s source line (a no-op without JAX's helper)."""
    if user_context is None:
        return contextlib.nullcontext()
    return user_context(eqn.source_info.traceback, name_stack=eqn.source_info.name_stack)
