"""SGD and Adam updates, run by the interpreter, against NumPy references; aliases and master weights."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan import GraphBuilder, GraphError
from meshplan.ir import DType, OpKind
from meshplan.ir.autodiff import append_backward
from meshplan.ir.interpret import cast, evaluate
from meshplan.models.optimizers import append_adam, append_sgd

RNG = np.random.default_rng(0)
W = RNG.normal(size=(2, 3))
G = RNG.normal(size=(2, 3))
M = RNG.normal(size=(2, 3))
V = RNG.uniform(0.1, 1.0, size=(2, 3))


def adam_reference(w, g, m, v, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, step=1):
    """Adam as in the paper (Kingma & Ba, Algorithm 1), bias corrections unfolded."""
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1 ** step), v / (1 - b2 ** step)
    return w - lr * m_hat / (np.sqrt(v_hat) + eps), m, v


def by_name(graph, name):
    return next(n.id for n in graph.nodes if n.name == name)


def params_and_grads(dtype="f64", layer=None):
    b = GraphBuilder("step")
    if layer is None:
        w = b.parameter((2, 3), dtype, name="w")
    else:
        with b.layer(layer):
            w = b.parameter((2, 3), dtype, name="w")
    g = b.parameter((2, 3), dtype, name="g")
    return b, w, g


# -- SGD -----------------------------------------------------------------------------------------


def test_sgd_update_and_alias():
    b, w, g = params_and_grads("f32")
    new = append_sgd(b, [w], {w: g}, lr=0.1)
    graph = b.build()
    value = evaluate(graph, {"w": W, "g": G})[new[w]]
    w32, g32 = W.astype(np.float32), G.astype(np.float32)
    np.testing.assert_array_equal(value, w32 - g32 * np.float32(0.1))
    assert graph.aliases == ((w, new[w]),) and graph[new[w]].name == "w.new"


def test_sgd_takes_grads_aligned_with_params_and_tags_the_layer():
    b, w, g = params_and_grads(layer=4)
    n_before = len(b.build())
    new = append_sgd(b, [w], [g], lr=0.5)
    graph = b.build()
    np.testing.assert_allclose(evaluate(graph, {"w": W, "g": G})[new[w]], W - 0.5 * G, rtol=1e-15)
    assert {n.layer for n in graph.nodes[n_before:]} == {4}


# -- Adam ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [1, 3])
def test_adam_matches_the_paper(step):
    b, w, g = params_and_grads()
    new = append_adam(b, [w], {w: g}, lr=0.01, b1=0.8, b2=0.99, eps=1e-3, step=step)
    graph = b.build()
    values = evaluate(graph, {"w": W, "g": G, "w.adam_m": M, "w.adam_v": V})
    want_w, want_m, want_v = adam_reference(W, G, M, V, 0.01, 0.8, 0.99, 1e-3, step)
    np.testing.assert_allclose(values[new[w]], want_w, rtol=1e-14)
    np.testing.assert_allclose(values[by_name(graph, "w.adam_m.new")], want_m, rtol=1e-14)
    np.testing.assert_allclose(values[by_name(graph, "w.adam_v.new")], want_v, rtol=1e-14)


def test_adam_state_is_aliased_and_tagged():
    b, w, g = params_and_grads("f32", layer=2)
    n_before = len(b.build())
    new = append_adam(b, [w], {w: g})
    graph = b.build()
    m, v = by_name(graph, "w.adam_m"), by_name(graph, "w.adam_v")
    assert graph[m].kind is OpKind.PARAMETER and graph[m].dtype is DType.F32 and graph[v].shape == (2, 3)
    assert set(graph.aliases) == {(m, by_name(graph, "w.adam_m.new")), (v, by_name(graph, "w.adam_v.new")),
                                  (w, new[w])}
    assert {n.layer for n in graph.nodes[n_before:]} == {2}


def test_adam_on_low_precision_weights_without_master_computes_in_f32():
    b, w, g = params_and_grads("bf16")
    new = append_adam(b, [w], {w: g}, lr=0.1)
    graph = b.build()
    assert graph[new[w]].dtype is DType.BF16 and graph[by_name(graph, "w.adam_m")].dtype is DType.F32
    values = evaluate(graph, {"w": W, "g": G, "w.adam_m": M, "w.adam_v": V})
    w16, g16 = cast(W, DType.BF16), cast(G, DType.BF16)
    want, _, _ = adam_reference(w16, g16, M.astype(np.float32), V.astype(np.float32), lr=0.1)
    np.testing.assert_array_equal(values[new[w]], cast(want, DType.BF16))


def test_adam_with_fp32_master_weights():
    b, w, g = params_and_grads("bf16", layer=1)
    new = append_adam(b, [w], {w: g}, lr=0.1, master_dtype="f32")
    graph = b.build()
    master, m, v = (by_name(graph, f"w.{s}") for s in ("master", "adam_m", "adam_v"))
    new_master = by_name(graph, "w.master.new")
    assert [graph[i].dtype for i in (master, m, v, new_master, new[w])] == [DType.F32] * 4 + [DType.BF16]
    assert set(graph.aliases) == {(master, new_master), (w, new[w]), (m, by_name(graph, "w.adam_m.new")),
                                  (v, by_name(graph, "w.adam_v.new"))}
    assert graph[new[w]].op == "convert" and graph[new[w]].operands == (new_master,)
    assert {graph[i].layer for i in (master, m, v, new_master, new[w])} == {1}

    master_value = W.astype(np.float32)
    values = evaluate(graph, {"w": W, "g": G, "w.master": master_value, "w.adam_m": M, "w.adam_v": V})
    want, _, _ = adam_reference(master_value.astype(np.float64), cast(G, DType.BF16).astype(np.float64), M, V, lr=0.1)
    np.testing.assert_allclose(values[new_master], want, rtol=1e-6)
    np.testing.assert_array_equal(values[new[w]], cast(values[new_master], DType.BF16))


def test_master_dtype_leaves_fp32_weights_alone():
    b, w, g = params_and_grads("f32")
    append_adam(b, [w], {w: g}, master_dtype="f32")
    assert not any(n.name == "w.master" for n in b.build().nodes)


def test_optimizer_errors():
    b, w, g = params_and_grads()
    with pytest.raises(GraphError, match="no gradient for parameter w; include it in append_backward's wrt"):
        append_sgd(b, [w], {})
    with pytest.raises(GraphError, match="1 parameters but 2 gradients"):
        append_adam(b, [w], [g, g])
    with pytest.raises(GraphError, match=r"has shape \(3,\), but parameter w has shape \(2, 3\)"):
        append_sgd(b, [w], {w: b.parameter((3,), "f64")})
    with pytest.raises(GraphError, match="step must be at least 1"):
        append_adam(b, [w], {w: g}, step=0)


# -- a whole training step -----------------------------------------------------------------------


def test_training_step_of_a_linear_model():
    """loss = sum((x w)^2) / 2 so dL/dw = x^T (x w); one Adam step from zero state moves w by ~lr."""
    b = GraphBuilder("train")
    x = b.parameter((4, 3), "f64", name="x")
    w = b.parameter((3, 2), "f64", name="w")
    y = b.matmul(x, w)
    loss = b.mul(b.reduce(b.mul(y, y), (0, 1)), b.full((), 0.5, "f64"), name="loss")
    grads = append_backward(b, loss, [w])
    new = append_adam(b, [w], grads, lr=0.01)
    b.outputs(loss)
    graph = b.build()
    xv, wv = RNG.normal(size=(4, 3)), RNG.normal(size=(3, 2))
    zeros = np.zeros((3, 2))
    values = evaluate(graph, {"x": xv, "w": wv, "w.adam_m": zeros, "w.adam_v": zeros})
    want, _, _ = adam_reference(wv, xv.T @ (xv @ wv), zeros, zeros, lr=0.01)
    np.testing.assert_allclose(values[new[w]], want, rtol=1e-13)
    assert len(graph.aliases) == 3
