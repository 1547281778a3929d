"""Capture rules for `gather` and `scatter-add`: jaxpr dimension numbers -> the IR's GATHER and SCATTER_ADD.

The IR indexes one dim (`axis`) with leading batch dims (tf.gather's form). A jaxpr gather maps
to it when it picks single entries along one operand dim, each other operand dim being either
taken whole or paired with an index dim (a batch dim). The pairs come from
`operand_batching_dims` (`jnp.take_along_axis`) or from index columns that count 0, 1, ...
along an index dim (`x[jnp.arange(n), labels]`); the latter are recognised by evaluating the
parameter-free index nodes. Operand, indices and result are transposed into that form when
their dims come in another order. Anything else (several gathered dims, partial windows,
CLIP-mode scatters, `ONE_HOT` mode) raises NotImplementedError and stays opaque.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from jax import lax

from meshplan.capture.flatten import Step
from meshplan.capture.rules import ir_dtype, register
from meshplan.ir import GraphBuilder, OpKind
from meshplan.ir.interpret import evaluate_node

# Largest parameter-free index tensor evaluated to look for aranges (elements).
_STATIC_LIMIT = 1 << 22


@dataclass(frozen=True, slots=True)
class _DimNumbers:
    """Gather and scatter dimension numbers under one set of names (scatter's in brackets).

    window: output (update) dims that hold operand dims [update_window_dims].
    collapsed: operand dims indexed by a single entry [inserted_window_dims].
    index_map: the operand dim each entry of the index vector indexes [scatter_dims_to_operand_dims].
    pairs: (operand dim, index dim) batch pairs.
    """

    window: tuple[int, ...]
    collapsed: tuple[int, ...]
    index_map: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class _Take:
    """One IR gather/scatter: the operand dim indexed, its batch pairs, and the index node."""

    axis: int
    pairs: tuple[tuple[int, int], ...]
    indices: int  # node of the indices without the index-vector dim


@register("gather")
def _gather(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    p = step.params
    mode = lax.GatherScatterMode.from_any(p["mode"])
    if mode is lax.GatherScatterMode.ONE_HOT:
        raise NotImplementedError
    d = p["dimension_numbers"]
    dn = _DimNumbers(tuple(d.offset_dims), tuple(d.collapsed_slice_dims), tuple(d.start_index_map),
                     tuple(zip(d.operand_batching_dims, d.start_indices_batching_dims, strict=True)))
    shape = b.shape(xs[0])
    whole = [s for k, s in enumerate(p["slice_sizes"]) if k not in dn.collapsed + _operand_dims(dn.pairs)]
    if whole != [shape[k] for k in _offset_operand_dims(len(shape), dn)]:
        raise NotImplementedError  # a window smaller than the dim: a slice, not a pick
    take = _resolve(b, xs[1], dn, shape)
    fill = None if mode is not lax.GatherScatterMode.FILL_OR_DROP else float(p["fill_value"])
    layout = _Layout(len(shape), b.node(take.indices).rank, take, dn)
    operand = _transpose(b, xs[0], layout.operand_perm)
    indices = _transpose(b, take.indices, layout.index_perm)
    out = b.gather(operand, indices, layout.axis, len(take.pairs), fill_value=fill)
    return [_transpose(b, out, layout.out_perm)]


@register("scatter-add")
def _scatter_add(b: GraphBuilder, step: Step, xs: list[int]) -> list[int]:
    p = step.params
    if lax.GatherScatterMode.from_any(p["mode"]) is lax.GatherScatterMode.CLIP:
        raise NotImplementedError  # the IR's scatter drops out-of-range updates; CLIP clamps them
    d = p["dimension_numbers"]
    dn = _DimNumbers(tuple(d.update_window_dims), tuple(d.inserted_window_dims),
                     tuple(d.scatter_dims_to_operand_dims),
                     tuple(zip(d.operand_batching_dims, d.scatter_indices_batching_dims, strict=True)))
    operand, shape, updates = xs[0], b.shape(xs[0]), b.shape(xs[2])
    if [updates[k] for k in dn.window] != [shape[k] for k in _offset_operand_dims(len(shape), dn)]:
        raise NotImplementedError  # updates that cover part of a dim: a window, not single entries
    take = _resolve(b, xs[1], dn, shape)
    layout = _Layout(len(shape), b.node(take.indices).rank, take, dn)
    canonical = _transpose(b, xs[2], np.argsort(layout.out_perm))
    indices = _transpose(b, take.indices, layout.index_perm)
    summed = b.scatter_add([shape[k] for k in layout.operand_perm], indices, canonical, layout.axis,
                           len(take.pairs), dtype=ir_dtype(step.avals[0].dtype))
    summed = _transpose(b, summed, np.argsort(layout.operand_perm))
    return [summed if _is_zero(b, operand) else b.add(operand, summed)]


class _Layout:
    """Transposes between a jaxpr gather's dim order and the IR's: operand [batch, rest],
    indices [batch, rest], output [batch, operand rest before axis, index rest, operand rest after].

    `out_perm[p]` is the IR output dim that lands at jaxpr output (or scatter update) dim p.
    """

    def __init__(self, operand_rank: int, index_rank: int, take: _Take, dn: _DimNumbers) -> None:
        batch_operand, batch_index = _operand_dims(take.pairs), tuple(k for _, k in take.pairs)
        rest = [k for k in range(operand_rank) if k not in batch_operand]
        index_rest = [k for k in range(index_rank) if k not in batch_index]
        self.operand_perm = list(batch_operand) + rest
        self.index_perm = list(batch_index) + index_rest
        self.axis = self.operand_perm.index(take.axis)
        nb, before = len(take.pairs), self.axis - len(take.pairs)
        window = [nb + m if m < before else nb + len(index_rest) + m
                  for m in range(len(rest) - 1)]  # the m-th kept operand dim, axis left out
        index_dims = [batch_index.index(k) if k in batch_index else nb + before + index_rest.index(k)
                      for k in range(index_rank)]
        out_rank = len(window) + index_rank
        self.out_perm = [window[dn.window.index(q)] if q in dn.window else index_dims.pop(0)
                         for q in range(out_rank)]


def _operand_dims(pairs: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    return tuple(o for o, _ in pairs)


def _offset_operand_dims(rank: int, dn: _DimNumbers) -> list[int]:
    return [k for k in range(rank) if k not in dn.collapsed + _operand_dims(dn.pairs)]


def _resolve(b: GraphBuilder, indices: int, dn: _DimNumbers, shape: tuple[int, ...]) -> _Take:
    """The one gathered operand dim: index-vector entries that count along an index dim become
    batch pairs; exactly one other entry must remain."""
    vector = b.shape(indices)
    if sorted(dn.collapsed) != sorted(dn.index_map) or vector[-1:] != (len(dn.index_map),):
        raise NotImplementedError  # windows along an indexed dim, or no trailing index vector
    columns, pairs = list(range(len(dn.index_map))), list(dn.pairs)
    for c in range(len(dn.index_map)):
        if len(columns) == 1:
            break  # the last candidate is the gathered dim, whatever its values
        value = _static_column(b, indices, c)
        k = None if value is None else _arange_dim(value, shape[dn.index_map[c]], {k for _, k in pairs})
        if k is not None:
            pairs.append((dn.index_map[c], k))
            columns.remove(c)
    if len(columns) != 1:
        raise NotImplementedError  # several gathered dims (x[i, j] with two index arrays)
    return _Take(dn.index_map[columns[0]], tuple(sorted(pairs, key=lambda p: p[1])),
                 _column(b, indices, columns[0]))


def _column(b: GraphBuilder, indices: int, c: int) -> int:
    """Entry `c` of the index vector (the trailing dim), with that dim dropped."""
    shape = b.shape(indices)
    if shape[-1] != 1:
        indices = b.slice(indices, [0] * (len(shape) - 1) + [c], [*shape[:-1], c + 1])
    return b.reshape(indices, shape[:-1])


def _arange_dim(column: np.ndarray, size: int, taken: set[int]) -> int | None:
    """The dim k (not in `taken`) of length `size` along which `column` counts 0, 1, ..., or None."""
    for k, n in enumerate(column.shape):
        if n == size and k not in taken:
            ramp = np.arange(n).reshape([-1 if j == k else 1 for j in range(column.ndim)])
            if np.array_equal(column, np.broadcast_to(ramp, column.shape)):
                return k
    return None


def _static_column(b: GraphBuilder, indices: int, c: int) -> np.ndarray | None:
    """Entry `c` of the index vector if it depends on no parameter, else None. JAX concatenates
    the index arrays along the vector dim, so the concatenation is looked through first."""
    node = b.node(indices)
    while node.kind is OpKind.CONCATENATE and node.attr("dim") == node.rank - 1:
        for part in node.operands:
            width = b.shape(part)[-1]
            if c < width:
                node = b.node(part)
                break
            c -= width
    value = _static_value(b, node.id)
    return None if value is None else value[..., c]


def _static_value(b: GraphBuilder, x: int) -> np.ndarray | None:
    """The value of node `x` if it depends on no parameter (iotas, scalar constants), else None."""
    values: dict[int, np.ndarray] = {}
    stack = [x]
    while stack:
        node = b.node(stack[-1])
        if node.id in values:
            stack.pop()
            continue
        if node.kind in (OpKind.PARAMETER, OpKind.OPAQUE) or node.size > _STATIC_LIMIT or (
                node.kind is OpKind.CONSTANT and node.attr("value") is None):
            return None  # an input, or a constant array capture keeps no value of
        missing = [o for o in node.operands if o not in values]
        if missing:
            stack.extend(missing)
            continue
        values[node.id] = evaluate_node(node, [values[o] for o in node.operands])
        stack.pop()
    return values[x]


def _is_zero(b: GraphBuilder, x: int) -> bool:
    """True for a zero scalar constant, possibly broadcast (what `jnp.zeros` and transposes emit)."""
    node = b.node(x)
    if node.kind is OpKind.BROADCAST:
        node = b.node(node.operands[0])
    return node.kind is OpKind.CONSTANT and node.attr("value") == 0.0


def _transpose(b: GraphBuilder, x: int, perm: Any) -> int:
    perm = [int(p) for p in perm]
    return x if perm == sorted(perm) else b.transpose(x, perm)
