"""Per-primitive rules turning flat-program steps into GraphBuilder nodes.

A rule takes (builder, step, operand node ids) and returns one node id per step output.
Primitives without a rule become opaque nodes (planned replicated) and are reported. The rules
for gathers and scatters live in `meshplan.capture.indexing`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from meshplan.capture.flatten import Step
from meshplan.ir import DType, GraphBuilder, as_dtype
from meshplan.ir.builder import BINARY_OPS, COMPARE_DIRECTIONS, UNARY_OPS

Rule = Callable[[GraphBuilder, Step, list[int]], list[int]]
RULES: dict[str, Rule] = {}
# Primitives that only change what autodiff or the pipeline cutter sees (mark_pipeline_boundary's
# "pipeline_boundary" is an identity), or a value's layout (`reshard`, which JAX inserts when a step
# is traced again on sharded arrays: the plan decides layouts): the output is the input's node.
PASS_THROUGH = frozenset({"stop_gradient", "copy", "copy_p", "optimization_barrier", "pipeline_boundary", "reshard"})
# Integer types the IR lacks map to a same-size stand-in so byte counts stay right.
_DTYPE_STAND_INS = {"uint32": DType.I32, "int16": DType.F16, "uint16": DType.F16, "uint64": DType.I64,
                    "bool_": DType.PRED, "float8_e4m3fn": DType.I8, "float8_e5m2": DType.I8}


def ir_dtype(dtype: Any) -> DType:
    """The meshplan DType of a NumPy/JAX dtype (float32 -> f32, bool -> pred, ...)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return DType.I64  # a typed PRNG key (threefry's holds two uint32 words): same bytes
    name = np.dtype(dtype).name
    return _DTYPE_STAND_INS.get(name) or as_dtype(name)


def register(*names: str) -> Callable[[Rule], Rule]:
    def decorate(rule: Rule) -> Rule:
        for name in names:
            RULES[name] = rule
        return rule
    return decorate


def _shape(step: Step, k: int = 0) -> tuple[int, ...]:
    return tuple(step.avals[k].shape)


def _to_shape(b: GraphBuilder, x: int, shape: Sequence[int]) -> int:
    """Broadcast an operand to the result's shape: jaxpr binary ops take scalars (`mul 2.0 x`)
    and, since JAX 0.10, size-1 dims of equal rank (`sub x[8,64] mean[8,1]`); the IR takes neither."""
    shape, own = tuple(shape), b.shape(x)
    if own == shape:
        return x
    return b.broadcast(x, shape, range(len(own)) if own else ())


@register(*UNARY_OPS - {"copy", "round", "bitcast"})
def _unary(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    return [b.unary(step.name, xs[0], dtype=ir_dtype(step.avals[0].dtype))]


@register("round")
def _round(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    if int(step.params["rounding_method"]) != 1:  # only half-to-even (jnp.round) has an IR form
        raise NotImplementedError
    return [b.unary("round", xs[0])]


@register("bitcast_convert_type")
def _bitcast(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    if b.shape(xs[0]) != _shape(step):  # a bitcast between widths reshapes; no IR form
        raise NotImplementedError
    return [b.unary("bitcast", xs[0], dtype=ir_dtype(step.avals[0].dtype))]


@register("erfc")
def _erfc(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    one = b.full(_shape(step), 1.0, b.node(xs[0]).dtype)
    return [b.sub(one, b.unary("erf", xs[0]))]


@register(*BINARY_OPS, "add_any")
def _binary(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    op = "add" if step.name == "add_any" else step.name
    shape = _shape(step)
    return [b.binary(op, _to_shape(b, xs[0], shape), _to_shape(b, xs[1], shape))]


@register(*COMPARE_DIRECTIONS)
def _compare(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    shape = _shape(step)
    return [b.compare(_to_shape(b, xs[0], shape), _to_shape(b, xs[1], shape), step.name)]


@register("integer_pow")
def _integer_pow(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    y, x = step.params["y"], xs[0]
    if 1 <= y <= 4:  # small powers as a chain of multiplies, as XLA expands them
        out = x
        for _ in range(y - 1):
            out = b.mul(out, x)
        return [out]
    exponent = b.full(_shape(step), float(y), b.node(x).dtype)
    return [b.binary("pow", x, exponent)]


@register("convert_element_type")
def _convert(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    return [b.convert(xs[0], ir_dtype(step.avals[0].dtype))]


@register("select_n")
def _select(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    shape = _shape(step)
    which, *cases = (_to_shape(b, x, shape) for x in xs)  # select_n(which, case 0, case 1, ...)
    if len(cases) == 2:
        return [b.select(which, cases[1], cases[0])]
    out = cases[0]
    for k, case in enumerate(cases[1:], start=1):  # more cases: a chain of (which == k) selects
        out = b.select(b.compare(which, b.full(shape, float(k), b.node(which).dtype), "eq"), case, out)
    return [out]


@register("clamp")
def _clamp(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    shape = _shape(step)
    low, x, high = (_to_shape(b, v, shape) for v in xs)  # clamp(min, x, max) = min(max(x, min), max), as XLA
    return [b.binary("min", b.max(x, low), high)]


@register("dot_general")
def _dot(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    (lc, rc), (lb, rb) = step.params["dimension_numbers"]
    return [b.dot(xs[0], xs[1], lc, rc, lb, rb, dtype=ir_dtype(step.avals[0].dtype))]


@register("broadcast_in_dim")
def _broadcast(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    return [b.broadcast(xs[0], step.params["shape"], step.params["broadcast_dimensions"])]


@register("reshape", "squeeze", "expand_dims")
def _reshape(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    return [b.reshape(xs[0], _shape(step))]


@register("transpose")
def _transpose(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    return [b.transpose(xs[0], step.params["permutation"])]


@register("reduce_sum", "reduce_max", "reduce_min", "reduce_prod")
def _reduce(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    return [b.reduce(xs[0], step.params["axes"], step.name.removeprefix("reduce_"))]


@register("iota")
def _iota(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    return [b.iota(_shape(step), step.params["dimension"], ir_dtype(step.avals[0].dtype))]


@register("concatenate")
def _concatenate(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    return [b.concatenate(xs, step.params["dimension"])]


@register("slice")
def _slice(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    strides = step.params.get("strides")
    if strides is not None and any(s != 1 for s in strides):
        raise NotImplementedError  # strided slices have no IR form
    return [b.slice(xs[0], step.params["start_indices"], step.params["limit_indices"])]


@register("dynamic_slice")
def _dynamic_slice(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    return [b.dynamic_slice(xs[0], xs[1:], step.params["slice_sizes"])]


@register("scan_row")
def _scan_row(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    shape, t = b.shape(xs[0]), step.params["index"]
    start, limit = [t] + [0] * (len(shape) - 1), [t + 1, *shape[1:]]
    return [b.reshape(b.slice(xs[0], start, limit), shape[1:])]


@register("scan_stack")
def _scan_stack(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    rows = [b.reshape(x, (1, *b.shape(x))) for x in xs]
    return [b.concatenate(rows, 0)]
