"""What `meshplan launch` is asked to run, checked before anything starts.

A `LaunchSpec` holds the command and how to run it; `check_spec` refuses what cannot work with one
message saying what and how to fix it: fewer than one process or device, a command or Python script
that does not exist, a coordinator address that is not HOST:PORT, a negative hang timeout.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

from meshplan.errors import LaunchError

DEFAULT_HANG_TIMEOUT_S = 30.0
# Python's options that take a value (so the script is not the next word); -c and -m name no script file.
_PYTHON_VALUED = ("-W", "-X", "--check-hash-based-pycs")


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """One launch.

    Attributes:
        command: the program and its arguments, run once per process (e.g. ("python", "train.py")).
        nprocs: processes to start; None on Ray means one per node of the cluster.
        devices_per_process: CPU devices each process gets (None: 1; on Ray GPU nodes, the node's GPUs).
        coordinator: HOST:PORT for JAX's coordination service ("": 127.0.0.1, or rank 0's node on Ray,
            and a free port).
        ray_address: "" to start local processes; "local", "auto" or "ray://HOST:PORT" to run on Ray.
        hang_timeout: seconds a rank behind the others may stay silent before it is declared hung
            (`meshplan.launch.faults`); 0 turns the hang watch off.
        ray_temp_dir: where a local Ray keeps its files ("": Ray's default).
    """

    command: tuple[str, ...]
    nprocs: int | None = None
    devices_per_process: int | None = None
    coordinator: str = ""
    ray_address: str = ""
    hang_timeout: float = DEFAULT_HANG_TIMEOUT_S
    ray_temp_dir: str = ""


def check_spec(spec: LaunchSpec) -> None:
    """Raise LaunchError when `spec` cannot run; say how to fix it."""
    if spec.nprocs is None and not spec.ray_address:
        raise LaunchError("say how many processes to start: meshplan launch --nprocs N -- python train.py")
    if spec.nprocs is not None and spec.nprocs < 1:
        raise LaunchError(f"--nprocs must be at least 1, got {spec.nprocs}")
    if spec.devices_per_process is not None and spec.devices_per_process < 1:
        raise LaunchError(f"--devices-per-process must be at least 1, got {spec.devices_per_process}")
    if spec.hang_timeout < 0:
        raise LaunchError(f"--hang-timeout must be 0 (off) or a number of seconds, got {spec.hang_timeout:g}")
    if spec.coordinator:
        check_address(spec.coordinator)
    _check_command(spec.command, local_files=not spec.ray_address.startswith("ray://"))


def check_address(address: str) -> None:
    """Raise LaunchError unless `address` is HOST:PORT with a port in 1..65535."""
    match = re.fullmatch(r"(.+):(\d+)", address)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise LaunchError(f"--coordinator {address!r} is not HOST:PORT (e.g. 10.0.0.1:1234)")


def _check_command(command: tuple[str, ...], local_files: bool) -> None:
    if not command:
        raise LaunchError("give the command to run after --, e.g. meshplan launch --nprocs 2 -- python train.py")
    program = command[0]
    if shutil.which(program) is None:
        raise LaunchError(f"command {program!r} not found (not on PATH, or not an executable file)")
    script = _python_script(command) if local_files else None
    if script is not None and not os.path.isfile(script):
        raise LaunchError(f"Python script {script!r} not found in {os.getcwd()}; check the path after "
                          f"{program!r}")


def _python_script(command: tuple[str, ...]) -> str | None:
    """The script file a `python ...` command runs, or None (not Python, or -c / -m / stdin)."""
    if not re.fullmatch(r"python[\d.]*", os.path.basename(command[0])):
        return None
    words = iter(command[1:])
    for word in words:
        if word in _PYTHON_VALUED:
            next(words, None)
        elif word == "-" or (word.startswith("-") and not word.startswith("--") and word[1:2] in "cm"):
            return None
        elif not word.startswith("-"):
            return word
    return None
