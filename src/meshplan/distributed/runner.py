"""Run planning tasks through an executor: cache look-ups, bounded retries, progress in tasks.

Input: a task function (module-level, so other processes can import it), `Task`s (a name for
people, a content key for the cache, a payload for the function) and a `TaskRunner`. Output:
one `TaskOutcome` per task, in task order whatever order they finished in. A task that fails
every attempt (an exception, its worker dying, the time limit) comes back with its error and
no value; the caller decides what that means (the simulator drops that candidate).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from meshplan.distributed.cache import MISSING, TaskCache
from meshplan.distributed.executors import Executor, InProcessExecutor, TaskFunction
from meshplan.errors import OptionsError

Progress = Callable[[str, int, int], None]
# Told each task's final outcome (its index in the task list) as soon as it has one.
Finished = Callable[[int, "TaskOutcome"], None]


@dataclass(frozen=True, slots=True)
class Task:
    """One independent unit of planning work.

    Attributes:
        name: what it is, for progress and failure messages (e.g. "view 8, sub-mesh 2x4 #0").
        key: its content (everything its result depends on) for the cache; "" = never cached.
        payload: the task function's argument.
    """

    name: str
    key: str
    payload: Any


@dataclass(frozen=True, slots=True)
class TaskOutcome:
    """A task's value, or the error of its last attempt."""

    name: str
    value: Any = None
    error: str = ""
    attempts: int = 0
    cached: bool = False

    @property
    def ok(self) -> bool:
        return not self.error


class TaskRunner:
    """How tasks run: the executor, retries after a failed attempt, a per-attempt time limit
    (seconds; enforced by the pool and Ray) and an optional cache.

    `attempts` counts the attempts it started (cache hits start none): an interrupted run
    resumed from the cache starts only the tasks that had not finished.
    """

    def __init__(self, executor: Executor | None = None, retries: int = 2, time_limit: float | None = None,
                 cache: TaskCache | str | None = None) -> None:
        if retries < 0:
            raise OptionsError(f"task retries must be 0 or more, got {retries}")
        if time_limit is not None and time_limit <= 0:
            raise OptionsError(f"task time limit must be positive, got {time_limit}")
        self.executor = executor or InProcessExecutor()
        self.retries = retries
        self.time_limit = time_limit
        self.cache = TaskCache(cache) if isinstance(cache, str) else cache
        self.attempts = 0

    def close(self) -> None:
        self.executor.close()

    def __enter__(self) -> TaskRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_tasks(fn: TaskFunction, tasks: Sequence[Task], runner: TaskRunner | None = None,
              progress: Progress | None = None, label: str = "tasks",
              finished: Finished | None = None) -> list[TaskOutcome]:
    """Run every task (cached ones are read, not run); failed attempts are retried up to
    `runner.retries` times. Progress reports (label, tasks finished, tasks in all); `finished`
    hears of each task's final outcome as it comes (callers start work that needs only some
    tasks while the others run)."""
    runner = runner or TaskRunner()
    outcomes: list[TaskOutcome | None] = [None] * len(tasks)
    for i, task in enumerate(tasks):
        if runner.cache is not None and task.key:
            value = runner.cache.get(task.key)
            if value is not MISSING:
                outcomes[i] = TaskOutcome(task.name, value, cached=True)
                if finished:
                    finished(i, outcomes[i])
    done = sum(o is not None for o in outcomes)
    if progress and done:
        progress(label, done, len(tasks))
    attempts = [0] * len(tasks)
    errors = [""] * len(tasks)
    pending = [i for i, o in enumerate(outcomes) if o is None]
    while pending:
        failed = []
        runner.attempts += len(pending)
        for i, ok, value in runner.executor.run(fn, [(i, tasks[i].payload) for i in pending], runner.time_limit):
            attempts[i] += 1
            if ok:
                outcomes[i] = TaskOutcome(tasks[i].name, value, attempts=attempts[i])
                if runner.cache is not None and tasks[i].key:
                    runner.cache.put(tasks[i].key, value)
            elif attempts[i] <= runner.retries:
                failed.append(i)
                errors[i] = str(value)
                continue
            else:
                outcomes[i] = TaskOutcome(tasks[i].name, None, _headline(str(value)), attempts[i])
            if finished:
                finished(i, outcomes[i])
            done += 1
            if progress:
                progress(label, done, len(tasks))
        pending = sorted(failed)
    return [o for o in outcomes if o is not None]


def _headline(error: str) -> str:
    """The error's first line (a worker's traceback follows it)."""
    return error.strip().splitlines()[0] if error.strip() else "failed"
