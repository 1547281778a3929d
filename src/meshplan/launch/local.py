"""Launch on this machine: N processes of the same command, JAX's coordination service on 127.0.0.1.

Each process gets its rank, the process count, the coordinator address and D CPU devices
(`WorkerEnvironment`); the supervisor shows their output and ends the job at the first fault.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TextIO

from meshplan.launch.environment import WorkerEnvironment, free_port
from meshplan.launch.rank_process import RankProcess, RankReport, stop_processes
from meshplan.launch.spec import LaunchSpec
from meshplan.launch.supervisor import supervise


class LocalWorkers:
    """The job's processes on this machine (the supervisor's `Workers`)."""

    def __init__(self, processes: Sequence[RankProcess]) -> None:
        self.processes = tuple(processes)

    def reports(self) -> Sequence[RankReport]:
        return [process.report() for process in self.processes]

    def stop(self) -> None:
        stop_processes(self.processes)


def launch_local(spec: LaunchSpec, out: TextIO, err: TextIO) -> int:
    """Run `spec` as `spec.nprocs` local processes; return the launch's exit status (`supervise`)."""
    assert spec.nprocs is not None  # check_spec asks for it without Ray
    coordinator = spec.coordinator or f"127.0.0.1:{free_port('127.0.0.1')}"
    devices = spec.devices_per_process or 1
    processes: list[RankProcess] = []
    try:
        for rank in range(spec.nprocs):
            worker = WorkerEnvironment(rank, spec.nprocs, coordinator, devices)
            processes.append(RankProcess(spec.command, worker, os.environ))
        return supervise(LocalWorkers(processes), spec.hang_timeout, out, err)
    finally:
        stop_processes(processes)  # also when interrupted while starting them
