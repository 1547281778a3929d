"""Start or join Ray: the one place meshplan calls `ray.init`, for planning tasks and for launched workers.

"local" starts a new Ray on this machine (even if another one runs here), with `RAY_AUTH_MODE=disabled`
unless the caller chose otherwise and its files in `temp_dir` when given; "auto" or "ray://HOST:PORT"
(or a GCS "HOST:PORT") joins an existing cluster. Whoever started a local Ray shuts it down.
"""

from __future__ import annotations

import logging
import os
import socket
from types import ModuleType
from typing import Any

from meshplan.errors import OptionsError


def import_ray(purpose: str) -> ModuleType:
    """The `ray` module, or a clear error naming what needed it (e.g. "--executor ray")."""
    try:
        import ray
    except ImportError:
        raise OptionsError(f"{purpose} needs Ray: pip install 'meshplan[ray]' (or pip install ray)") from None
    return ray


def start_or_join_ray(address: str, temp_dir: str | None = None, num_cpus: int | None = None,
                      purpose: str = "Ray") -> bool:
    """Connect this process to Ray at `address` unless it already is; True when a local Ray was started
    here (the caller shuts it down with `ray.shutdown()`).

    Raises:
        OptionsError: Ray is not installed, or cannot be started or reached at `address`.
    """
    ray = import_ray(purpose)
    if ray.is_initialized():
        return False
    # Quiet: meshplan reports what its tasks and workers do; Ray's own start-up notes would interleave.
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "ignore_reinit_error": True,
                              "logging_level": logging.WARNING}
    if address == "local":
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        kwargs.update(address="local", num_cpus=num_cpus)
        if temp_dir:
            kwargs["_temp_dir"] = temp_dir
    else:
        _check_reachable(address)
        kwargs["address"] = address
    try:
        ray.init(**kwargs)
    except Exception as exc:  # Ray raises ConnectionError, ValueError, RuntimeError, ... by cause
        raise OptionsError(f"could not start or join Ray at --ray-address {address!r} ({exc}); use 'local' to start "
                           "one here, 'auto' inside a Ray cluster, or ray://HOST:10001") from None
    return address == "local"


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Refuse a HOST:PORT (or ray://HOST:PORT) nobody answers on: Ray itself retries such an address for
    minutes. "auto" is left to Ray (it finds the address on this node and fails at once when there is none)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise OptionsError(f"no Ray cluster answers at --ray-address {address!r} ({exc.strerror or exc}); check the "
                           "address and that the cluster runs (ray status), or use 'local' to start one here") from None
