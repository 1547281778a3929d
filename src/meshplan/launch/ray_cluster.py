"""Launch on a Ray cluster: one worker per node, JAX's coordination service on rank 0's node.

A placement group reserves one bundle per worker: STRICT_SPREAD (one per node) on a cluster of several
nodes, PACK on one machine (`--ray-address local` starts a Ray here and places every worker on it). Each
bundle holds one CPU and, on GPU nodes, the GPUs its worker gets (Ray sets CUDA_VISIBLE_DEVICES for it):
the node's GPUs, or --devices-per-process of them. A Ray actor per rank (`RankHost`) starts the command
as an ordinary process on its node, with the same environment a local launch gives; the launcher asks
every actor for its rank's output, progress and exit status, so the supervisor watches Ray workers exactly
as it watches local processes. Ray is the cluster manager: meshplan adds no daemon of its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TextIO

from meshplan.distributed.ray_session import import_ray, start_or_join_ray
from meshplan.errors import LaunchError
from meshplan.launch.environment import WorkerEnvironment, free_port
from meshplan.launch.faults import RankState
from meshplan.launch.rank_process import RankProcess, RankReport, stop_processes
from meshplan.launch.spec import LaunchSpec
from meshplan.launch.supervisor import supervise

PLACEMENT_TIMEOUT_S = 60.0
REPORT_TIMEOUT_S = 60.0  # an actor that does not answer for this long counts as lost


class RankHost:
    """The Ray actor of one rank: runs the rank's process on its node and reports on it."""

    def __init__(self) -> None:
        self._process: RankProcess | None = None

    def address(self) -> tuple[str, int]:
        """This node's IP address and a port free on it (for the coordinator, when this is rank 0)."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def start(self, command: Sequence[str], worker: WorkerEnvironment, cwd: str) -> None:
        """Start the rank's process, in the driver's working directory when this node has it."""
        self._process = RankProcess(command, worker, os.environ, cwd if os.path.isdir(cwd) else None)

    def report(self) -> RankReport:
        assert self._process is not None, "start first"
        return self._process.report()

    def stop(self) -> None:
        if self._process is not None:
            stop_processes([self._process])


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the workers go: `nprocs` bundles of `bundle` placed by `strategy`; each worker has
    `devices_per_process` devices (its GPUs, or CPU devices when the bundle has none)."""

    nprocs: int
    strategy: str
    bundle: dict[str, float]
    devices_per_process: int


class RayWorkers:
    """The job's Ray actors, one per rank (the supervisor's `Workers`)."""

    def __init__(self, ray: ModuleType, actors: Sequence[Any]) -> None:
        self._ray, self.actors = ray, tuple(actors)

    def reports(self) -> Sequence[RankReport]:
        refs = [actor.report.remote() for actor in self.actors]
        return [self._report(rank, ref) for rank, ref in enumerate(refs)]

    def _report(self, rank: int, ref: Any) -> RankReport:
        ray = self._ray
        try:
            return ray.get(ref, timeout=REPORT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            lost = f"its Ray worker did not answer for {REPORT_TIMEOUT_S:g} s"
        except ray.exceptions.RayError as exc:  # the actor died: its node went away, it was killed, ...
            lost = f"its Ray worker died ({type(exc).__name__})"
        return RankReport(RankState(rank, None, None, 0.0, lost=lost))

    def stop(self) -> None:
        refs = [actor.stop.remote() for actor in self.actors]
        for ref in refs:
            with contextlib.suppress(self._ray.exceptions.RayError):
                self._ray.get(ref, timeout=REPORT_TIMEOUT_S)


def plan_placement(nodes: Sequence[dict[str, Any]], nprocs: int | None, devices_per_process: int | None) -> Placement:
    """The placement of one worker per node of `nodes` (Ray's `ray.nodes()`, alive ones), or of every
    worker on the one node of a single-machine cluster.

    Raises:
        LaunchError: more workers than nodes, GPUs that cannot be shared evenly, or too few of them.
    """
    gpus = [int(node["Resources"].get("GPU", 0)) for node in nodes]
    if len(nodes) == 1:
        count = nprocs or 1
        if not gpus[0]:
            return Placement(count, "PACK", {"CPU": 1.0}, devices_per_process or 1)
        per_worker = devices_per_process or gpus[0] // count
        if (devices_per_process is None and gpus[0] % count) or per_worker * count > gpus[0] or not per_worker:
            raise LaunchError(f"the Ray node has {gpus[0]} GPUs, which {count} workers cannot share evenly with "
                              f"{per_worker or 'no'} each; use --nprocs dividing {gpus[0]}, or --devices-per-process")
        return Placement(count, "PACK", {"CPU": 1.0, "GPU": float(per_worker)}, per_worker)
    count = nprocs or len(nodes)
    if count > len(nodes):
        raise LaunchError(f"--nprocs {count} asks for one worker per node, but the Ray cluster has {len(nodes)} "
                          "nodes; use --nprocs at most the number of nodes")
    if not any(gpus):
        return Placement(count, "STRICT_SPREAD", {"CPU": 1.0}, devices_per_process or 1)
    if devices_per_process is None and len(set(gpus)) > 1:
        raise LaunchError(f"the Ray nodes have uneven GPUs ({', '.join(map(str, sorted(set(gpus))))} per node), but "
                          "every process of a JAX job needs as many devices; pass --devices-per-process to use that "
                          "many on each node")
    per_worker = devices_per_process or gpus[0]
    return Placement(count, "STRICT_SPREAD", {"CPU": 1.0, "GPU": float(per_worker)}, per_worker)


def launch_on_ray(spec: LaunchSpec, out: TextIO, err: TextIO) -> int:
    """Run `spec` as one Ray actor-started process per node (every one on this machine with "local");
    return the launch's exit status (`supervise`).

    Raises:
        OptionsError: Ray is missing, or cannot be started or reached at `spec.ray_address`.
        LaunchError: the cluster cannot hold the workers.
    """
    ray = import_ray("meshplan launch --ray-address")
    local_cpus = max(spec.nprocs or 1, os.cpu_count() or 1) if spec.ray_address == "local" else None
    started = start_or_join_ray(spec.ray_address, spec.ray_temp_dir or None, local_cpus,
                                purpose="meshplan launch --ray-address")
    group, actors = None, []
    try:
        placement = plan_placement([n for n in ray.nodes() if n["Alive"]], spec.nprocs, spec.devices_per_process)
        group = _reserve(ray, placement)
        _start_actors(ray, group, placement, spec, actors)
        return supervise(RayWorkers(ray, actors), spec.hang_timeout, out, err)
    finally:
        _release(ray, actors, group, started)


def _reserve(ray: ModuleType, placement: Placement) -> Any:
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([dict(placement.bundle)] * placement.nprocs, strategy=placement.strategy)
    if not group.wait(timeout_seconds=PLACEMENT_TIMEOUT_S):
        remove_placement_group(group)
        raise LaunchError(f"Ray could not place {placement.nprocs} workers of {placement.bundle} "
                          f"({placement.strategy}) within {PLACEMENT_TIMEOUT_S:g} s; the cluster has "
                          f"{ray.available_resources()} free; use fewer workers or free the resources")
    return group


def _start_actors(ray: ModuleType, group: Any, placement: Placement, spec: LaunchSpec, actors: list[Any]) -> None:
    """Create one actor per bundle into `actors` (filled as they are made, so a failure leaves them
    known to `_release`) and start every rank's process."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    host = ray.remote(RankHost)
    for index in range(placement.nprocs):
        where = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
        actors.append(host.options(num_cpus=placement.bundle["CPU"], num_gpus=placement.bundle.get("GPU", 0),
                                   scheduling_strategy=where).remote())
    coordinator = spec.coordinator
    if not coordinator:
        ip, port = ray.get(actors[0].address.remote())
        coordinator = f"{ip}:{port}"
    ray.get([actor.start.remote(spec.command, WorkerEnvironment(rank, placement.nprocs, coordinator,
                                                                placement.devices_per_process), os.getcwd())
             for rank, actor in enumerate(actors)])


def _release(ray: ModuleType, actors: Sequence[Any], group: Any, started: bool) -> None:
    """Stop the ranks' processes, then the actors, the placement group and a Ray started here."""
    from ray.util.placement_group import remove_placement_group

    RayWorkers(ray, actors).stop()
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor)
    if group is not None:
        with contextlib.suppress(Exception):
            remove_placement_group(group)
    if started:
        ray.shutdown()
