"""The worker's side of `meshplan launch`: `initialize()` joins the job the launcher started.

Call it once at the top of a training script, before anything uses JAX. Under the launcher it starts
`jax.distributed` with the launcher's coordinator, process count and id, waits until every process has
joined (JAX exchanges the processes' devices when the backend starts), and checks that each process has
the devices the launcher gave it. Run without the launcher (`python train.py`), it does nothing and
returns None: the same script runs in one process.
"""

from __future__ import annotations

import os
from types import ModuleType

from meshplan.errors import LaunchError
from meshplan.launch.environment import WorkerEnvironment
from meshplan.launch.progress import report_initialized


def initialize() -> WorkerEnvironment | None:
    """Join the job this process was launched in (`meshplan launch`); None outside a launch.

    Returns:
        This process's rank, the number of processes, the coordinator and its devices, or None when
        `meshplan launch` did not start this process (nothing is done then).

    Raises:
        LaunchError: JAX already started in this process, or its devices are not those the launcher
            gave (e.g. the script sets its own CPU device count).
    """
    worker = WorkerEnvironment.from_env(os.environ)
    if worker is None:
        return None
    import jax

    report_initialized()  # joining: a rank that never gets here is told apart from one waiting here
    if not jax.distributed.is_initialized():
        try:
            jax.distributed.initialize(worker.coordinator, worker.num_processes, worker.process_id)
        except RuntimeError as exc:
            raise LaunchError(f"process {worker.process_id} could not join the job: {exc}. Call "
                              "meshplan.launch.initialize() at the top of the script, before anything uses JAX") \
                from None
    _check_devices(jax, worker)
    report_initialized()
    return worker


def _check_devices(jax: ModuleType, worker: WorkerEnvironment) -> None:
    """Every process must hold the launcher's number of devices (JAX's meshes assume even processes);
    starting the backend here also waits for every process to join."""
    local, total = jax.local_device_count(), jax.device_count()
    want = worker.devices_per_process
    if local != want:
        raise LaunchError(f"process {worker.process_id} has {local} {jax.default_backend()} devices, but the "
                          f"launcher gave each process {want}; do not set the device count in the script "
                          "(XLA_FLAGS, JAX_NUM_CPU_DEVICES, jax_num_cpu_devices), pass --devices-per-process")
    if total != want * worker.num_processes:
        raise LaunchError(f"the job has {total} devices over {worker.num_processes} processes, but each process "
                          f"should have {want}: the processes hold uneven devices; give every process the same "
                          "number (--devices-per-process)")
