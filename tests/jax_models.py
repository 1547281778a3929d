"""Small JAX functions shared by the capture and runtime tests (kept here, not in src: test data)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mlp_loss(params, x, y):
    """Two-layer MLP with a ReLU, mean squared error."""
    h = jax.nn.relu(x @ params[0])
    return jnp.mean((h @ params[1] - y) ** 2)


def mlp_step(params, x, y):
    """One SGD step (learning rate 0.1) on `mlp_loss`."""
    grads = jax.grad(mlp_loss)(params, x, y)
    return [p - 0.1 * g for p, g in zip(params, grads, strict=True)]


def mlp_args(batch, d_in, hidden, d_out, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    params = [jax.random.normal(k[0], (d_in, hidden)) / d_in**0.5,
              jax.random.normal(k[1], (hidden, d_out)) / hidden**0.5]
    return params, jax.random.normal(k[2], (batch, d_in)), jax.random.normal(k[3], (batch, d_out))


def _layer_norm(x):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5)


def transformer_block(params, x, heads=4):
    """Pre-LN self-attention + GELU MLP block; x is [batch, seq, hidden]."""
    b, s, h = x.shape
    y = _layer_norm(x)
    q, k, v = (jnp.einsum("bsh,hd->bsd", y, params[n]).reshape(b, s, heads, h // heads) for n in ("wq", "wk", "wv"))
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / (h // heads) ** 0.5
    attn = jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(scores, axis=-1), v).reshape(b, s, h)
    x = x + attn @ params["wo"]
    y = jax.nn.gelu(_layer_norm(x) @ params["w1"])
    return x + y @ params["w2"]


def transformer_args(batch=8, seq=16, hidden=64, ffn=256, seed=0):
    k = jax.random.split(jax.random.key(seed), 7)
    shapes = {"wq": (hidden, hidden), "wk": (hidden, hidden), "wv": (hidden, hidden), "wo": (hidden, hidden),
              "w1": (hidden, ffn), "w2": (ffn, hidden)}
    pairs = zip(k[:6], shapes.items(), strict=True)
    params = {n: jax.random.normal(key, shape) / shape[0] ** 0.5 for key, (n, shape) in pairs}
    return params, jax.random.normal(k[6], (batch, seq, hidden))


# A 4-layer tanh MLP as a list of per-layer parameters, for the pipeline tests.
PIPE_SIZES = (16, 32, 32, 32, 4)  # 16 -> 32 -> 32 -> 32 -> 4
PIPE_BATCH = 8


def pipe_mlp_params(seed=0):
    import numpy as np

    keys = jax.random.split(jax.random.PRNGKey(seed), len(PIPE_SIZES) - 1)
    return [{"w": jax.random.normal(k, (i, o), jnp.float32) / np.sqrt(i), "b": jnp.full((o,), 0.1, jnp.float32)}
            for k, i, o in zip(keys, PIPE_SIZES[:-1], PIPE_SIZES[1:], strict=True)]


def pipe_data(seed=1):
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    return (jax.random.normal(kx, (PIPE_BATCH, PIPE_SIZES[0]), jnp.float32),
            jax.random.normal(ky, (PIPE_BATCH, PIPE_SIZES[-1]), jnp.float32))


def pipe_layers(params, x):
    for layer in params:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x
