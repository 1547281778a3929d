"""Train a Hugging Face Flax GPT-2 (small config, random weights) with optax AdamW under each
meshplan method on 8 CPU devices; the step is written as optax's docs write it. "pipeshard"
pipelines the same whole step: its loss cut into 4 layers by FLOPs, one stage of 2 devices per
layer, 4 micro-batches, the AdamW update on each stage's devices.

Run: python examples/hf_flax_gpt2.py [--steps N] [--methods shard,dp,zero2,zero3,tp,pipeshard]
Across processes: meshplan launch --nprocs 2 --devices-per-process 4 -- python examples/hf_flax_gpt2.py
(the pipeshard variant then runs stages 0-1 in process 0 and stages 2-3 in process 1; docs/multihost.md)
"""

from __future__ import annotations

import os

# XLA reads these once, when JAX initialises: set them before importing JAX.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

import meshplan  # noqa: E402
import meshplan.launch  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)  # transformers: Flax models are deprecated upstream
from transformers import FlaxGPT2LMHeadModel, GPT2Config  # noqa: E402

METHODS = {"shard": meshplan.ShardParallel(), "dp": meshplan.DataParallel(), "zero2": meshplan.Zero2Parallel(),
           "zero3": meshplan.Zero3Parallel(), "tp": meshplan.TensorParallel(),
           "pipeshard": meshplan.PipeshardParallel(num_micro_batches=4, layers=4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()
    meshplan.launch.initialize()  # under `meshplan launch`: join the job (every process runs this script)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=8)
    model = FlaxGPT2LMHeadModel(config, seed=0)  # random weights: nothing is downloaded
    optimizer = optax.adamw(3e-3)

    def loss_fn(params, ids):
        logits = model(ids, params=params).logits[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    def step(params, opt_state, ids):  # meshplan finds that ids is the batch: no batch_argnums needed
        loss, grads = jax.value_and_grad(loss_fn)(params, ids)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    ids = jax.random.randint(jax.random.key(0), (16, 32), 0, config.vocab_size)
    for name in args.methods.split(","):
        parallel = meshplan.parallelize(step, method=METHODS[name])
        params, opt_state = model.params, optimizer.init(model.params)
        for k in range(args.steps):
            start = time.perf_counter()
            params, opt_state, loss = parallel(params, opt_state, ids)
            print(f"{name} step {k}: loss {float(loss):.4f} ({time.perf_counter() - start:.2f} s)")
        plan = parallel.get_plan()
        if name == "pipeshard":
            print(f"{name}: stages " + ", ".join(f"layer {s.first_layer} on devices {s.devices} as {s.logical_mesh}"
                                                 for s in plan.stages))
        else:
            print(f"{name}: mesh {plan.mesh.shape}, batch {parallel.describe_batch()}")


if __name__ == "__main__":
    main()
