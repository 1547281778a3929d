"""ShardingSpec: which mesh axes split each tensor dim, and how specs move through layout ops."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.cluster.mesh import LogicalMesh
from meshplan.ir.dimflow import reshape_groups

_TEXT: dict[tuple[tuple[int, ...], ...], str] = {}  # ShardingSpec.__str__ by dims


@dataclass(frozen=True, slots=True)
class ShardingSpec:
    """For each tensor dim, the mesh axes it is split over (major to minor); () = not split.

    A spec never names an axis twice. Axes that split no dim replicate the tensor along them.
    """

    dims: tuple[tuple[int, ...], ...]

    @staticmethod
    def replicated(rank: int) -> ShardingSpec:
        return ShardingSpec(((),) * rank)

    @staticmethod
    def of(*dims: Sequence[int] | int | None) -> ShardingSpec:
        """ShardingSpec.of(0, None) splits dim 0 over axis 0; of((0, 1), None) over both."""
        return ShardingSpec(tuple(_as_axes(d) for d in dims))

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def is_replicated(self) -> bool:
        return not any(self.dims)

    def axes(self) -> tuple[int, ...]:
        """All mesh axes that split some dim."""
        return tuple(a for d in self.dims for a in d)

    def dim_of_axis(self, axis: int) -> int | None:
        for d, axes in enumerate(self.dims):
            if axis in axes:
                return d
        return None

    def num_shards(self, mesh: LogicalMesh) -> int:
        return mesh.axis_size(self.axes())

    def shard_shape(self, shape: Sequence[int], mesh: LogicalMesh) -> tuple[int, ...]:
        """Local shape on one device; a dim the axes do not divide is padded up (ceil)."""
        return tuple(math.ceil(s / mesh.axis_size(a)) if a else s for s, a in zip(shape, self.dims, strict=True))

    def is_valid_for(self, shape: Sequence[int], mesh: LogicalMesh) -> bool:
        """True when every split dim is divided evenly by its axes."""
        return all(s % mesh.axis_size(a) == 0 for s, a in zip(shape, self.dims, strict=True))

    def without_axes(self, axes: Sequence[int]) -> ShardingSpec:
        return ShardingSpec(tuple(tuple(a for a in d if a not in axes) for d in self.dims))

    def transpose(self, perm: Sequence[int]) -> ShardingSpec:
        """Spec of transpose(x, perm) given x's spec."""
        return ShardingSpec(tuple(self.dims[p] for p in perm))

    def broadcast(self, dims: Sequence[int], out_rank: int) -> ShardingSpec:
        """Spec of broadcast_in_dim(x, dims): operand dim i lands at output dim dims[i]."""
        out: list[tuple[int, ...]] = [()] * out_rank
        for i, d in enumerate(dims):
            out[d] = self.dims[i]
        return ShardingSpec(tuple(out))

    def unbroadcast(self, dims: Sequence[int], operand_shape: Sequence[int],
                    out_shape: Sequence[int]) -> ShardingSpec:
        """The operand spec whose broadcast_in_dim(x, dims) is this spec where it can be: the
        splits of the output dims that hold operand dims (size-1 operand dims that the broadcast
        expands hold none)."""
        return ShardingSpec(tuple(self.dims[d] if operand_shape[i] == out_shape[d] else ()
                                  for i, d in enumerate(dims)))

    def reduce(self, dims: Sequence[int]) -> ShardingSpec:
        """Spec of reduce(x, dims): the reduced dims disappear (their axes need an all-reduce)."""
        return ShardingSpec(tuple(a for d, a in enumerate(self.dims) if d not in dims))

    def reduced_axes(self, dims: Sequence[int]) -> tuple[int, ...]:
        """Axes splitting the reduced dims: the partial results must be summed over them."""
        return tuple(a for d in dims for a in self.dims[d])

    def __str__(self) -> str:
        text = _TEXT.get(self.dims)
        if text is None:  # every strategy's name spells its specs: remembered per dims
            text = _TEXT[self.dims] = "R(scalar)" if not self.dims else "".join(
                "R" if not a else "S" + "".join(map(str, a)) for a in self.dims)
        return text

    @staticmethod
    def parse(text: str) -> ShardingSpec:
        """The spec `str(spec)` wrote, e.g. "S01R" (axes are single digits) or "R(scalar)".

        Raises:
            ValueError: the text is not a spec.
        """
        if text == "R(scalar)":
            return ShardingSpec(())
        match = re.fullmatch(r"(?:R|S\d+)+", text)
        if match is None:
            raise ValueError(f"{text!r} is not a sharding spec like S0R or RS01")
        return ShardingSpec(tuple(() if part == "R" else tuple(int(a) for a in part[1:])
                                  for part in re.findall(r"R|S\d+", text)))


def conversion_path(src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh) -> tuple[ShardingSpec, ...]:
    """The layouts a conversion from `src` passes through, in order, ending with `dst` (empty
    when src == dst). The runtime constrains a value to each in turn and the resharding rule
    prices each step, so XLA's partitioner makes the steps that were priced:

    1. `gathered_first`: the dropped axes gathered (the moved ones too when they go apart).
    2. `sliced_first`: while axes move, the axes `dst` adds are sliced locally first, so the
       all-to-all carries the smaller shards (what XLA does unpinned; RRS1 -> S01RR: slice to
       S0RS1, then one all-to-all over axis 1).
    3. `dst`.
    """
    path, at = [], src
    for first in (gathered_first, sliced_first):
        step = first(at, dst, mesh)
        if step is not None:
            path.append(step)
            at = step
    return (*path, dst) if at != dst else tuple(path)


def gathered_first(src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh) -> ShardingSpec | None:
    """The layout a conversion passes through when one collective cannot do it: the axes it
    drops are gathered first, then the rest exchanged (S01R -> RS0: gather axis 1, then move
    axis 0) or sliced (RRRS1 -> RRRS0: gather axis 1, then slice over axis 0); axes that leave
    one dim for several, or several dims for one, are gathered too and the result sliced. XLA's
    partitioner has no collective for the first kind and gathers the whole value itself, calling
    it an involuntary rematerialization (measured on 8 CPU devices: S01RR -> RRS0, RRS01 ->
    S1S0R, S0S1R -> RRS01); for the second it swaps shards and gathers over device groups of no
    mesh axes (measured: RRRS1 -> RRRS0 on a (2, 4) mesh, a collective-permute and a 2-way
    all-gather), which no plan prices. The runtime converts through this layout explicitly.
    None when one collective (or none) does it."""
    moved, dropped = moved_and_dropped(src, dst, mesh)
    if len({(src.dim_of_axis(a), dst.dim_of_axis(a)) for a in moved}) > 1:
        return src.without_axes(moved + dropped)
    added = added_axes(src, dst, mesh)
    return src.without_axes(dropped) if dropped and (moved or added) else None


def sliced_first(src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh) -> ShardingSpec | None:
    """`src` sliced over the axes `dst` adds (each appended to its dim in `dst`) when axes also
    move (an all-to-all follows); None otherwise. XLA's partitioner slices first in this case
    (measured on a (2, 4) mesh: RRS1 -> S01RR is one all-to-all over axis 1 of a quarter of the
    replicated value's bytes; RRS0 -> S01RR an all-to-all over axis 0 and a collective-permute
    that puts axis 0 before axis 1, each of the sliced shard's bytes)."""
    moved, _ = moved_and_dropped(src, dst, mesh)
    added = added_axes(src, dst, mesh)
    if not moved or not added:
        return None
    dims = [list(axes) for axes in src.dims]
    for axis in added:
        dims[dst.dim_of_axis(axis)].append(axis)
    return ShardingSpec(tuple(tuple(axes) for axes in dims))


def added_axes(src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh) -> list[int]:
    """Axes of `dst` (with more than one device) that split nothing in `src`."""
    return [a for a in dst.axes() if mesh.shape[a] > 1 and src.dim_of_axis(a) is None]


def moved_and_dropped(src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh) -> tuple[list[int], list[int]]:
    """Axes of `src` (with more than one device) that `dst` puts on another dim, and that it drops."""
    moved, dropped = [], []
    for axis in src.axes():
        if mesh.shape[axis] == 1:
            continue
        target = dst.dim_of_axis(axis)
        if target is None:
            dropped.append(axis)
        elif target != src.dim_of_axis(axis):
            moved.append(axis)
    return moved, dropped


def collectives_per_step(src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh) -> tuple[int, ...]:
    """How many collectives the exact resharding rule (`sharding.resharding`) prices for each
    step of `conversion_path`, in order: a collective-permute where `permuted_axes`, an
    all-to-all where axes move, one all-gather per dim that drops axes."""
    counts, at = [], src
    for step in conversion_path(src, dst, mesh):
        moved, dropped = moved_and_dropped(at, step, mesh)
        counts.append(bool(permuted_axes(at, step, mesh)) + bool(moved) + len({at.dim_of_axis(a) for a in dropped}))
        at = step
    return tuple(counts)


def permuted_axes(src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh) -> tuple[int, ...]:
    """Mesh axes whose devices must swap shards because a dim keeps some of its axes in another
    order. A dim split over axes (a, b) is cut a-major: device (i, j) holds chunk i * |b| + j.
    Slicing further (S0 -> S01) or gathering the minor axes (S01 -> S0) stays local, but S1 ->
    S01 or S01 -> S1 leaves a device's chunk on another device: XLA swaps shards among the
    devices of all the dim's axes with a collective-permute."""
    permuted: set[int] = set()
    for s, t in zip(src.dims, dst.dims, strict=True):
        s = tuple(a for a in s if mesh.shape[a] > 1)
        t = tuple(a for a in t if mesh.shape[a] > 1)
        kept = tuple(a for a in s if a in t)
        if kept and not (s[:len(kept)] == kept == t[:len(kept)]):
            permuted.update(s + t)
    return tuple(sorted(permuted))


def reshape_spec(spec: ShardingSpec, in_shape: Sequence[int], out_shape: Sequence[int],
                 mesh: LogicalMesh) -> ShardingSpec:
    """Best spec of reshape(x) for x laid out as `spec`: axes that cannot move are dropped.

    A split dim keeps its axes when it maps to the major dim of its reshape group and that
    dim stays divisible; splits of minor dims of a merged group are dropped (the caller then
    prices the gather needed to drop them).
    """
    out: list[tuple[int, ...]] = [()] * len(out_shape)
    for in_dims, out_dims in reshape_groups(in_shape, out_shape):
        if not in_dims or not out_dims:
            continue
        major_in = next((d for d in in_dims if in_shape[d] > 1), in_dims[0])
        major_out = next((d for d in out_dims if out_shape[d] > 1), out_dims[0])
        if any(spec.dims[d] for d in in_dims if d != major_in):
            continue  # a split minor dim of a merged group cannot stay split
        axes = spec.dims[major_in]
        if axes and out_shape[major_out] % mesh.axis_size(axes) == 0:
            out[major_out] = axes
    return ShardingSpec(tuple(out))


def _as_axes(value: Sequence[int] | int | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)
