"""One process of tests/test_multihost.py: joins a 2-process JAX cluster of 4 CPU devices each
(127.0.0.1, gloo collectives), trains the MLP step under `parallelize` on all 8 devices and
prints its losses and plan as one JSON line.

Run: python tests/multihost_worker.py PROCESS_ID PORT METHOD
"""

from __future__ import annotations

import json
import os
import sys

process_id, port, method_name = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # before JAX starts

import jax  # noqa: E402

jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

from meshplan.errors import MeshplanError  # noqa: E402
from meshplan.parallel import (  # noqa: E402
    DataParallel,
    PipeshardParallel,
    ShardParallel,
    parallelize,
)
from multihost_step import STEPS, make_data, pipelined_loss, step  # noqa: E402

state, x, y = make_data()
if method_name == "pipeshard":  # not supported across processes: the error must say so
    f = parallelize(pipelined_loss, method=PipeshardParallel(2))
    try:
        f([state["w1"], state["w2"]], x, y)
    except MeshplanError as error:
        print(json.dumps({"process": jax.process_index(), "error": str(error)}), flush=True)
    jax.distributed.shutdown()
    sys.exit(0)
method = {"shard": ShardParallel(), "dp": DataParallel()}[method_name]
f = parallelize(step, method=method, batch_argnums=(1, 2))
losses = []
for _ in range(STEPS):
    state, loss = f(state, x, y)
    losses.append(float(loss))
plan = f.get_plan()
print(json.dumps({"process": jax.process_index(), "devices": jax.device_count(), "local": jax.local_device_count(),
                  "losses": losses, "mesh": list(plan.mesh.shape), "objective": plan.objective}), flush=True)
jax.distributed.shutdown()
