"""Graph IR: builder shapes and checks, FLOPs, printer."""

from __future__ import annotations

import pytest

from meshplan import DType, GraphBuilder, GraphError, format_graph
from meshplan.ir import Graph, Node, OpKind, check_graph, graph_flops, node_flops


def test_dot_general_shape_and_flops():
    b = GraphBuilder()
    q = b.parameter((2, 16, 4, 8), name="q")  # batch, seq, heads, d
    k = b.parameter((2, 16, 4, 8), name="k")
    s = b.dot(q, k, (3,), (3,), (0, 2), (0, 2), name="scores")
    g = b.build()
    assert g[s].shape == (2, 4, 16, 16)  # batch dims, lhs free, rhs free
    assert node_flops(g, g[s]) == 2 * 2 * 4 * 16 * 16 * 8


def test_layout_ops():
    b = GraphBuilder()
    x = b.parameter((4, 6), dtype="bf16")
    t = b.transpose(x, (1, 0))
    r = b.reshape(t, (2, 3, 4))
    s = b.reduce(r, (1,), "max")
    c = b.broadcast(s, (2, 5, 4), (0, 2))
    g = b.build()
    assert [g[i].shape for i in (t, r, s, c)] == [(6, 4), (2, 3, 4), (2, 4), (2, 5, 4)]
    assert g[x].dtype is DType.BF16 and g[x].nbytes == 48
    assert g[s].op == "max"


def test_elementwise_and_select():
    b = GraphBuilder()
    x, y = b.parameter((3,)), b.parameter((3,))
    p = b.compare(x, y, "lt")
    z = b.select(p, x, y)
    e = b.exp(z)
    g = b.build()
    assert g[p].dtype is DType.PRED and g[z].shape == (3,)
    assert node_flops(g, g[e]) == 3 * 4  # a transcendental costs several FLOPs


def test_aliases_outputs_and_printer():
    b = GraphBuilder("step")
    w = b.parameter((2, 2), name="w")
    nw = b.sub(w, b.exp(w), name="new_w")
    b.outputs(nw, force_replicated=True)
    b.alias(w, nw)
    g = b.build()
    assert g.aliases == ((w, nw),) and g.force_replicated == (nw,)
    text = format_graph(g)
    assert "new_w = sub(w, %1) : f32[2x2]" in text and "aliases: w <- new_w" in text
    assert graph_flops(g) == 4 * 4 + 4


@pytest.mark.parametrize(("build", "message"), [
    (lambda b: b.matmul(b.parameter((2, 3)), b.parameter((4, 5))), "has size 3"),
    (lambda b: b.add(b.parameter((2, 3)), b.parameter((3, 2))), "operand shapes differ"),
    (lambda b: b.reshape(b.parameter((2, 3)), (4, 2)), "element counts must match"),
    (lambda b: b.transpose(b.parameter((2, 3)), (0, 0)), "not a permutation"),
    (lambda b: b.reduce(b.parameter((2, 3)), (2,)), "out of range"),
    (lambda b: b.broadcast(b.parameter((2, 3)), (2, 4), (0, 1)), "cannot become output dim"),
    (lambda b: b.unary("frobnicate", b.parameter((2,))), "unknown unary op"),
    (lambda b: b.alias(b.exp(b.parameter((2,))), b.parameter((2,))), "only parameters"),
    (lambda b: b.exp(7), "not a node id"),
    (lambda b: b.parameter((2,), dtype="float7"), "unknown dtype"),
])
def test_builder_rejects_bad_input(build, message):
    with pytest.raises(GraphError, match=message):
        build(GraphBuilder())


def test_check_graph_catches_order_and_names():
    a = Node(0, OpKind.PARAMETER, (), (2,), DType.F32, name="a")
    bad = Node(1, OpKind.ELEMENTWISE, (2,), (2,), DType.F32, (("op", "exp"),))
    with pytest.raises(GraphError, match="topological order"):
        check_graph(Graph((a, bad)))
    twin = Node(1, OpKind.PARAMETER, (), (2,), DType.F32, name="a")
    with pytest.raises(GraphError, match="two nodes are named"):
        check_graph(Graph((a, twin)))
    with pytest.raises(GraphError, match="no nodes"):
        check_graph(Graph(()))
