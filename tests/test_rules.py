"""Strategy rules: dot's Table-3 strategies, followers, reduce all-reduce, gathers, replicated fallback."""

from __future__ import annotations

import pytest

from meshplan import GraphBuilder, IntraOptions, LogicalMesh, ShardingSpec, solve_intra
from meshplan.cost import CollectiveKind, CostModel
from meshplan.intra import build_intra_problem
from meshplan.sharding import UnsupportedOpWarning, enumerate_strategies
from meshplan.sharding.context import RuleConfig
from meshplan.sharding.strategy import StrategySpace

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


def pick_graph():
    """Cross-entropy's label pick from log-probabilities, its gradient, and an embedding and its gradient."""
    b = GraphBuilder()
    logp = b.parameter((8, 16), name="logp")
    labels = b.parameter((8,), "i32", name="labels")
    table = b.parameter((32, 16), name="table")
    ids = b.parameter((8, 4), "i32", name="ids")
    rows = b.parameter((8, 4, 16), name="rows")
    pick = b.gather(b.exp(logp), labels, 1, 1, name="pick")
    dlogp = b.scatter_add((8, 16), labels, b.full((8,), -1.0), 1, 1, name="dlogp")  # updates: constant
    embed = b.gather(table, ids, name="embed")
    dtable = b.scatter_add((32, 16), ids, rows, name="dtable")
    b.outputs(b.reduce(pick, (0,)), dlogp, embed, dtable)
    return b.build()


def by_operand(graph, name, position):
    node = next(n for n in graph.nodes if n.name == name)
    ns = enumerate_strategies(graph, MESH, CostModel(flops_per_second=1.0))[node.id]
    return ns, {s.operands[position]: s for s in ns.strategies}


def test_batched_gather_follows_its_operand_and_all_reduces_a_split_gathered_dim():
    S = ShardingSpec.of
    ns, strategies = by_operand(pick_graph(), "pick", 0)
    assert ns.follows == 0
    rows = strategies[S(0, None)]
    assert (rows.output, rows.operands[1], rows.collectives) == (S(0), S(0), ())
    vocab = strategies[S(0, 1)]  # vocabulary split: each device picks what it holds, partial sums
    (ar,) = vocab.collectives
    assert (vocab.output, vocab.operands[1]) == (S(0), S(0))
    assert ar.kind is CollectiveKind.ALL_REDUCE and ar.axes == (1,) and ar.nbytes == 4 * 4


def test_scatter_add_of_constant_updates_follows_the_indices():
    S = ShardingSpec.of
    ns, strategies = by_operand(pick_graph(), "dlogp", 0)
    assert ns.follows == 0
    split = strategies[S((0, 1))]
    assert (split.output, split.operands[1], split.collectives) == (S((0, 1), None), S((0, 1)), ())


def test_embedding_gather_reads_the_table_whole_and_its_gradient_sums_split_rows():
    S = ShardingSpec.of
    ns, strategies = by_operand(pick_graph(), "embed", 1)
    assert ns.follows == 1
    assert {(s.output, s.operands[0]) for s in ns.strategies if s.operands[1] == S(0, 1)} == {
        (S(0, 1, None), S(None, None))}
    ns, strategies = by_operand(pick_graph(), "dtable", 1)
    assert ns.follows == 1
    batch = strategies[S(0, None, 1)]  # rows split by batch: partial tables, summed over axis 0
    (ar,) = batch.collectives
    assert (batch.output, batch.operands[0]) == (S(None, 1), S(0, None))
    assert ar.axes == (0,) and ar.nbytes == 32 * 4 * 4



def test_reduce_scatter_variants_of_split_contractions():
    """A weight gradient x^T @ dy with the batch split: besides all-reducing the partial sums,
    reduce_scatter offers scattering them onto either whole output dim (ZeRO-2's gradients)."""
    b = GraphBuilder()
    x = b.parameter((16, 32), name="x")
    dy = b.parameter((16, 64), name="dy")
    b.outputs(b.dot(x, dy, (0,), (0,), name="dw"))
    g, mesh, model = b.build(), LogicalMesh((4,), (1.0,), (0.1,)), CostModel(flops_per_second=1.0)
    S = ShardingSpec.of
    plain = {s.output: s for s in enumerate_strategies(g, mesh, model)[2].strategies if s.operands[0] == S(0, None)}
    assert list(plain) == [S(None, None)]  # the partial sums can only be all-reduced
    rich = enumerate_strategies(g, mesh, model, RuleConfig(reduce_scatter=True))[2].strategies
    by_output = {s.output: s for s in rich if s.operands[0] == S(0, None)}
    assert set(by_output) == {S(None, None), S(0, None), S(None, 0)}
    partial = 32 * 64 * 4
    for spec in (S(0, None), S(None, 0)):
        (rs,) = by_output[spec].collectives
        assert rs.kind is CollectiveKind.REDUCE_SCATTER and rs.axes == (0,) and rs.nbytes == partial
        assert by_output[spec].communication == pytest.approx(1.0 + 0.1 * 3 / 4 * partial)
        assert by_output[spec].memory == partial / 4
        assert by_output[spec].compute == by_output[S(None, None)].compute == 2 * 4 * 32 * 64
    assert by_output[S(None, None)].communication == pytest.approx(1.0 + 0.1 * 2 * 3 / 4 * partial)
    alpa = enumerate_strategies(g, mesh, model, RuleConfig(space=StrategySpace.ALPA, reduce_scatter=True))[2]
    assert all(c.kind is not CollectiveKind.REDUCE_SCATTER for s in alpa.strategies for c in s.collectives)
