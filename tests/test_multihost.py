"""Multi-host: two processes (4 CPU devices each, jax.distributed on 127.0.0.1, gloo
collectives) run one parallelized training step over all 8 devices, and both see the losses
one device computes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from multihost_step import STEPS, make_data, step

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(method: str) -> list[dict]:
    port = str(free_port())
    # The workers import this checkout's meshplan (its src first), whatever is installed.
    path = os.pathsep.join(str(p) for p in (HERE.parent / "src", HERE))
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": path}
    procs = [subprocess.Popen([sys.executable, str(HERE / "multihost_worker.py"), str(i), port, method],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in (0, 1)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.parametrize("method", ["shard", "dp"])
def test_two_processes_train_like_one_device(method):
    state, x, y = make_data()
    want = []
    one = jax.jit(step)
    state = jax.device_put(state, jax.devices()[0])
    for _ in range(STEPS):
        state, loss = one(state, x, y)
        want.append(float(loss))
    results = run_two_processes(method)
    assert [r["process"] for r in results] == [0, 1]
    assert all(r["devices"] == 8 and r["local"] == 4 for r in results)
    assert results[0]["mesh"] == results[1]["mesh"] and results[0]["objective"] == results[1]["objective"]
    for r in results:
        np.testing.assert_allclose(r["losses"], want, rtol=1e-5, atol=1e-6)


def test_pipeshard_across_processes_is_a_clear_error():
    results = run_two_processes("pipeshard")
    for r in results:
        assert "PipeshardParallel runs in one process, but JAX runs 2 (jax.distributed)" in r["error"]
