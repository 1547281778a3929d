"""Executors: run one attempt of each task somewhere and report each as it finishes.

Three implementations of one small protocol (`Executor.run`):
- `InProcessExecutor`: one after the other in this process (small jobs, debugging);
- `PoolExecutor`: worker processes on this machine, each running one task at a time, started
  when the executor is made (their start-up overlaps the caller's own work); a worker that dies
  or overruns the time limit is replaced and its task reported failed;
- `RayExecutor`: Ray tasks on a local Ray started on demand or on an existing cluster.
Retrying, caching and progress live in `meshplan.distributed.runner`, the same for all three.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

from meshplan.distributed.ray_session import import_ray, start_or_join_ray
from meshplan.errors import OptionsError

# One attempt's report: (task index, succeeded, value or error text).
Attempt = tuple[int, bool, Any]
TaskFunction = Callable[[Any], Any]


class Executor(Protocol):
    """Runs one attempt of each item and yields its report as soon as it finishes."""

    name: str

    def run(self, fn: TaskFunction, items: Sequence[tuple[int, Any]], time_limit: float | None) -> Iterator[Attempt]:
        ...

    def close(self) -> None:
        ...


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


class InProcessExecutor:
    """Tasks one after the other in this process. The time limit is not enforced here (a task
    cannot be stopped from inside its own process); use the pool for that."""

    name = "inprocess"

    def run(self, fn: TaskFunction, items: Sequence[tuple[int, Any]], time_limit: float | None) -> Iterator[Attempt]:
        del time_limit
        for index, payload in items:
            try:
                value = fn(payload)
            except Exception as exc:  # a failed task is reported, never raised
                yield index, False, _error_text(exc)
            else:
                yield index, True, value

    def close(self) -> None:
        pass


def _worker_loop(conn: Connection, inherited: tuple[Connection, ...] = ()) -> None:
    """A pool worker: run (fn, index, payload) messages until told to stop (None). `inherited`:
    the parent's ends of pipes a forked worker holds copies of; closed, so that the worker sees
    end-of-file when the parent goes away."""
    for other in inherited:
        other.close()
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        fn, index, payload = message
        conn.send(("start", index))  # the task's time runs from here, after imports and unpickling
        try:
            reply = (index, True, fn(payload))
        except Exception as exc:
            reply = (index, False, _error_text(exc) + "\n" + traceback.format_exc(limit=3))
        conn.send(("done", reply))


def fork_is_safe() -> bool:
    """Whether a worker may be forked from this process now: POSIX, a single Python thread (a
    lock another thread holds at the fork stays locked in the child), and JAX not loaded (its
    runtime runs threads of its own). A forked worker starts at once with this process's imports;
    a spawned one imports meshplan afresh (about 1.5 s of CPU)."""
    if "fork" not in multiprocessing.get_all_start_methods() or multiprocessing.current_process().daemon:
        return False
    return threading.active_count() == 1 and "jax" not in sys.modules


class _Worker:
    def __init__(self, start_method: str, siblings: tuple[Connection, ...] = ()) -> None:
        if start_method == "auto":
            start_method = "fork" if fork_is_safe() else "spawn"
        context = multiprocessing.get_context(start_method)
        self.conn, child = context.Pipe()
        inherited = (self.conn, *siblings) if start_method == "fork" else ()
        self.process = context.Process(target=_worker_loop, args=(child, inherited), daemon=True)
        self.process.start()
        child.close()
        self.task: int | None = None
        self.started = math.inf  # when the worker began the task (inf: still unpacking it)

    def stop(self, kill: bool = False) -> None:
        if kill:
            self.process.kill()
        else:
            with contextlib.suppress(OSError):
                self.conn.send(None)
        self.process.join(timeout=5)
        if self.process.is_alive():  # pragma: no cover - a worker stuck in native code
            self.process.kill()
            self.process.join()
        self.conn.close()


class PoolExecutor:
    """`workers` processes on this machine, started when the executor is made and kept for its
    lifetime.

    `start_method` "auto" forks each worker when that is safe at the time (`fork_is_safe`: make
    the executor before starting threads, as the planner does) and spawns it otherwise; "spawn"
    is safe whatever the parent holds (threads, JAX); "fork" always forks.
    """

    name = "pool"

    def __init__(self, workers: int = 2, start_method: str = "auto") -> None:
        if workers < 1:
            raise OptionsError(f"a process pool needs at least 1 worker, got workers={workers}")
        if start_method not in ("auto", *multiprocessing.get_all_start_methods()):
            raise OptionsError(f"unknown start method {start_method!r} for a process pool")
        self.workers = workers
        self.start_method = start_method
        self._pool: list[_Worker] = []
        self._fill()

    def worker_pids(self) -> tuple[int, ...]:
        """Process ids of the live workers (tests kill one to check recovery)."""
        return tuple(w.process.pid for w in self._pool if w.process.pid is not None)

    def _fill(self) -> None:
        while len(self._pool) < self.workers:
            self._pool.append(_Worker(self.start_method, tuple(w.conn for w in self._pool)))

    def _replace(self, worker: _Worker, kill: bool) -> None:
        worker.stop(kill=kill)
        self._pool.remove(worker)
        self._fill()

    def run(self, fn: TaskFunction, items: Sequence[tuple[int, Any]], time_limit: float | None) -> Iterator[Attempt]:
        queue = list(items)[::-1]
        self._fill()
        while queue or any(w.task is not None for w in self._pool):
            for worker in self._pool:
                if worker.task is None and queue:
                    index, payload = queue.pop()
                    try:
                        worker.conn.send((fn, index, payload))
                    except OSError:  # the worker died while idle: replace it, keep the task
                        queue.append((index, payload))
                        self._replace(worker, kill=True)
                        break
                    worker.task, worker.started = index, math.inf
            yield from self._collect(time_limit)

    def _collect(self, time_limit: float | None) -> Iterator[Attempt]:
        busy = [w for w in self._pool if w.task is not None]
        if not busy:
            return
        timeout = None
        if time_limit is not None:
            deadline = min(w.started + time_limit for w in busy)
            timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
        ready = wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout)
        now = time.monotonic()
        for worker in busy:
            index = worker.task
            if worker.conn in ready:
                try:
                    kind, reply = worker.conn.recv()
                except (EOFError, OSError):
                    kind = reply = None
                if kind == "start":
                    worker.started = now
                    continue
                if kind == "done":
                    worker.task = None
                    yield reply
                    continue
            if worker.process.sentinel in ready or not worker.process.is_alive():
                code = worker.process.exitcode
                self._replace(worker, kill=True)
                yield index, False, f"worker process died (exit code {code})"
            elif time_limit is not None and now - worker.started >= time_limit:
                self._replace(worker, kill=True)
                yield index, False, f"exceeded the time limit of {time_limit:g} s"

    def close(self) -> None:
        for worker in self._pool:
            worker.stop()
        self._pool.clear()

    def __del__(self) -> None:  # pragma: no cover - best effort when not closed
        with contextlib.suppress(Exception):
            self.close()


class RayExecutor:
    """Ray tasks: `address` "local" starts a Ray on this machine on demand (stopped by `close`);
    "auto" or "ray://host:port" joins an existing cluster, whose workers must have meshplan
    installed. At most as many tasks are in flight as the cluster has CPUs, so a task's time
    limit counts from about when it starts."""

    name = "ray"

    def __init__(self, address: str = "local", temp_dir: str | None = None, num_cpus: int | None = None) -> None:
        self._ray = import_ray("--executor ray")
        self._started = start_or_join_ray(address, temp_dir, num_cpus, purpose="--executor ray")
        self._remote: dict[TaskFunction, Any] = {}

    def _slots(self) -> int:
        return max(1, int(self._ray.cluster_resources().get("CPU", 1)))

    def run(self, fn: TaskFunction, items: Sequence[tuple[int, Any]], time_limit: float | None) -> Iterator[Attempt]:
        ray = self._ray
        if fn not in self._remote:  # retries are ours (counted and bounded the same for every executor)
            self._remote[fn] = ray.remote(max_retries=0, retry_exceptions=False)(fn)
        remote = self._remote[fn]
        queue = list(items)[::-1]
        flying: dict[Any, tuple[int, float]] = {}
        slots = self._slots()
        while queue or flying:
            while queue and len(flying) < slots:
                index, payload = queue.pop()
                flying[remote.remote(payload)] = (index, time.monotonic())
            timeout = None
            if time_limit is not None:
                timeout = max(0.0, min(start + time_limit for _, start in flying.values()) - time.monotonic())
            done, _ = ray.wait(list(flying), num_returns=1, timeout=timeout)
            for ref in done:
                index, _ = flying.pop(ref)
                try:
                    yield index, True, ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    yield index, False, _error_text(exc.cause if exc.cause is not None else exc)
                except ray.exceptions.RayError as exc:  # the worker died, the node went away, ...
                    yield index, False, f"Ray worker failed ({type(exc).__name__})"
            now = time.monotonic()
            for ref, (index, start) in list(flying.items()):
                if time_limit is not None and now - start >= time_limit:
                    ray.cancel(ref, force=True)
                    del flying[ref]
                    yield index, False, f"exceeded the time limit of {time_limit:g} s"

    def close(self) -> None:
        if self._started and self._ray.is_initialized():
            self._ray.shutdown()
        self._started = False


EXECUTORS = ("auto", "inprocess", "pool", "ray")


def make_executor(name: str = "auto", workers: int = 2, ray_address: str = "local", num_tasks: int | None = None,
                  ray_temp_dir: str | None = None) -> Executor:
    """The executor `name`; "auto" is the pool when there are several workers and (if known)
    several tasks, else in-process."""
    if name == "auto":
        many = num_tasks is None or num_tasks > 1
        name = "pool" if workers > 1 and many else "inprocess"
    if name == "inprocess":
        return InProcessExecutor()
    if name == "pool":
        return PoolExecutor(workers)
    if name == "ray":
        return RayExecutor(ray_address, temp_dir=ray_temp_dir)
    raise OptionsError(f"unknown executor {name!r}; use one of {', '.join(EXECUTORS)}")
