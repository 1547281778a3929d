"""Geometry of windowed ops (convolutions, window reductions): dimension numbers, padding, output sizes.

A convolution's operands may lay their dims out in any order; `ConvDims` names which dim is the
batch, the feature and each spatial dim of lhs, rhs and output, so rules, the interpreter and
autodiff never guess. Along one spatial dim of size n, with window k, stride s, padding (lo, hi),
base (lhs) dilation d and window (rhs) dilation r, the operand is dilated to (n - 1)·d + 1 (holes
between entries), padded, and the dilated window (k - 1)·r + 1 slides with stride s:

    out = floor(((n - 1)·d + 1 + lo + hi - ((k - 1)·r + 1)) / s) + 1      (0 when negative)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.errors import GraphError
from meshplan.ir.node import Node, OpKind

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


@dataclass(frozen=True, slots=True)
class Halo:
    """Rows of a windowed op's input each device needs from its neighbours when one spatial dim
    is split in equal blocks: `left` rows from the device before it, `right` from the one after."""

    left: int
    right: int


def spatial_halo(size: int, out_size: int, window: int, stride: int, padding: tuple[int, int],
                 base_dilation: int, window_dilation: int, shards: int, split_window: bool = False) -> Halo | None:
    """The halo of a spatial dim split over `shards` devices, or None when the split does not
    keep each device's work next to its own rows: sizes that `shards` does not divide, blocks
    that drift apart (input block · base dilation ≠ output block · stride), or a halo deeper
    than a block (it would hop over several devices).

    Each device holds a block of `size` / `shards` input rows and computes either a block of the
    output (`split_window` False: the window slides over its rows) or, with `split_window`, every
    output entry over a block of the window's taps (a kernel gradient whose window is the
    cotangent: partial sums). Input row p sits at p · base_dilation + padding[0] in the padded
    operand; output o with tap t reads o · stride + t · window_dilation there.
    """
    split = window if split_window else out_size
    if shards < 2 or size % shards or split % shards:
        return None
    rows, block = size // shards, split // shards
    if rows * base_dilation != block * (window_dilation if split_window else stride) or base_dilation > 1 < stride:
        return None
    left = right = 0
    for j in range(shards):
        if split_window:
            first = j * block * window_dilation
            last = (out_size - 1) * stride + (j * block + block - 1) * window_dilation
        else:
            first = j * block * stride
            last = (j * block + block - 1) * stride + (window - 1) * window_dilation
        need_first = -(-(first - padding[0]) // base_dilation)
        need_last = (last - padding[0]) // base_dilation
        if j > 0:
            left = max(left, j * rows - need_first)
        if j < shards - 1:
            right = max(right, need_last - (j + 1) * rows + 1)
    if left > rows or right > rows:
        return None
    return Halo(max(left, 0), max(right, 0))


def halo_window_padding(rows: int, out_rows: int, window: int, stride: int, padding: tuple[int, int],
                        halo: Halo, window_dilation: int = 1, base_dilation: int = 1) -> tuple[int, int] | None:
    """The padding of one device's share of a windowed op split in aligned blocks, once its block
    of `rows` operand rows has its halo on both sides (`halo.left` + `rows` + `halo.right` rows,
    the devices at either end filling theirs with the padding value): its `out_rows` windows then
    slide over those rows as over the whole operand. None when the extended block is longer than
    its windows reach (a window smaller than its stride skips rows: negative padding)."""
    low = padding[0] - halo.left * base_dilation
    extended = dilated(halo.left + rows + halo.right, base_dilation)
    high = (out_rows - 1) * stride + dilated(window, window_dilation) - low - extended
    return None if low < 0 or high < 0 else (low, high)


def window_halo(node: Node, operand_shape: Sequence[int], dim: int, shards: int
                ) -> tuple[Halo, tuple[int, int] | None] | None:
    """The halo of a window reduction (`node`, of an operand of `operand_shape`) or of max
    pooling's gradient (`node` a select_and_scatter_add, `operand_shape` its cotangent's) split
    along `dim` in `shards` aligned blocks, and the padding of a block extended by it
    (`halo_window_padding`), or None when such a split keeps no device's work next to its rows."""
    ones = (1,) * node.rank
    window, strides, padding = (node.attr(k) for k in ("window_dimensions", "window_strides", "padding"))
    base, wdil = node.attr("base_dilation", ones)[dim], node.attr("window_dilation", ones)[dim]
    # (input rows, output rows): max pooling's gradient carries its cotangent back to the pooled input's rows
    rows, out_rows = (node.shape[dim], operand_shape[dim]) if node.kind is OpKind.SELECT_AND_SCATTER_ADD else (
        operand_shape[dim], node.shape[dim])
    halo = spatial_halo(rows, out_rows, window[dim], strides[dim], padding[dim], base, wdil, shards)
    if halo is None:
        return None
    return halo, halo_window_padding(rows // shards, out_rows // shards, window[dim], strides[dim], padding[dim],
                                     halo, wdil, base)


def conv_tap_pairs(node: Node, lhs_shape: Sequence[int], kernel_shape: Sequence[int]) -> float:
    """Multiply-adds per output entry and kernel input feature of a convolution: its taps, less
    those that land on the holes of a dilated input (an input gradient of a strided convolution
    reads the cotangent dilated by the strides: most taps meet zeros, which no kernel multiplies).
    Along a dilated dim only taps on real entries count (each is one multiply-add of the forward
    convolution); along an undilated dim every tap counts, padding included, the usual convention
    (ResNet-50's 4.09 G multiply-adds)."""
    dims = ConvDims.of(node)
    per_output = 1.0
    for i in range(dims.spatial_rank):
        window = kernel_shape[dims.rhs[2 + i]]
        d = node.attr("lhs_dilation")[i]
        if d == 1:
            per_output *= window
            continue
        out_size = node.shape[dims.out[2 + i]]
        hits = _real_taps(out_size, window, node.attr("window_strides")[i], node.attr("rhs_dilation")[i],
                          node.attr("padding")[i][0], dilated(lhs_shape[dims.lhs[2 + i]], d), d)
        per_output *= hits / max(out_size, 1)
    return per_output


@functools.cache
def _real_taps(out_size: int, window: int, stride: int, window_dilation: int, lo: int, span: int, d: int) -> int:
    """(output, tap) pairs of one dim that read a real entry of an input dilated by `d`."""
    return sum(1 for o in range(out_size) for t in range(window)
               if 0 <= (c := o * stride + t * window_dilation - lo) < span and c % d == 0)
