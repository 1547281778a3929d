"""Capture rules for convolutions and window reductions: `conv_general_dilated`, the pooling
primitives `reduce_window_sum/max/min` (Flax's `nn.avg_pool`, `nn.max_pool`), max pooling's
gradient `select_and_scatter_add`, and `rev` (the flipped kernel of a convolution's input
gradient). Batch norm needs no rule of its own: its statistics are `reduce_sum`s over the batch
and spatial dims, which become cross-device reductions wherever the batch is split.
"""

from __future__ import annotations

from meshplan.capture.flatten import Step
from meshplan.capture.rules import ir_dtype, register
from meshplan.ir import GraphBuilder


@register("conv_general_dilated")
def _conv(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    p = step.params
    numbers = p["dimension_numbers"]
    dims = (numbers.lhs_spec, numbers.rhs_spec, numbers.out_spec)
    return [b.conv(xs[0], xs[1], p["window_strides"], p["padding"], p["lhs_dilation"], p["rhs_dilation"], dims,
                   p["feature_group_count"], p["batch_group_count"], dtype=ir_dtype(step.avals[0].dtype))]


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min")
def _reduce_window(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    p = step.params
    return [b.reduce_window(xs[0], step.name.removeprefix("reduce_window_"), p["window_dimensions"],
                            p["window_strides"], p["padding"], p["base_dilation"], p["window_dilation"])]


@register("select_and_scatter_add")
def _select_and_scatter_add(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    p = step.params
    select = getattr(p["select_prim"], "name", str(p["select_prim"]))
    if select not in ("ge", "le"):
        raise NotImplementedError
    return [b.select_and_scatter_add(xs[0], xs[1], p["window_dimensions"], p["window_strides"], p["padding"],
                                     select)]


@register("rev")
def _rev(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    return [b.reverse(xs[0], step.params["dimensions"])]
