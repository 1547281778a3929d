"""Reverse-mode autodiff: every VJP rule against central finite differences, run by the interpreter."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan import GraphBuilder, GraphError
from meshplan.ir import Graph, OpKind
from meshplan.ir.autodiff import append_backward
from meshplan.ir.interpret import evaluate

EPS = 1e-6
RTOL = 1e-6
ATOL = 1e-7  # central differences lose about 1e-16 * |loss| / EPS to rounding, ~1e-9 for these losses


def normal(shape, rng):
    return rng.normal(size=shape)


def positive(shape, rng):
    return rng.uniform(0.5, 2.0, size=shape)


def numeric_gradient(graph: Graph, loss: int, inputs: dict, name: str) -> np.ndarray:
    """Central differences of the loss with respect to input `name`, one element at a time."""
    base = np.asarray(inputs[name], dtype=np.float64)
    grad = np.zeros_like(base)
    for index in np.ndindex(base.shape):
        shifted = []
        for step in (EPS, -EPS):
            moved = base.copy()
            moved[index] += step
            shifted.append(evaluate(graph, {**inputs, name: moved})[loss])
        grad[index] = (shifted[0] - shifted[1]) / (2 * EPS)
    return grad


def check_gradients(graph: Graph, loss: int, grads: dict[int, int], inputs: dict) -> None:
    values = evaluate(graph, inputs)
    assert grads, "nothing to check"
    for param, grad in grads.items():
        name = graph[param].name
        assert values[grad].shape == graph[param].shape
        np.testing.assert_allclose(values[grad], numeric_gradient(graph, loss, inputs, name), rtol=RTOL, atol=ATOL,
                                   err_msg=f"gradient of {name}")


def check_op(build: Callable, *samplers, seed: int = 0, extra: dict | None = None) -> None:
    """Differentiate sum(build(params) * probe) with respect to one f64 parameter per sampler.

    A sampler is a function (shape, rng) -> array, paired with a shape: (sampler, shape).
    `extra` holds non-differentiated inputs: name -> (dtype, array).
    """
    rng = np.random.default_rng(seed)
    b = GraphBuilder("op")
    params = [b.parameter(shape, "f64", name=f"x{i}") for i, (_, shape) in enumerate(samplers)]
    others = {name: b.parameter(np.shape(value), dtype, name=name) for name, (dtype, value) in (extra or {}).items()}
    out = build(b, *params, **others)
    probe = b.parameter(b.shape(out), "f64", name="probe")
    loss = b.reduce(b.mul(out, probe), range(len(b.shape(out))), name="loss")
    grads = append_backward(b, loss, params)
    inputs = {f"x{i}": sample(shape, rng) for i, (sample, shape) in enumerate(samplers)}
    inputs |= {name: value for name, (_, value) in (extra or {}).items()}
    inputs["probe"] = rng.normal(size=b.shape(out))
    check_gradients(b.build(), loss, grads, inputs)


# -- one test per VJP rule -----------------------------------------------------------------------

M23 = (2, 3)
UNARY_DOMAINS = {
    "neg": normal, "exp": normal, "log": positive, "rsqrt": positive, "sqrt": positive, "tanh": normal,
    "logistic": normal, "square": normal, "abs": normal, "sin": normal, "cos": normal, "copy": normal,
    "log1p": positive, "expm1": normal, "erf": normal,
}


@pytest.mark.parametrize("op", sorted(UNARY_DOMAINS))
def test_unary_vjp(op):
    check_op(lambda b, x: b.unary(op, x), (UNARY_DOMAINS[op], M23))


@pytest.mark.parametrize(("op", "x_domain", "y_domain"), [
    ("add", normal, normal), ("sub", normal, normal), ("mul", normal, normal), ("div", normal, positive),
    ("max", normal, normal), ("min", normal, normal), ("pow", positive, normal), ("rem", positive, positive),
])
def test_binary_vjp(op, x_domain, y_domain):
    check_op(lambda b, x, y: b.binary(op, x, y), (x_domain, M23), (y_domain, M23))


def test_select_and_compare_vjp():
    # The predicate depends on x and y through compare, which passes no gradient.
    check_op(lambda b, x, y: b.select(b.compare(x, y, "gt"), b.exp(x), b.mul(y, y)), (normal, M23), (normal, M23))


def test_convert_vjp_converts_the_cotangent_back():
    b = GraphBuilder()
    x = b.parameter((3,), "f64", name="x")
    probe = b.parameter((3,), "f32", name="probe")
    loss = b.reduce(b.mul(b.convert(x, "f32"), probe), (0,))
    grads = append_backward(b, loss, [x])
    graph = b.build()
    value = evaluate(graph, {"x": [1.0, 2.0, 3.0], "probe": [0.5, -1.25, 3.0]})[grads[x]]
    assert graph[grads[x]].op == "convert" and value.dtype == np.float64
    np.testing.assert_array_equal(value, [0.5, -1.25, 3.0])


def test_dot_vjp_matmul():
    check_op(lambda b, x, w: b.matmul(x, w), (normal, (2, 3)), (normal, (3, 4)))


def test_dot_vjp_batched_with_transposes():
    # Attention scores: q [b, s, h, d] . k [b, t, h, d] -> [b, h, s, t].
    check_op(lambda b, q, k: b.dot(q, k, (3,), (3,), (0, 2), (0, 2)), (normal, (2, 3, 2, 2)), (normal, (2, 2, 2, 2)))


@pytest.mark.parametrize(("shape", "out", "dims"), [
    ((3,), (2, 3), (1,)),  # new leading dim
    ((1, 3), (4, 2, 3), (1, 2)),  # new dim and a stretched size-1 dim
    ((2, 1), (2, 1, 3), (0, 1)),  # size-1 dim kept at size 1
    ((), (2, 2), ()),  # scalar
])
def test_broadcast_vjp(shape, out, dims):
    check_op(lambda b, x: b.broadcast(x, out, dims), (normal, shape))


def test_reshape_and_transpose_vjp():
    check_op(lambda b, x: b.transpose(b.reshape(x, (2, 3, 2)), (2, 0, 1)), (normal, (4, 3)))


@pytest.mark.parametrize(("kind", "dims"), [("sum", (1,)), ("sum", (0, 2)), ("max", (2,)), ("min", (0,)),
                                            ("prod", (1, 2)), ("sum", ())])
def test_reduce_vjp(kind, dims):
    check_op(lambda b, x: b.reduce(x, dims, kind), (positive if kind == "prod" else normal, (2, 3, 4)))


def test_reduce_max_splits_ties_equally():
    b = GraphBuilder()
    x = b.parameter((4,), "f64", name="x")
    loss = b.reduce(x, (0,), "max")
    grads = append_backward(b, loss, [x])
    value = evaluate(b.build(), {"x": [1.0, 3.0, 3.0, -2.0]})[grads[x]]
    np.testing.assert_array_equal(value, [0.0, 0.5, 0.5, 0.0])


def test_slice_vjp():
    check_op(lambda b, x: b.slice(x, (1, 0, 2), (3, 2, 3)), (normal, (4, 2, 5)))


def test_concatenate_vjp():
    check_op(lambda b, x, y: b.concatenate([x, y, x], 1), (normal, (2, 1)), (normal, (2, 3)))


def test_gather_vjp_scatters_into_the_table():
    ids = np.array([[0, 3], [3, 1]], dtype=np.int32)  # row 3 twice: its gradient sums two rows
    check_op(lambda b, t, ids: b.gather(t, ids), (normal, (4, 3)), extra={"ids": ("i32", ids)})


def test_scatter_add_vjp_gathers_from_the_cotangent():
    ids = np.array([2, 0, 2], dtype=np.int32)
    check_op(lambda b, u, ids: b.scatter_add((4, 2), ids, u), (normal, (3, 2)), extra={"ids": ("i32", ids)})


def test_batched_gather_vjp_scatters_into_each_row():
    ids = np.array([[4, 0, 4, 1], [2, 3, 0, 0]], dtype=np.int32)  # repeats within a row accumulate
    check_op(lambda b, x, ids: b.gather(x, ids, 2, 1), (normal, (2, 3, 5, 2)), extra={"ids": ("i32", ids)})


def test_batched_scatter_add_vjp_gives_dropped_updates_no_gradient():
    ids = np.array([[4, 0, 7], [2, -1, 2]], dtype=np.int32)  # 7 and -1 are out of range: dropped
    check_op(lambda b, u, ids: b.scatter_add((2, 5, 3), ids, u, 1, 1), (normal, (2, 3, 3)),
             extra={"ids": ("i32", ids)})


# -- random dot_general layouts ------------------------------------------------------------------


@st.composite
def dot_layouts(draw):
    """(lhs shape, rhs shape, lhs_contracting, rhs_contracting, lhs_batch, rhs_batch)."""
    counts = {role: draw(st.integers(0, 2)) for role in "bclr"}  # batch, contracting, lhs free, rhs free
    sizes = {(role, k): draw(st.integers(1, 3)) for role, n in counts.items() for k in range(n)}
    lhs = draw(st.permutations([key for key in sizes if key[0] in "bcl"]))
    rhs = draw(st.permutations([key for key in sizes if key[0] in "bcr"]))
    pairs = {role: draw(st.permutations(range(counts[role]))) for role in "bc"}  # pairing order
    dims = [tuple(side.index((role, k)) for k in pairs[role]) for role in "cb" for side in (lhs, rhs)]
    return (tuple(sizes[k] for k in lhs), tuple(sizes[k] for k in rhs), *dims)


@settings(max_examples=40, deadline=None)
@given(dot_layouts(), st.integers(0, 2 ** 31))
def test_dot_vjp_random_layouts(layout, seed):
    lhs_shape, rhs_shape, lc, rc, lb, rb = layout
    check_op(lambda b, x, y: b.dot(x, y, lc, rc, lb, rb), (normal, lhs_shape), (normal, rhs_shape), seed=seed)


# -- whole blocks --------------------------------------------------------------------------------


def random_inputs(graph: Graph, seed: int = 0, **fixed) -> dict:
    rng = np.random.default_rng(seed)
    return {p.name: fixed[p.name] if p.name in fixed else rng.normal(size=p.shape) for p in graph.parameters()}


def test_two_layer_mlp_with_mse_loss():
    b = GraphBuilder("mlp")
    x, target = b.parameter((4, 3), "f64", name="x"), b.parameter((4, 2), "f64", name="target")
    w1, w2 = b.parameter((3, 5), "f64", name="w1"), b.parameter((5, 2), "f64", name="w2")
    with b.layer(0):
        h = b.tanh(b.matmul(x, w1, name="h"))
    with b.layer(1):
        err = b.sub(b.matmul(h, w2, name="y"), target)
        mean = b.mul(b.reduce(b.mul(err, err), (0, 1)), b.full((), 1 / 8, "f64"))
    grads = append_backward(b, mean, [w1, w2])
    graph = b.build()
    check_gradients(graph, mean, grads, random_inputs(graph))
    assert graph[grads[w1]].name == "grad.w1" and graph[grads[w1]].layer == 0
    assert graph[grads[w2]].name == "grad.w2" and graph[grads[w2]].layer == 1


def rms_norm(b: GraphBuilder, x: int, gain: int) -> int:
    rows, hidden = b.shape(x)
    mean_sq = b.mul(b.reduce(b.mul(x, x), (1,)), b.full((rows,), 1 / hidden, "f64"))
    inv = b.rsqrt(b.add(mean_sq, b.full((rows,), 1e-5, "f64")))
    return b.mul(b.mul(x, b.broadcast(inv, (rows, hidden), (0,))), b.broadcast(gain, (rows, hidden), (1,)))


def test_rms_norm():
    b = GraphBuilder("rmsnorm")
    x, gain = b.parameter((3, 4), "f64", name="x"), b.parameter((4,), "f64", name="gain")
    probe = b.parameter((3, 4), "f64", name="probe")
    loss = b.reduce(b.mul(rms_norm(b, x, gain), probe), (0, 1))
    grads = append_backward(b, loss, [x, gain])
    graph = b.build()
    check_gradients(graph, loss, grads, random_inputs(graph))


def softmax_attention(b: GraphBuilder, h: int, wq: int, wk: int, wv: int) -> int:
    """softmax(q k^T / sqrt(d)) v per head; h [batch, seq, hidden], w* [hidden, heads, d]."""
    q, k, v = (b.dot(h, w, (2,), (0,)) for w in (wq, wk, wv))  # [batch, seq, heads, d]
    batch, seq, heads, d = b.shape(q)
    shape = (batch, heads, seq, seq)
    scores = b.mul(b.dot(q, k, (3,), (3,), (0, 2), (0, 2)), b.full(shape, d ** -0.5, "f64"))
    e = b.exp(b.sub(scores, b.broadcast(b.reduce(scores, (3,), "max"), shape, (0, 1, 2))))
    probs = b.div(e, b.broadcast(b.reduce(e, (3,)), shape, (0, 1, 2)))
    ctx = b.dot(probs, v, (3,), (1,), (0, 1), (0, 2))  # [batch, heads, seq, d]
    return b.transpose(ctx, (0, 2, 1, 3))


def test_attention_block_with_softmax():
    b = GraphBuilder("attention")
    with b.layer(7):
        h = b.parameter((2, 3, 4), "f64", name="h")
        ws = [b.parameter((4, 2, 2), "f64", name=f"w{n}") for n in "qkv"]
        probe = b.parameter((2, 3, 2, 2), "f64", name="probe")
        loss = b.reduce(b.mul(softmax_attention(b, h, *ws), probe), (0, 1, 2, 3), name="loss")
    grads = append_backward(b, loss, [h, *ws])
    graph = b.build()
    check_gradients(graph, loss, grads, random_inputs(graph))
    backward = graph.nodes[loss + 1:]
    assert {n.layer for n in backward} == {7} and {n.kind for n in backward} >= {OpKind.DOT, OpKind.TRANSPOSE}


def test_embedding_gather_then_scatter_add_gradient():
    b = GraphBuilder("embed")
    table = b.parameter((5, 3), "f64", name="table")
    ids = b.parameter((2, 4), "i32", name="ids")
    w = b.parameter((3, 2), "f64", name="w")
    logits = b.tanh(b.dot(b.gather(table, ids, name="embed"), w, (2,), (0,)))
    loss = b.reduce(b.mul(logits, logits), (0, 1, 2))
    grads = append_backward(b, loss, [table, w])
    graph = b.build()
    assert graph[grads[table]].kind is OpKind.SCATTER_ADD and graph[grads[table]].name == "grad.table"
    check_gradients(graph, loss, grads, random_inputs(graph, ids=np.array([[0, 4, 4, 1], [1, 1, 0, 2]])))


# -- driver behaviour ----------------------------------------------------------------------------


def test_a_value_used_twice_sums_its_cotangents():
    b = GraphBuilder()
    x = b.parameter((2,), "f64", name="x")
    loss = b.reduce(b.mul(x, b.exp(x)), (0,))
    grads = append_backward(b, loss, [x])
    graph = b.build()
    assert graph[grads[x]].op == "add" and graph[grads[x]].name == "grad.x"
    value = evaluate(graph, {"x": [0.0, 1.0]})[grads[x]]
    np.testing.assert_allclose(value, [1.0, 2 * math.e], rtol=1e-15)


def test_only_needed_gradients_are_built():
    b = GraphBuilder()
    x, w = b.parameter((4, 3), "f64", name="x"), b.parameter((3, 2), "f64", name="w")
    loss = b.reduce(b.matmul(x, w), (0, 1))
    n_forward = len(b.build())
    grads = append_backward(b, loss, [w])
    graph = b.build()
    kinds = [n.kind for n in graph.nodes[n_forward:]]
    # seed, broadcast of the reduce, and one dot in w's dim order: no dx, no transpose
    assert kinds == [OpKind.CONSTANT, OpKind.BROADCAST, OpKind.DOT]
    assert graph[grads[w]].operands == (x, n_forward + 1)


def test_unreachable_wrt_gets_named_zeros_with_its_layer():
    b = GraphBuilder()
    x = b.parameter((2,), "f64", name="x")
    with b.layer(3):
        unused = b.parameter((2, 2), "f64", name="unused")
    loss = b.reduce(b.exp(x), (0,))
    grads = append_backward(b, loss, [x, unused])
    graph = b.build()
    node = graph[grads[unused]]
    assert (node.name, node.kind, node.layer, node.shape) == ("grad.unused", OpKind.BROADCAST, 3, (2, 2))
    np.testing.assert_array_equal(evaluate(graph, {"x": [0.0, 0.0], "unused": np.ones((2, 2))})[grads[unused]],
                                  np.zeros((2, 2)))


def test_integer_paths_and_predicates_carry_no_gradient():
    b = GraphBuilder()
    x = b.parameter((3,), "f64", name="x")
    as_int = b.convert(b.convert(x, "i32"), "f64")  # piecewise constant: no gradient
    loss = b.reduce(b.add(b.mul(x, b.full((3,), 2.0, "f64")), as_int), (0,))
    grads = append_backward(b, loss, [x])
    graph = b.build()
    np.testing.assert_array_equal(evaluate(graph, {"x": [0.5, 1.5, -2.5]})[grads[x]], [2.0, 2.0, 2.0])
    assert not any(n.op == "convert" for n in graph.nodes[loss + 1:])


def test_error_messages():
    b = GraphBuilder()
    x = b.parameter((2,), "f64", name="x")
    i = b.parameter((2,), "i32", name="i")
    mystery = b.opaque([x], (2,), "f64", "custom_call", name="mystery")
    with pytest.raises(GraphError, match=r"the loss mystery is f64\[2\]; it must be a floating-point scalar"):
        append_backward(b, mystery, [x])
    loss = b.reduce(mystery, (0,))
    with pytest.raises(GraphError, match="wrt node i is i32; only floating-point values have gradients"):
        append_backward(b, loss, [i])
    with pytest.raises(GraphError, match=r"no VJP rule for opaque op 'custom_call' at node mystery"):
        append_backward(b, loss, [x])


def test_a_failed_request_appends_nothing_and_a_second_request_keeps_names_unique():
    b = GraphBuilder()
    x = b.parameter((2,), "f64", name="x")
    loss = b.reduce(b.opaque([x], (2,), "f64", "custom_call"), (0,))
    with pytest.raises(GraphError, match="no VJP rule"):
        append_backward(b, loss, [x])
    assert len(b) == 3
    other = b.reduce(b.exp(x), (0,))
    first, second = append_backward(b, other, [x]), append_backward(b, other, [x])
    graph = b.build()  # would raise on a repeated name
    assert graph[first[x]].name == "grad.x" and graph[second[x]].name == ""


def test_opaque_ops_off_the_gradient_path_are_fine():
    b = GraphBuilder()
    x, c = b.parameter((2,), "f64", name="x"), b.parameter((2,), "f64", name="c")
    scale = b.opaque([c], (2,), "f64", "custom_call")
    loss = b.reduce(b.mul(x, scale), (0,))
    grads = append_backward(b, loss, [x])
    assert b.node(grads[x]).operands[1] == scale
