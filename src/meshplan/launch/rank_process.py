"""One launched process on this machine: started with its worker environment, its output read line by
line as it comes, its progress and exit status reported on demand, stopped as a process group.

The same class runs the local launcher's processes and, inside a Ray actor, a Ray node's process.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import IO

from meshplan.launch.environment import WorkerEnvironment, worker_variables
from meshplan.launch.faults import RankState
from meshplan.launch.progress import read_progress

# Exit status of a process that could not be started (the shell's "command not found").
_NOT_STARTED = 127


@dataclass(frozen=True, slots=True)
class RankReport:
    """A rank's state and the output lines it printed since the last report."""

    state: RankState
    stdout: tuple[str, ...] = ()
    stderr: tuple[str, ...] = ()


class RankProcess:
    """`command` run as rank `worker.process_id`, in its own process group (so stopping it stops its
    children too), with `base_env` plus the worker's variables and a fresh progress file."""

    def __init__(self, command: Sequence[str], worker: WorkerEnvironment, base_env: Mapping[str, str],
                 cwd: str | None = None) -> None:
        self.rank = worker.process_id
        fd, self._progress = tempfile.mkstemp(prefix=f"meshplan-rank{self.rank}-", suffix=".progress")
        os.close(fd)
        env = worker_variables(base_env, replace(worker, progress_file=self._progress))
        self._started = time.time()
        self._lines: dict[str, queue.SimpleQueue[str]] = {"stdout": queue.SimpleQueue(), "stderr": queue.SimpleQueue()}
        self._readers: list[threading.Thread] = []
        try:
            self._popen: subprocess.Popen[str] | None = subprocess.Popen(
                list(command), env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
        except OSError as exc:  # the command is missing on this machine, or not executable
            self._popen = None
            self._lines["stderr"].put(f"could not start {command[0]!r}: {exc.strerror or exc}")
            return
        for name, stream in (("stdout", self._popen.stdout), ("stderr", self._popen.stderr)):
            reader = threading.Thread(target=_read_lines, args=(stream, self._lines[name]), daemon=True)
            reader.start()
            self._readers.append(reader)

    def report(self) -> RankReport:
        """Its state now and the lines it printed since the last report (all of them once it has ended)."""
        status = _NOT_STARTED if self._popen is None else self._popen.poll()
        if status is not None:
            for reader in self._readers:  # the last lines (a traceback) arrive just before the exit
                reader.join(timeout=5)
            self._readers = []
        progress = read_progress(self._progress)
        quiet = time.time() - (progress.time if progress else self._started)
        state = RankState(self.rank, status, progress, quiet)
        return RankReport(state, _drain(self._lines["stdout"]), _drain(self._lines["stderr"]))

    def signal(self, number: int) -> None:
        """Send signal `number` to its process group, if it still runs."""
        if self._popen is not None and self._popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._popen.pid, number)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for it to end; True when it has."""
        if self._popen is None:
            return True
        try:
            self._popen.wait(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            return False
        return True

    def close(self) -> None:
        """Forget its progress file (after it has ended)."""
        with contextlib.suppress(OSError):
            os.unlink(self._progress)


def stop_processes(processes: Sequence[RankProcess], grace_s: float = 2.0) -> None:
    """Stop every process that still runs: SIGTERM to all, then SIGKILL to those still running after
    `grace_s` (JAX catches SIGTERM as a preemption notice and keeps running)."""
    for process in processes:
        process.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        if not process.wait(deadline - time.monotonic()):
            process.signal(signal.SIGKILL)
            process.wait(10.0)
        process.close()


def _read_lines(stream: IO[str], lines: queue.SimpleQueue[str]) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    stream.close()


def _drain(lines: queue.SimpleQueue[str]) -> tuple[str, ...]:
    drained = []
    while True:
        try:
            drained.append(lines.get_nowait())
        except queue.Empty:
            return tuple(drained)
