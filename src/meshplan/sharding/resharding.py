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
from meshplan.sharding.spec import ShardingSpec, conversion_path, moved_and_dropped, permuted_axes

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
    """The collectives that turn layout `src` into `dst` on a mesh of `mesh_shape`: each step of
    `conversion_path` alone (the runtime constrains every step, so XLA makes these)."""
    grid = _grid(mesh_shape)
    steps: list[Step] = []
    at = src
    for via in conversion_path(ShardingSpec(src), ShardingSpec(dst), grid):
        steps.extend(_step(at, via.dims, grid))
        at = via.dims
    return tuple(steps)


def _step(src: Dims, dst: Dims, grid: LogicalMesh) -> list[Step]:
    """One step: a collective-permute of permuted axes, an all-to-all of the moved axes, one
    all-gather per dim that drops axes, or nothing (a local slice)."""
    source, target = ShardingSpec(src), ShardingSpec(dst)
    moved, dropped = moved_and_dropped(source, target, grid)
    steps: list[Step] = []
    permuted = permuted_axes(source, target, grid)
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
    return steps


@functools.lru_cache(maxsize=64)
def _grid(shape: tuple[int, ...]) -> LogicalMesh:
    """A mesh of `shape` with no costs: what the conversion rules read (its axis sizes)."""
    return LogicalMesh(shape, (0.0,) * len(shape), (0.0,) * len(shape))
