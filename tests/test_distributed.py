"""Planning tasks through executors: same plans everywhere, faults survived, resume from the cache."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import pytest

from meshplan.cluster import Cluster, get_device
from meshplan.distributed import (
    InProcessExecutor,
    PoolExecutor,
    Task,
    TaskCache,
    TaskRunner,
    make_executor,
    run_tasks,
)
from meshplan.distributed.executors import fork_is_safe
from meshplan.errors import OptionsError
from meshplan.models.transformer import PRESETS
from meshplan.simulator import PlannerOptions, TrainingJob, pricing, simulate, to_plan
from meshplan.simulator.planner import plan_training
from meshplan.simulator.stage_plans import with_stage_plans

SMALL = PRESETS["gpt3-125m"].replace(layers=4)
JOB = TrainingJob(SMALL, global_batch=16, seq_len=256)
CLUSTER = Cluster(2, 2, get_device("a100-40gb"))
OPTIONS = PlannerOptions(workers=2, microbatch_sizes=(2, 4))


def square(x: int) -> int:
    return x * x


def fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError("three is not allowed")
    return x


def sleep_on_two(x: int) -> int:
    time.sleep(30 if x == 2 else 0)
    return x


def plan_json(runner: TaskRunner | None = None, progress=None, options: PlannerOptions = OPTIONS) -> dict:
    return without_timings(simulate(JOB, CLUSTER, options, progress, runner=runner).to_dict())


def without_timings(data):
    """The plan without the seconds its making took (planner phases, solver and build times),
    which differ from run to run."""
    if isinstance(data, dict):
        return {k: without_timings(v) for k, v in data.items() if k not in ("metrics", "wall_s", "build_s")}
    if isinstance(data, list):
        return [without_timings(v) for v in data]
    return data


@pytest.fixture(scope="module")
def reference() -> dict:
    with TaskRunner(InProcessExecutor()) as runner:
        return plan_json(runner)


def test_results_in_task_order_from_every_local_executor():
    tasks = [Task(f"square {x}", "", x) for x in range(7)]
    for executor in (InProcessExecutor(), PoolExecutor(2, "fork"), PoolExecutor(2, "spawn")):
        with TaskRunner(executor) as runner:
            outcomes = run_tasks(square, tasks, runner)
        assert [o.value for o in outcomes] == [x * x for x in range(7)]
        assert all(o.ok and o.attempts == 1 for o in outcomes)


def test_pool_forks_its_workers_only_while_this_process_runs_one_thread(monkeypatch):
    monkeypatch.delitem(sys.modules, "jax", raising=False)
    assert fork_is_safe() == (threading.active_count() == 1)  # earlier tests may have left threads
    monkeypatch.setitem(sys.modules, "jax", sys)  # JAX's runtime threads make a fork unsafe
    assert not fork_is_safe()
    monkeypatch.delitem(sys.modules, "jax")
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        assert not fork_is_safe()
    finally:
        release.set()
        thread.join()


def test_a_forked_worker_stops_when_the_planner_closes_its_pipe():
    # Each forked worker closes its copies of the parent's pipe ends (its own and its elder
    # siblings'); a copy left open would keep it waiting for a task after the parent is gone.
    executor = PoolExecutor(2, "fork")
    elder, younger = executor._pool
    try:
        elder.conn.close()  # the younger worker, still running, holds no copy of it
        elder.process.join(timeout=10)
        assert elder.process.exitcode == 0 and younger.process.is_alive()
    finally:
        for worker in executor._pool:
            worker.process.kill()
            worker.process.join()
        executor._pool.clear()


def test_a_task_failing_every_time_is_named_and_the_others_finish():
    tasks = [Task(f"number {x}", "", x) for x in range(5)]
    seen, finished = [], []
    with TaskRunner(PoolExecutor(2), retries=2) as runner:
        outcomes = run_tasks(fail_on_three, tasks, runner, lambda label, done, total: seen.append((done, total)),
                             finished=lambda i, outcome: finished.append((i, outcome)))
    assert [o.ok for o in outcomes] == [True, True, True, False, True]
    # Each task's final outcome is told once, the failed one only after its last attempt.
    assert sorted(finished, key=lambda f: f[0]) == list(enumerate(outcomes))
    assert outcomes[3].name == "number 3" and outcomes[3].attempts == 3
    assert outcomes[3].error == "ValueError: three is not allowed"
    assert seen[-1] == (5, 5) and [d for d, _ in seen] == [1, 2, 3, 4, 5]  # progress counts tasks


def test_time_limit_stops_a_task_and_retries_it_a_bounded_number_of_times():
    tasks = [Task(f"number {x}", "", x) for x in range(4)]
    with TaskRunner(PoolExecutor(2), retries=1, time_limit=1.0) as runner:
        outcomes = run_tasks(sleep_on_two, tasks, runner)  # task 2 would sleep 30 s: stopped at 1 s
    assert [o.value for o in outcomes if o.ok] == [0, 1, 3]
    assert outcomes[2].error == "exceeded the time limit of 1 s" and outcomes[2].attempts == 2


def test_cache_is_keyed_by_content_and_survives_a_bad_file(tmp_path):
    cache = TaskCache(tmp_path)
    with TaskRunner(InProcessExecutor(), cache=cache) as runner:
        run_tasks(square, [Task("a", "key 3", 3), Task("b", "key 4", 4)], runner)
        assert runner.attempts == 2
        finished = []
        outcomes = run_tasks(square, [Task("a", "key 3", 3), Task("c", "key 5", 5)], runner,
                             finished=lambda i, outcome: finished.append(i))
        assert runner.attempts == 3 and outcomes[0].cached and outcomes[1].value == 25
        assert finished == [0, 1]  # the cached one is told before any runs
    next(tmp_path.glob("*.pkl")).write_bytes(b"half-writ")  # a damaged entry is recomputed
    assert len(cache) == 3 and sum(cache.has(k) for k in ("key 3", "key 4", "key 5")) == 2


def test_unknown_executor_is_a_clear_error():
    with pytest.raises(OptionsError, match="unknown executor 'gpu'; use one of auto, inprocess, pool, ray"):
        make_executor("gpu")


def test_pool_plan_equals_in_process_plan(reference):
    with TaskRunner(PoolExecutor(2)) as runner:
        assert plan_json(runner) == reference


def test_stage_plans_solved_on_the_pool_equal_those_solved_one_after_another():
    cluster = JOB.on(CLUSTER)
    with TaskRunner(InProcessExecutor()) as runner:
        plan = to_plan(plan_training(JOB, cluster, OPTIONS, runner=runner), JOB, cluster)
    serial = with_stage_plans(plan, JOB, cluster, OPTIONS)
    with TaskRunner(PoolExecutor(2)) as runner:
        pooled = with_stage_plans(plan, JOB, cluster, OPTIONS, runner)
        solves = runner.attempts
    assert all(stage.pieces for stage in serial.stages)
    distinct = {(p.name, s.submesh, s.logical_mesh, s.memory_plan) for s in serial.stages for p in s.pieces}
    assert solves == len(distinct)  # every distinct piece solved once, on the pool
    assert without_timings(pooled.to_dict())["stages"] == without_timings(serial.to_dict())["stages"]
    assert serial.metrics_under("time.") and pooled.metrics_under("time.") == serial.metrics_under("time.")


def test_killed_pool_worker_is_replaced_and_the_plan_matches(reference):
    executor = PoolExecutor(2)
    killed = []

    def kill_one(label, done, total):
        if not killed and done == 1:  # the other worker is busy with a task right now
            pid = executor.worker_pids()[0]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    with TaskRunner(executor) as runner:
        assert plan_json(runner, kill_one) == reference
        assert killed and killed[0] not in executor.worker_pids()


def test_a_pricing_task_failing_every_time_is_named_and_a_plan_is_still_made(monkeypatch, reference):
    real = pricing.price_view

    def broken(task):
        if task.key.submesh == (1, 2):
            raise RuntimeError("solver crashed")
        return real(task)

    monkeypatch.setattr(pricing, "price_view", broken)
    with TaskRunner(InProcessExecutor(), retries=1) as runner:
        data = plan_json(runner)
    named = [n for n in data["notes"] if "sub-mesh 1x2" in n]
    assert named and all("RuntimeError: solver crashed after 2 attempts" in n for n in named)
    # The stage DP plans without the failed views; a recipe priced apart (the layout search's
    # layout on the operator graph) may still use that sub-mesh, and its note says so.
    taken = [n for n in data["notes"] if n.startswith("taken from")]
    assert taken or all(s["submesh"] != [1, 2] for s in data["stages"])
    assert data["prediction"]["iteration_time_s"] >= reference["prediction"]["iteration_time_s"]


def test_interrupted_run_resumes_from_the_cache_doing_only_the_rest(tmp_path, reference):
    with TaskRunner(InProcessExecutor()) as runner:
        plan_json(runner)
        total = runner.attempts
    finished = []

    def interrupt(label, done, total_in_batch):
        finished.append(done)
        if len(finished) == 3:
            raise KeyboardInterrupt

    with TaskRunner(InProcessExecutor(), cache=str(tmp_path)) as runner, pytest.raises(KeyboardInterrupt):
        plan_json(runner, interrupt)
    with TaskRunner(InProcessExecutor(), cache=str(tmp_path)) as runner:
        assert plan_json(runner) == reference
        assert runner.attempts == total - 3


@pytest.fixture(scope="module")
def ray_executor():
    """A local Ray for this module's tests, or a skip saying why it cannot start here."""
    try:
        import ray  # noqa: F401
    except ImportError:
        pytest.skip("Ray is not installed (pip install 'meshplan[ray]')")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    try:
        executor = make_executor("ray", ray_address="local", ray_temp_dir=temp_dir)
    except OptionsError as exc:
        shutil.rmtree(temp_dir, ignore_errors=True)
        pytest.skip(f"Ray cannot start here: {exc}")
    yield executor
    executor.close()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_local_ray_plan_equals_in_process_plan(ray_executor, reference):
    assert plan_json(TaskRunner(ray_executor)) == reference


@pytest.mark.slow
def test_ray_names_a_task_failing_every_time(ray_executor):
    def fail_on_three_here(x: int) -> int:  # a local function: Ray ships it by value (its
        if x == 3:                           # workers cannot import the tests folder)
            raise ValueError("three is not allowed")
        return x

    tasks = [Task(f"number {x}", "", x) for x in range(5)]
    outcomes = run_tasks(fail_on_three_here, tasks, TaskRunner(ray_executor, retries=1))
    assert [o.value for o in outcomes if o.ok] == [0, 1, 2, 4]
    assert outcomes[3].error == "ValueError: three is not allowed" and outcomes[3].attempts == 2
