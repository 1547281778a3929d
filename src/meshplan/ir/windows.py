"""Geometry of windowed ops (convolutions, window reductions): dimension numbers, padding, output sizes.

A convolution's operands may lay their dims out in any order; `ConvDims` names which dim is the
batch, the feature and each spatial dim of lhs, rhs and output, so rules, the interpreter and
autodiff never guess. Along one spatial dim of size n, with window k, stride s, padding (lo, hi),
base (lhs) dilation d and window (rhs) dilation r, the operand is dilated to (n - 1)·d + 1 (holes
between entries), padded, and the dilated window (k - 1)·r + 1 slides with stride s:

    out = floor(((n - 1)·d + 1 + lo + hi - ((k - 1)·r + 1)) / s) + 1      (0 when negative)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.errors import GraphError
from meshplan.ir.node import Node

Padding = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class ConvDims:
    """Which dim of each operand plays which role in a convolution.

    Attributes:
        lhs: (batch, feature, spatial 0, spatial 1, ...) dims of the input.
        rhs: (output feature, input feature, spatial 0, ...) dims of the kernel.
        out: (batch, feature, spatial 0, ...) dims of the output.
    """

    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    out: tuple[int, ...]

    @property
    def spatial_rank(self) -> int:
        return len(self.lhs) - 2

    @classmethod
    def of(cls, node: Node) -> ConvDims:
        return cls(node.attr("lhs_spec"), node.attr("rhs_spec"), node.attr("out_spec"))

    @classmethod
    def canonical(cls, spatial_rank: int) -> ConvDims:
        """NCHW / OIHW / NCHW (dims in role order)."""
        order = tuple(range(spatial_rank + 2))
        return cls(order, order, order)


def conv_dims(spec: Sequence | None, rank: int) -> ConvDims:
    """Normalize dimension numbers: None (NCHW, OIHW, NCHW), three index tuples in role order
    (JAX's ConvDimensionNumbers), or three strings such as ("NHWC", "HWIO", "NHWC") whose spatial
    letters are matched by name, in the kernel string's order."""
    if spec is None:
        return ConvDims.canonical(rank - 2)
    lhs, rhs, out = spec
    if isinstance(lhs, str):
        spatial = [c for c in rhs if c not in "OI"]
        lhs, rhs, out = ([s.index(c) for c in (*roles, *spatial)] for s, roles in
                         ((lhs, "NC"), (rhs, "OI"), (out, "NC")))
    dims = ConvDims(*(tuple(int(d) for d in s) for s in (lhs, rhs, out)))
    for what, s in (("lhs", dims.lhs), ("rhs", dims.rhs), ("out", dims.out)):
        if sorted(s) != list(range(rank)):
            raise GraphError(f"conv: {what} dimension numbers {s} must name each of the {rank} dims once")
    return dims


def window_padding(padding: str | Sequence[Sequence[int]] | None, sizes: Sequence[int], windows: Sequence[int],
                   strides: Sequence[int]) -> Padding:
    """(lo, hi) per dim from explicit pairs, None (no padding) or "VALID"/"SAME" (output size
    ceil(n / s), the padding split with the smaller half before), as `jax.lax` computes them:
    from the operand's undilated `sizes` and the dilated `windows`."""
    if padding is None or padding == "VALID":
        return tuple((0, 0) for _ in sizes)
    if padding == "SAME":
        pads = []
        for n, k, s in zip(sizes, windows, strides, strict=True):
            total = max((-(-n // s) - 1) * s + k - n, 0)
            pads.append((total // 2, total - total // 2))
        return tuple(pads)
    if isinstance(padding, str):
        raise GraphError(f"padding {padding!r} is unknown; pass 'SAME', 'VALID' or (lo, hi) per dim")
    pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    if len(pads) != len(sizes):
        raise GraphError(f"padding {pads} has {len(pads)} entries for {len(sizes)} windowed dims")
    return pads


def dilated(size: int, dilation: int) -> int:
    """Size of `size` entries with `dilation - 1` holes between neighbours."""
    return 0 if size == 0 else (size - 1) * dilation + 1


def window_output_size(size: int, window: int, stride: int, padding: tuple[int, int], base_dilation: int = 1,
                       window_dilation: int = 1) -> int:
    span = dilated(size, base_dilation) + padding[0] + padding[1] - dilated(window, window_dilation)
    return max(span // stride + 1, 0) if span >= 0 else 0


def positive(values: Sequence[int] | None, count: int, what: str) -> tuple[int, ...]:
    """`values` (default all ones) as `count` positive ints."""
    values = (1,) * count if values is None else tuple(int(v) for v in values)
    if len(values) != count or any(v < 1 for v in values):
        raise GraphError(f"{what} {values} must be {count} positive integers")
    return values


def transposed_padding(sizes: Sequence[int], windows: Sequence[int], strides: Sequence[int],
                       out_sizes: Sequence[int], padding: Padding, base_dilation: Sequence[int],
                       window_dilation: Sequence[int]) -> Padding:
    """The padding of the windowed op that carries a cotangent of `out_sizes` back to the operand
    (of `sizes`): the cotangent is dilated by the strides and the (dilated) window slides over it
    reversed, so each side is padded by the window minus what the forward padding already covered."""
    pads = []
    for n, k, s, m, (lo, _), d, r in zip(sizes, windows, strides, out_sizes, padding, base_dilation,
                                         window_dilation, strict=True):
        k_span = dilated(k, r)
        before = k_span - lo - 1
        pads.append((before, dilated(n, d) + k_span - 1 - dilated(m, s) - before))
    return tuple(pads)


def kernel_padding(sizes: Sequence[int], windows: Sequence[int], strides: Sequence[int], out_sizes: Sequence[int],
                   padding: Padding, base_dilation: Sequence[int], window_dilation: Sequence[int]) -> Padding:
    """The padding of the convolution of the input with the cotangent that gives the kernel's
    gradient: the forward padding before, and after whatever makes the result the kernel's size."""
    pads = []
    for n, k, s, m, (lo, _), d, r in zip(sizes, windows, strides, out_sizes, padding, base_dilation,
                                         window_dilation, strict=True):
        pads.append((lo, dilated(m, s) - dilated(n, d) + dilated(k, r) - lo - 1))
    return tuple(pads)


def windowed_dims(node: Node) -> set[int]:
    """Dims a window reduction (or max pooling's gradient) slides along: window or stride above 1,
    padding, or dilation; the other dims (batch, features) pass through position by position."""
    window, strides, padding = (node.attr(k) for k in ("window_dimensions", "window_strides", "padding"))
    ones = (1,) * node.rank
    base, wdil = node.attr("base_dilation", ones), node.attr("window_dilation", ones)
    return {d for d in range(node.rank) if window[d] > 1 or strides[d] > 1 or padding[d] != (0, 0)
            or base[d] > 1 or wdil[d] > 1}


SUMMED = "summed"  # conv_output_dim's answer for a dim the convolution contracts


def conv_output_dim(node: Node, position: int, dim: int, kernel_shape: Sequence[int]) -> int | str | None:
    """Where dim `dim` of operand `position` (0 input, 1 kernel) of a convolution goes: an output
    dim that holds it position by position, SUMMED when it is contracted, or None when the
    convolution mixes its positions (a sliding window, groups)."""
    dims = ConvDims.of(node)
    role = (dims.lhs if position == 0 else dims.rhs).index(dim)
    if position == 1:  # output features keep their positions; input features and taps are summed
        return dims.out[1] if role == 0 else SUMMED
    if role == 0:  # the batch, unless batch groups fold it into the features
        return dims.out[0] if node.attr("batch_group_count") == 1 else None
    if role == 1:  # input features, summed unless groups route them to some outputs only
        return SUMMED if node.attr("feature_group_count") == 1 else None
    return dims.out[role] if is_pointwise(node, role - 2, kernel_shape) else None


def is_pointwise(node: Node, i: int, kernel_shape: Sequence[int]) -> bool:
    """Whether a convolution's spatial dim `i` maps input positions one to one onto output
    positions (kernel size 1, stride 1, no padding, no input dilation: a 1x1 convolution's)."""
    return (kernel_shape[node.attr("rhs_spec")[2 + i]] == 1 and node.attr("window_strides")[i] == 1
            and node.attr("padding")[i] == (0, 0) and node.attr("lhs_dilation")[i] == 1)
