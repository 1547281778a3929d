"""One process of tests/test_multihost.py, started by `meshplan launch`: joins the job, trains the MLP
step under `parallelize` with each method asked for, over every device of every process, and writes
its losses and plans to OUT/rank<N>.json.

Run: meshplan launch --nprocs 2 --devices-per-process 4 -- python tests/multihost_worker.py OUT shard,dp
With --fault kill|hang, rank 1 kills itself (SIGKILL) or sleeps forever right after joining.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import meshplan.launch

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("methods")
parser.add_argument("--fault", choices=("none", "kill", "hang"), default="none")
args = parser.parse_args()

worker = meshplan.launch.initialize()
assert worker is not None, "run me with meshplan launch"
if worker.process_id == 1 and args.fault != "none":
    print(f"fault at {time.time()}", file=sys.stderr, flush=True)  # the test times the launcher from here
    if args.fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        time.sleep(60)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshplan.parallel import DataParallel, PipeshardParallel, ShardParallel, parallelize  # noqa: E402
from multihost_step import STEPS, make_data, pipelined_loss, predict, step  # noqa: E402


def train(method_name: str) -> dict:
    state, x, y = make_data()
    if method_name == "pipeinfer":  # an inference step, forward only: its outputs where the last stage holds them
        f = parallelize(predict, method=PipeshardParallel(2))
        return {"outputs": [_held(f(state, x))], "plan": _plan_hash(f)}
    if method_name == "pipeloss":  # a loss function cut by mark_pipeline_boundary: loss and grads
        f = parallelize(pipelined_loss, method=PipeshardParallel(2))
        loss, grads = f([state["w1"], state["w2"]], x, y)
        return {"losses": [float(loss)], "grads": [_held(g) for g in grads], "plan": _plan_hash(f)}
    method = {"shard": ShardParallel(), "dp": DataParallel(), "pipeshard": PipeshardParallel(2),
              "pipeshard4": PipeshardParallel(4, schedule="gpipe")}[method_name]
    f = parallelize(step, method=method, batch_argnums=(1, 2))
    losses = []
    for _ in range(STEPS):
        state, loss = f(state, x, y)
        losses.append(float(loss))
    plan = f.get_plan()
    if method_name.startswith("pipeshard"):
        return {"losses": losses, "params": {k: _held(v) for k, v in state.items()}, "plan": _plan_hash(f)}
    return {"losses": losses, "mesh": list(plan.mesh.shape), "objective": plan.objective}


def _held(value) -> list:
    """The shards of `value` this process holds: [index as (start, stop) pairs, values]."""
    return [[[(s.start, s.stop) for s in shard.index], np.asarray(shard.data).tolist()]
            for shard in value.addressable_shards]


def _plan_hash(f) -> str:
    return f.get_plan().fingerprint()


results = {name: train(name) for name in args.methods.split(",")}
report = {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
          "local": jax.local_device_count(), "results": results}
Path(args.out, f"rank{worker.process_id}.json").write_text(json.dumps(report))
print(f"rank {worker.process_id} done", flush=True)
