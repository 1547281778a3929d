"""Train a small GPT (plain JAX, hand-written Adam) for a few steps under `parallelize` on 8 CPU devices.

Run: python examples/gpt.py [shard|dp|zero2|zero3|tp]   (default: shard; prints loss and step time)
"""

from __future__ import annotations

import os

# XLA reads these once, when JAX initialises: set them before importing JAX.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from meshplan.parallel import (  # noqa: E402
    DataParallel,
    ShardParallel,
    TensorParallel,
    Zero2Parallel,
    Zero3Parallel,
    parallelize,
)

METHODS = {"shard": ShardParallel(), "dp": DataParallel(), "zero2": Zero2Parallel(), "zero3": Zero3Parallel(),
           "tp": TensorParallel()}


@dataclass(frozen=True)
class Config:
    vocab: int = 128
    seq: int = 32
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    batch: int = 16
    lr: float = 3e-3


def init(cfg: Config, key):
    keys = iter(jax.random.split(key, 2 + 6 * cfg.layers))
    dense = lambda n, m: jax.random.normal(next(keys), (n, m)) / n**0.5  # noqa: E731
    h = cfg.hidden
    blocks = [{"wq": dense(h, h), "wk": dense(h, h), "wv": dense(h, h), "wo": dense(h, h),
               "w1": dense(h, 4 * h), "w2": dense(4 * h, h)} for _ in range(cfg.layers)]
    return {"wte": 0.02 * jax.random.normal(next(keys), (cfg.vocab, h)),
            "wpe": 0.02 * jax.random.normal(next(keys), (cfg.seq, h)), "blocks": blocks}


def layer_norm(x):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(jnp.mean((x - mean) ** 2, axis=-1, keepdims=True) + 1e-5)


def block(p, x, heads):
    b, s, h = x.shape
    y = layer_norm(x)
    q, k, v = (jnp.einsum("bsh,hd->bsd", y, p[n]).reshape(b, s, heads, h // heads) for n in ("wq", "wk", "wv"))
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / (h // heads) ** 0.5
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)  # causal
    x = x + jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(scores, axis=-1), v).reshape(b, s, h) @ p["wo"]
    return x + jax.nn.gelu(layer_norm(x) @ p["w1"]) @ p["w2"]


def loss_fn(params, tokens, heads):
    x = jnp.take(params["wte"], tokens[:, :-1], axis=0) + params["wpe"]
    for p in params["blocks"]:
        x = block(p, x, heads)
    logp = jax.nn.log_softmax(layer_norm(x) @ params["wte"].T)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def make_step(cfg: Config, b1=0.9, b2=0.999, eps=1e-8):
    """Adam written out: state = (params, m, v, t)."""
    def train_step(state, tokens):
        params, m, v, t = state
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, cfg.heads)
        t = t + 1
        m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
        v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
        scale = cfg.lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
        params = jax.tree_util.tree_map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + eps), params, m, v)
        return (params, m, v, t), loss
    return train_step


def main(method: str = "shard", steps: int = 6, cfg: Config = Config()) -> None:
    if method not in METHODS:
        sys.exit(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    params = init(cfg, jax.random.key(0))
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    state = (params, zeros, zeros, jnp.zeros((), jnp.float32))
    # A fixed batch the model can memorise, so the loss visibly falls in a few steps.
    tokens = jax.random.randint(jax.random.key(1), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    train_step = parallelize(make_step(cfg), method=METHODS[method])
    print(f"{len(jax.devices())} devices, method {METHODS[method]}; the first step captures, plans and compiles")
    for step in range(steps):
        start = time.perf_counter()
        with warnings.catch_warnings():  # gather/scatter-add (the embedding) are planned replicated
            warnings.simplefilter("ignore", UserWarning)
            state, loss = train_step(state, tokens)
        loss = float(loss)  # waits for the step to finish
        print(f"step {step}: loss {loss:.4f}  time {time.perf_counter() - start:.3f} s")
    plan = train_step.get_plan()
    print(f"plan on mesh {plan.mesh.name}: {len(plan.nodes)} nodes, objective {plan.objective:.3e} s, "
          f"peak memory {plan.peak_memory / 1e6:.2f} MB per device, unsupported ops {plan.unsupported_ops}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "shard")
