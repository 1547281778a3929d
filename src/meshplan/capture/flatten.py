"""Flatten a ClosedJaxpr into a straight-line program: nested calls inlined, static scans and
while loops of a static trip count unrolled, both branches of a cond run and their results selected.

Jaxpr variables are not unique across call sites (a cached inner jaxpr is shared by every
call), so the flat program names each value by a fresh integer instead of by its Var.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jax.extend import core as jcore

from meshplan.capture.control import UNKNOWN, static_trip_count
from meshplan.capture.folding import fold_padded_window_sums

# Primitives whose body is run as-is: calling them is the same as running their jaxpr.
INLINED = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                     "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint", "custom_lin"})
_BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
REMAT = frozenset({"remat", "remat2", "checkpoint"})  # jax.checkpoint: its body's values get a Scope
# Longest while loop unrolled; longer ones stay one opaque (replicated) step.
MAX_UNROLLED_TRIPS = 256


@dataclass(frozen=True, slots=True)
class Step:
    """One primitive application: `outputs = primitive.bind(*inputs, **params)` on value ids."""

    primitive: Any
    params: dict[str, Any]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    avals: tuple[Any, ...]  # abstract values of the outputs (shape, dtype)
    effectful: bool = False  # has side effects: kept even when its outputs are unused

    @property
    def name(self) -> str:
        return self.primitive.name


@dataclass(frozen=True, slots=True)
class Scope:
    """The value ids of one call site of a jaxpr: the runtime re-binds a remat call with its body
    replayed, and a body's Vars name values only per call site (a cached body is shared).

    Attributes:
        values: the body's Vars -> value ids at this call site.
        remats: equation index -> the Scope of the remat call that equation makes.
    """

    values: dict[Any, int] = field(default_factory=dict)
    remats: dict[int, Scope] = field(default_factory=dict)


@dataclass(slots=True)
class FlatProgram:
    """A straight-line program over integer value ids.

    Attributes:
        steps: primitive applications in evaluation order.
        inputs: value ids of the flat arguments.
        outputs: value ids of the flat results.
        constants: value id -> concrete value (jaxpr literals and closed-over constants).
        avals: value id -> abstract value.
        top_vars: top-level jaxpr Var -> value id (the only level where Vars are unique).
        top_remats: top-level equation index -> the Scope of its remat (jax.checkpoint) call.
    """

    steps: list[Step] = field(default_factory=list)
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    constants: dict[int, Any] = field(default_factory=dict)
    avals: dict[int, Any] = field(default_factory=dict)
    top_vars: dict[Any, int] = field(default_factory=dict)
    top_remats: dict[int, Scope] = field(default_factory=dict)

    def new_value(self, aval: Any) -> int:
        vid = len(self.avals)
        self.avals[vid] = aval
        return vid


def flatten(closed: jcore.ClosedJaxpr) -> FlatProgram:
    """Flatten `closed` (from `jax.make_jaxpr`) into a FlatProgram."""
    prog = FlatProgram()
    jaxpr = closed.jaxpr
    consts = [_constant(prog, v.aval, c) for v, c in zip(jaxpr.constvars, closed.consts, strict=True)]
    args = [prog.new_value(v.aval) for v in jaxpr.invars]
    prog.inputs = tuple(args)
    top = Scope()
    prog.outputs = tuple(_emit(prog, jaxpr, consts + args, top))
    prog.top_vars.update(top.values)
    prog.top_remats.update(top.remats)
    fold_padded_window_sums(prog)
    _prune(prog)
    return prog


def _prune(prog: FlatProgram) -> None:
    """Drop steps no output depends on: XLA removes them too, so the planner must not price them."""
    live, kept = set(prog.outputs), []
    for step in reversed(prog.steps):
        if step.effectful or live.intersection(step.outputs):
            live.update(step.inputs)
            kept.append(step)
    prog.steps = kept[::-1]


def _constant(prog: FlatProgram, aval: Any, value: Any) -> int:
    vid = prog.new_value(aval)
    prog.constants[vid] = value
    return vid


def _emit(prog: FlatProgram, jaxpr: jcore.Jaxpr, in_ids: Sequence[int], scope: Scope | None = None) -> list[int]:
    """Append the steps of `jaxpr` applied to value ids `in_ids` (constvars first); return output
    ids. `scope`, when given, records this call site's Vars and those of the remat calls in it."""
    env: dict[Any, int] = dict(zip(list(jaxpr.constvars) + list(jaxpr.invars), in_ids, strict=True))

    def read(atom: Any) -> int:
        if isinstance(atom, jcore.Literal):
            return _constant(prog, atom.aval, atom.val)
        return env[atom]

    for k, eqn in enumerate(jaxpr.eqns):
        ins = [read(a) for a in eqn.invars]
        if scope is not None and eqn.primitive.name in REMAT:
            scope.remats[k] = Scope()
            outs = _inline(prog, eqn.params["jaxpr"], ins, scope.remats[k])
        else:
            outs = _expand(prog, eqn, ins)
        env.update(zip(eqn.outvars, outs, strict=True))
    if scope is not None:
        scope.values.update((v, i) for v, i in env.items() if not isinstance(v, jcore.Literal))
    return [read(a) for a in jaxpr.outvars]


def _expand(prog: FlatProgram, eqn: Any, ins: list[int]) -> list[int]:
    name = eqn.primitive.name
    if name in INLINED:
        body = next((eqn.params[p] for p in _BODY_PARAMS if p in eqn.params), None)
        if body is not None:
            return _inline(prog, body, ins)
    if name == "scan" and not eqn.params.get("_split_transpose", False):
        return _unroll_scan(prog, eqn, ins)
    if name == "cond" and not eqn.effects:
        return _both_branches(prog, eqn, ins)
    if name == "while" and not eqn.effects:
        outs = _unroll_while(prog, eqn, ins)
        if outs is not None:
            return outs
    outs = [prog.new_value(v.aval) for v in eqn.outvars]
    params = eqn.primitive.get_bind_params(eqn.params)
    prog.steps.append(Step(eqn.primitive, dict(params[1]) if isinstance(params, tuple) else dict(params),
                           tuple(ins), tuple(outs), tuple(v.aval for v in eqn.outvars), bool(eqn.effects)))
    return outs


def _inline(prog: FlatProgram, body: Any, ins: list[int], scope: Scope | None = None) -> list[int]:
    if isinstance(body, jcore.ClosedJaxpr):
        consts = [_constant(prog, v.aval, c) for v, c in zip(body.jaxpr.constvars, body.consts, strict=True)]
        return _emit(prog, body.jaxpr, consts + ins, scope)
    return _emit(prog, body, ins, scope)


def _unroll_scan(prog: FlatProgram, eqn: Any, ins: list[int]) -> list[int]:
    """Unroll a scan of static length: slice xs per step, run the body, stack the ys."""
    p = eqn.params
    body, length, n_consts, n_carry = p["jaxpr"], p["length"], p["num_consts"], p["num_carry"]
    consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
    order = range(length - 1, -1, -1) if p["reverse"] else range(length)
    ys_per_step: dict[int, list[int]] = {}
    for t in order:
        x_t = [_synthetic(prog, _row, [x], _row_aval(prog.avals[x]), index=t) for x in xs]
        out = _inline(prog, body, consts + carry + x_t)
        carry, ys_per_step[t] = out[:n_carry], out[n_carry:]
    ys = []
    for k, var in enumerate(eqn.outvars[n_carry:]):
        rows = [ys_per_step[t][k] for t in range(length)]
        ys.append(_synthetic(prog, _stack, rows, var.aval))
    return list(carry) + ys


def _both_branches(prog: FlatProgram, eqn: Any, ins: list[int]) -> list[int]:
    """Every branch, then select_n(index, ...) per result: the plan covers both branches and the
    result is the chosen branch's. (XLA would run one branch; the flat program runs them all.)"""
    index, operands = ins[0], ins[1:]
    results = [_inline(prog, branch, operands) for branch in eqn.params["branches"]]
    outs = []
    for j, var in enumerate(eqn.outvars):
        cases = [r[j] for r in results]
        outs.append(cases[0] if len(set(cases)) == 1 else _synthetic(prog, _select, [index, *cases], var.aval))
    return outs


def _unroll_while(prog: FlatProgram, eqn: Any, ins: list[int]) -> list[int] | None:
    """Unroll a while loop whose trip count the program fixes (see `capture.control`), else None."""
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    known = [prog.constants.get(i, UNKNOWN) for i in ins]
    trips = static_trip_count(p["cond_jaxpr"], p["body_jaxpr"], known[:nc], known[nc:nc + nb], known[nc + nb:],
                              MAX_UNROLLED_TRIPS)
    if trips is None:
        return None
    consts, carry = ins[nc:nc + nb], ins[nc + nb:]
    for _ in range(trips):
        carry = _inline(prog, p["body_jaxpr"], consts + carry)
    return list(carry)


@dataclass(frozen=True, slots=True)
class Synthetic:
    """A pseudo-primitive for steps the unroller adds (row of a scan input, stacking of outputs)."""

    name: str
    fn: Callable[..., Any]
    multiple_results: bool = False

    def bind(self, *args: Any, **params: Any) -> Any:
        return self.fn(*args, **params)


def _synthetic(prog: FlatProgram, prim: Synthetic, ins: list[int], aval: Any, **params: Any) -> int:
    out = prog.new_value(aval)
    prog.steps.append(Step(prim, params, tuple(ins), (out,), (aval,)))
    return out


_row = Synthetic("scan_row", lambda x, index: x[index])


def _stack_rows(*rows: Any) -> Any:
    import jax.numpy as jnp  # local: keeps this helper importable without touching the backend

    return jnp.stack(rows)


_stack = Synthetic("scan_stack", _stack_rows)


def _select_cases(which: Any, *cases: Any) -> Any:
    from jax import lax  # local, as in _stack_rows

    return lax.select_n(which, *cases)


_select = Synthetic("select_n", _select_cases)


def _row_aval(aval: Any) -> Any:
    return aval.update(shape=aval.shape[1:])
