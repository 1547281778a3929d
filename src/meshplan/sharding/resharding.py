"""Cost of turning a producer's sharding into the one a consumer requires."""

from __future__ import annotations

import math
from collections.abc import Sequence

from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.collectives import Collective, CollectiveKind
from meshplan.cost.model import CostModel, ReshardingRule
from meshplan.sharding.spec import ShardingSpec, conversion_path, moved_and_dropped, permuted_axes


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
    """Each step of `conversion_path` priced alone (the runtime constrains every step)."""
    out, at = [], src
    for step in conversion_path(src, dst, mesh):
        out.extend(_step_collectives(shape, itemsize, at, step, mesh, model))
        at = step
    return tuple(out)


def _step_collectives(shape, itemsize, src, dst, mesh, model) -> list[Collective]:
    """One step: a permute, an all-to-all, all-gathers, or nothing (a local slice)."""
    moved, dropped = moved_and_dropped(src, dst, mesh)
    out = []
    permuted = permuted_axes(src, dst, mesh)
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
    return out
