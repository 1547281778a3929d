"""`meshplan launch`: start the processes of one JAX job, here or on a Ray cluster, and watch them.

    meshplan launch --nprocs 2 --devices-per-process 4 -- python train.py     # two processes here
    meshplan launch --ray-address auto -- python train.py                     # one per Ray node

The launcher (`run`) gives every process its rank, the process count, the coordinator of JAX's
coordination service and its devices (`environment`); the script joins with `initialize()` (`worker`)
and reports progress from every parallelized call (`progress`). The launcher prints rank 0's output and
the other ranks' errors, and ends the whole job with one message naming the rank when a rank fails or
hangs (`faults`, `supervisor`). Processes run on this machine (`local`) or through Ray actors, one per
node (`ray_cluster`). See docs/multihost.md.
"""

from __future__ import annotations

import sys
from typing import TextIO

from meshplan.launch.environment import WorkerEnvironment
from meshplan.launch.local import launch_local
from meshplan.launch.ray_cluster import launch_on_ray
from meshplan.launch.spec import DEFAULT_HANG_TIMEOUT_S, LaunchSpec, check_spec
from meshplan.launch.worker import initialize


def run(spec: LaunchSpec, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Launch `spec` and watch it to the end; return its exit status (0: every rank exited 0; 1: a rank
    failed or hung, and every rank was stopped; 130: interrupted).

    Raises:
        LaunchError: the launch cannot start (see `check_spec`, and Ray's placement).
        OptionsError: Ray is missing or cannot be reached at `spec.ray_address`.
    """
    check_spec(spec)
    out, err = out or sys.stdout, err or sys.stderr
    return launch_on_ray(spec, out, err) if spec.ray_address else launch_local(spec, out, err)


__all__ = ["DEFAULT_HANG_TIMEOUT_S", "LaunchSpec", "WorkerEnvironment", "check_spec", "initialize", "run"]
