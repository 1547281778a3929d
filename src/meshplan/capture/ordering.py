"""Capture rules for ops that work along one dim: running reductions (`cumsum` ...), `sort`,
`top_k`, `argmax`/`argmin`. Each becomes an IR op of its own; the sharding rules keep that dim
whole (`meshplan.sharding.rules.ordering`)."""

from __future__ import annotations

from meshplan.capture.flatten import Step
from meshplan.capture.rules import ir_dtype, register
from meshplan.ir import GraphBuilder

_CUMULATIVE = {"cumsum": "sum", "cumprod": "prod", "cummax": "max", "cummin": "min", "cumlogsumexp": "logsumexp"}


@register(*_CUMULATIVE)
def _cumulative(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    p = step.params
    return [b.cumulative(xs[0], p["axis"], _CUMULATIVE[step.name], bool(p["reverse"]))]


@register("sort")
def _sort(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    p = step.params
    return [b.sort(xs, p["dimension"], p["num_keys"], output=k) for k in range(len(xs))]


@register("top_k")
def _top_k(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    p, rank = step.params, len(b.shape(xs[0]))
    dim = p.get("axis", -1) % rank
    index_dtype = ir_dtype(step.avals[1].dtype)
    return [b.top_k(xs[0], p["k"], output, dim, index_dtype) for output in (0, 1)]


@register("argmax", "argmin")
def _arg_reduce(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    (axis,) = step.params["axes"]
    return [b.arg_reduce(xs[0], axis, step.name, ir_dtype(step.params["index_dtype"]))]
