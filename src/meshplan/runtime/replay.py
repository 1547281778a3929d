"""Replay jaxpr equations on concrete or traced values, optionally touching each result.

Re-binding each top-level equation keeps nested calls as they are (jit, custom_jvp/custom_vjp
rules, remat), so differentiating a replayed function gives JAX's own gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr, Literal

# (jaxpr Var, value) -> the value to keep, e.g. with a sharding constraint applied
ValueHook = Callable[[Any, Any], Any]


def replay(eqns: Sequence[Any], env: dict[Any, Any], hook: ValueHook | None = None) -> dict[Any, Any]:
    """Run `eqns` in order, reading and writing `env` (Var -> value); return `env`.

    `env` must hold the equations' free variables (inputs and constants) on entry.
    """
    for eqn in eqns:
        outs = eqn.primitive.bind(*(read(env, v) for v in eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
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
