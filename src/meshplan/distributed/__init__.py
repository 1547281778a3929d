"""Planning tasks run through one executor: in this process, a local process pool, or Ray.

A planner turns its independent work (intra-op solves per layer, view and micro-batch size; CFP
segment profiles) into `Task`s and hands them to `run_tasks` with a `TaskRunner`: which
executor runs them, how often a failed task is retried, its time limit, and an optional
on-disk cache keyed by task content (an interrupted run resumes with the tasks not yet done).
Results are the same whichever executor runs them. Nothing here knows what a task computes.
"""

from meshplan.distributed.cache import TaskCache
from meshplan.distributed.executors import (
    EXECUTORS,
    Executor,
    InProcessExecutor,
    PoolExecutor,
    RayExecutor,
    make_executor,
)
from meshplan.distributed.runner import Task, TaskOutcome, TaskRunner, run_tasks

__all__ = [
    "EXECUTORS",
    "Executor",
    "InProcessExecutor",
    "PoolExecutor",
    "RayExecutor",
    "Task",
    "TaskCache",
    "TaskOutcome",
    "TaskRunner",
    "make_executor",
    "run_tasks",
]
