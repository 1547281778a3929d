"""The launcher's watch over a running job: show the ranks' output, end the job at the first fault.

Input: the job's workers (local processes or Ray actors, behind one `Workers` protocol), the hang
timeout and where to print. Output: the launch's exit status — 0 when every rank exited 0; 1 when a rank
failed or hung (all ranks are then stopped and one line names the rank); 130 when interrupted.
Rank 0's output is printed as it comes; the other ranks' standard error is printed with "[rank N] "
in front of each line, and their standard output is dropped (it repeats rank 0's).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Protocol, TextIO

from meshplan.launch.faults import failure_message, hang_message
from meshplan.launch.rank_process import RankReport

FAILED, INTERRUPTED = 1, 130


class Workers(Protocol):
    """The processes of one job, wherever they run."""

    def reports(self) -> Sequence[RankReport]:
        """Every rank's report, in rank order."""
        ...

    def stop(self) -> None:
        """Stop every rank still running."""
        ...


def supervise(workers: Workers, hang_timeout: float, out: TextIO, err: TextIO, poll_s: float = 0.2) -> int:
    """Watch `workers` until they all exit 0 or one fails or hangs; return the launch's exit status."""
    with _signals_interrupt():
        try:
            while True:
                reports = workers.reports()
                _show(reports, out, err)
                states = [r.state for r in reports]
                problem = failure_message(states) or hang_message(states, hang_timeout)
                if problem:
                    _end(workers, err, f"{problem}; stopped every rank")
                    return FAILED
                if all(s.exit_status == 0 for s in states):
                    return 0
                time.sleep(poll_s)
        except KeyboardInterrupt:
            _end(workers, err, "interrupted; stopped every rank")
            return INTERRUPTED


def _end(workers: Workers, err: TextIO, message: str) -> None:
    """Stop every rank and say why, last (what the ranks print while being stopped is dropped: it is the
    stopping's noise, e.g. JAX's coordination service reporting the lost peers)."""
    workers.stop()
    err.write(f"error: {message}\n")
    err.flush()


def _show(reports: Sequence[RankReport], out: TextIO, err: TextIO) -> None:
    for report in reports:
        if report.state.rank == 0:
            out.writelines(f"{line}\n" for line in report.stdout)
            err.writelines(f"{line}\n" for line in report.stderr)
        else:
            err.writelines(f"[rank {report.state.rank}] {line}\n" for line in report.stderr)
    out.flush()
    err.flush()


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP stop the job like Ctrl-C does (so the ranks never outlive their launcher)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(number: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = {number: signal.signal(number, interrupt) for number in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
