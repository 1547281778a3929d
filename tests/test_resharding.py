"""Resharding on 2-D and 3-D meshes: the conversions derived once per (spec pair, mesh shape) and
the matrix pricer give the same collectives and the same floats as the per-pair derivation the
planner used before (kept here as the oracle: each step of `conversion_path` priced alone), on
every pair of layouts of a tensor."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from meshplan import LogicalMesh, ShardingSpec
from meshplan.cluster import Cluster, get_device
from meshplan.cost import CollectiveCosts, CollectiveKind, CostModel
from meshplan.sharding.resharding import resharding_collectives, resharding_cost, resharding_cost_matrix
from meshplan.sharding.spec import conversion_path, moved_and_dropped, permuted_axes


def _oracle_collectives(shape, itemsize, src, dst, mesh, model):
    """The exact rule as `resharding_collectives` derived it pair by pair, every time."""
    if src == dst or src.is_replicated:
        return ()
    out, at = [], src
    for step in conversion_path(src, dst, mesh):
        out.extend(_oracle_step(shape, itemsize, at, step, mesh, model))
        at = step
    return tuple(out)


def _oracle_step(shape, itemsize, src, dst, mesh, model):
    moved, dropped = moved_and_dropped(src, dst, mesh)

    def local(spec):
        return math.prod(spec.shard_shape(shape, mesh)) * itemsize

    out = []
    permuted = permuted_axes(src, dst, mesh)
    if permuted:
        out.append(model.collectives.collective(CollectiveKind.COLLECTIVE_PERMUTE, mesh, permuted,
                                                min(local(src), local(dst))))
    if moved:
        out.append(model.collectives.collective(CollectiveKind.ALL_TO_ALL, mesh, moved, local(src)))
    gathered = src
    for dim in sorted({src.dim_of_axis(a) for a in dropped}, reverse=True):
        axes = [a for a in src.dims[dim] if a in dropped]
        gathered = gathered.without_axes(axes)
        out.append(model.collectives.collective(CollectiveKind.ALL_GATHER, mesh, axes, local(gathered)))
    return tuple(out)


def _every_layout(rank: int, axes: int) -> list[ShardingSpec]:
    """Every spec of a rank-`rank` tensor on `axes` mesh axes: each axis on one dim or none, in
    every order within a dim."""
    out = []
    for owner in itertools.product(range(rank + 1), repeat=axes):
        groups = [[a for a in range(axes) if owner[a] == d] for d in range(rank)]
        out.extend(ShardingSpec(dims) for dims in itertools.product(*map(itertools.permutations, groups)))
    return out


_A100 = Cluster(4, 8, get_device("a100-80gb"))
_NODE_AWARE = CostModel(CollectiveCosts(link_efficiency=0.8))
_CASES = {
    # name: (mesh, cost model, tensor shape); odd sizes so that some splits pad up. Every pair of
    # layouts of the tensor is compared: 106 x 106 for a rank-3 tensor on three axes.
    "2x4 alpha-beta": (LogicalMesh((2, 4), (1.0, 2.0), (0.5, 0.25)), CostModel(), (8, 12, 6)),
    "2x8 of A100 nodes": (next(v for v in _A100.logical_views((2, 8)) if v.shape == (2, 8)), _NODE_AWARE,
                          (4, 24, 10)),
    "2x2x2 alpha-beta": (LogicalMesh((2, 2, 2), (1.0, 0.1, 0.01), (1.0, 0.1, 0.01)), CostModel(), (6, 5)),
    "2x2x4 of A100 nodes": (next(v for v in _A100.logical_views((2, 8), max_axes=3) if v.shape == (2, 2, 4)),
                            _NODE_AWARE, (4, 12, 16)),
    "1x2x4 unit": (LogicalMesh((1, 2, 4), (1.0, 1.0, 1.0), (1.0, 1.0, 1.0)),
                   CostModel(CollectiveCosts(truncate=True, tie_constants=True)), (8, 8)),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_conversions_price_as_the_pair_by_pair_rule(case):
    mesh, model, shape = _CASES[case]
    layouts = _every_layout(len(shape), mesh.ndim)
    want = [[_oracle_collectives(shape, 2, s, t, mesh, model) for t in layouts] for s in layouts]
    assert [[resharding_collectives(shape, 2, s, t, mesh, model) for t in layouts] for s in layouts] == want
    matrix = resharding_cost_matrix(shape, 2, layouts, layouts, mesh, model)
    np.testing.assert_array_equal(matrix, [[sum(c.cost for c in cs) for cs in row] for row in want])
    kinds = {c.kind for row in want for cs in row for c in cs}
    assert kinds == set(CollectiveKind) - {CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER}
    assert any(len(c.axes) == mesh.ndim - (1 in mesh.shape) for row in want for cs in row for c in cs)


def test_alpa_rule_matrix_prices_pair_by_pair():
    mesh, _, shape = _CASES["2x2x2 alpha-beta"]
    model = CostModel.alpa_unit()
    layouts = _every_layout(2, 3)
    matrix = resharding_cost_matrix(shape, 4, layouts, layouts[:7], mesh, model)
    assert matrix.shape == (len(layouts), 7)
    assert matrix.tolist() == [[resharding_cost(shape, 4, s, t, mesh, model) for t in layouts[:7]] for s in layouts]
