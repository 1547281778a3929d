"""Intra-op runtime: a Captured program and an IntraPlan -> a jitted function sharded as planned.

The captured flat program is re-evaluated primitive by primitive inside `jax.jit`; every value
the plan splits gets a `with_sharding_constraint`, and XLA's SPMD partitioner inserts the
collectives the plan implies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from meshplan.capture import Captured
from meshplan.cluster.mesh import LogicalMesh
from meshplan.errors import MeshError, PlanValidationError
from meshplan.intra.plan import IntraPlan
from meshplan.ir.node import OpKind
from meshplan.runtime.diagnostics import CompileDiagnostics, compile_lowered
from meshplan.runtime.halo_pooling import halo_select_and_scatter_add, halo_split
from meshplan.sharding.spec import ShardingSpec, conversion_path

_AXIS_NAMES = ("x", "y", "z")


def axis_names(ndim: int) -> tuple[str, ...]:
    """JAX mesh axis names for a mesh of `ndim` axes: "x", "y", "z", then "a3", "a4", ..."""
    return tuple(_AXIS_NAMES[i] if i < len(_AXIS_NAMES) else f"a{i}" for i in range(ndim))


def make_jax_mesh(logical_mesh: LogicalMesh, devices: Sequence[Any] | None = None) -> Mesh:
    """The `jax.sharding.Mesh` (Auto axes) that runs a plan made for `logical_mesh`.

    Args:
        logical_mesh: the plan's mesh; its `device_ids` index into `devices` in row-major order.
        devices: the devices to use; defaults to `jax.devices()`.

    Raises:
        MeshError: the devices given do not match the mesh, or JAX sees too few devices.
    """
    needed = math.prod(logical_mesh.shape)
    if devices is not None and len(devices) != needed:
        raise MeshError(
            f"mesh {logical_mesh.name} needs {needed} devices but {len(devices)} were given; "
            f"pass exactly {needed} devices or plan for a mesh of {len(devices)} devices")
    available = list(jax.devices()) if devices is None else list(devices)
    if devices is None and max(logical_mesh.device_ids) >= len(available):
        raise MeshError(
            f"mesh {logical_mesh.name} needs {needed} devices (ids up to {max(logical_mesh.device_ids)}) but "
            f"JAX sees {len(available)} {jax.default_backend()} device(s); plan for a mesh of at most "
            f"{len(available)} devices, or on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={needed} "
            f"before importing JAX")
    ids = logical_mesh.device_ids if devices is None else range(needed)
    grid = np.array([available[i] for i in ids], dtype=object).reshape(logical_mesh.shape)
    # Auto axes: with_sharding_constraint is only honoured on them (Explicit is make_mesh's default).
    return Mesh(grid, axis_names(logical_mesh.ndim), axis_types=(AxisType.Auto,) * logical_mesh.ndim)


def partition_spec(spec: ShardingSpec) -> PartitionSpec:
    """The PartitionSpec of a meshplan ShardingSpec (mesh axis i is named `axis_names(...)[i]`)."""
    names = axis_names(1 + max(spec.axes(), default=0))
    return PartitionSpec(*(_dim_entry(tuple(names[a] for a in axes)) for axes in spec.dims))


def _dim_entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


class ShardedFunction:
    """A captured function jitted with the plan's shardings; call it like the original.

    `lower(*args)` gives the `jax.stages.Lowered` stage (e.g. to count collectives in HLO);
    `compile(*args)` compiles ahead of time and reports XLA's full rematerializations.

    Attributes:
        jitted: the `jax.jit` function of the flat arguments.
        executable: the `jax.stages.Compiled` calls go to, once `compile` made one; it takes
            arguments laid out exactly as the plan's input shardings.
    """

    def __init__(self, captured: Captured, jitted: Any, executable: Any = None) -> None:
        self._captured = captured
        self.jitted = jitted
        self.executable = executable

    def __call__(self, *args: Any) -> Any:
        flat = self._flat_args(args)
        run = self.jitted if self.executable is None else self.executable
        return jax.tree_util.tree_unflatten(self._captured.out_tree, run(*flat))

    def lower(self, *args: Any) -> Any:
        """Lower for `args` without running (see `jax.jit(...).lower`)."""
        return self.jitted.lower(*self._flat_args(args))

    def compile(self, *args: Any) -> tuple[ShardedFunction, CompileDiagnostics]:
        """Compile for `args` (arrays or ShapeDtypeStructs) and read XLA's log while it does.

        Returns:
            The function bound to the compiled executable, and the CompileDiagnostics.
        """
        executable, diagnostics = compile_lowered(self.lower(*args))
        return ShardedFunction(self._captured, self.jitted, executable), diagnostics

    def _flat_args(self, args: tuple[Any, ...]) -> list[Any]:
        flat, tree = jax.tree_util.tree_flatten(args)
        if tree != self._captured.in_tree:
            raise PlanValidationError(
                f"arguments have structure {tree} but the function was captured with {self._captured.in_tree}; "
                f"call it with arguments shaped like the capture's example arguments")
        return flat


def execute_sharded(captured: Captured, plan: IntraPlan, mesh: Mesh,
                    donate_argnums: Sequence[int] = ()) -> ShardedFunction:
    """Jit the captured function so that every value follows `plan`'s sharding.

    Args:
        captured: the output of `meshplan.capture.capture`.
        plan: an IntraPlan of `captured.graph`.
        mesh: from `make_jax_mesh(plan.mesh)`.
        donate_argnums: flat argument (leaf) indices whose buffers XLA may reuse for results,
            e.g. `pair_donated(...).donated`; plan with those pairs as graph aliases so that
            each argument and its result share a layout. Donated arrays are deleted by a call.

    Returns:
        A ShardedFunction taking the same (pytree) arguments as the captured function.
    """
    _check_plan(captured, plan, mesh)
    specs = {c.node: c.output for c in plan.nodes}
    graph = captured.graph
    shard = lambda node: NamedSharding(mesh, partition_spec(placeable_spec(specs[node], graph[node].shape, plan.mesh)))
    run = _interpreter(captured, plan, mesh)
    jitted = jax.jit(run, in_shardings=tuple(shard(n) for n in captured.input_nodes),
                     out_shardings=tuple(shard(n) for n in captured.output_nodes),
                     donate_argnums=tuple(donate_argnums))
    return ShardedFunction(captured, jitted)


def placeable_spec(spec: ShardingSpec, shape: tuple[int, ...], logical: LogicalMesh) -> ShardingSpec:
    """The spec with padded (uneven) splits dropped: jit arguments and results must divide evenly."""
    return ShardingSpec(tuple(a if s % logical.axis_size(a) == 0 else () for s, a in zip(shape, spec.dims,
                                                                                       strict=True)))


def _check_plan(captured: Captured, plan: IntraPlan, mesh: Mesh) -> None:
    if len(plan.nodes) != len(captured.graph.nodes):
        raise PlanValidationError(
            f"plan of {plan.graph_name!r} has {len(plan.nodes)} nodes but graph {captured.graph.name!r} has "
            f"{len(captured.graph.nodes)}; plan the captured graph itself (solve_intra(captured.graph, ...))")
    if tuple(mesh.devices.shape) != plan.mesh.shape:
        raise MeshError(f"plan is for mesh {plan.mesh.name} but the JAX mesh has shape {mesh.devices.shape}; "
                        f"build it with make_jax_mesh(plan.mesh)")


def _interpreter(captured: Captured, plan: IntraPlan, mesh: Mesh) -> Any:
    """A function of the flat arguments that replays the flat program with sharding constraints.

    Every value is constrained to the layout the plan chose for it, replicated ones included: an
    unconstrained value is left to XLA's sharding propagation, which spreads neighbouring splits
    into it and adds collectives the plan never priced (seen: an Adam update split like its
    moments made XLA split the whole backward pass and gather activations). An operand the plan
    converts for its consumer is constrained again, to the layout the consumer asked for, right
    before the consumer runs: XLA then partitions the op as planned instead of picking its own
    algorithm for the mismatched layouts. A broadcast is converted as the plan prices it: its
    operand is converted and broadcast again (not the broadcast result, a tensor of the
    activations' size). Each distinct conversion of a value is made once and shared by its
    consumers: XLA does not merge repeated all-to-alls of one value (measured: an S01R -> RS0
    conversion for two consumers ran its all-to-all twice)."""
    program, graph, logical = captured.program, captured.graph, plan.mesh
    specs = {c.node: c.output for c in plan.nodes}
    named = lambda spec: NamedSharding(mesh, partition_spec(spec))  # noqa: E731
    placed = {vid: named(specs[n]) for vid, n in captured.value_nodes.items()
              if is_placeable(specs[n], tuple(program.avals[vid].shape), graph[n].shape, logical)}
    conversions = _conversions(captured, plan, named)
    own_steps = _halo_pooling_steps(captured, plan, mesh)

    def run(*flat_args: Any) -> tuple[Any, ...]:
        env: dict[int, Any] = dict(program.constants)
        env.update(zip(program.inputs, flat_args, strict=True))
        converted: dict[tuple[Any, ...], Any] = {}
        for k, step in enumerate(program.steps):
            ins = [_convert(env, converted, vid, conversions.get((k, i))) for i, vid in enumerate(step.inputs)]
            outs = own_steps[k](*ins) if k in own_steps else step.primitive.bind(*ins, **step.params)
            outs = outs if step.primitive.multiple_results else (outs,)
            for vid, value in zip(step.outputs, outs, strict=True):
                env[vid] = _constrain(value, placed.get(vid))
        return tuple(env[v] for v in program.outputs)

    return run


def _halo_pooling_steps(captured: Captured, plan: IntraPlan, mesh: Mesh) -> dict[int, Any]:
    """Step -> the function that runs it instead of its primitive: max pooling's gradients the
    plan splits along a windowed dim, with the planned halo exchanges (`runtime/halo_pooling.py`)."""
    program, graph = captured.program, captured.graph
    chosen = {c.node: c for c in plan.nodes}
    found = {}
    for k, step in enumerate(program.steps):
        if step.name != "select_and_scatter_add":
            continue
        node = graph[captured.value_nodes[step.outputs[0]]]
        spec = chosen[node.id].output
        split = halo_split(node, graph[node.operands[0]].shape, spec, plan.mesh.shape)
        if split is not None:
            found[k] = halo_select_and_scatter_add(step.primitive, step.params, split, mesh, partition_spec(spec))
    return found


@dataclass(frozen=True, slots=True)
class _Conversion:
    """An operand converted for its consumer: constrained to each layout of `path` in turn (the
    last is the one the consumer requires; the ones before are the steps the plan priced,
    `sharding.spec.conversion_path`); a broadcast's operand (value `source`) constrained to
    `source_sharding` first and broadcast again by `step`."""

    path: tuple[NamedSharding, ...]
    step: Any = None
    source: int | None = None
    source_sharding: NamedSharding | None = None


def _conversions(captured: Captured, plan: IntraPlan, named: Any) -> dict[tuple[int, int], _Conversion]:
    """(step, input position) -> how the step's node wants that input converted, where the plan
    converts it (the step's node reads the input's node directly and requires another spec)."""
    program, graph, logical = captured.program, captured.graph, plan.mesh
    chosen = {c.node: c for c in plan.nodes}
    made_by = {vid: step for step in program.steps for vid in step.outputs}
    found = {}
    for k, step in enumerate(program.steps):
        consumer = captured.value_nodes.get(step.outputs[0]) if step.outputs else None
        if consumer is None:
            continue
        for i, vid in enumerate(step.inputs):
            producer = captured.value_nodes.get(vid)
            spec = _required(graph, consumer, chosen[consumer].operands, producer)
            if spec is None or spec == chosen[producer].output or not is_placeable(
                    spec, tuple(program.avals[vid].shape), graph[producer].shape, logical):
                continue
            path = conversion_path(chosen[producer].output, spec, logical)
            found[(k, i)] = _rebroadcast(captured, producer, spec, made_by.get(vid), named) or _Conversion(
                tuple(named(s) for s in path))
    return found


def _required(graph: Any, consumer: int, required: tuple[ShardingSpec, ...],
              producer: int | None) -> ShardingSpec | None:
    """The spec `consumer` requires of `producer`'s value: of the operand itself, or, where
    capture made the primitive's implicit broadcast a node of its own, of the value before it."""
    for operand, spec in zip(graph[consumer].operands, required, strict=True):
        if operand == producer:
            return spec
    for operand, spec in zip(graph[consumer].operands, required, strict=True):
        node = graph[operand]
        if node.kind is OpKind.BROADCAST and node.operands == (producer,):
            return spec.unbroadcast(node.attr("dims"), graph[producer].shape, node.shape)
    return None


def _rebroadcast(captured: Captured, producer: int, spec: ShardingSpec, step: Any, named: Any) -> _Conversion | None:
    """The conversion of a broadcast result through its operand, when the program's step is the
    graph's broadcast node of one operand."""
    graph = captured.graph
    node = graph[producer]
    if node.kind is not OpKind.BROADCAST or step is None or len(step.inputs) != 1 \
            or captured.value_nodes.get(step.inputs[0]) != node.operands[0]:
        return None
    operand = graph[node.operands[0]]
    return _Conversion((named(spec),), step, step.inputs[0],
                       named(spec.unbroadcast(node.attr("dims"), operand.shape, node.shape)))


def _convert(env: dict[int, Any], converted: dict[tuple[Any, ...], Any], vid: int,
             conversion: _Conversion | None) -> Any:
    """`env[vid]` converted as `conversion` says; each step made once per value and path so far
    (`converted` keeps them), so conversions that start alike share their first steps."""
    if conversion is None:
        return env[vid]
    start = (vid, conversion.source, conversion.source_sharding)
    if start not in converted:
        converted[start] = env[vid] if conversion.step is None else conversion.step.primitive.bind(
            _constrain(env[conversion.source], conversion.source_sharding), **conversion.step.params)
    value = converted[start]
    for n, sharding in enumerate(conversion.path, 1):
        key = (*start, conversion.path[:n])
        if key not in converted:
            converted[key] = _constrain(value, sharding)
        value = converted[key]
    return value


def _constrain(value: Any, sharding: NamedSharding | None) -> Any:
    return value if sharding is None else jax.lax.with_sharding_constraint(value, sharding)


def is_placeable(spec: ShardingSpec, value_shape: tuple[int, ...], node_shape: tuple[int, ...],
                 mesh: LogicalMesh) -> bool:
    """A value can be constrained to `spec` when its node has the value's own shape and the spec
    splits it evenly (padded splits are left to XLA)."""
    return value_shape == node_shape and spec.is_valid_for(value_shape, mesh)


def is_constrained(spec: ShardingSpec, value_shape: tuple[int, ...], node_shape: tuple[int, ...],
                   mesh: LogicalMesh) -> bool:
    """Constrain only values the plan splits, evenly, and whose node has the value's own shape
    (the pipeshard stages' rule; `execute_sharded` constrains replicated values too)."""
    return not spec.is_replicated and is_placeable(spec, value_shape, node_shape, mesh)
