"""Progress reports from a launched process to the launcher's hang watch.

A process reports when it has joined the job (`report_initialized`), each time it starts a call of a
parallelized function (`report_call`), and while it builds one (captures, plans, compiles: `building`).
The launcher compares the processes' reports (`meshplan.launch.faults`): every process of a job calls
its parallelized functions in the same order, so one that stays behind while the others wait is hung.

One small file per process, rewritten in place at each event (a fixed-width line, one `pwrite`), read by
the launcher on the same machine. Outside `meshplan launch` (no MESHPLAN_PROGRESS_FILE) reports do nothing.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from meshplan.launch.environment import PROGRESS_FILE


@dataclass(frozen=True, slots=True)
class Progress:
    """One process's last report.

    Attributes:
        calls: parallelized calls it has started (0: joined the job, none started yet).
        building: it is building (capturing, planning, compiling) its latest call.
        time: when it reported (`time.time()` on its machine).
    """

    calls: int
    building: bool
    time: float

    def line(self) -> bytes:
        return f"{self.calls:>12d} {int(self.building)} {self.time:>20.6f}\n".encode()


def read_progress(path: str) -> Progress | None:
    """The last report written to `path`, or None when there is none (yet) or it cannot be read."""
    try:
        with open(path, "rb") as handle:
            calls, building, stamp = handle.read(64).split()
        return Progress(int(calls), building == b"1", float(stamp))
    except (OSError, ValueError):
        return None


class _Reporter:
    """Writes this process's reports to its progress file."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self._calls, self._building = 0, False
        self.depth = 0  # nested `building()` blocks open

    def report(self, calls: int | None = None, building: bool | None = None) -> None:
        with self._lock:
            self._calls = self._calls if calls is None else calls
            self._building = self._building if building is None else building
            os.pwrite(self._fd, Progress(self._calls, self._building, time.time()).line(), 0)

    @property
    def calls(self) -> int:
        return self._calls


@functools.cache
def _reporter() -> _Reporter | None:
    """This process's reporter (one per process, like its pid), None outside `meshplan launch`."""
    path = os.environ.get(PROGRESS_FILE, "")
    return _Reporter(path) if path else None


def report_initialized() -> None:
    """This process joined (or is joining) the job: no parallelized call started yet."""
    if (reporter := _reporter()) is not None:
        reporter.report(calls=0, building=False)


def report_call() -> None:
    """This process starts its next parallelized call."""
    if (reporter := _reporter()) is not None:
        reporter.report(calls=reporter.calls + 1, building=False)


@contextlib.contextmanager
def building() -> Iterator[None]:
    """This process is building its current call (capture, plan, compile): busy, not hung. Nests:
    the process is building until the outermost block ends."""
    reporter = _reporter()
    if reporter is None:
        yield
        return
    reporter.depth += 1
    reporter.report(building=True)
    try:
        yield
    finally:
        reporter.depth -= 1
        reporter.report(building=reporter.depth > 0)
