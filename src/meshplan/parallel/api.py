"""`parallelize(fn)`: a function that captures, plans and runs itself in parallel.

Costs: meshplan.cluster.costs.DeviceCosts, placeholders unless `parallelize(..., cluster=...)`
gives measured ones (a cluster file from `meshplan profile-cluster`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from meshplan.cluster.cluster import Cluster
from meshplan.cluster.costs import DeviceCosts
from meshplan.errors import OptionsError
from meshplan.parallel.methods import SPMD_METHODS, Method, ShardParallel
from meshplan.parallel.pipeshard import PipeshardParallel
from meshplan.parallel.pipeshard_function import PipeshardFunction
from meshplan.parallel.spmd import SpmdFunction


def parallelize(fn: Callable[..., Any] | None = None, *, method: Method | None = None,
                devices: Sequence[Any] | None = None, batch_argnums: Sequence[int] | None = None,
                donate_argnums: Sequence[int] | str = (), cluster: Cluster | str | None = None) -> Any:
    """Make `fn` plan and run itself sharded over `devices`.

    Usable as `@parallelize` or `@parallelize(method=DataParallel())`.

    Args:
        fn: a JAX-traceable function of pytrees of arrays.
        method: ShardParallel() (default), DataParallel(), Zero2Parallel(), Zero3Parallel(),
            TensorParallel() or PipeshardParallel(...) (a whole train step pipelined over
            stages, or a loss function cut into layers by mark_pipeline_boundary).
        devices: the devices to use; defaults to `jax.devices()`.
        batch_argnums: positions of the arguments whose leading dim is the batch (split by the
            data-parallel methods), as in Alpa. Default None: inferred from the program
            (`meshplan.capture.batch`): inputs the step returns updated (weights, optimizer
            state) are not the batch; among the others, the dims that run through the most
            values are. A wrong value raises OptionsError naming the argument and the fix.
        donate_argnums: positions of the arguments whose buffers the results may reuse, as in
            `jax.jit`; "auto": every argument except the batch arguments. Each donated leaf is
            paired with the first unpaired result of its shape and dtype (params -> new
            params); the plan gives both one layout. A donated leaf with no such result is
            not donated (UnusedDonationWarning, except under "auto"). Under PipeshardParallel
            the update of a train step writes into the donated buffers on each stage.
            Default (): none.
        cluster: plan with measured costs instead of placeholders: a Cluster, or the path of
            a file written by `meshplan profile-cluster` on these devices (intra- and
            inter-node collective latency and bandwidth, matmul FLOP/s; see DeviceCosts).

    Returns:
        A ParallelizedFunction, or a decorator making one when `fn` is None.
    """
    method = ShardParallel() if method is None else method
    argnums = None if batch_argnums is None else tuple(batch_argnums)
    donated = _check_donate_argnums(donate_argnums)
    costs = DeviceCosts() if cluster is None else DeviceCosts.from_cluster(cluster)

    if not isinstance(method, (*SPMD_METHODS, PipeshardParallel)):
        raise OptionsError(
            f"parallelize(method={method!r}): unknown method; use ShardParallel(), DataParallel(), "
            "Zero2Parallel(), Zero3Parallel(), TensorParallel() or PipeshardParallel(...)")

    def wrap(f: Callable[..., Any]) -> SpmdFunction | PipeshardFunction:
        if isinstance(method, PipeshardParallel):  # a train step, or a loss fn with boundaries
            jitted = hasattr(f, "lower") and hasattr(f, "__wrapped__")  # a jax.jit step: trace the Python function
            return PipeshardFunction(f.__wrapped__ if jitted else f, method, devices, costs, argnums, donated)
        return SpmdFunction(f, method, devices, argnums, donated, costs)

    return wrap if fn is None else wrap(fn)


def _check_donate_argnums(donate_argnums: Sequence[int] | str) -> tuple[int, ...] | str:
    if isinstance(donate_argnums, str):
        if donate_argnums != "auto":
            raise OptionsError(f"parallelize(..., donate_argnums={donate_argnums!r}): use \"auto\" or a tuple "
                               "of argument positions, e.g. donate_argnums=(0,)")
        return donate_argnums
    if isinstance(donate_argnums, int):
        return (donate_argnums,)
    return tuple(donate_argnums)
