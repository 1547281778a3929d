"""Cost of turning a producer's sharding into the one a consumer requires."""

from __future__ import annotations

import math
from collections.abc import Sequence

from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.collectives import Collective, CollectiveKind
from meshplan.cost.model import CostModel, ReshardingRule
from meshplan.sharding.spec import ShardingSpec, gathered_first, moved_and_dropped


def resharding_collectives(shape: Sequence[int], itemsize: int, src: ShardingSpec, dst: ShardingSpec,
                           mesh: LogicalMesh, model: CostModel) -> tuple[Collective, ...]:
    """The collectives that turn `src` into `dst`; an empty tuple when slicing suffices."""
    if src == dst or src.is_replicated:
        return ()
    if model.resharding is ReshardingRule.ALPA:
        return _alpa_collectives(shape, itemsize, src, dst, mesh, model)
    return _exact_collectives(shape, itemsize, src, dst, mesh, model)


def resharding_cost(shape: Sequence[int], itemsize: int, src: ShardingSpec, dst: ShardingSpec,
                    mesh: LogicalMesh, model: CostModel) -> float:
    return sum(c.cost for c in resharding_collectives(shape, itemsize, src, dst, mesh, model))


def _local_bytes(shape: Sequence[int], itemsize: int, spec: ShardingSpec, mesh: LogicalMesh) -> float:
    return math.prod(spec.shard_shape(shape, mesh)) * itemsize


def _alpa_collectives(shape, itemsize, src, dst, mesh, model) -> tuple[Collective, ...]:
    full = math.prod(shape) * itemsize
    out = []
    for axis in src.axes():
        if mesh.shape[axis] > 1 and dst.dim_of_axis(axis) != src.dim_of_axis(axis):
            out.append(model.collectives.collective(CollectiveKind.ALL_GATHER, mesh, (axis,), full))
    return tuple(out)


def _exact_collectives(shape, itemsize, src, dst, mesh, model) -> tuple[Collective, ...]:
    via = gathered_first(src, dst, mesh)
    if via is not None:
        return (*_exact_collectives(shape, itemsize, src, via, mesh, model),
                *_exact_collectives(shape, itemsize, via, dst, mesh, model))
    moved, dropped = moved_and_dropped(src, dst, mesh)
    out = []
    permuted = _permuted_axes(src, dst, mesh)
    if permuted:  # at the finer of the two splits: slice first, or swap before gathering
        nbytes = min(_local_bytes(shape, itemsize, src, mesh), _local_bytes(shape, itemsize, dst, mesh))
        out.append(model.collectives.collective(CollectiveKind.COLLECTIVE_PERMUTE, mesh, permuted, nbytes))
    if moved:
        out.append(model.collectives.collective(
            CollectiveKind.ALL_TO_ALL, mesh, moved, _local_bytes(shape, itemsize, src, mesh)))
    gathered = src
    for dim in sorted({src.dim_of_axis(a) for a in dropped}, reverse=True):
        # one all-gather per dim, the last dim first, as XLA's partitioner gathers
        axes = [a for a in src.dims[dim] if a in dropped]
        gathered = gathered.without_axes(axes)
        out.append(model.collectives.collective(
            CollectiveKind.ALL_GATHER, mesh, axes, _local_bytes(shape, itemsize, gathered, mesh)))
    return tuple(out)


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
