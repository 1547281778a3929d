"""One process of a multi-process pipelined GPT-2 run, started by `meshplan launch`: trains Hugging Face
Flax GPT-2 (tiny config, random weights, tied embedding) with optax AdamW after global-norm clipping
under a whole-step PipeshardParallel over every device of every process, trains the same steps with
`jax.jit` on one of its own devices, and writes OUT/rank<N>.json: both runs' losses, the plan's
fingerprint and, for the parameters this process holds, the sums that give their error.

Run: meshplan launch --nprocs 2 --devices-per-process 4 -- python tests/multihost_gpt2.py OUT --layers 4
Used by tests/test_multihost.py and benchmarks/check_multihost_pipeshard.py (every layout).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import meshplan.launch

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--layers", default="2", help="a number, or auto")
parser.add_argument("--stages", default="uniform", choices=("uniform", "auto"))
parser.add_argument("--schedule", default="1f1b")
parser.add_argument("--micro-batches", type=int, default=2)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

worker = meshplan.launch.initialize()
assert worker is not None, "run me with meshplan launch"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from framework_models import gpt2, lm_step, tokens  # noqa: E402
from meshplan.parallel import PipeshardParallel, parallelize  # noqa: E402


def train(step, params, opt_state, ids):
    losses = []
    for _ in range(args.steps):
        params, opt_state, loss = step(params, opt_state, ids)
        losses.append(float(loss))
    return params, losses


def held_error(got, want) -> dict:
    """Per parameter leaf, over the shards of `got` this process holds (each slice once):
    [sum |got - want|, sum |want|, the slices as (start, stop) pairs]."""
    found = {}
    for (path, value), expected in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(want),
                                       strict=True):
        seen, diff, size = set(), 0.0, 0.0
        for shard in value.addressable_shards:
            index = tuple((s.start, s.stop) for s in shard.index)
            if index in seen:
                continue
            seen.add(index)
            part = np.asarray(expected)[shard.index]
            diff += float(np.abs(np.asarray(shard.data) - part).sum())
            size += float(np.abs(part).sum())
        found[jax.tree_util.keystr(path)] = [diff, size, sorted(seen)]
    return found


model = gpt2(layers=2)
optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
step = lm_step(model, optimizer)
ids = tokens()
params = jax.tree_util.tree_map(np.asarray, model.params)  # host values, equal in every process
layers = args.layers if args.layers == "auto" else int(args.layers)
method = PipeshardParallel(args.micro_batches, layers=layers, stages=args.stages, schedule=args.schedule)
pipelined = parallelize(step, method=method)
got, losses = train(pipelined, params, optimizer.init(params), ids)
plan = pipelined.get_plan()
one = jax.local_devices()[0]
want, want_losses = train(jax.jit(step, device=one), jax.device_put(params, one),
                          jax.device_put(optimizer.init(params), one), jax.device_put(ids, one))
report = {"process": jax.process_index(), "losses": losses, "one_device_losses": want_losses,
          "plan": plan.fingerprint(), "stages": [list(s.devices) for s in plan.stages],
          "params": held_error(got, want)}
Path(args.out, f"rank{worker.process_id}.json").write_text(json.dumps(report))
print(f"rank {worker.process_id} done: stages {report['stages']}", flush=True)
