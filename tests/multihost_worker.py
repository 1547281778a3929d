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

from meshplan.errors import MeshplanError  # noqa: E402
from meshplan.parallel import DataParallel, PipeshardParallel, ShardParallel, parallelize  # noqa: E402
from multihost_step import STEPS, make_data, pipelined_loss, step  # noqa: E402


def train(method_name: str) -> dict:
    state, x, y = make_data()
    if method_name == "pipeshard":  # not supported across processes: the error must say so
        try:
            parallelize(pipelined_loss, method=PipeshardParallel(2))([state["w1"], state["w2"]], x, y)
        except MeshplanError as error:
            return {"error": str(error)}
        return {"error": ""}
    method = {"shard": ShardParallel(), "dp": DataParallel()}[method_name]
    f = parallelize(step, method=method, batch_argnums=(1, 2))
    losses = []
    for _ in range(STEPS):
        state, loss = f(state, x, y)
        losses.append(float(loss))
    plan = f.get_plan()
    return {"losses": losses, "mesh": list(plan.mesh.shape), "objective": plan.objective}


results = {name: train(name) for name in args.methods.split(",")}
report = {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
          "local": jax.local_device_count(), "results": results}
Path(args.out, f"rank{worker.process_id}.json").write_text(json.dumps(report))
print(f"rank {worker.process_id} done", flush=True)
