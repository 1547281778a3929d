"""The trip count of a `while` loop, when the program fixes it.

`lax.while_loop(lambda c: c[0] < n, body, (0, x))` runs a known number of times whenever the
values its predicate reads (here the counter) start from constants and are updated from
constants and themselves only. Then those values are run on their own, without the rest of the
loop (no matmuls), until the predicate fails; the loop can be unrolled like a static scan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend import core as jcore

UNKNOWN = object()  # a value that is not known before the program runs


def static_trip_count(cond: jcore.ClosedJaxpr, body: jcore.ClosedJaxpr, cond_consts: Sequence[Any],
                      body_consts: Sequence[Any], init: Sequence[Any], limit: int) -> int | None:
    """How many times the loop body runs, or None when that depends on run-time values or
    exceeds `limit`. Arguments hold concrete values or UNKNOWN."""
    control, used_cond, used_body = _control(cond.jaxpr, body.jaxpr, len(cond_consts), len(body_consts))
    known = [init[c] for c in control] + [cond_consts[k] for k in used_cond] + [body_consts[k] for k in used_body]
    if any(v is UNKNOWN for v in known):
        return None
    carry = {c: init[c] for c in control}
    try:
        for trips in range(limit + 1):
            if not bool(_evaluate(cond, [*cond_consts, *_with(carry, len(init))], [0])[0]):
                return trips
            outs = _evaluate(body, [*body_consts, *_with(carry, len(init))], sorted(control))
            carry = dict(zip(sorted(control), outs, strict=True))
    except Exception:  # noqa: BLE001 -- a predicate that cannot run ahead of time: the loop stays opaque
        return None
    return None


def _control(cond: jcore.Jaxpr, body: jcore.Jaxpr, n_cond: int, n_body: int) -> tuple[set[int], set[int], set[int]]:
    """The carry positions the predicate depends on, closed under the body's updates, and the
    positions of the cond and body constants they read."""
    used = _used_inputs(cond, [0])
    used_cond = {i for i in used if i < n_cond}
    control = {i - n_cond for i in used if i >= n_cond}
    used_body: set[int] = set()
    frontier = set(control)
    while frontier:
        used = _used_inputs(body, sorted(frontier))
        used_body |= {i for i in used if i < n_body}
        new = {i - n_body for i in used if i >= n_body} - control
        control |= new
        frontier = new
    return control, used_cond, used_body


def _used_inputs(jaxpr: jcore.Jaxpr, outputs: Sequence[int]) -> set[int]:
    """Positions of the jaxpr's inputs (constvars excluded) that `outputs` depend on."""
    live = {v for k in outputs if isinstance(v := jaxpr.outvars[k], jcore.Var)}
    for eqn in reversed(jaxpr.eqns):
        if live.intersection(eqn.outvars):
            live.update(v for v in eqn.invars if isinstance(v, jcore.Var))
    return {k for k, v in enumerate(jaxpr.invars) if v in live}


def _evaluate(closed: jcore.ClosedJaxpr, args: Sequence[Any], outputs: Sequence[int]) -> list[Any]:
    """The values of `outputs`, running only the equations they need (other inputs may be UNKNOWN)."""
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    wanted = [jaxpr.outvars[k] for k in outputs]
    live = {v for v in wanted if isinstance(v, jcore.Var)}
    needed = []
    for eqn in reversed(jaxpr.eqns):
        if live.intersection(eqn.outvars):
            needed.append(eqn)
            live.update(v for v in eqn.invars if isinstance(v, jcore.Var))
    for eqn in reversed(needed):
        values = [v.val if isinstance(v, jcore.Literal) else env[v] for v in eqn.invars]
        outs = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else (outs,), strict=True))
    return [v.val if isinstance(v, jcore.Literal) else env[v] for v in wanted]


def _with(carry: dict[int, Any], size: int) -> list[Any]:
    return [carry.get(k, UNKNOWN) for k in range(size)]
