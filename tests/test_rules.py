"""Strategy rules: dot's Table-3 strategies, followers, reduce all-reduce, replicated fallback."""

from __future__ import annotations

import pytest

from meshplan import GraphBuilder, IntraOptions, LogicalMesh, ShardingSpec, solve_intra
from meshplan.cost import CollectiveKind, CostModel
from meshplan.intra import build_intra_problem
from meshplan.sharding import UnsupportedOpWarning, enumerate_strategies

MESH = LogicalMesh((2, 4), (1.0, 1.0), (1.0, 0.1))


def matmul_graph():
    b = GraphBuilder()
    x = b.parameter((16, 32), name="x")
    w = b.parameter((32, 64), name="w")
    h = b.matmul(x, w, name="h")
    b.outputs(b.reduce(b.exp(h), (0,), name="r"))
    return b.build()


def test_dot_strategies_include_data_column_row_and_2d():
    g = matmul_graph()
    ns = enumerate_strategies(g, MESH, CostModel(flops_per_second=1.0))[2]
    specs = {(s.output, s.operands): s for s in ns.strategies}
    S = ShardingSpec.of
    data = specs[(S(0, None), (S(0, None), S(None, None)))]
    column = specs[(S(None, 1), (S(None, None), S(None, 1)))]
    row = specs[(S(None, None), (S(None, 1), S(1, None)))]
    mixed = specs[(S(0, 1), (S(0, None), S(None, 1)))]
    assert data.communication == column.communication == mixed.communication == 0.0
    (ar,) = row.collectives
    assert ar.kind is CollectiveKind.ALL_REDUCE and ar.axes == (1,) and ar.nbytes == 16 * 64 * 4
    assert row.communication == pytest.approx(1.0 + 0.1 * 2 * 3 / 4 * 16 * 64 * 4)
    assert mixed.compute == pytest.approx(2 * 16 * 32 * 64 / 8)
    assert specs[(S(None, None), (S(None, None), S(None, None)))].compute == 2 * 16 * 32 * 64


def test_compute_off_requires_every_axis():
    ns = enumerate_strategies(matmul_graph(), MESH, CostModel())[2]
    assert all({0, 1} <= set(s.output.axes() + s.operands[0].axes() + s.operands[1].axes())
               for s in ns.strategies)


def test_followers_merge_and_reduce_all_reduces():
    g = matmul_graph()
    sg, _, _, _ = build_intra_problem(g, MESH, IntraOptions())
    assert sg.leader[3] == 2 and sg.leader[4] == 2  # exp and reduce follow the dot
    plan = solve_intra(g, MESH, IntraOptions())
    r = plan.strategy("r")
    if plan.strategy("h").output.dims[0]:
        assert r.collectives and r.collectives[0].kind is CollectiveKind.ALL_REDUCE


def test_op_without_rule_is_replicated_with_warning():
    b = GraphBuilder()
    x = b.parameter((8, 8), name="x")
    y = b.opaque([x], (8, 8), "f32", op="fft", name="y")
    b.outputs(b.exp(y))
    with pytest.warns(UnsupportedOpWarning, match="fft"):
        plan = solve_intra(b.build(), MESH, IntraOptions())
    assert plan.strategy("y").output.is_replicated
    assert plan.unsupported_ops == ("fft",)
