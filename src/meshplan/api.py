"""User API: `parallelize(fn)` -> a function that captures, plans and runs itself sharded.

On the first call with new argument shapes the function is captured (meshplan.capture),
planned on a logical mesh of the visible devices (solve_intra), jitted as planned
(execute_sharded) and compiled at once, counting XLA's involuntary full rematerializations
(runtime.diagnostics); later calls with the same shapes reuse that executable. Donated
arguments (donate_argnums) are paired with results of the same shape and dtype
(runtime.donation); the pairs are planned as aliases and their buffers reused by XLA.

Costs: meshplan.runtime.defaults.DeviceCosts, placeholders unless `parallelize(...,
cluster=...)` gives measured ones (a cluster file from `meshplan profile-cluster`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
from jax.sharding import NamedSharding

from meshplan.capture import Captured, capture, tag_batch_inputs
from meshplan.cluster.cluster import Cluster
from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.model import CostModel
from meshplan.errors import InfeasiblePlanError, MeshError, OptionsError
from meshplan.files import write_json_atomic, write_text_atomic
from meshplan.intra.options import IntraOptions
from meshplan.intra.plan import IntraPlan
from meshplan.intra.solve import solve_intra
from meshplan.ir import format_graph
from meshplan.pipeshard import PipeshardFunction, PipeshardParallel
from meshplan.runtime.abstract import shapes_of, signature
from meshplan.runtime.defaults import DeviceCosts, default_mesh_shape
from meshplan.runtime.diagnostics import CompileDiagnostics, warn_if_rematerialized
from meshplan.runtime.donation import Donation, alias_donated, drop_unplaceable, pair_donated, warn_not_donated
from meshplan.runtime.sharded import (
    ShardedFunction,
    execute_sharded,
    make_jax_mesh,
    partition_spec,
    placeable_spec,
)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardParallel:
    """Automatic intra-op parallelism: the ILP chooses every sharding.

    Attributes:
        mesh_shape: logical mesh shape; its product must equal the device count.
            None: `default_mesh_shape(n)`.
    """

    mesh_shape: tuple[int, ...] | None = None

    def mesh(self, num_devices: int) -> tuple[int, ...]:
        shape = default_mesh_shape(num_devices) if self.mesh_shape is None else tuple(self.mesh_shape)
        if math.prod(shape) != num_devices:
            raise MeshError(
                f"ShardParallel(mesh_shape={shape}) needs {math.prod(shape)} devices but {num_devices} are "
                f"used; give a mesh_shape whose product is {num_devices}, e.g. {default_mesh_shape(num_devices)}, "
                f"or pass that many devices to parallelize(devices=...)")
        return shape

    def options(self, costs: DeviceCosts) -> IntraOptions:
        return IntraOptions(cost=CostModel(flops_per_second=costs.flops_per_second))

    @property
    def forces_batch(self) -> bool:
        return False


@dataclasses.dataclass(frozen=True, slots=True)
class DataParallel:
    """Data parallelism: a 1-D mesh of all devices, batch arguments split over it.

    Parameters carry no memory price, so the plan keeps them whole on every device unless
    splitting one is strictly cheaper in the cost model (e.g. a value used only elementwise).
    """

    def mesh(self, num_devices: int) -> tuple[int, ...]:
        return (num_devices,)

    def options(self, costs: DeviceCosts) -> IntraOptions:
        return IntraOptions(cost=CostModel(flops_per_second=costs.flops_per_second), force_batch_dim_to_mesh_dim=0)

    @property
    def forces_batch(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True, slots=True)
class Zero2Parallel(DataParallel):
    """Data parallelism with a memory price that shards what is cheap to shard (ZeRO-2-like).

    A captured function does not tell weights from optimizer state: both are inputs, and
    without `donate_argnums` meshplan's captured graphs carry no parameter->update aliases,
    so each input's layout is chosen on its own. A price of half a byte's transfer time per
    byte held makes a split pay off only when it costs (almost) no communication: optimizer
    moments, used only elementwise with reduce-scattered gradients, end up sharded; weights
    that the forward pass needs whole stay replicated (splitting them would cost an
    all-gather per step).
    Whether a given tensor is sharded is the ILP's decision; read it from `get_plan()`.
    """

    def options(self, costs: DeviceCosts) -> IntraOptions:
        cost = CostModel(flops_per_second=costs.flops_per_second, memory_price=0.5 * costs.beta)
        return IntraOptions(cost=cost, force_batch_dim_to_mesh_dim=0)


@dataclasses.dataclass(frozen=True, slots=True)
class Zero3Parallel(DataParallel):
    """Data parallelism with every non-batch input (weights and optimizer state) sharded (ZeRO-3).

    Inputs with no dim that the mesh can split (scalars, tiny vectors) stay replicated.
    """

    def options(self, costs: DeviceCosts) -> IntraOptions:
        cost = CostModel(flops_per_second=costs.flops_per_second, memory_price=10 * costs.beta)
        return IntraOptions(cost=cost, force_batch_dim_to_mesh_dim=0, allow_replicated_parameters=False)


@dataclasses.dataclass(frozen=True, slots=True)
class TensorParallel:
    """Megatron-style tensor parallelism: a 1-D mesh of all devices on which no input may stay
    whole, so weights are split (column then row in an MLP) and the ILP picks how."""

    def mesh(self, num_devices: int) -> tuple[int, ...]:
        return (num_devices,)

    def options(self, costs: DeviceCosts) -> IntraOptions:
        return IntraOptions(cost=CostModel(flops_per_second=costs.flops_per_second),
                            allow_replicated_parameters=False)

    @property
    def forces_batch(self) -> bool:
        return False


Method = ShardParallel | DataParallel | Zero2Parallel | Zero3Parallel | TensorParallel | PipeshardParallel
# Methods a ParallelizedFunction runs; PipeshardParallel has its own PipeshardFunction.
_METHODS = (ShardParallel, DataParallel, Zero2Parallel, Zero3Parallel, TensorParallel)


@dataclasses.dataclass(frozen=True, slots=True)
class _Compiled:
    """Everything one input signature produced."""

    captured: Captured  # graph aliases include the donated pairs
    plan: IntraPlan
    sharded: ShardedFunction  # bound to its compiled executable
    example: tuple[Any, ...]  # ShapeDtypeStructs of the (reordered) arguments
    in_shardings: tuple[Any, ...]  # NamedShardings of the (reordered) arguments, same pytree
    donation: Donation  # flat indices of the (reordered) arguments
    diagnostics: CompileDiagnostics


class ParallelizedFunction:
    """A function planned and sharded per input signature; call it like the original.

    Donated arguments (`donate_argnums`) already laid out as planned, e.g. the previous step's
    results, are consumed: their arrays are deleted by the call. Arguments that must first be
    moved to the planned layout (e.g. freshly made on one device) are copied, only the copy is
    donated, and the originals stay valid.
    """

    def __init__(self, fn: Callable[..., Any], method: Method, devices: Sequence[Any] | None,
                 batch_argnums: tuple[int, ...], donate_argnums: tuple[int, ...] | str = (),
                 costs: DeviceCosts | None = None) -> None:
        if not isinstance(method, _METHODS):
            raise OptionsError(
                f"parallelize(method={method!r}): unknown method; use ShardParallel(), DataParallel(), "
                "Zero2Parallel(), Zero3Parallel(), TensorParallel() or PipeshardParallel(...)")
        self.fn, self.method, self.batch_argnums = fn, method, batch_argnums
        self.donate_argnums = donate_argnums
        self.costs = costs or DeviceCosts()
        self.devices = None if devices is None else tuple(devices)
        self._cache: dict[Any, _Compiled] = {}
        self._last: _Compiled | None = None
        self.__name__ = getattr(fn, "__name__", "parallelized")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args: Any) -> Any:
        compiled = self._compiled(args)
        ordered = self._order(args)
        if compiled.donation.pairs:
            ordered = _copy_misplaced_donations(ordered, compiled)
        # Arguments committed elsewhere (e.g. the previous step's outputs, laid out as the plan
        # chose for outputs) are moved to the planned input layout; the executable rejects them.
        return compiled.sharded(*jax.device_put(ordered, compiled.in_shardings))

    def get_plan(self) -> IntraPlan:
        """The IntraPlan of the last call.

        Raises:
            OptionsError: the function has not been called yet.
        """
        return self._require_last().plan

    def dump_debug_info(self, folder: str | Path) -> tuple[Path, ...]:
        """Write what the last call planned and compiled into `folder`; return the paths.

        Files: graph.txt (captured graph, with donation aliases), plan.json (IntraPlan.to_dict),
        hlo.txt (compiled HLO), memory.txt (compiled.memory_analysis()), cost.json
        (compiled.cost_analysis()), shardings.txt (input and output shardings of the compiled
        function), diagnostics.json (involuntary full rematerializations XLA reported while
        compiling, with its messages; compile time; donated argument -> result pairs).
        """
        last = self._require_last()
        compiled = last.sharded.executable
        folder = Path(folder)
        texts = {"graph.txt": format_graph(last.captured.graph), "hlo.txt": compiled.as_text(),
                 "memory.txt": str(compiled.memory_analysis()) + "\n",
                 "shardings.txt": _shardings_text(compiled)}
        for name, text in texts.items():
            write_text_atomic(folder / name, text)
        jsons = {"plan.json": last.plan.to_dict(), "cost.json": _jsonable(compiled.cost_analysis()),
                 "diagnostics.json": _diagnostics(last)}
        for name, value in jsons.items():
            write_json_atomic(folder / name, value)
        return tuple(folder / n for n in (*texts, *jsons))

    def _require_last(self) -> _Compiled:
        if self._last is None:
            raise OptionsError(f"{self.__name__} has no plan yet; call it once with example arguments first")
        return self._last

    def _compiled(self, args: tuple[Any, ...]) -> _Compiled:
        key = signature(args)
        if key not in self._cache:
            self._cache[key] = self._plan(args)
        self._last = self._cache[key]
        return self._last

    def _plan(self, args: tuple[Any, ...]) -> _Compiled:
        self._check_batch_argnums(args)
        donated_args = self._donated_positions(args)
        devices = list(self.devices) if self.devices is not None else jax.devices()
        shape = self.method.mesh(len(devices))
        ordered = self._order(args)
        captured = capture(self._ordered_fn(len(args)), *ordered, name=self.__name__)
        if self.method.forces_batch:
            captured = tag_batch_inputs(captured, self._num_batch_leaves(args))
        self.costs.check_devices(len(devices), f"parallelize({self.__name__})")
        mesh = self.costs.mesh(shape)
        donation, plan = self._solve(captured, pair_donated(captured, self._donated_leaves(args, donated_args)), mesh)
        if self.donate_argnums != "auto":  # "auto" donates what can be donated, silently
            warn_not_donated(captured, donation, self.__name__, stacklevel=4)
        captured = alias_donated(captured, donation)
        jax_mesh = make_jax_mesh(mesh, devices if self.devices else None)
        example = shapes_of(ordered)
        sharded, diagnostics = execute_sharded(captured, plan, jax_mesh, donation.donated).compile(*example)
        warn_if_rematerialized(diagnostics, f"{self.__name__} on mesh {mesh.name}", stacklevel=4)
        specs = [NamedSharding(jax_mesh, partition_spec(placeable_spec(plan.strategy(n).output,
                                                                     captured.graph[n].shape, plan.mesh)))
                 for n in captured.input_nodes]
        return _Compiled(captured, plan, sharded, example, jax.tree_util.tree_unflatten(captured.in_tree, specs),
                         donation, diagnostics)

    def _solve(self, captured: Captured, donation: Donation, mesh: LogicalMesh) -> tuple[Donation, IntraPlan]:
        """Plan with the donated pairs as aliases. When that is infeasible, drop the pairs that
        share no layout and retry, and last plan without any pair (an error then is not the
        donation's)."""
        options = self.method.options(self.costs)
        solve = lambda d: solve_intra(alias_donated(captured, d).graph, mesh, options)  # noqa: E731
        try:
            return donation, solve(donation)
        except InfeasiblePlanError:
            if not donation.pairs:
                raise
        pruned = drop_unplaceable(captured, donation, mesh, options)
        if pruned.pairs and pruned.pairs != donation.pairs:
            try:
                return pruned, solve(pruned)
            except InfeasiblePlanError:
                pass
        undonated = donation.without_pairs()
        return undonated, solve(undonated)

    def _donated_positions(self, args: tuple[Any, ...]) -> tuple[int, ...]:
        """Positions (in the caller's order) of the donated arguments."""
        if self.donate_argnums == "auto":
            return tuple(i for i in range(len(args)) if i not in self.batch_argnums)
        bad = [i for i in self.donate_argnums if not 0 <= i < len(args)]
        if bad:
            raise OptionsError(
                f"parallelize(..., donate_argnums={self.donate_argnums}): position(s) {bad} are out of range "
                f"for {self.__name__} called with {len(args)} argument(s); give positions 0..{len(args) - 1}")
        return tuple(self.donate_argnums)

    def _donated_leaves(self, args: tuple[Any, ...], positions: tuple[int, ...]) -> list[int]:
        """Flat leaf indices, in the (reordered) captured arguments, of the arguments at `positions`."""
        order = self._argument_order(len(args))
        leaves, start = [], 0
        for position in order:
            count = len(jax.tree_util.tree_leaves(args[position]))
            if position in positions:
                leaves.extend(range(start, start + count))
            start += count
        return leaves

    def _order(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Batch arguments first when the method forces the batch split: the planner traces
        the batch dim from the graph's first parameter."""
        if not self.method.forces_batch:
            return args
        rest = [a for i, a in enumerate(args) if i not in self.batch_argnums]
        return (*(args[i] for i in self.batch_argnums), *rest)

    def _argument_order(self, nargs: int) -> list[int]:
        """Caller positions in the order the captured function takes them (see `_order`)."""
        if not self.method.forces_batch:
            return list(range(nargs))
        return [*self.batch_argnums, *(i for i in range(nargs) if i not in self.batch_argnums)]

    def _ordered_fn(self, nargs: int) -> Callable[..., Any]:
        if not self.method.forces_batch:
            return self.fn
        order = self._argument_order(nargs)

        def reordered(*ordered: Any) -> Any:
            args = [None] * nargs
            for position, value in zip(order, ordered, strict=True):
                args[position] = value
            return self.fn(*args)

        return reordered

    def _num_batch_leaves(self, args: tuple[Any, ...]) -> int:
        return len(jax.tree_util.tree_leaves([args[i] for i in self.batch_argnums]))

    def _check_batch_argnums(self, args: tuple[Any, ...]) -> None:
        if not self.method.forces_batch:
            return
        bad = [i for i in self.batch_argnums if not 0 <= i < len(args)]
        if bad or not self.batch_argnums:
            raise OptionsError(
                f"{type(self.method).__name__} splits the batch arguments batch_argnums={self.batch_argnums}, "
                f"but {self.__name__} was called with {len(args)} argument(s); pass "
                f"parallelize(..., batch_argnums=(i, ...)) with the positions of the batch arguments")


def parallelize(fn: Callable[..., Any] | None = None, *, method: Method | None = None,
                devices: Sequence[Any] | None = None, batch_argnums: Sequence[int] = (1,),
                donate_argnums: Sequence[int] | str = (), cluster: Cluster | str | None = None) -> Any:
    """Make `fn` plan and run itself sharded over `devices`.

    Usable as `@parallelize` or `@parallelize(method=DataParallel())`.

    Args:
        fn: a JAX-traceable function of pytrees of arrays.
        method: ShardParallel() (default), DataParallel(), Zero2Parallel() or Zero3Parallel().
        devices: the devices to use; defaults to `jax.devices()`.
        batch_argnums: positions of the arguments whose leading dim is the batch (used by
            the data-parallel methods), as in Alpa; default (1,): `step(params, batch)`.
        donate_argnums: positions of the arguments whose buffers the results may reuse, as in
            `jax.jit`; "auto": every argument except the batch_argnums. Each donated leaf is
            paired with the first unpaired result of its shape and dtype (params -> new
            params); the plan gives both one layout. A donated leaf with no such result is
            not donated (UnusedDonationWarning, except under "auto"). Default (): none.
        cluster: plan with measured costs instead of placeholders: a Cluster, or the path of
            a file written by `meshplan profile-cluster` on these devices (intra- and
            inter-node collective latency and bandwidth, matmul FLOP/s; see DeviceCosts).

    Returns:
        A ParallelizedFunction, or a decorator making one when `fn` is None.
    """
    method = ShardParallel() if method is None else method
    argnums = tuple(batch_argnums)
    donated = _check_donate_argnums(donate_argnums)
    costs = DeviceCosts() if cluster is None else DeviceCosts.from_cluster(cluster)

    def wrap(f: Callable[..., Any]) -> ParallelizedFunction | PipeshardFunction:
        if isinstance(method, PipeshardParallel):  # a loss fn with boundaries: pipelined (loss, grads)
            if donated:
                raise OptionsError(f"parallelize(method=PipeshardParallel(...), donate_argnums={donated!r}): "
                                   "a pipelined loss function returns (loss, grads), no updated state that could "
                                   "reuse its arguments' buffers; drop donate_argnums")
            return PipeshardFunction(f, method, devices, costs)
        return ParallelizedFunction(f, method, devices, argnums, donated, costs)

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


def _copy_misplaced_donations(ordered: tuple[Any, ...], compiled: _Compiled) -> tuple[Any, ...]:
    """Copy donated leaves that are not yet laid out as planned, so that only copies are donated.

    jax.device_put may share a buffer with its source even with may_alias=False (measured on
    JAX 0.10 CPU: one device -> replicated keeps device 0's buffer); donating the result would
    then delete an array the caller did not hand over laid out as planned.
    """
    flat, tree = jax.tree_util.tree_flatten(ordered)
    targets = jax.tree_util.tree_leaves(compiled.in_shardings)
    for i in compiled.donation.donated:
        if not _is_placed(flat[i], targets[i]):
            flat[i] = jax.numpy.array(flat[i], copy=True)
    return jax.tree_util.tree_unflatten(tree, flat)


def _is_placed(value: Any, sharding: Any) -> bool:
    if not isinstance(value, jax.Array):
        return False
    return value.sharding == sharding or value.sharding.is_equivalent_to(sharding, value.ndim)


def _diagnostics(compiled: _Compiled) -> dict[str, Any]:
    graph, captured = compiled.captured.graph, compiled.captured
    donated = [{"argument": graph[captured.input_nodes[a]].name, "result": r} for a, r in compiled.donation.pairs]
    not_donated = [{"argument": graph[captured.input_nodes[a]].name, "reason": "no result of its shape and dtype"}
                   for a in compiled.donation.unmatched]
    not_donated += [{"argument": graph[captured.input_nodes[a]].name, "reason": "no common layout with its result"}
                    for a in compiled.donation.unplaceable]
    return {**compiled.diagnostics.to_dict(), "donated": donated, "not_donated": not_donated}


def _shardings_text(compiled: Any) -> str:
    lines = [f"input {i}: {s}" for i, s in enumerate(jax.tree_util.tree_leaves(compiled.input_shardings))]
    lines += [f"output {i}: {s}" for i, s in enumerate(jax.tree_util.tree_leaves(compiled.output_shardings))]
    return "\n".join(lines) + "\n"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
