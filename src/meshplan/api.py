"""User API: `parallelize(fn)` -> a function that captures, plans and runs itself sharded.

On the first call with new argument shapes the function is captured (meshplan.capture),
planned on a logical mesh of the visible devices (solve_intra) and jitted as planned
(execute_sharded); later calls with the same shapes reuse that plan.

Cost constants: the placeholders of meshplan.runtime.defaults (not measurements).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
from jax.sharding import NamedSharding

from meshplan.capture import Captured, capture
from meshplan.cost.model import CostModel
from meshplan.errors import MeshError, OptionsError
from meshplan.files import write_json_atomic, write_text_atomic
from meshplan.intra.options import IntraOptions
from meshplan.intra.plan import IntraPlan
from meshplan.intra.solve import solve_intra
from meshplan.ir import format_graph
from meshplan.pipeshard import PipeshardFunction, PipeshardParallel
from meshplan.runtime.defaults import BETA_S_PER_BYTE, FLOPS_PER_SECOND, default_mesh_shape, local_mesh
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

    def options(self) -> IntraOptions:
        return IntraOptions(cost=CostModel(flops_per_second=FLOPS_PER_SECOND))

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

    def options(self) -> IntraOptions:
        return IntraOptions(cost=CostModel(flops_per_second=FLOPS_PER_SECOND), force_batch_dim_to_mesh_dim=0)

    @property
    def forces_batch(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True, slots=True)
class Zero2Parallel(DataParallel):
    """Data parallelism with a memory price that shards what is cheap to shard (ZeRO-2-like).

    A captured function does not tell weights from optimizer state: both are inputs, and
    meshplan's captured graphs carry no parameter->update aliases, so each input's layout
    is chosen on its own. A price of half a byte's transfer time per byte held makes a split
    pay off only when it costs (almost) no communication: optimizer moments, used only
    elementwise with reduce-scattered gradients, end up sharded; weights that the forward
    pass needs whole stay replicated (splitting them would cost an all-gather per step).
    Whether a given tensor is sharded is the ILP's decision; read it from `get_plan()`.
    """

    def options(self) -> IntraOptions:
        cost = CostModel(flops_per_second=FLOPS_PER_SECOND, memory_price=0.5 * BETA_S_PER_BYTE)
        return IntraOptions(cost=cost, force_batch_dim_to_mesh_dim=0)


@dataclasses.dataclass(frozen=True, slots=True)
class Zero3Parallel(DataParallel):
    """Data parallelism with every non-batch input (weights and optimizer state) sharded (ZeRO-3).

    Inputs with no dim that the mesh can split (scalars, tiny vectors) stay replicated.
    """

    def options(self) -> IntraOptions:
        cost = CostModel(flops_per_second=FLOPS_PER_SECOND, memory_price=10 * BETA_S_PER_BYTE)
        return IntraOptions(cost=cost, force_batch_dim_to_mesh_dim=0, allow_replicated_parameters=False)


@dataclasses.dataclass(frozen=True, slots=True)
class TensorParallel:
    """Megatron-style tensor parallelism: a 1-D mesh of all devices on which no input may stay
    whole, so weights are split (column then row in an MLP) and the ILP picks how."""

    def mesh(self, num_devices: int) -> tuple[int, ...]:
        return (num_devices,)

    def options(self) -> IntraOptions:
        return IntraOptions(cost=CostModel(flops_per_second=FLOPS_PER_SECOND), allow_replicated_parameters=False)

    @property
    def forces_batch(self) -> bool:
        return False


Method = ShardParallel | DataParallel | Zero2Parallel | Zero3Parallel | TensorParallel | PipeshardParallel
# Methods a ParallelizedFunction runs; PipeshardParallel has its own PipeshardFunction.
_METHODS = (ShardParallel, DataParallel, Zero2Parallel, Zero3Parallel, TensorParallel)


@dataclasses.dataclass(frozen=True, slots=True)
class _Compiled:
    """Everything one input signature produced."""

    captured: Captured
    plan: IntraPlan
    sharded: ShardedFunction
    example: tuple[Any, ...]  # ShapeDtypeStructs of the (reordered) arguments
    in_shardings: tuple[Any, ...]  # NamedShardings of the (reordered) arguments, same pytree


class ParallelizedFunction:
    """A function planned and sharded per input signature; call it like the original."""

    def __init__(self, fn: Callable[..., Any], method: Method, devices: Sequence[Any] | None,
                 batch_argnums: tuple[int, ...]) -> None:
        if not isinstance(method, _METHODS):
            raise OptionsError(
                f"parallelize(method={method!r}): unknown method; use ShardParallel(), DataParallel(), "
                "Zero2Parallel(), Zero3Parallel(), TensorParallel() or PipeshardParallel(...)")
        self.fn, self.method, self.batch_argnums = fn, method, batch_argnums
        self.devices = None if devices is None else tuple(devices)
        self._cache: dict[Any, _Compiled] = {}
        self._last: _Compiled | None = None
        self.__name__ = getattr(fn, "__name__", "parallelized")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args: Any) -> Any:
        compiled = self._compiled(args)
        # Arguments committed elsewhere (e.g. the previous step's outputs, laid out as the plan
        # chose for outputs) are moved to the planned input layout; jit would reject them.
        return compiled.sharded(*jax.device_put(self._order(args), compiled.in_shardings))

    def get_plan(self) -> IntraPlan:
        """The IntraPlan of the last call.

        Raises:
            OptionsError: the function has not been called yet.
        """
        return self._require_last().plan

    def dump_debug_info(self, folder: str | Path) -> tuple[Path, ...]:
        """Write what the last call planned and compiled into `folder`; return the paths.

        Files: graph.txt (captured graph), plan.json (IntraPlan.to_dict), hlo.txt (compiled
        HLO), memory.txt (compiled.memory_analysis()), cost.json (compiled.cost_analysis()),
        shardings.txt (input and output shardings of the compiled function).
        """
        last = self._require_last()
        compiled = last.sharded.lower(*last.example).compile()
        folder = Path(folder)
        texts = {"graph.txt": format_graph(last.captured.graph), "hlo.txt": compiled.as_text(),
                 "memory.txt": str(compiled.memory_analysis()) + "\n",
                 "shardings.txt": _shardings_text(compiled)}
        for name, text in texts.items():
            write_text_atomic(folder / name, text)
        write_json_atomic(folder / "plan.json", last.plan.to_dict())
        write_json_atomic(folder / "cost.json", _jsonable(compiled.cost_analysis()))
        return tuple(folder / n for n in (*texts, "plan.json", "cost.json"))

    def _require_last(self) -> _Compiled:
        if self._last is None:
            raise OptionsError(f"{self.__name__} has no plan yet; call it once with example arguments first")
        return self._last

    def _compiled(self, args: tuple[Any, ...]) -> _Compiled:
        key = _signature(args)
        if key not in self._cache:
            self._cache[key] = self._plan(args)
        self._last = self._cache[key]
        return self._last

    def _plan(self, args: tuple[Any, ...]) -> _Compiled:
        self._check_batch_argnums(args)
        devices = list(self.devices) if self.devices is not None else jax.devices()
        shape = self.method.mesh(len(devices))
        ordered = self._order(args)
        captured = capture(self._ordered_fn(len(args)), *ordered, name=self.__name__)
        if self.method.forces_batch:
            captured = _tag_batch_inputs(captured, self._num_batch_leaves(args))
        mesh = local_mesh(shape)
        plan = solve_intra(captured.graph, mesh, self.method.options())
        jax_mesh = make_jax_mesh(mesh, devices if self.devices else None)
        sharded = execute_sharded(captured, plan, jax_mesh)
        example = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(jax.numpy.shape(a), _dtype(a)), ordered)
        specs = [NamedSharding(jax_mesh, partition_spec(placeable_spec(plan.strategy(n).output,
                                                                     captured.graph[n].shape, plan.mesh)))
                 for n in captured.input_nodes]
        return _Compiled(captured, plan, sharded, example, jax.tree_util.tree_unflatten(captured.in_tree, specs))

    def _order(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Batch arguments first when the method forces the batch split: the planner traces
        the batch dim from the graph's first parameter."""
        if not self.method.forces_batch:
            return args
        rest = [a for i, a in enumerate(args) if i not in self.batch_argnums]
        return (*(args[i] for i in self.batch_argnums), *rest)

    def _ordered_fn(self, nargs: int) -> Callable[..., Any]:
        if not self.method.forces_batch:
            return self.fn
        order = [*self.batch_argnums, *(i for i in range(nargs) if i not in self.batch_argnums)]

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
                devices: Sequence[Any] | None = None, batch_argnums: Sequence[int] = (1,)) -> Any:
    """Make `fn` plan and run itself sharded over `devices`.

    Usable as `@parallelize` or `@parallelize(method=DataParallel())`.

    Args:
        fn: a JAX-traceable function of pytrees of arrays.
        method: ShardParallel() (default), DataParallel(), Zero2Parallel() or Zero3Parallel().
        devices: the devices to use; defaults to `jax.devices()`.
        batch_argnums: positions of the arguments whose leading dim is the batch (used by
            the data-parallel methods), as in Alpa; default (1,): `step(params, batch)`.

    Returns:
        A ParallelizedFunction, or a decorator making one when `fn` is None.
    """
    method = ShardParallel() if method is None else method
    argnums = tuple(batch_argnums)

    def wrap(f: Callable[..., Any]) -> ParallelizedFunction | PipeshardFunction:
        if isinstance(method, PipeshardParallel):  # a loss fn with boundaries: pipelined (loss, grads)
            return PipeshardFunction(f, method, devices)
        return ParallelizedFunction(f, method, devices, argnums)

    return wrap if fn is None else wrap(fn)


def _signature(args: tuple[Any, ...]) -> Any:
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, tuple((tuple(jax.numpy.shape(x)), str(_dtype(x))) for x in leaves)


def _dtype(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else jax.numpy.asarray(x).dtype


def _tag_batch_inputs(captured: Captured, num_batch_leaves: int) -> Captured:
    """Mark the first `num_batch_leaves` inputs as batch inputs (split over the forced axis)."""
    nodes = list(captured.graph.nodes)
    for node_id in captured.input_nodes[:num_batch_leaves]:
        node = nodes[node_id]
        if node.rank:
            nodes[node_id] = dataclasses.replace(node, attrs=tuple(sorted({**dict(node.attrs),
                                                                         "batch_input": True}.items())))
    return dataclasses.replace(captured, graph=dataclasses.replace(captured.graph, nodes=tuple(nodes)))


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
