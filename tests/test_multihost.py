"""Multi-host on one machine: `meshplan launch` starts processes of CPU devices (jax.distributed on
127.0.0.1, gloo collectives) that train one parallelized step over every device of every process and
see the losses one device computes; through Ray the same; a killed or hanging worker ends the job with
one message naming it, within 60 s."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from multihost_step import STEPS, make_data, pipelined_loss, predict, step

pytestmark = pytest.mark.slow  # each test launches a job of 2-4 processes (15-70 s on 2 shared cores)

HERE = Path(__file__).parent
WORKER = str(HERE / "multihost_worker.py")


@pytest.fixture(scope="module")
def one_device_run() -> tuple[list[float], dict]:
    """The losses of STEPS steps on one device, and the parameters after them."""
    state, x, y = make_data()
    one = jax.jit(step)
    state = jax.device_put(state, jax.devices()[0])
    losses = []
    for _ in range(STEPS):
        state, loss = one(state, x, y)
        losses.append(float(loss))
    return losses, jax.tree_util.tree_map(np.asarray, state)


@pytest.fixture(scope="module")
def one_device_losses(one_device_run) -> list[float]:
    return one_device_run[0]


def launch(*args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    """`meshplan launch ARGS` with this checkout's meshplan (its src first, whatever is installed) and the
    test helpers importable; its result and wall seconds."""
    path = os.pathsep.join(str(p) for p in (HERE.parent / "src", HERE))
    start = time.monotonic()
    command = [sys.executable, "-m", "meshplan.cli", "launch", *args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": path, "TF_CPP_MIN_LOG_LEVEL": "2"}) as launcher:
        try:
            stdout, stderr = launcher.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM, not the SIGKILL subprocess.run sends: the launcher then ends its workers
            # (they run in sessions of their own) instead of leaving them behind.
            launcher.terminate()
            stdout, stderr = launcher.communicate(timeout=60)
            pytest.fail(f"meshplan launch {' '.join(args)} ran past {timeout} s; its stderr:\n{stderr[-3000:]}")
    result = subprocess.CompletedProcess(command, launcher.returncode, stdout, stderr)
    return result, time.monotonic() - start


def train(tmp_path: Path, nprocs: int, devices: int, methods: str, *options: str) -> list[dict]:
    result, _ = launch("--nprocs", str(nprocs), "--devices-per-process", str(devices), *options, "--", "python",
                       WORKER, str(tmp_path), methods)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "rank 0 done"  # rank 0's output only
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(nprocs)]


def check_like_one_device(reports: list[dict], method: str, want: list[float]) -> None:
    plans = {(tuple(r["results"][method]["mesh"]), r["results"][method]["objective"]) for r in reports}
    assert len(plans) == 1  # every process planned the same step
    for report in reports:
        np.testing.assert_allclose(report["results"][method]["losses"], want, rtol=1e-5, atol=1e-6)


def held_values(reports: list[dict], method: str, key: str) -> dict:
    """Every process's shards of the results `key` (a dict or list of arrays), joined: name -> [(index, values)]."""
    found: dict = {}
    for report in reports:
        values = report["results"][method][key]
        for name, shards in (values.items() if isinstance(values, dict) else enumerate(values)):
            found.setdefault(name, []).extend(shards)
    return found


def check_held_like(reports: list[dict], method: str, key: str, want: dict, rtol: float) -> None:
    """Every element of every array in `want` is held by some process and equals it within `rtol`."""
    held = held_values(reports, method, key)
    for name, expected in want.items():
        covered = np.zeros(expected.shape, bool)
        for index, values in held[name]:
            where = tuple(slice(start, stop) for start, stop in index)
            np.testing.assert_allclose(values, expected[where], rtol=rtol, atol=1e-6)
            covered[where] = True
        assert covered.all(), name


def check_pipelined_like_one_device(reports: list[dict], method: str, run: tuple[list[float], dict]) -> None:
    """Identical plans in every process; every process sees one device's losses; the stages' new
    parameters, wherever they are held, are one device's."""
    assert len({r["results"][method]["plan"] for r in reports}) == 1  # every process planned the same
    for report in reports:
        np.testing.assert_allclose(report["results"][method]["losses"], run[0], rtol=1e-5, atol=1e-6)
    check_held_like(reports, method, "params", run[1], rtol=1e-4)


def test_two_processes_of_four_devices_train_like_one_device(tmp_path, one_device_run):
    reports = train(tmp_path, 2, 4, "shard,dp,pipeshard,pipeloss,pipeinfer")
    assert [(r["process"], r["processes"], r["devices"], r["local"]) for r in reports] == [(0, 2, 8, 4), (1, 2, 8, 4)]
    for method in ("shard", "dp"):
        check_like_one_device(reports, method, one_device_run[0])
    # a whole train step pipelined over 2 stages, one per process
    check_pipelined_like_one_device(reports, "pipeshard", one_device_run)
    # a loss function cut by a mark: loss and grads as jax.value_and_grad gives them
    state, x, y = make_data()
    loss, grads = jax.value_and_grad(pipelined_loss)([state["w1"], state["w2"]], x, y)
    assert len({r["results"]["pipeloss"]["plan"] for r in reports}) == 1
    for report in reports:
        np.testing.assert_allclose(report["results"]["pipeloss"]["losses"], [float(loss)], rtol=1e-6)
    check_held_like(reports, "pipeloss", "grads", dict(enumerate(np.asarray(g) for g in grads)), rtol=1e-5)
    # an inference step: forward only, its outputs on the last stage (process 1)
    assert len({r["results"]["pipeinfer"]["plan"] for r in reports}) == 1
    check_held_like(reports, "pipeinfer", "outputs", {0: np.asarray(predict(state, x))}, rtol=1e-5)


def test_four_processes_of_two_devices_train_like_one_device(tmp_path, one_device_run):
    reports = train(tmp_path, 4, 2, "shard,pipeshard4")
    assert [(r["process"], r["devices"], r["local"]) for r in reports] == [(p, 8, 2) for p in range(4)]
    check_like_one_device(reports, "shard", one_device_run[0])
    # 2 stages of 4 devices, each spanning 2 processes; 4 micro-batches in GPipe order
    check_pipelined_like_one_device(reports, "pipeshard4", one_device_run)


def gpt2_reports(tmp_path: Path, nprocs: int, devices: int, *options: str) -> list[dict]:
    """Reports of tests/multihost_gpt2.py: pipelined Hugging Face GPT-2 + AdamW against one device."""
    result, _ = launch("--nprocs", str(nprocs), "--devices-per-process", str(devices), "--", "python",
                       str(HERE / "multihost_gpt2.py"), str(tmp_path), *options, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(nprocs)]


def mean_relative_error(reports: list[dict]) -> float:
    """Mean over parameter leaves of sum |got - want| / sum |want|, every leaf fully held by some process."""
    totals: dict = {}
    for report in reports:
        for name, (diff, size, _) in report["params"].items():
            total = totals.setdefault(name, [0.0, 0.0])
            total[0] += diff
            total[1] += size
    assert all(size > 0 for _, size in totals.values())  # every leaf is held somewhere
    return float(np.mean([diff / size for diff, size in totals.values()]))


def test_gpt2_whole_step_on_four_stages_over_two_processes_trains_like_one_device(tmp_path):
    """Hugging Face Flax GPT-2, AdamW after global-norm clipping, 4 stages (2 per process): the tied
    embedding's owner (stage 0, process 0) gets the LM head's gradient from stage 3 (process 1), and the
    global norm and step count cross processes."""
    reports = gpt2_reports(tmp_path, 2, 4, "--layers", "4")
    assert reports[0]["stages"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert len({r["plan"] for r in reports}) == 1
    for report in reports:
        np.testing.assert_allclose(report["losses"], report["one_device_losses"], rtol=1e-5)
    assert mean_relative_error(reports) <= 1e-4


def test_ray_launch_trains_like_one_device(tmp_path, one_device_run):
    pytest.importorskip("ray")
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    try:
        reports = train(tmp_path, 2, 2, "shard,pipeshard", "--ray-address", "local", "--ray-temp-dir", ray_dir)
    finally:
        subprocess.run(["rm", "-rf", ray_dir], check=False)
    assert [(r["process"], r["devices"], r["local"]) for r in reports] == [(0, 4, 2), (1, 4, 2)]
    check_like_one_device(reports, "shard", one_device_run[0])
    check_pipelined_like_one_device(reports, "pipeshard", one_device_run)


def seconds_since_fault(stderr: str) -> float:
    """Seconds since rank 1 went wrong (it prints the time just before)."""
    return time.time() - float(re.search(r"\[rank 1\] fault at ([\d.]+)", stderr).group(1))


@pytest.mark.parametrize(("fault", "message"), [
    ("kill", "error: rank 1 failed (killed by signal 9 (SIGKILL)); stopped every rank"),
    ("hang", "error: rank 1 hangs: it joined the job"),
])
def test_a_killed_or_hanging_worker_ends_the_job_naming_it(tmp_path, fault, message):
    result, _ = launch("--nprocs", "2", "--devices-per-process", "2", "--hang-timeout", "10", "--", "python",
                       WORKER, str(tmp_path), "shard", "--fault", fault, timeout=240)
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(message), last
    assert "rank 0 failed" not in last and "rank 0 hangs" not in last  # not the rank waiting for rank 1
    assert seconds_since_fault(result.stderr) < 60
    assert not list(tmp_path.glob("rank*.json"))  # no rank finished
