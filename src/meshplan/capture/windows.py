"""Capture rules for window ops: `pad`, `split` and `dynamic_update_slice`.

`pad` and `split` become ops the IR already has (concatenations with the padding value, slices),
so their sharding, FLOPs and gradients come with those ops; `dynamic_update_slice` (a KV-cache
write) is its own IR op.
"""

from __future__ import annotations

from meshplan.capture.flatten import Step
from meshplan.capture.rules import register
from meshplan.ir import GraphBuilder, OpKind


@register("pad")
def _pad(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    """Per dim: a negative edge is a slice, a positive one a concatenation with the padding value
    broadcast to the edge's shape. Interior padding (between entries, as a strided average
    pooling's gradient has) is a window sum of one entry over the base-dilated operand, whose
    holes and edges hold zeros: with another padding value v, of x - v, then + v."""
    x, value = xs
    config = [(int(lo), int(hi), int(interior)) for lo, hi, interior in step.params["padding_config"]]
    if any(interior for _, _, interior in config):
        return [_interior_pad(b, x, value, config)]
    for dim, (low, high, _) in enumerate(config):
        x = _cut(b, x, dim, max(-int(low), 0), max(-int(high), 0))
        parts = [_edge(b, value, x, dim, int(low)), x, _edge(b, value, x, dim, int(high))]
        parts = [p for p in parts if p is not None]
        x = parts[0] if len(parts) == 1 else b.concatenate(parts, dim)
    return [x]


def _interior_pad(b: GraphBuilder, x: int, value: int, config: list[tuple[int, int, int]]) -> int:
    if any(lo < 0 or hi < 0 for lo, hi, _ in config):
        raise NotImplementedError  # negative edges of a dilated operand: no IR form
    ones = (1,) * len(config)
    edges, dilation = [(lo, hi) for lo, hi, _ in config], [interior + 1 for _, _, interior in config]
    node = b.node(value)
    if node.kind is OpKind.CONSTANT and node.attr("value") == 0:
        return b.reduce_window(x, "sum", ones, ones, edges, dilation)
    shifted = b.sub(x, b.broadcast(value, b.shape(x), ()))
    padded = b.reduce_window(shifted, "sum", ones, ones, edges, dilation)
    return b.add(padded, b.broadcast(value, b.shape(padded), ()))


def _cut(b: GraphBuilder, x: int, dim: int, low: int, high: int) -> int:
    if not low and not high:
        return x
    shape = b.shape(x)
    start = [low if d == dim else 0 for d in range(len(shape))]
    limit = [s - high if d == dim else s for d, s in enumerate(shape)]
    return b.slice(x, start, limit)


def _edge(b: GraphBuilder, value: int, x: int, dim: int, width: int) -> int | None:
    if width <= 0:
        return None
    shape = list(b.shape(x))
    shape[dim] = width
    return b.broadcast(value, shape, ())


@register("split")
def _split(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    shape, axis = b.shape(xs[0]), step.params["axis"]
    outs, start = [], 0
    for size in step.params["sizes"]:
        first = [start if d == axis else 0 for d in range(len(shape))]
        limit = [start + int(size) if d == axis else s for d, s in enumerate(shape)]
        outs.append(b.slice(xs[0], first, limit))
        start += int(size)
    return outs


@register("dynamic_update_slice")
def _dynamic_update_slice(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    return [b.dynamic_update_slice(xs[0], xs[1], xs[2:])]
