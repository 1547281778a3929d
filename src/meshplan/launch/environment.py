"""The contract between `meshplan launch` and the processes it starts: environment variables.

The launcher gives every worker the address of JAX's coordination service, the number of processes,
its process id and its devices; the worker's `meshplan.launch.initialize()` reads them back
(`WorkerEnvironment.from_env`). Where JAX reads a variable itself it gets the standard name:
`JAX_COORDINATOR_ADDRESS` (read by `jax.distributed.initialize`), `JAX_NUM_CPU_DEVICES` (the CPU
backend's device count) and `JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo` (cross-process collectives on
CPU). JAX 0.10.2 takes the process count and id only from arguments or from a cluster it recognises
(Slurm, Open MPI, Kubernetes, Cloud TPU; jax/_src/clusters/), so those two are meshplan's own.
"""

from __future__ import annotations

import shlex
import socket
from collections.abc import Mapping
from dataclasses import dataclass

COORDINATOR = "JAX_COORDINATOR_ADDRESS"
NUM_PROCESSES = "MESHPLAN_NUM_PROCESSES"
PROCESS_ID = "MESHPLAN_PROCESS_ID"
DEVICES_PER_PROCESS = "MESHPLAN_DEVICES_PER_PROCESS"
PROGRESS_FILE = "MESHPLAN_PROGRESS_FILE"
CPU_DEVICES = "JAX_NUM_CPU_DEVICES"
CPU_COLLECTIVES = "JAX_CPU_COLLECTIVES_IMPLEMENTATION"
# XLA's older way to ask for CPU devices; a stale value inherited from the caller would contradict the launcher's.
_FORCED_CPU_DEVICES = "--xla_force_host_platform_device_count"


@dataclass(frozen=True, slots=True)
class WorkerEnvironment:
    """What one launched process is told.

    Attributes:
        process_id: this process's rank, 0 .. num_processes - 1 (rank 0 hosts JAX's coordination service).
        num_processes: how many processes the job has.
        coordinator: HOST:PORT of the coordination service, reachable from every process.
        devices_per_process: the devices each process must see (CPU devices on a CPU machine).
        progress_file: where this process reports its progress to the launcher's hang watch ("" = nowhere).
    """

    process_id: int
    num_processes: int
    coordinator: str
    devices_per_process: int
    progress_file: str = ""

    def variables(self) -> dict[str, str]:
        """The environment variables that describe this process to `from_env` and to JAX."""
        return {COORDINATOR: self.coordinator, NUM_PROCESSES: str(self.num_processes),
                PROCESS_ID: str(self.process_id), DEVICES_PER_PROCESS: str(self.devices_per_process),
                PROGRESS_FILE: self.progress_file, CPU_DEVICES: str(self.devices_per_process),
                CPU_COLLECTIVES: "gloo", "PYTHONUNBUFFERED": "1"}  # unbuffered: output streams as it is printed

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> WorkerEnvironment | None:
        """The launcher's description of this process, or None when no launcher started it."""
        if PROCESS_ID not in environ:
            return None
        return cls(int(environ[PROCESS_ID]), int(environ[NUM_PROCESSES]), environ[COORDINATOR],
                   int(environ[DEVICES_PER_PROCESS]), environ.get(PROGRESS_FILE, ""))


def worker_variables(base: Mapping[str, str], worker: WorkerEnvironment) -> dict[str, str]:
    """`base` (the node's environment) with `worker`'s variables, and without a forced CPU device count in
    XLA_FLAGS (JAX_NUM_CPU_DEVICES says it instead)."""
    env = dict(base)
    flags = [f for f in shlex.split(env.get("XLA_FLAGS", "")) if not f.startswith(_FORCED_CPU_DEVICES)]
    if flags:
        env["XLA_FLAGS"] = shlex.join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    env.update(worker.variables())
    return env


def free_port(host: str = "") -> int:
    """A TCP port free on this machine now (for the coordination service, which binds it soon after)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
