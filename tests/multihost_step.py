"""The training step tests/test_multihost.py runs in two processes and in one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

STEPS = 3


def step(params, x, y):
    def loss(p):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, params, grads), value


def pipelined_loss(params, x, y):
    from meshplan.runtime import mark_pipeline_boundary

    h = mark_pipeline_boundary(jnp.tanh(x @ params[0]))
    return jnp.mean((h @ params[1] - y) ** 2)


def predict(params, x):
    """An inference step (no gradient): pipelined forward only."""
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def make_data():
    """Host (NumPy) arrays, identical in every process."""
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (32, 64)) / 8, "w2": jax.random.normal(k[1], (64, 16)) / 8}
    x, y = jax.random.normal(k[2], (16, 32)), jax.random.normal(k[3], (16, 16))
    return jax.tree_util.tree_map(np.asarray, (params, x, y))
