"""Train a two-layer MLP for a few SGD steps under `meshplan.parallelize` on 8 CPU devices.

Run: python examples/mlp.py   (prints loss and step time; the first step includes planning)
Across processes: meshplan launch --nprocs 2 --devices-per-process 4 -- python examples/mlp.py
"""

from __future__ import annotations

import os

# XLA reads these once, when JAX initialises: set them before importing JAX.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import meshplan.launch  # noqa: E402
from meshplan.parallel import ShardParallel, parallelize  # noqa: E402

LEARNING_RATE = 0.1


def init(key, d_in=256, hidden=1024, d_out=256):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (d_in, hidden)) / d_in**0.5, "b1": jnp.zeros((hidden,)),
            "w2": jax.random.normal(k2, (hidden, d_out)) / hidden**0.5}


def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


@parallelize(method=ShardParallel())
def train_step(params, batch):
    """One SGD step; returns the new parameters and the loss."""
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    return jax.tree_util.tree_map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss


def main(steps: int = 5, batch_size: int = 256) -> None:
    meshplan.launch.initialize()  # joins the job under `meshplan launch`; nothing when run alone
    kp, kx, kw = jax.random.split(jax.random.key(0), 3)
    params = init(kp)
    x = jax.random.normal(kx, (batch_size, 256))
    y = jnp.tanh(x @ jax.random.normal(kw, (256, 256)) / 16)  # a learnable target
    print(f"{len(jax.devices())} devices; the first step captures, plans and compiles")
    for step in range(steps):
        start = time.perf_counter()
        params, loss = train_step(params, (x, y))
        loss = float(loss)  # waits for the step to finish
        print(f"step {step}: loss {loss:.5f}  time {time.perf_counter() - start:.3f} s")
    plan = train_step.get_plan()
    print(f"plan on mesh {plan.mesh.name}: objective {plan.objective:.3e} s, "
          f"peak memory {plan.peak_memory / 1e6:.2f} MB per device")


if __name__ == "__main__":
    main()
