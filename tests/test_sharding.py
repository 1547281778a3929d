"""ShardingSpec transforms, collective costs and resharding."""

from __future__ import annotations

import pytest

from meshplan import LogicalMesh, ShardingSpec
from meshplan.cost import CollectiveCosts, CollectiveKind, CostModel
from meshplan.ir.dimflow import reshape_groups
from meshplan.sharding import reshape_spec, resharding_collectives

MESH = LogicalMesh((2, 4), (1.0, 2.0), (0.5, 0.25))


def test_spec_transforms():
    s = ShardingSpec.of(0, None, 1)
    assert s.transpose((2, 0, 1)) == ShardingSpec.of(1, 0, None)
    assert ShardingSpec.of(0, 1).broadcast((0, 2), 3) == ShardingSpec.of(0, None, 1)
    assert s.reduce((0,)) == ShardingSpec.of(None, 1) and s.reduced_axes((0,)) == (0,)
    assert str(ShardingSpec.of((0, 1), None)) == "S01R"
    assert ShardingSpec.of(0, None).shard_shape((5, 3), MESH) == (3, 3)  # padded up


def test_reshape_groups_and_specs():
    assert reshape_groups((2, 3, 4), (6, 4)) == [((0, 1), (0,)), ((2,), (1,))]
    assert reshape_groups((8, 1), (8,)) == [((0,), (0,)), ((1,), ())]
    # Splitting heads: (b, s, h) -> (b, s, heads, d) keeps an h split on heads.
    assert reshape_spec(ShardingSpec.of(None, None, 1), (2, 8, 16), (2, 8, 4, 4), MESH) == \
        ShardingSpec.of(None, None, 1, None)
    # A split minor dim of a merged group cannot survive.
    assert reshape_spec(ShardingSpec.of(None, 0), (4, 8), (32,), MESH) == ShardingSpec.of(None)
    assert reshape_spec(ShardingSpec.of(0, None), (4, 8), (32,), MESH) == ShardingSpec.of(0)


def test_collective_formulas():
    c = CollectiveCosts()
    assert c.cost(CollectiveKind.ALL_REDUCE, MESH, (1,), 1000) == pytest.approx(2.0 + 0.25 * 2 * 3 / 4 * 1000)
    assert c.cost(CollectiveKind.ALL_GATHER, MESH, (0,), 1000) == pytest.approx(1.0 + 0.5 * 0.5 * 1000)
    assert c.cost(CollectiveKind.REDUCE_SCATTER, MESH, (1,), 1000) == pytest.approx(2.0 + 0.25 * 0.75 * 1000)
    assert c.cost(CollectiveKind.ALL_TO_ALL, MESH, (1,), 1000) == pytest.approx(2.0 + 0.25 * 0.75 * 1000)
    # Over both axes: best order of the hierarchical all-reduce.
    axis1_first = (2.0 + 0.25 * 1.5 * 1000) + (1.0 + 0.5 * 1.0 * 1000 / 4)
    axis0_first = (1.0 + 0.5 * 1.0 * 1000) + (2.0 + 0.25 * 1.5 * 1000 / 2)
    assert c.cost(CollectiveKind.ALL_REDUCE, MESH, (0, 1), 1000) == pytest.approx(min(axis1_first, axis0_first))
    assert c.cost(CollectiveKind.ALL_REDUCE, MESH, (), 1000) == 0.0
    unit = CollectiveCosts(truncate=True, tie_constants=True)
    assert unit.cost(CollectiveKind.ALL_REDUCE, MESH, (1,), 1001) == 377 + 0.01
    forced = CollectiveCosts(forced=((CollectiveKind.ALL_GATHER, 1e8),))
    assert forced.cost(CollectiveKind.ALL_GATHER, MESH, (0,), 1) == 1e8


def test_exact_resharding():
    model = CostModel()
    shape, item = (8, 8), 4
    # Replicated -> split is free slicing.
    assert resharding_collectives(shape, item, ShardingSpec.of(None, None), ShardingSpec.of(0, 1), MESH, model) == ()
    # Dropping axis 1: all-gather of the shard left after it (8x8x4 / 2 bytes).
    (ag,) = resharding_collectives(shape, item, ShardingSpec.of(0, 1), ShardingSpec.of(0, None), MESH, model)
    assert ag.kind is CollectiveKind.ALL_GATHER and ag.axes == (1,) and ag.nbytes == 128
    # Moving axis 0 from dim 0 to dim 1: all-to-all of the local shard.
    (a2a,) = resharding_collectives(shape, item, ShardingSpec.of(0, None), ShardingSpec.of(None, 0), MESH, model)
    assert a2a.kind is CollectiveKind.ALL_TO_ALL and a2a.nbytes == 128


def test_alpa_resharding_gathers_full_tensor_per_axis():
    model = CostModel.alpa_unit()
    out = resharding_collectives((8, 8), 4, ShardingSpec.of(0, 1), ShardingSpec.of(None, None), MESH, model)
    assert [(c.axes, c.nbytes) for c in out] == [((0,), 256), ((1,), 256)]
