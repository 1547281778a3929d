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
from meshplan.parallel.call import CallForm
from meshplan.parallel.methods import SPMD_METHODS, Method, ShardParallel
from meshplan.parallel.pipeshard import PipeshardParallel
from meshplan.parallel.pipeshard_function import PipeshardFunction
from meshplan.parallel.spmd import SpmdFunction


def parallelize(fn: Callable[..., Any] | None = None, *, method: Method | None = None,
                devices: Sequence[Any] | None = None, batch_argnums: Sequence[int] | None = None,
                donate_argnums: Sequence[int] | str = (), cluster: Cluster | str | None = None,
                static_argnums: Sequence[int] | int = (), static_argnames: Sequence[str] | str = (),
                donate_argnames: Sequence[str] | str = (), batch_argnames: Sequence[str] | str = ()) -> Any:
    """Make `fn` plan and run itself sharded over `devices`.

    Usable as `@parallelize` or `@parallelize(method=DataParallel())`. Call the result as `fn`
    itself: positional or keyword arguments (bound to `fn`'s signature as `jax.jit` binds them).
    Flax nnx objects passed in (modules, `nnx.Optimizer`, metrics, `nnx.Rngs`) are updated in place
    as under `nnx.jit`. A `jax.jit`- or `nnx.jit`-decorated `fn` is unwrapped (its static
    arguments kept; its donation not: give `donate_argnums` here).

    Arguments are named by position or by name. A position counts `fn`'s positional arguments from
    0 (as in `jax.jit`), whether the caller then passes that argument by position or by keyword;
    a name names a parameter (keyword-only ones included). The `*argnums` and `*argnames` forms of
    one option add up.

    Args:
        fn: a JAX-traceable function of pytrees of arrays (and nnx objects).
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
            params; an nnx object -> its new state); the plan gives both one layout. A donated
            leaf with no such result is not donated (UnusedDonationWarning, except under "auto").
            Under PipeshardParallel the update of a train step writes into the donated buffers on
            each stage.
            Default (): none.
        cluster: plan with measured costs instead of placeholders: a Cluster, or the path of
            a file written by `meshplan profile-cluster` on these devices (intra- and
            inter-node collective latency and bandwidth, matmul FLOP/s; see DeviceCosts).
        static_argnums, static_argnames: arguments that are hashable Python values (a flag, a
            config, a function), as in `jax.jit`: not traced, each new value planned and
            compiled once and cached. An unhashable one raises OptionsError when called.
        donate_argnames, batch_argnames: `donate_argnums` and `batch_argnums` by parameter name.

    Returns:
        A ParallelizedFunction, or a decorator making one when `fn` is None.
    """
    method = ShardParallel() if method is None else method
    costs = DeviceCosts() if cluster is None else DeviceCosts.from_cluster(cluster)
    _check_donate_argnums(donate_argnums)  # before fn: a decorator reports it at once

    if not isinstance(method, (*SPMD_METHODS, PipeshardParallel)):
        raise OptionsError(
            f"parallelize(method={method!r}): unknown method; use ShardParallel(), DataParallel(), "
            "Zero2Parallel(), Zero3Parallel(), TensorParallel() or PipeshardParallel(...)")

    def wrap(f: Callable[..., Any]) -> SpmdFunction | PipeshardFunction:
        form = CallForm.of(f, static_argnums, static_argnames)
        batch = None if batch_argnums is None and not batch_argnames else \
            form.slot_indices(batch_argnums, batch_argnames, "batch_argnums")
        donated = donate_argnums if donate_argnums == "auto" else \
            form.slot_indices(_check_donate_argnums(donate_argnums), donate_argnames, "donate_argnums")
        _check_not_static(form, batch or (), "batch_argnums")
        _check_not_static(form, () if donated == "auto" else donated, "donate_argnums")
        if isinstance(method, PipeshardParallel):  # a train step, or a loss fn with boundaries
            return PipeshardFunction(form, method, devices, costs, batch, donated)
        return SpmdFunction(form, method, devices, batch, donated, costs)

    return wrap if fn is None else wrap(fn)


def _check_not_static(form: CallForm, slots: Sequence[int], option: str) -> None:
    both = sorted(set(slots) & set(form.static_slots()))
    if both:
        names = ", ".join(repr(form.slot_name(i)) for i in both)
        raise OptionsError(f"parallelize(..., {option}=...) names {names}, a static argument of {form.name}; a "
                           f"static argument is a Python value, not arrays: drop it from {option} or from "
                           f"static_argnums/static_argnames")


def _check_donate_argnums(donate_argnums: Sequence[int] | str) -> tuple[int, ...] | str:
    if isinstance(donate_argnums, str):
        if donate_argnums != "auto":
            raise OptionsError(f"parallelize(..., donate_argnums={donate_argnums!r}): use \"auto\" or a tuple "
                               "of argument positions, e.g. donate_argnums=(0,)")
        return donate_argnums
    if isinstance(donate_argnums, int):
        return (donate_argnums,)
    return tuple(donate_argnums)
