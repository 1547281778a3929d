"""Train a 4-block GPT (plain JAX, optax Adam) as a pipeline with sharded stages on 8 CPU devices.

Run: python examples/pipeshard_gpt.py [--stages uniform|auto] [--stage-sharding auto|data_parallel|replicated]
                                     [--micro-batches N] [--schedule 1f1b|gpipe]

Each `mark_pipeline_boundary` ends a layer (here: a transformer block; the first also embeds,
the last also holds the head). stages="uniform" puts one layer per stage on equal device groups;
"auto" lets meshplan's inter-op search group layers and size sub-meshes. Prints the plan, then
loss and step time per step.
"""

from __future__ import annotations

import os

# XLA reads these once, when JAX initialises: set them before importing JAX.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from gpt import block as gpt_block  # noqa: E402  (examples/gpt.py, beside this file)
from gpt import layer_norm  # noqa: E402

from meshplan import mark_pipeline_boundary  # noqa: E402
from meshplan.parallel import (
    PipeshardParallel,  # noqa: E402
    parallelize,  # noqa: E402
)
from meshplan.report.pipeshard_text import pipeshard_text  # noqa: E402

VOCAB, SEQ, HIDDEN, HEADS, BLOCKS, BATCH = 128, 32, 64, 4, 4, 16


def loss_fn(params, tokens, targets):
    """params[k] is layer k's: block k, plus the embeddings (first) or the head (last)."""
    x = jnp.take(params[0]["wte"], tokens, axis=0) + params[0]["wpe"]
    for k, p in enumerate(params):
        x = gpt_block(p["block"], x, HEADS)
        if k < len(params) - 1:
            x = mark_pipeline_boundary(x)
    logp = jax.nn.log_softmax(layer_norm(x) @ params[-1]["head"])
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def init(key):
    keys = iter(jax.random.split(key, 3 + 6 * BLOCKS))
    dense = lambda n, m: jax.random.normal(next(keys), (n, m)) / n**0.5  # noqa: E731
    layers = [{"block": {"wq": dense(HIDDEN, HIDDEN), "wk": dense(HIDDEN, HIDDEN), "wv": dense(HIDDEN, HIDDEN),
                         "wo": dense(HIDDEN, HIDDEN), "w1": dense(HIDDEN, 4 * HIDDEN), "w2": dense(4 * HIDDEN, HIDDEN)}}
              for _ in range(BLOCKS)]
    layers[0].update(wte=0.02 * jax.random.normal(next(keys), (VOCAB, HIDDEN)),
                     wpe=0.02 * jax.random.normal(next(keys), (SEQ, HIDDEN)))
    layers[-1]["head"] = dense(HIDDEN, VOCAB)
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", choices=("uniform", "auto"), default="auto")
    parser.add_argument("--stage-sharding", choices=("auto", "data_parallel", "replicated"), default="auto")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    method = PipeshardParallel(args.micro_batches, stages=args.stages, schedule=args.schedule,
                               stage_sharding=args.stage_sharding)
    params = init(jax.random.key(0))
    # A fixed batch the model can memorise, so the loss visibly falls in a few steps.
    tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, VOCAB)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    step_fn = parallelize(loss_fn, method=method)
    tx = optax.adam(3e-3)
    update = jax.jit(lambda p, g, s: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
    states = None
    print(f"{len(jax.devices())} devices, {method}; the first step captures, plans and compiles")
    for step in range(args.steps):
        start = time.perf_counter()
        loss, grads = step_fn(params, inputs, targets)
        # Each layer's update runs where its grads are: on its stage's sub-mesh.
        params = [jax.tree_util.tree_map(lambda a, g: jax.device_put(a, g.sharding), p, g)
                  for p, g in zip(params, grads, strict=True)]
        states = [jax.jit(tx.init)(p) for p in params] if states is None else states
        stepped = [update(p, g, s) for p, g, s in zip(params, grads, states, strict=True)]
        params, states = [p for p, _ in stepped], [s for _, s in stepped]
        loss = float(loss)  # waits for the step to finish
        print(f"step {step}: loss {loss:.4f}  time {time.perf_counter() - start:.3f} s")
        if step == 0:
            print(pipeshard_text(step_fn.get_plan()))


if __name__ == "__main__":
    main()
