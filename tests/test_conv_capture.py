"""Flax convolutional networks capture without opaque nodes: Conv (NHWC, strides, SAME padding),
BatchNorm with mutable batch statistics, max and average pooling, and their gradients (the
average pooling's as one window sum of the dilated cotangent); the captured graph, run by the IR
interpreter, gives what JAX gives."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from conv_steps import numpy_init
from meshplan.capture import capture
from meshplan.ir import OpKind
from meshplan.ir.interpret import evaluate


class TinyCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(4, (3, 3), strides=(2, 2))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        x = nn.Conv(6, (3, 3), padding=((1, 1), (0, 2)), kernel_dilation=(1, 2))(x)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(5)(x.reshape((x.shape[0], -1)))


def test_flax_cnn_gradient_step_captures_whole_and_runs_like_jax():
    model = TinyCNN()
    x = np.random.default_rng(1).standard_normal((2, 16, 16, 3)).astype(np.float32)
    variables = numpy_init(model, x, seed=0)

    def grads(params, batch_stats, images):
        def loss(p):
            y, updates = model.apply({"params": p, "batch_stats": batch_stats}, images, mutable=["batch_stats"])
            return jnp.mean(y ** 2), updates["batch_stats"]
        return jax.grad(loss, has_aux=True)(params)

    captured = capture(grads, variables["params"], variables["batch_stats"], x)
    assert captured.unsupported == ()
    kinds = {n.kind for n in captured.graph.nodes}
    assert {OpKind.CONV, OpKind.REDUCE_WINDOW, OpKind.SELECT_AND_SCATTER_ADD, OpKind.REVERSE} <= kinds
    # The average pooling and its gradient: JAX's zero padding with holes and its window sum are
    # folded into one window sum of the dilated cotangent (capture/folding.py), as XLA writes it.
    sums = [n for n in captured.graph.nodes if n.kind is OpKind.REDUCE_WINDOW and n.attr("op") == "sum"]
    assert [(n.attr("window_dimensions"), n.attr("window_strides"), n.attr("base_dilation"), n.attr("padding"))
            for n in sums] == [((1, 2, 2, 1), (1, 2, 2, 1), (1, 1, 1, 1), ((0, 0),) * 4),
                               ((1, 2, 2, 1), (1, 1, 1, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (1, 1), (0, 0)))]
    flat = jax.tree_util.tree_leaves((variables["params"], variables["batch_stats"], x))
    values = evaluate(captured.graph, {node: np.asarray(v) for node, v in zip(captured.input_nodes, flat,
                                                                                strict=True)})
    want = jax.tree_util.tree_leaves(jax.jit(grads)(variables["params"], variables["batch_stats"], x))
    for node, expected in zip(captured.output_nodes, want, strict=True):
        np.testing.assert_allclose(values[node], expected, rtol=2e-4, atol=2e-5)


def test_interior_padding_captures_as_a_base_dilated_window_sum():
    x = np.random.default_rng(2).standard_normal((2, 3, 4)).astype(np.float32)
    config = ((0, 0, 0), (1, 2, 1), (2, 0, 2))
    for fn in (lambda v: jax.lax.pad(v, 0.0, config), lambda v: jax.lax.pad(v, v[0, 0, 0], config)):
        captured = capture(fn, x)
        assert captured.unsupported == ()
        assert any(n.kind is OpKind.REDUCE_WINDOW for n in captured.graph.nodes)
        values = evaluate(captured.graph, {captured.input_nodes[0]: x})
        # exact with zeros; (x - v) + v rounds (the runtime runs the pad itself, not this form)
        np.testing.assert_allclose(values[captured.output_nodes[0]], fn(x), rtol=1e-6, atol=1e-7)
