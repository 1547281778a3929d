"""`meshplan launch` without JAX: the hang rule, failure messages, progress reports, the workers'
environment, setup checks, Ray placement, and the launcher's output and exit status on small commands.
The JAX jobs it launches (training across processes, a killed and a hanging worker, Ray) are in
tests/test_multihost.py."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshplan.errors import LaunchError
from meshplan.launch import LaunchSpec, WorkerEnvironment, check_spec, run
from meshplan.launch import progress as progress_module
from meshplan.launch.environment import worker_variables
from meshplan.launch.faults import RankState, failure_message, hang_message
from meshplan.launch.progress import Progress, read_progress
from meshplan.launch.ray_cluster import plan_placement

SRC = Path(__file__).resolve().parents[1] / "src"


def state(rank, calls, quiet, building=False, exit_status=None, lost=""):
    progress = None if calls is None else Progress(calls, building, time.time() - quiet)
    return RankState(rank, exit_status, progress, quiet, lost)


# --- the hang rule -------------------------------------------------------------------------------------------

def test_a_rank_left_behind_and_silent_hangs():
    message = hang_message([state(0, 1, 2.0), state(1, 0, 20.0)], timeout=10)
    assert message == ("rank 1 hangs: it joined the job 20 s ago and started no parallelized call since, while "
                       "rank 0 started parallelized call 1 (--hang-timeout 10 s)")


def test_a_rank_behind_that_reported_lately_is_catching_up():
    assert hang_message([state(0, 3, 50.0), state(1, 1, 9.0)], timeout=10) is None


def test_no_hang_while_a_rank_builds_its_call():
    assert hang_message([state(0, 3, 40.0, building=True), state(1, 1, 40.0)], timeout=10) is None
    assert hang_message([state(0, 3, 40.0), state(1, 1, 40.0, building=True)], timeout=10) is None


def test_ranks_stopped_at_the_same_call_are_not_blamed():
    assert hang_message([state(0, 2, 99.0), state(1, 2, 99.0)], timeout=10) is None


def test_hang_watch_off_and_several_ranks_behind():
    states = [state(0, 4, 30.0), state(1, 4, 1.0), state(2, 2, 30.0), state(3, None, 30.0)]
    assert hang_message(states, timeout=0) is None
    message = hang_message(states, timeout=10)
    assert message == ("rank 2 hangs: it started parallelized call 2 30 s ago and no other since; rank 3 hangs: it "
                       "has not called meshplan.launch.initialize() in the 30 s since it started, while ranks 0, 1 "
                       "started parallelized call 4 (--hang-timeout 10 s)")


def test_a_rank_that_exited_early_is_named():
    message = hang_message([state(0, 3, 15.0), state(1, 2, 15.0, exit_status=0)], timeout=10)
    assert message.startswith("rank 1 exited (exit status 0) after starting parallelized call 2, while rank 0")


def test_failures_name_every_failed_rank():
    states = [state(0, 1, 1.0), state(1, 1, 1.0, exit_status=-9), state(2, 1, 1.0, exit_status=3),
              state(3, None, 0.0, lost="its Ray worker died (ActorDiedError)")]
    assert failure_message(states) == ("rank 1 failed (killed by signal 9 (SIGKILL)); rank 2 failed (exit status 3); "
                                       "rank 3 was lost: its Ray worker died (ActorDiedError)")
    assert failure_message([state(0, 1, 1.0, exit_status=0)]) is None


# --- progress reports and the workers' environment -----------------------------------------------------------

def test_progress_reports_round_trip(tmp_path, monkeypatch):
    path = tmp_path / "rank0.progress"
    monkeypatch.setenv("MESHPLAN_PROGRESS_FILE", str(path))
    progress_module._reporter.cache_clear()
    try:
        progress_module.report_initialized()
        assert read_progress(str(path)).calls == 0
        progress_module.report_call()
        with progress_module.building():
            with progress_module.building():  # nested (a pipeline's first run compiles its update pieces)
                pass
            inside = read_progress(str(path))
        progress_module.report_call()
        after = read_progress(str(path))
    finally:
        progress_module._reporter.cache_clear()
    assert (inside.calls, inside.building) == (1, True)
    assert (after.calls, after.building) == (2, False) and abs(after.time - time.time()) < 60
    assert read_progress(str(tmp_path / "missing")) is None


def test_reports_do_nothing_outside_a_launch(monkeypatch):
    monkeypatch.delenv("MESHPLAN_PROGRESS_FILE", raising=False)
    progress_module._reporter.cache_clear()
    try:
        progress_module.report_call()
        with progress_module.building():
            pass
        assert progress_module._reporter() is None
    finally:
        progress_module._reporter.cache_clear()


def test_worker_environment_round_trip_and_jax_variables():
    worker = WorkerEnvironment(1, 4, "127.0.0.1:1234", 2, "/tmp/p")
    base = {"PATH": "/bin", "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d"}
    env = worker_variables(base, worker)
    assert WorkerEnvironment.from_env(env) == worker
    assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:1234" and env["JAX_NUM_CPU_DEVICES"] == "2"
    assert env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo" and env["PATH"] == "/bin"
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"  # the stale device count goes, other flags stay
    assert "XLA_FLAGS" not in worker_variables({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, worker)
    assert WorkerEnvironment.from_env({"PATH": "/bin"}) is None


def test_initialize_outside_a_launch_does_nothing_and_leaves_jax_alone():
    code = ("import sys, meshplan.launch; print(meshplan.launch.initialize(), 'jax' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHPLAN_")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**env, "PYTHONPATH": str(SRC)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None", "False"]


# --- setup checks -------------------------------------------------------------------------------------------

SCRIPT = str(Path(__file__))


@pytest.mark.parametrize(("spec", "message"), [
    (LaunchSpec(("python", SCRIPT), nprocs=0), "--nprocs must be at least 1, got 0"),
    (LaunchSpec(("python", SCRIPT)), "say how many processes to start"),
    (LaunchSpec(("python", SCRIPT), nprocs=2, devices_per_process=0), "--devices-per-process must be at least 1"),
    (LaunchSpec(("python", "-u", "no_such_script.py"), nprocs=2), "Python script 'no_such_script.py' not found"),
    (LaunchSpec(("no-such-program-here", "x"), nprocs=2), "command 'no-such-program-here' not found"),
    (LaunchSpec((), nprocs=2), "give the command to run after --"),
    (LaunchSpec(("python", SCRIPT), nprocs=2, coordinator="localhost"), "is not HOST:PORT"),
    (LaunchSpec(("python", SCRIPT), nprocs=2, coordinator="h:70000"), "is not HOST:PORT"),
    (LaunchSpec(("python", SCRIPT), nprocs=2, hang_timeout=-1), "--hang-timeout must be 0"),
])
def test_bad_setups_are_refused_before_anything_starts(spec, message):
    with pytest.raises(LaunchError, match=message):
        check_spec(spec)


@pytest.mark.parametrize("command", [("python", "-m", "no_such_module"), ("python", "-c", "pass"),
                                     ("python", "-X", "dev", SCRIPT), ("sh", "-c", "true")])
def test_commands_without_a_script_file_pass(command):
    check_spec(LaunchSpec(command, nprocs=1))


def test_cli_bad_setup_is_one_line_and_status_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "meshplan.cli", "launch", "--nprocs", "2", "--", "python",
                             "missing.py"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(SRC)})
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: Python script 'missing.py' not found in {tmp_path}; check the path " \
                                    "after 'python'"


def test_unreachable_ray_address_is_a_clear_error():
    from meshplan.errors import OptionsError

    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # the launcher would use that Ray instead of the address
        pytest.skip("Ray already runs in this test process")
    with pytest.raises(OptionsError, match=r"no Ray cluster answers at --ray-address '127.0.0.1:1' \(Connection "
                                           "refused\\); check the address"):
        run(LaunchSpec(("python", SCRIPT), nprocs=2, ray_address="127.0.0.1:1"))


# --- Ray placement -------------------------------------------------------------------------------------------

def node(gpus=0):
    return {"Resources": {"CPU": 8.0, **({"GPU": float(gpus)} if gpus else {})}}


def test_one_machine_packs_every_worker_and_many_nodes_spread_one_per_node():
    one = plan_placement([node()], nprocs=4, devices_per_process=2)
    assert (one.nprocs, one.strategy, one.bundle, one.devices_per_process) == (4, "PACK", {"CPU": 1.0}, 2)
    gpus = plan_placement([node(8)], nprocs=2, devices_per_process=None)
    assert (gpus.bundle, gpus.devices_per_process) == ({"CPU": 1.0, "GPU": 4.0}, 4)
    spread = plan_placement([node(4), node(4), node(4)], nprocs=None, devices_per_process=None)
    assert (spread.nprocs, spread.strategy, spread.bundle) == (3, "STRICT_SPREAD", {"CPU": 1.0, "GPU": 4.0})
    assert plan_placement([node(4), node(2)], nprocs=2, devices_per_process=2).bundle == {"CPU": 1.0, "GPU": 2.0}


@pytest.mark.parametrize(("nodes", "nprocs", "message"), [
    ([node(4), node(2)], None, r"uneven GPUs \(2, 4 per node\)"),
    ([node(), node()], 3, "--nprocs 3 asks for one worker per node, but the Ray cluster has 2 nodes"),
    ([node(8)], 3, "8 GPUs, which 3 workers cannot share evenly"),
])
def test_placements_that_cannot_work_are_refused(nodes, nprocs, message):
    with pytest.raises(LaunchError, match=message):
        plan_placement(nodes, nprocs, None)


# --- output and exit status ----------------------------------------------------------------------------------

RANK_SAYS = ("import os, sys; rank = int(os.environ['MESHPLAN_PROCESS_ID']); print('out', rank); "
             "print('err', rank, file=sys.stderr); sys.exit({status})")


def launch_small(status_expr: str, nprocs: int = 3) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = run(LaunchSpec((sys.executable, "-c", RANK_SAYS.format(status=status_expr)), nprocs=nprocs),
                 out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def test_rank_0_output_and_the_others_errors_are_shown():
    status, out, err = launch_small("0")
    assert status == 0
    assert out == "out 0\n"  # the other ranks' standard output repeats rank 0's: dropped
    assert sorted(err.splitlines()) == ["[rank 1] err 1", "[rank 2] err 2", "err 0"]


def test_a_failing_rank_stops_the_job_with_its_name():
    status, out, err = launch_small("3 if rank == 2 else 0")
    assert status == 1
    assert "[rank 2] err 2" in err.splitlines()
    assert err.splitlines()[-1] == "error: rank 2 failed (exit status 3); stopped every rank"
