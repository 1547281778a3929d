"""Sharding rules of convolutions and poolings: the strategies offered (batch, output features,
input features with their partial sums all-reduced or reduce-scattered, pointwise spatial dims;
never a dim a window slides along), and the ILP equal to brute force on small conv graphs,
forward and with their gradients (append_backward)."""

from __future__ import annotations

import math

import pytest

from meshplan import GraphBuilder, IntraOptions, LogicalMesh, solve_intra
from meshplan.cost import CostModel
from meshplan.cost.collectives import CollectiveKind
from meshplan.intra import build_intra_problem
from meshplan.ir.autodiff import append_backward
from meshplan.sharding import enumerate_strategies
from meshplan.sharding.spec import ShardingSpec
from test_ilp_bruteforce import brute_force


def _strategies(graph, mesh, node, **config):
    options = IntraOptions(cost=CostModel(flops_per_second=None), **config)
    return enumerate_strategies(graph, mesh, options.cost, options.rules)[node].strategies


def test_conv_splits_batch_and_features_and_all_reduces_input_feature_splits():
    b = GraphBuilder("conv")
    x, w = b.parameter((8, 6, 6, 4), name="x"), b.parameter((3, 3, 4, 8), name="w")
    y = b.conv(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    b.outputs(y)
    graph = b.build()
    mesh = LogicalMesh((4,), (1.0,), (1.0,))
    found = {(str(s.output), str(s.operands[0]), str(s.operands[1])): s for s in _strategies(graph, mesh, y)}
    batch = found[("S0RRR", "S0RRR", "RRRR")]
    assert not batch.collectives
    assert not found[("RRRS0", "RRRR", "RRRS0")].collectives  # output features
    reduced = found[("RRRR", "RRRS0", "RRS0R")]  # input features: partial sums
    (collective,) = reduced.collectives
    assert collective.kind is CollectiveKind.ALL_REDUCE and collective.nbytes == graph[y].nbytes
    # The window slides along H and W: no strategy splits them.
    for s in found.values():
        assert not s.output.dims[1] and not s.output.dims[2]
    scattered = _strategies(graph, mesh, y, reduce_scatter=True)
    assert any(s.output == ShardingSpec.of(0, None, None, None) and s.operands[0].dims[3]
               and s.collectives[0].kind is CollectiveKind.REDUCE_SCATTER for s in scattered)


def test_pointwise_conv_splits_spatial_dims_and_pooling_keeps_windows_whole():
    b = GraphBuilder("pointwise")
    x, w = b.parameter((2, 8, 8, 4), name="x"), b.parameter((1, 1, 4, 4), name="w")
    y = b.conv(x, w, dimension_numbers=("NHWC", "HWIO", "NHWC"))
    pooled = b.max_pool(y, (2, 2), (2, 2))
    b.outputs(pooled)
    graph = b.build()
    mesh = LogicalMesh((4,), (1.0,), (1.0,))
    assert any(s.output.dims[1] == (0,) and not s.collectives for s in _strategies(graph, mesh, y))
    for s in _strategies(graph, mesh, pooled):
        assert not s.output.dims[1] and not s.output.dims[2] and s.operands[0] == s.output


def _conv_net(train: bool):
    """conv (stride 2, SAME) -> relu -> max pool -> 1x1 conv -> mean over batch and space."""
    b = GraphBuilder("convnet")
    x = b.parameter((4, 4, 4, 2), name="x")
    w1, w2 = b.parameter((3, 3, 2, 4), name="w1"), b.parameter((1, 1, 4, 2), name="w2")
    nhwc = ("NHWC", "HWIO", "NHWC")
    h = b.conv(x, w1, (2, 2), "SAME", dimension_numbers=nhwc)
    h = b.max(h, b.zeros(b.shape(h)))
    h = b.max_pool(h, (2, 2), (1, 1), "SAME")
    y = b.conv(h, w2, dimension_numbers=nhwc)
    loss = b.reduce(b.mul(y, y), (0, 1, 2, 3))
    if train:
        grads = append_backward(b, loss, (w1, w2))
        b.outputs(loss, *grads.values())
    else:
        b.outputs(y)
    return b.build()


def _conv_pool():
    """A strided conv and a pooling, small enough to brute-force on a 2x2 mesh."""
    b = GraphBuilder("convpool")
    x, w = b.parameter((2, 4, 4, 2), name="x"), b.parameter((3, 3, 2, 2), name="w")
    y = b.conv(x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    b.outputs(b.avg_pool(y, (2, 2), (1, 1), "SAME"))
    return b.build()


CASES = [("forward", (4,)), ("train", (4,)), ("convpool", (2, 2))]


@pytest.mark.parametrize(("graph_name", "shape"), CASES, ids=[f"{g}-{'x'.join(map(str, s))}" for g, s in CASES])
@pytest.mark.parametrize("reduce_scatter", [False, True])
def test_ilp_equals_brute_force_on_conv_graphs(graph_name, shape, reduce_scatter):
    build = {"forward": lambda: _conv_net(False), "train": lambda: _conv_net(True), "convpool": _conv_pool}
    graph = build[graph_name]()
    mesh = LogicalMesh(shape, (1.0, 0.5)[:len(shape)], (1.0, 0.01)[:len(shape)])
    options = IntraOptions(cost=CostModel(flops_per_second=1e3), reduce_scatter=reduce_scatter)
    sg, _, _, _ = build_intra_problem(graph, mesh, options)
    combos = math.prod(sg.size(g) for g in sg.groups)
    assert 1 < combos <= 20_000, combos
    for budget in (None, 0.5 * sum(n.nbytes for n in graph.nodes)):
        expected = brute_force(sg, budget)
        plan = solve_intra(graph, mesh, options.replace(memory_budget=budget))
        assert plan.objective == pytest.approx(expected, rel=1e-7, abs=1e-9)


def test_conv_gradient_graph_plans_in_seconds_with_kernel_models_and_a_forced_batch_axis():
    """The simulator's setting: GEMM-curve kernel models, fusion, the batch forced onto axis 0
    (traced from x's dim 0 through the convolutions and pooling): every forward conv splits the
    batch over axis 0, and the kernels' gradients all-reduce over it."""
    from meshplan.cluster.devices import DEVICES
    from meshplan.cost.kernels import KernelCosts
    from meshplan.simulator.pricing import PiecePricing, piece_options

    graph = _conv_net(True)
    pricing = PiecePricing(KernelCosts(DEVICES["v100-16gb"]))
    options = piece_options(1e12, 4, 0.0, 30.0, 0, False, pricing)
    plan = solve_intra(graph, LogicalMesh((2, 2), (1e-5, 1e-5), (1e-9, 1e-10)), options)
    convs = {n.name: n for n in plan.nodes if n.op == "conv"}
    for name in ("grad.w1", "grad.w2"):
        (collective,) = convs.pop(name).collectives
        assert collective.kind is CollectiveKind.ALL_REDUCE and collective.axes == (0,)
    assert len(convs) == 3 and all(n.output.dims[0] == (0,) for n in convs.values())
    assert plan.objective > 0
