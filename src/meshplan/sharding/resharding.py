"""Cost of turning a producer's sharding into the one a consumer requires.

A conversion's collectives (which kinds, over which mesh axes, moving which layout's shard)
depend on the two specs and the mesh's shape alone; only their bytes depend on the tensor. The
planner prices the same spec pairs on tensors of many shapes, pieces and memory prices (a 3-D
view's strategy lists hold tens of thousands of distinct pairs), so each pair's steps are derived
once per mesh shape (`_conversion`) and priced per tensor (`resharding_cost_matrix` prices a whole
producer x consumer matrix, each collective once).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.collectives import Collective, CollectiveKind
from meshplan.cost.model import CostModel, ReshardingRule
from meshplan.sharding.spec import ShardingSpec, gathered_first, moved_and_dropped

Dims = tuple[tuple[int, ...], ...]  # a spec's dims
# One collective of a conversion: its kind, the mesh axes it spans (each of more than one device)
# and the layouts whose local shard it moves (the smallest of them).
Step = tuple[CollectiveKind, tuple[int, ...], tuple[Dims, ...]]


def resharding_collectives(shape: Sequence[int], itemsize: int, src: ShardingSpec, dst: ShardingSpec,
                           mesh: LogicalMesh, model: CostModel) -> tuple[Collective, ...]:
    """The collectives that turn `src` into `dst`; an empty tuple when slicing suffices."""
    if src == dst or src.is_replicated:
        return ()
    if model.resharding is ReshardingRule.ALPA:
        return _alpa_collectives(shape, itemsize, src, dst, mesh, model)
    return tuple(model.collectives.collective(kind, mesh, axes, min(_local_bytes(shape, itemsize, d, mesh)
                                                                    for d in layouts))
                 for kind, axes, layouts in _conversion(src.dims, dst.dims, mesh.shape))


def resharding_cost(shape: Sequence[int], itemsize: int, src: ShardingSpec, dst: ShardingSpec,
                    mesh: LogicalMesh, model: CostModel) -> float:
    return sum(c.cost for c in resharding_collectives(shape, itemsize, src, dst, mesh, model))


def resharding_cost_matrix(shape: Sequence[int], itemsize: int, sources: Sequence[ShardingSpec],
                           targets: Sequence[ShardingSpec], mesh: LogicalMesh, model: CostModel) -> np.ndarray:
    """[i, j]: `resharding_cost` of `sources[i]` -> `targets[j]` (the same floats), each layout's
    shard size and each collective priced once for the whole matrix."""
    if model.resharding is ReshardingRule.ALPA:
        return np.array([[resharding_cost(shape, itemsize, s, t, mesh, model) for t in targets] for s in sources],
                        dtype=float).reshape(len(sources), len(targets))
    shard_bytes: dict[Dims, int] = {}
    prices: dict[tuple[CollectiveKind, tuple[int, ...], int], float] = {}

    def moved_bytes(layouts: tuple[Dims, ...]) -> int:
        sizes = []
        for dims in layouts:
            size = shard_bytes.get(dims)
            if size is None:
                size = shard_bytes[dims] = _local_bytes(shape, itemsize, dims, mesh)
            sizes.append(size)
        return min(sizes)

    def cost(src: Dims, dst: Dims) -> float:
        total = 0  # the same sum, in the same order, as `resharding_cost`
        for kind, axes, layouts in _conversion(src, dst, mesh.shape):
            key = (kind, axes, moved_bytes(layouts))
            price = prices.get(key)
            if price is None:
                price = prices[key] = model.collectives.cost(kind, mesh, axes, key[2])
            total += price
        return total

    # No conversion (equal layouts, a replicated source) has no steps: every pair goes one way.
    rows = [[cost(s.dims, t.dims) for t in targets] for s in sources]
    return np.array(rows, dtype=float).reshape(len(sources), len(targets))


def _local_bytes(shape: Sequence[int], itemsize: int, dims: Dims, mesh: LogicalMesh) -> int:
    return math.prod(math.ceil(s / mesh.axis_size(a)) if a else s for s, a in zip(shape, dims, strict=True)) * itemsize


def _alpa_collectives(shape, itemsize, src, dst, mesh, model) -> tuple[Collective, ...]:
    full = math.prod(shape) * itemsize
    out = []
    for axis in src.axes():
        if mesh.shape[axis] > 1 and dst.dim_of_axis(axis) != src.dim_of_axis(axis):
            out.append(model.collectives.collective(CollectiveKind.ALL_GATHER, mesh, (axis,), full))
    return tuple(out)


@functools.lru_cache(maxsize=1 << 18)
def _conversion(src: Dims, dst: Dims, mesh_shape: tuple[int, ...]) -> tuple[Step, ...]:
    """The steps that turn layout `src` into `dst` on a mesh of `mesh_shape` (XLA's partitioner's
    way): through `gathered_first`'s layout when one collective cannot do it; else a
    collective-permute of permuted axes, an all-to-all of the moved axes, one all-gather per dim
    that drops axes."""
    grid = _grid(mesh_shape)
    source, target = ShardingSpec(src), ShardingSpec(dst)
    via = gathered_first(source, target, grid)
    if via is not None:
        return _conversion(src, via.dims, mesh_shape) + _conversion(via.dims, dst, mesh_shape)
    moved, dropped = moved_and_dropped(source, target, grid)
    steps: list[Step] = []
    permuted = _permuted_axes(source, target, grid)
    if permuted:  # at the finer of the two splits: slice first, or swap before gathering
        steps.append((CollectiveKind.COLLECTIVE_PERMUTE, permuted, (src, dst)))
    if moved:
        steps.append((CollectiveKind.ALL_TO_ALL, tuple(moved), (src,)))
    gathered = source
    for dim in sorted({source.dim_of_axis(a) for a in dropped}, reverse=True):
        # one all-gather per dim, the last dim first, as XLA's partitioner gathers
        axes = tuple(a for a in src[dim] if a in dropped)
        gathered = gathered.without_axes(axes)
        steps.append((CollectiveKind.ALL_GATHER, axes, (gathered.dims,)))
    return tuple(steps)


@functools.lru_cache(maxsize=64)
def _grid(shape: tuple[int, ...]) -> LogicalMesh:
    """A mesh of `shape` with no costs: what the conversion rules read (its axis sizes)."""
    return LogicalMesh(shape, (0.0,) * len(shape), (0.0,) * len(shape))


def _permuted_axes(src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh) -> tuple[int, ...]:
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
