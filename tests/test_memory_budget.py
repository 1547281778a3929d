"""The memory constraint binds when it should; an impossible budget says what would fit."""

from __future__ import annotations

import pytest

from meshplan import GraphBuilder, InfeasiblePlanError, IntraOptions, LogicalMesh, solve_intra


def wide_mlp():
    """Batch 8, big weights: data parallel is free but keeps both weights whole on every device."""
    b = GraphBuilder("wide")
    x = b.parameter((8, 1024), name="x")
    w1 = b.parameter((1024, 1024), name="w1")
    w2 = b.parameter((1024, 1024), name="w2")
    h = b.matmul(b.matmul(x, w1, name="h1"), w2, name="h2")
    b.outputs(h)
    return b.build()


MESH = LogicalMesh((4,), (1.0,), (1.0,))
WEIGHT = 1024 * 1024 * 4
OPTIONS = IntraOptions()


def test_unlimited_memory_picks_replicated_weights():
    plan = solve_intra(wide_mlp(), MESH, OPTIONS.replace(cost=OPTIONS.cost))
    assert plan.objective == 0.0  # compute off: batch split, weights whole, no communication
    assert plan.peak_memory >= 2 * WEIGHT


def test_tight_budget_shards_weights():
    free = solve_intra(wide_mlp(), MESH, OPTIONS)
    budget = 1.2 * WEIGHT  # less than two whole weights
    plan = solve_intra(wide_mlp(), MESH, OPTIONS.replace(memory_budget=budget))
    assert plan.peak_memory <= budget
    assert plan.objective > free.objective
    assert not (plan.strategy("w1").output.is_replicated and plan.strategy("w2").output.is_replicated)


def test_impossible_budget_reports_smallest_that_fits():
    with pytest.raises(InfeasiblePlanError) as info:
        solve_intra(wide_mlp(), MESH, OPTIONS.replace(memory_budget=1000.0))
    need = info.value.min_budget_bytes
    # Everything sharded 4 ways: two weights, x, h1 and h2 quarters at the second dot.
    assert need == pytest.approx((2 * WEIGHT + 3 * 8 * 1024 * 4) / 4)
    assert "needs at least" in str(info.value) and "budget" in str(info.value)
    plan = solve_intra(wide_mlp(), MESH, OPTIONS.replace(memory_budget=need))
    assert plan.peak_memory <= need * (1 + 1e-9)
    with pytest.raises(InfeasiblePlanError):
        solve_intra(wide_mlp(), MESH, OPTIONS.replace(memory_budget=need * 0.99))


def test_mesh_memory_is_the_default_budget():
    mesh = LogicalMesh((4,), (1.0,), (1.0,), memory_per_device=1000.0)
    with pytest.raises(InfeasiblePlanError):
        solve_intra(wide_mlp(), mesh)


def test_axis_dividing_nothing_warns_and_pads():
    from meshplan.intra.solve import PaddedSplitWarning

    with pytest.warns(PaddedSplitWarning, match="divides no tensor dim"):
        plan = solve_intra(wide_mlp(), LogicalMesh((3,), (1.0,), (1.0,)), OPTIONS)
    assert plan.solve.status.value == "optimal"
