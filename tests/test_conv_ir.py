"""Convolutions and window reductions in the IR: shapes, FLOPs, the interpreter against
`jax.lax`, and the IR's gradients (append_backward) against `jax.vjp`, for strides, padding,
dilations, feature and batch groups and Flax's NHWC layout."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax import lax

from meshplan import GraphBuilder, GraphError
from meshplan.ir import OpKind, node_flops
from meshplan.ir.autodiff import append_backward
from meshplan.ir.interpret import evaluate

# (lhs shape, rhs shape, dimension numbers, keyword arguments of conv / conv_general_dilated)
CONVS = {
    "nhwc_same_stride2": ((2, 9, 9, 4), (3, 3, 4, 6), ("NHWC", "HWIO", "NHWC"),
                          {"window_strides": (2, 2), "padding": "SAME"}),
    "dilations_negative_pad": ((2, 4, 7, 7), (6, 4, 3, 2), None,
                               {"window_strides": (2, 1), "padding": ((1, -1), (2, 0)), "lhs_dilation": (2, 1),
                                "rhs_dilation": (1, 2)}),
    "feature_groups": ((2, 8, 7, 7), (8, 2, 3, 3), None, {"feature_group_count": 4, "padding": "SAME"}),
    "batch_groups": ((4, 3, 7, 7), (6, 3, 3, 3), None, {"batch_group_count": 2}),
    "conv1d_nwc": ((2, 9, 4), (3, 4, 2), ("NWC", "WIO", "NWC"), {"window_strides": (2,)}),
    "same_rhs_dilated": ((1, 2, 5, 6), (3, 2, 3, 2), None, {"window_strides": (2, 1), "padding": "SAME",
                                                            "rhs_dilation": (1, 2)}),
    "conv3d": ((1, 2, 5, 4, 4), (3, 2, 3, 2, 2), None, {"padding": "SAME", "window_strides": (1, 2, 1)}),
}


def _conv_graph(lhs_shape, rhs_shape, dn, kw):
    b = GraphBuilder("conv")
    x, w = b.parameter(lhs_shape, "f64", name="x"), b.parameter(rhs_shape, "f64", name="w")
    return b, x, w, b.conv(x, w, dimension_numbers=dn, **kw)


def _lax_conv(dn, kw):
    return lambda x, w: lax.conv_general_dilated(x, w, kw.get("window_strides", (1,) * (x.ndim - 2)),
                                                 kw.get("padding", "VALID"), kw.get("lhs_dilation"),
                                                 kw.get("rhs_dilation"), dn, kw.get("feature_group_count", 1),
                                                 kw.get("batch_group_count", 1), precision="highest")


@pytest.mark.parametrize("case", CONVS)
def test_conv_value_flops_and_gradients_equal_lax(case):
    lhs_shape, rhs_shape, dn, kw = CONVS[case]
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(lhs_shape), rng.standard_normal(rhs_shape)
    b, xn, wn, y = _conv_graph(lhs_shape, rhs_shape, dn, kw)
    fn = _lax_conv(dn, kw)
    with jax.enable_x64(True):  # the oracle in float64, as the interpreter runs it
        want, vjp = jax.vjp(fn, x, w)
        dx, dw = vjp(p := rng.standard_normal(want.shape))
    assert b.shape(y) == want.shape
    probe = b.parameter(want.shape, "f64", name="probe")
    loss = b.reduce(b.mul(y, probe), range(len(want.shape)))
    wrt = (xn, wn) if kw.get("batch_group_count", 1) == 1 else (wn,)
    grads = append_backward(b, loss, wrt)
    graph = b.build()
    values = evaluate(graph, {"x": x, "w": w, "probe": p})
    np.testing.assert_allclose(values[y], want, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(values[grads[wn]], dw, rtol=1e-10, atol=1e-10)
    if xn in grads:
        np.testing.assert_allclose(values[grads[xn]], dx, rtol=1e-10, atol=1e-10)
    kernel_taps = np.prod(rhs_shape) // want.shape[graph[y].attr("out_spec")[1]]
    if kw.get("lhs_dilation") is None:
        assert node_flops(graph, graph[y]) == 2.0 * np.prod(want.shape) * kernel_taps
    else:
        assert node_flops(graph, graph[y]) == 2.0 * _real_macs(x.shape, w.shape, dn, kw)


def _real_macs(lhs_shape, rhs_shape, dn, kw):
    """Multiply-adds that meet a real input entry, padding counted along undilated dims (as for
    every undilated conv): the sum of the convolution of ones with ones, the undilated dims'
    positive padding made of ones too (NCHW layouts only)."""
    assert dn is None
    pads, ones_pad = [], [(0, 0), (0, 0)]
    for (lo, hi), d in zip(kw["padding"], kw["lhs_dilation"], strict=True):
        keep = (lo, hi) if d > 1 else (min(lo, 0), min(hi, 0))
        pads.append(keep)
        ones_pad.append((lo - keep[0], hi - keep[1]))
    ones = np.pad(np.ones(lhs_shape), ones_pad, constant_values=1.0)
    with jax.enable_x64(True):
        counts = _lax_conv(dn, {**kw, "padding": pads})(ones, np.ones(rhs_shape))
    return float(np.sum(counts))


POOLS = {
    "max_same": ("max", (1, 3, 3, 1), (1, 2, 2, 1), "SAME", None),
    "min_valid": ("min", (1, 2, 3, 1), (1, 1, 2, 1), "VALID", None),
    "sum_stride": ("sum", (1, 2, 2, 1), (1, 2, 2, 1), "VALID", None),
    "sum_same_dilated": ("sum", (1, 3, 2, 1), (1, 2, 2, 1), "SAME", (1, 2, 1, 1)),
    "sum_padded_dilated": ("sum", (1, 3, 2, 1), (1, 2, 1, 1), ((0, 0), (1, 2), (0, 1), (0, 0)), (1, 1, 2, 1)),
}


@pytest.mark.parametrize("case", POOLS)
def test_reduce_window_value_and_gradient_equal_lax(case):
    op, window, strides, padding, base = POOLS[case]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 7, 6, 3))
    init, fn = {"max": (-np.inf, lax.max), "min": (np.inf, lax.min), "sum": (0.0, lax.add)}[op]
    pool = lambda v: lax.reduce_window(v, init, fn, window, strides, padding, base_dilation=base)  # noqa: E731
    with jax.enable_x64(True):
        want, vjp = jax.vjp(pool, x)
        dx = vjp(p := rng.standard_normal(want.shape))[0]
    b = GraphBuilder("pool")
    xn = b.parameter(x.shape, "f64", name="x")
    y = b.reduce_window(xn, op, window, strides, padding, base_dilation=base)
    assert b.shape(y) == want.shape
    probe = b.parameter(want.shape, "f64", name="probe")
    grads = append_backward(b, b.reduce(b.mul(y, probe), range(4)), (xn,))
    graph = b.build()
    values = evaluate(graph, {"x": x, "probe": p})
    np.testing.assert_allclose(values[y], want)
    np.testing.assert_allclose(values[grads[xn]], dx, rtol=1e-12, atol=1e-12)
    assert node_flops(graph, graph[y]) == np.prod(want.shape) * np.prod(window)
    if op != "sum":
        assert any(n.kind is OpKind.SELECT_AND_SCATTER_ADD for n in graph.nodes)


def test_flax_pooling_helpers_and_reverse():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 6, 6, 3))
    b = GraphBuilder("pools")
    xn = b.parameter(x.shape, "f64", name="x")
    mx, avg = b.max_pool(xn, (3, 3), (2, 2), "SAME"), b.avg_pool(xn, (2, 2), (2, 2))
    rev = b.reverse(xn, (1, 2))
    values = evaluate(b.build(), {"x": x})
    with jax.enable_x64(True):
        want = lax.reduce_window(x, -np.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
    np.testing.assert_allclose(values[mx], want)
    np.testing.assert_allclose(values[avg], x.reshape(2, 3, 2, 3, 2, 3).mean(axis=(2, 4)))
    np.testing.assert_allclose(values[rev], x[:, ::-1, ::-1])


def test_conv_errors_name_the_rule():
    b = GraphBuilder("bad")
    x, w = b.parameter((2, 8, 5, 5)), b.parameter((6, 3, 3, 3))
    with pytest.raises(GraphError, match="input features must equal kernel input features"):
        b.conv(x, w)
    with pytest.raises(GraphError, match="must name each of the 4 dims once"):
        b.conv(x, w, dimension_numbers=((0, 1, 2, 2), (0, 1, 2, 3), (0, 1, 2, 3)))
    with pytest.raises(GraphError, match="undefined with lhs_dilation"):
        b.conv(x, b.parameter((6, 8, 3, 3)), padding="SAME", lhs_dilation=(2, 2))
    with pytest.raises(GraphError, match="unknown op"):
        b.reduce_window(x, "mean", (1, 1, 2, 2))


def test_input_gradient_of_a_strided_conv_counts_only_taps_on_real_entries():
    """x (1, 16, 16, 4), w 3x3x4x8, stride 2, SAME (padding (0, 1)). Per spatial dim the forward
    pairs 8 outputs with 3 taps: 24 (output, tap) pairs, one on padding (output 7's tap 2 reads row
    16), 23 on real rows. The input gradient convolves the cotangent dilated by 2 (15 rows, 7 of
    them holes) with the flipped kernel: of its 16 outputs x 3 taps = 48 pairs per dim, exactly those
    23 meet a real cotangent entry. So it makes 2 x 4 x 8 x 23² FLOPs, not 2 x 16² x 4 x 8 x 9 (4.4x
    as many, and 4x the forward's 2 x 8² x 8 x 4 x 9)."""
    b = GraphBuilder("strided")
    x, w = b.parameter((1, 16, 16, 4), name="x"), b.parameter((3, 3, 4, 8), name="w")
    y = b.conv(x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    grads = append_backward(b, b.reduce(b.mul(y, y), (0, 1, 2, 3)), (x, w))
    graph = b.build()
    assert graph[grads[x]].attr("lhs_dilation") == (2, 2)
    assert node_flops(graph, graph[y]) == 2 * 8 * 8 * 8 * 4 * 9
    assert node_flops(graph, graph[grads[x]]) == 2 * 4 * 8 * 23 * 23
    assert node_flops(graph, graph[grads[w]]) == 2 * 3 * 3 * 4 * 8 * 8 * 8  # every tap real: no dilated input
