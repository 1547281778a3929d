"""The NumPy interpreter: every op against NumPy written by hand, plus the builder's new ops."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meshplan import GraphBuilder, GraphError
from meshplan.ir import DType, OpKind, node_bytes_accessed, node_flops
from meshplan.ir.builder import BINARY_OPS, UNARY_OPS
from meshplan.ir.interpret import cast, evaluate

X = np.array([[0.5, -1.5, 2.0], [3.0, -0.25, 1.0]])
Y = np.array([[2.0, 0.5, -3.0], [1.5, 4.0, 0.75]])


def run_one(make, *arrays, dtype="f64"):
    """Build `make(b, *params)` on parameters holding `arrays`; return the value of its result."""
    b = GraphBuilder()
    params = [b.parameter(np.shape(a), dtype if np.asarray(a).dtype.kind == "f" else "i32", name=f"p{i}")
              for i, a in enumerate(arrays)]
    out = make(b, *params)
    return evaluate(b.build(), {f"p{i}": a for i, a in enumerate(arrays)})[out]


# -- leaves --------------------------------------------------------------------------------------


def test_parameters_by_name_or_id_and_constants():
    b = GraphBuilder()
    x = b.parameter((2,), "f64", name="x")
    y = b.parameter((2,), "f64")
    c = b.constant((2,), "f64", value=1.5)
    d = b.constant((2, 2), "f32")
    s = b.add(b.add(x, y), c)
    values = evaluate(b.build(), {"x": [1.0, 2.0], y: [10.0, 20.0]}, constants_default=7.0)
    np.testing.assert_array_equal(values[s], [12.5, 23.5])
    np.testing.assert_array_equal(values[d], np.full((2, 2), 7.0, np.float32))
    assert values[d].dtype == np.float32 and values[s].dtype == np.float64


def test_iota_full_and_zeros():
    b = GraphBuilder()
    i = b.iota((2, 3), dim=1)
    f = b.full((2, 2), 2.5, "f64")
    z = b.zeros((3,), "i32")
    values = evaluate(b.build(), {})
    np.testing.assert_array_equal(values[i], [[0, 1, 2], [0, 1, 2]])
    assert values[i].dtype == np.int32
    np.testing.assert_array_equal(values[f], [[2.5, 2.5], [2.5, 2.5]])
    np.testing.assert_array_equal(values[z], [0, 0, 0])


# -- dot -----------------------------------------------------------------------------------------


def test_matmul():
    got = run_one(lambda b, x, y: b.dot(x, y, (1,), (1,)), X, Y)  # x @ y.T
    np.testing.assert_array_equal(got, X @ Y.T)


def test_dot_general_orders_batch_then_lhs_free_then_rhs_free():
    lhs = np.arange(2 * 3 * 4, dtype=np.float64).reshape(3, 2, 4)  # [k, batch, m]
    rhs = np.arange(2 * 3 * 5, dtype=np.float64).reshape(5, 2, 3)  # [n, batch, k]
    got = run_one(lambda b, x, y: b.dot(x, y, (0,), (2,), (1,), (1,)), lhs, rhs)
    expected = np.zeros((2, 4, 5))
    for bb in range(2):
        for m in range(4):
            for n in range(5):
                expected[bb, m, n] = sum(lhs[k, bb, m] * rhs[n, bb, k] for k in range(3))
    np.testing.assert_array_equal(got, expected)


def test_dot_with_result_dtype_accumulates_wide():
    b = GraphBuilder()
    x = b.parameter((1, 4), "f16", name="x")
    y = b.parameter((4, 1), "f16", name="y")
    d = b.dot(x, y, (1,), (0,), dtype="f32")
    ones = np.array([[2048.0, 1.0, 1.0, 1.0]])
    value = evaluate(b.build(), {"x": ones, "y": np.ones((4, 1))})[d]
    assert value.dtype == np.float32 and value[0, 0] == 2051.0  # f16 accumulation would give 2048 or 2052


# -- elementwise ---------------------------------------------------------------------------------

UNARY_REFERENCE = {
    "neg": lambda x: -x, "exp": np.exp, "log": np.log, "rsqrt": lambda x: 1 / np.sqrt(x), "sqrt": np.sqrt,
    "tanh": np.tanh, "logistic": lambda x: 1 / (1 + np.exp(-x)), "abs": np.abs, "sign": np.sign,
    "erf": lambda x: np.array([[math.erf(v) for v in row] for row in x]), "sin": np.sin, "cos": np.cos,
    "copy": lambda x: x, "floor": np.floor, "ceil": np.ceil, "square": lambda x: x * x, "log1p": np.log1p,
    "expm1": np.expm1, "is_finite": np.isfinite, "round": np.round, "tan": np.tan, "bitcast": lambda x: x,
    "erf_inv": lambda x: np.array([[_erf_inverse(v) for v in row] for row in x]),
}
BINARY_REFERENCE = {
    "add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y, "div": lambda x, y: x / y,
    "max": np.maximum, "min": np.minimum, "pow": np.power, "rem": np.fmod, "atan2": np.arctan2,
}
INTEGER_BINARY_OPS = {"and", "or", "xor", "shift_left", "shift_right_logical", "shift_right_arithmetic"}


def _erf_inverse(y: float) -> float:
    """Bisection on math.erf: an independent reference for the interpreter's erf_inv."""
    lo, hi = -10.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.erf(mid) < y else (lo, mid)
    return (lo + hi) / 2


def test_every_sub_op_has_a_reference_here():
    assert set(UNARY_REFERENCE) | {"not"} == UNARY_OPS
    assert set(BINARY_REFERENCE) | INTEGER_BINARY_OPS == BINARY_OPS


@pytest.mark.parametrize("op", sorted(UNARY_REFERENCE))
def test_unary(op):
    x = np.abs(X) if op in ("log", "log1p", "rsqrt", "sqrt") else X
    x = np.tanh(x) if op == "erf_inv" else x
    rtol = 1e-12 if op == "erf_inv" else 1e-15  # SciPy's erfinv vs bisection on math.erf
    np.testing.assert_allclose(run_one(lambda b, p: b.unary(op, p), x), UNARY_REFERENCE[op](x), rtol=rtol)


@pytest.mark.parametrize("op", sorted(BINARY_REFERENCE))
def test_binary(op):
    x = np.abs(X) if op == "pow" else X
    np.testing.assert_allclose(run_one(lambda b, p, q: b.binary(op, p, q), x, Y), BINARY_REFERENCE[op](x, Y),
                               rtol=1e-15)


def test_integer_division_and_remainder_truncate_toward_zero():
    x, y = np.array([7, -7, 7, -7]), np.array([2, 2, -2, -2])
    np.testing.assert_array_equal(run_one(lambda b, p, q: b.div(p, q), x, y), [3, -3, -3, 3])
    np.testing.assert_array_equal(run_one(lambda b, p, q: b.binary("rem", p, q), x, y), [1, -1, 1, -1])


def test_logical_and_bitwise_ops():
    b = GraphBuilder()
    x, y = b.parameter((3,), "i32", name="x"), b.parameter((3,), "i32", name="y")
    p, q = b.compare(x, y, "lt"), b.compare(x, y, "ne")
    ops = [b.binary("and", p, q), b.binary("or", p, q), b.unary("not", p), b.binary("and", x, y),
           b.binary("or", x, y), b.unary("not", x)]
    values = evaluate(b.build(), {"x": [1, 6, 3], "y": [2, 5, 3]})
    expected = [[True, False, False], [True, True, False], [False, True, True], [0, 4, 3], [3, 7, 3], [-2, -7, -4]]
    for node, want in zip(ops, expected, strict=True):
        np.testing.assert_array_equal(values[node], want)


def test_xor_and_shifts_treat_signed_stand_ins_of_unsigned_bits_as_bits():
    b = GraphBuilder()
    x, y = b.parameter((3,), "i32", name="x"), b.parameter((3,), "i32", name="y")
    ops = [b.binary(op, x, y) for op in ("xor", "shift_left", "shift_right_logical", "shift_right_arithmetic")]
    values = evaluate(b.build(), {"x": [6, -8, 1], "y": [3, 1, 4]})
    expected = [[5, -7, 5], [48, -16, 16], [0, 0x7FFFFFFC, 0], [0, -4, 0]]
    for node, want in zip(ops, expected, strict=True):
        np.testing.assert_array_equal(values[node], want)


@pytest.mark.parametrize(("direction", "expected"), [
    ("eq", [False, True, False]), ("ne", [True, False, True]), ("lt", [True, False, False]),
    ("le", [True, True, False]), ("gt", [False, False, True]), ("ge", [False, True, True]),
])
def test_compare(direction, expected):
    got = run_one(lambda b, p, q: b.compare(p, q, direction), np.array([1.0, 2.0, 3.0]), np.array([2.0, 2.0, 2.0]))
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, expected)


def test_select():
    got = run_one(lambda b, p, q: b.select(b.compare(p, q, "gt"), p, q), X, Y)
    np.testing.assert_array_equal(got, np.where(X > Y, X, Y))


def test_convert_truncates_to_int_and_rounds_bf16_to_nearest_even():
    x = np.array([1.7, -1.7, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -8 + 2.0 ** -20])
    assert run_one(lambda b, p: b.convert(p, "i32"), x).tolist() == [1, -1, 1, 1, 1]
    bf16 = run_one(lambda b, p: b.convert(p, "bf16"), x)
    assert bf16.dtype == np.float32
    # bf16 keeps 8 significant bits: ties go to the even neighbour, anything above a tie rounds up.
    assert bf16.tolist() == [1.703125, -1.703125, 1.0, 1 + 2.0 ** -6, 1 + 2.0 ** -7]


def test_cast_keeps_nan_and_overflows_to_inf_in_bf16():
    out = cast(np.array([np.nan, 3.4e38, -3.4e38]), DType.BF16)
    assert np.isnan(out[0]) and out[1] == np.inf and out[2] == -np.inf


# -- layout --------------------------------------------------------------------------------------


def test_broadcast_maps_operand_dims_and_stretches_size_one():
    x = np.array([[1.0, 2.0, 3.0]])  # [1, 3]
    got = run_one(lambda b, p: b.broadcast(p, (2, 4, 3), (1, 2)), x)
    assert got.shape == (2, 4, 3)
    np.testing.assert_array_equal(got[1, 3], [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(got, np.tile(x, (2, 4, 1)))


def test_reshape_and_transpose():
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(run_one(lambda b, p: b.reshape(p, (3, 2)), x), [[0, 1], [2, 3], [4, 5]])
    y = np.arange(24.0).reshape(2, 3, 4)
    got = run_one(lambda b, p: b.transpose(p, (2, 0, 1)), y)
    assert got.shape == (4, 2, 3) and got[3, 1, 2] == y[1, 2, 3]


@pytest.mark.parametrize(("kind", "expected"), [
    ("sum", [3.5, -1.75, 3.0]), ("max", [3.0, -0.25, 2.0]), ("min", [0.5, -1.5, 1.0]),
    ("prod", [1.5, 0.375, 2.0]),
])
def test_reduce(kind, expected):
    np.testing.assert_array_equal(run_one(lambda b, p: b.reduce(p, (0,), kind), X), expected)


def test_reduce_over_several_dims():
    x = np.arange(24.0).reshape(2, 3, 4)  # sum over i, k of x[i, j, k] = (16j + 6) + (48 + 16j + 6)
    np.testing.assert_array_equal(run_one(lambda b, p: b.reduce(p, (0, 2)), x), [60.0, 92.0, 124.0])


def test_slice_and_concatenate():
    x = np.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(run_one(lambda b, p: b.slice(p, (1, 1), (3, 3)), x), [[5, 6], [9, 10]])
    got = run_one(lambda b, p, q: b.concatenate([p, q, p], 1), X, Y)
    np.testing.assert_array_equal(got, np.concatenate([X, Y, X], axis=1))


def test_dynamic_slice_clamps_its_start():
    b = GraphBuilder()
    x = b.parameter((3, 4), "f64", name="x")
    i, j = b.parameter((), "i32", name="i"), b.parameter((), "i32", name="j")
    s = b.dynamic_slice(x, (i, j), (2, 2))
    graph = b.build()
    data = np.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(evaluate(graph, {"x": data, "i": 1, "j": 1})[s], [[5, 6], [9, 10]])
    np.testing.assert_array_equal(evaluate(graph, {"x": data, "i": 5, "j": -3})[s], [[4, 5], [8, 9]])


# -- indexing ------------------------------------------------------------------------------------


def test_gather_picks_rows_and_clamps_indices():
    table = np.arange(8.0).reshape(4, 2)
    got = run_one(lambda b, t, i: b.gather(t, i), table, np.array([[3, 0], [1, 7]]))
    assert got.shape == (2, 2, 2)
    np.testing.assert_array_equal(got, [[[6, 7], [0, 1]], [[2, 3], [6, 7]]])


def test_scatter_add_accumulates_duplicates_and_drops_out_of_range():
    indices = np.array([[1, 3], [1, 9]])
    updates = np.arange(8.0).reshape(2, 2, 2)
    got = run_one(lambda b, i, u: b.scatter_add((4, 2), i, u), indices, updates)
    np.testing.assert_array_equal(got, [[0, 0], [0 + 4, 1 + 5], [0, 0], [2, 3]])


def test_scatter_add_builder_checks_and_flops():
    b = GraphBuilder()
    idx = b.parameter((2, 3), "i32", name="idx")
    upd = b.parameter((2, 3, 8), "f32", name="upd")
    s = b.scatter_add((100, 8), idx, upd, name="grad_table")
    graph = b.build()
    assert graph[s].kind is OpKind.SCATTER_ADD and graph[s].shape == (100, 8)
    assert node_flops(graph, graph[s]) == 48.0
    with pytest.raises(GraphError, match=r"into \(100, 4\) along axis 0 .* need updates of shape \(2, 3, 4\)"):
        b.scatter_add((100, 4), idx, upd)
    with pytest.raises(GraphError, match="convert them to an integer dtype"):
        b.scatter_add((100, 8), b.parameter((2, 3), "f32"), upd)


def test_gather_with_batch_dims_picks_one_entry_per_row():
    logp = np.arange(24.0).reshape(2, 3, 4)
    labels = np.array([[0, 3, 1], [2, 2, 0]])
    got = run_one(lambda b, x, i: b.gather(x, i, axis=2, batch_dims=2), logp, labels)
    np.testing.assert_array_equal(got, np.take_along_axis(logp, labels[..., None], axis=2)[..., 0])


def test_gather_between_batch_and_trailing_dims():
    x = np.arange(60.0).reshape(2, 3, 5, 2)  # batch 2, kept 3, gathered 5, trailing 2
    ids = np.array([[4, 0, 4, 1], [2, 3, 0, 0]])
    got = run_one(lambda b, x, i: b.gather(x, i, axis=2, batch_dims=1), x, ids)
    want = np.stack([x[n][:, ids[n]] for n in range(2)])  # out[n, p, j, q] = x[n, p, ids[n, j], q]
    assert got.shape == (2, 3, 4, 2)
    np.testing.assert_array_equal(got, want)


def test_gather_fill_value_replaces_out_of_range_entries():
    logp = np.arange(8.0).reshape(2, 4)
    got = run_one(lambda b, x, i: b.gather(x, i, 1, 1, fill_value=np.nan), logp, np.array([3, 4]))
    np.testing.assert_array_equal(got, [3.0, np.nan])
    clamped = run_one(lambda b, x, i: b.gather(x, i, 1, 1), logp, np.array([-2, 9]))
    np.testing.assert_array_equal(clamped, [0.0, 7.0])


def test_batched_scatter_add_is_the_transpose_of_gather():
    """<gather(x, i), u> == <x, scatter_add(i, u)> for every x and u: the two are adjoint."""
    rng = np.random.default_rng(0)
    x, u = rng.normal(size=(2, 3, 5, 2)), rng.normal(size=(2, 3, 4, 2))
    ids = np.array([[4, 0, 4, 7], [2, -1, 0, 0]])  # a duplicate, and two out-of-range entries dropped
    b = GraphBuilder()
    xp, ip, up = b.parameter(x.shape, "f64", "x"), b.parameter(ids.shape, "i32", "i"), b.parameter(u.shape, "f64", "u")
    g = b.gather(xp, ip, 2, 1, fill_value=0.0)
    s = b.scatter_add(x.shape, ip, up, 2, 1)
    values = evaluate(b.build(), {"x": x, "i": ids, "u": u})
    assert values[s].shape == x.shape and values[s][1, :, 0].tolist() == (u[1, :, 2] + u[1, :, 3]).tolist()
    assert np.vdot(values[g], u) == pytest.approx(np.vdot(x, values[s]))


def test_gather_builder_checks_batch_dims_and_counts_picked_bytes():
    b = GraphBuilder()
    x = b.parameter((8, 16, 100), name="x")
    labels = b.parameter((8, 16), "i32", name="labels")
    pick = b.gather(x, labels, 2, 2, name="pick")
    graph = b.build()
    assert graph[pick].shape == (8, 16) and graph[pick].attrs == (("axis", 2), ("batch_dims", 2), ("fill_value", None))
    assert node_flops(graph, graph[pick]) == 0.0
    assert node_bytes_accessed(graph, graph[pick]) == 2 * 8 * 16 * 4 + 8 * 16 * 4  # not the whole x
    with pytest.raises(GraphError, match=r"batch dims of indices labels \(8, 16\) and of \(16, 8, 100\) differ"):
        b.gather(b.parameter((16, 8, 100)), labels, 2, 2)
    with pytest.raises(GraphError, match=r"batch_dims=2 must lie in \[0, min\(axis=1"):
        b.gather(x, labels, 1, 2)


def test_builder_node_and_rename():
    b = GraphBuilder()
    x = b.parameter((2,), name="x")
    b.rename(x, "y")
    assert b.node(x).name == "y" and b.node(x).shape == (2,) and b.node(x).attr("missing", 3) == 3


# -- errors --------------------------------------------------------------------------------------


def test_input_errors():
    b = GraphBuilder("g")
    b.parameter((2,), name="x")
    graph = b.build()
    with pytest.raises(GraphError, match=r"no input for parameters \['x'\]"):
        evaluate(graph, {})
    with pytest.raises(GraphError, match=r"inputs \['z'\] name no parameter"):
        evaluate(graph, {"x": [1.0, 2.0], "z": 1.0})
    with pytest.raises(GraphError, match=r"has shape \(3,\), but the parameter has shape \(2,\)"):
        evaluate(graph, {"x": [1.0, 2.0, 3.0]})


def test_opaque_ops_cannot_be_evaluated():
    b = GraphBuilder()
    x = b.parameter((2,), name="x")
    b.opaque([x], (2,), "f32", "custom_call", name="mystery")
    with pytest.raises(GraphError, match=r"node mystery has op kind opaque \('custom_call'\), which the interpreter"):
        evaluate(b.build(), {"x": [1.0, 2.0]})
