"""A laid-out IR graph as a sharded JAX program (Graph + node strategies -> jitted function).

Each node becomes the matching `jax.lax` operation; its result is constrained to the layout its
strategy gives (`with_sharding_constraint` on a mesh of Auto axes), and an operand a strategy
needs in another layout is constrained to that layout first, so XLA's partitioner inserts the
collectives the plan implies and no others. Parameters are the function's arguments, laid out
as their strategies say. A split that does not divide its dim evenly (the ILP may plan
padded splits) is dropped there: that dim stays whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding

from meshplan.cluster.mesh import LogicalMesh
from meshplan.errors import GraphError
from meshplan.ir.dtypes import DType
from meshplan.ir.graph import Graph
from meshplan.ir.node import Node, OpKind
from meshplan.runtime.sharded import partition_spec, placeable_spec
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import Strategy

_DTYPES = {DType.F64: jnp.float64, DType.F32: jnp.float32, DType.BF16: jnp.bfloat16, DType.F16: jnp.float16,
           DType.I64: jnp.int64, DType.I32: jnp.int32, DType.I8: jnp.int8, DType.U8: jnp.uint8,
           DType.PRED: jnp.bool_}
_UNARY: dict[str, Callable] = {
    "neg": lax.neg, "exp": lax.exp, "log": lax.log, "rsqrt": lax.rsqrt, "sqrt": lax.sqrt, "tanh": lax.tanh,
    "logistic": lax.logistic, "abs": lax.abs, "sign": lax.sign, "erf": lax.erf, "sin": lax.sin, "cos": lax.cos,
    "copy": lambda x: x, "floor": lax.floor, "ceil": lax.ceil, "not": lax.bitwise_not, "square": lax.square,
    "log1p": lax.log1p, "expm1": lax.expm1,
}
_BINARY: dict[str, Callable] = {
    "add": lax.add, "sub": lax.sub, "mul": lax.mul, "div": lax.div, "max": lax.max, "min": lax.min,
    "pow": lax.pow, "and": lax.bitwise_and, "or": lax.bitwise_or, "rem": lax.rem,
}
_COMPARE = {"eq": lax.eq, "ne": lax.ne, "lt": lax.lt, "le": lax.le, "gt": lax.gt, "ge": lax.ge}
_REDUCE = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "prod": jnp.prod}


@dataclass(frozen=True, slots=True)
class Program:
    """A jitted function of the graph's parameters (in node order) returning its outputs.

    Attributes:
        jitted: the `jax.jit` function.
        parameters: the parameter node ids, in argument order.
        shardings: the NamedSharding of each argument.
    """

    jitted: Any
    parameters: tuple[int, ...]
    shardings: tuple[NamedSharding, ...]

    def abstract_args(self, graph: Graph) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(graph[p].shape, jax_dtype(graph[p].dtype), sharding=s)
                for p, s in zip(self.parameters, self.shardings, strict=True)]

    def example_args(self, graph: Graph, seed: int = 0) -> list[jax.Array]:
        """Random arguments laid out as the program takes them (small floats, indices 0 or 1)."""
        rng = np.random.default_rng(seed)
        return [jax.device_put(_random(rng, graph[p]), s) for p, s in zip(self.parameters, self.shardings,
                                                                             strict=True)]


def jax_dtype(dtype: DType) -> Any:
    return _DTYPES[dtype]


def lower(graph: Graph, layouts: Sequence[Strategy], logical: LogicalMesh, mesh: Mesh) -> Program:
    """Jit `graph` with node v laid out as `layouts[v]` on `mesh` (built for `logical`).

    Raises:
        GraphError: the graph has an op the lowering cannot express (opaque).
    """
    shard = lambda spec, node: NamedSharding(mesh, partition_spec(placeable_spec(spec, node.shape, logical)))
    parameters = tuple(n.id for n in graph.nodes if n.kind is OpKind.PARAMETER)
    for node in graph.nodes:
        if node.kind is not OpKind.PARAMETER and node.kind not in _LOWERINGS:
            raise GraphError(f"cannot run node {node.label}: op kind {node.kind.value} ({node.op!r}) has no JAX "
                             "lowering in meshplan.cfp; express it with IR ops")

    def constrained(value: Any, node: Node, spec: ShardingSpec) -> Any:
        return lax.with_sharding_constraint(value, shard(spec, node)) if node.rank else value

    def run(*args: Any) -> tuple[Any, ...]:
        values: dict[int, Any] = dict(zip(parameters, args, strict=True))
        for node in graph.nodes:
            if node.kind is OpKind.PARAMETER:
                continue
            s = layouts[node.id]
            inputs = [values[o] if layouts[o].output == r else constrained(values[o], graph[o], r)
                      for o, r in zip(node.operands, s.operands, strict=True)]
            out = _LOWERINGS[node.kind](node, inputs)
            values[node.id] = constrained(out.astype(jax_dtype(node.dtype)), node, s.output)
        return tuple(values[v] for v in graph.outputs)

    in_shardings = tuple(shard(layouts[p].output, graph[p]) for p in parameters)
    out_shardings = tuple(shard(layouts[v].output, graph[v]) for v in graph.outputs)
    return Program(jax.jit(run, in_shardings=in_shardings, out_shardings=out_shardings), parameters, in_shardings)


def _random(rng: np.random.Generator, node: Node) -> np.ndarray:
    if node.dtype is DType.PRED:
        return rng.integers(0, 2, node.shape).astype(bool)
    if node.dtype in (DType.I64, DType.I32, DType.I8, DType.U8):
        return rng.integers(0, 2, node.shape).astype(np.dtype(jax_dtype(node.dtype)))
    return (0.1 * rng.standard_normal(node.shape)).astype(np.dtype(jax_dtype(node.dtype)))


# -- one lowering per op kind: (node, operand values) -> value ------------------------------------


def _constant(node: Node, args: list) -> Any:
    value = node.attr("value")
    return jnp.full(node.shape, 0.0 if value is None else value, jax_dtype(node.dtype))


def _dot(node: Node, args: list) -> Any:
    dims = ((node.attr("lhs_contracting"), node.attr("rhs_contracting")), (node.attr("lhs_batch"),
                                                                             node.attr("rhs_batch")))
    return lax.dot_general(args[0], args[1], dims, preferred_element_type=jax_dtype(node.dtype))


def _elementwise(node: Node, args: list) -> Any:
    op = node.op
    if op == "compare":
        return _COMPARE[node.attr("direction")](*args)
    if op == "select":
        return lax.select(*args)
    if op == "convert":
        return args[0]
    table = _UNARY if len(args) == 1 else _BINARY
    if op not in table:
        raise GraphError(f"cannot run node {node.label}: elementwise op {op!r} has no JAX lowering")
    return table[op](*args)


def _take_index(shape: tuple[int, ...], indices: Any, axis: int, batch_dims: int) -> tuple[Any, ...]:
    """Index tuple t with x[t] == gather(x, indices, axis, batch_dims) (the interpreter's form)."""
    picked = indices.shape[batch_dims:]
    lead = axis + len(picked)
    index: list[Any] = [jnp.arange(shape[d]).reshape([-1 if k == d else 1 for k in range(lead)]) for d in range(axis)]
    index.append(indices.reshape(indices.shape[:batch_dims] + (1,) * (axis - batch_dims) + picked))
    return (*index, *[slice(None)] * (len(shape) - axis - 1))


def _batched_numbers(operand_rank: int, indices_rank: int, axis: int) -> dict[str, tuple[int, ...]]:
    """Gather/scatter dimension numbers of a pick along `axis` whose `axis` leading dims are batch
    dims of both sides (`operand_batching_dims`: XLA's partitioner then keeps a batch split local)."""
    batch = tuple(range(axis))
    return {"window": tuple(range(indices_rank, indices_rank + operand_rank - axis - 1)), "collapsed": (axis,),
            "to_operand": (axis,), "batch": batch}


def _gather(node: Node, args: list) -> Any:
    operand, indices = args
    axis, batch_dims, fill = node.attr("axis"), node.attr("batch_dims"), node.attr("fill_value")
    size = operand.shape[axis]
    if 0 < batch_dims == axis and fill is None:
        n = _batched_numbers(operand.ndim, indices.ndim, axis)
        numbers = lax.GatherDimensionNumbers(n["window"], n["collapsed"], n["to_operand"], n["batch"], n["batch"])
        sizes = tuple(1 if d <= axis else operand.shape[d] for d in range(operand.ndim))
        return lax.gather(operand, jnp.clip(indices, 0, size - 1)[..., None], numbers, sizes,
                          mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    picked = operand[_take_index(operand.shape, jnp.clip(indices, 0, size - 1), axis, batch_dims)]
    if fill is None:
        return picked
    inside = (indices >= 0) & (indices < size)
    inside = inside.reshape(indices.shape[:batch_dims] + (1,) * (axis - batch_dims) + indices.shape[batch_dims:])
    return jnp.where(inside.reshape(inside.shape + (1,) * (picked.ndim - inside.ndim)), picked, fill)


def _scatter_add(node: Node, args: list) -> Any:
    indices, updates = args
    axis, batch_dims = node.attr("axis"), node.attr("batch_dims")
    if 0 < batch_dims == axis:
        n = _batched_numbers(len(node.shape), indices.ndim, axis)
        numbers = lax.ScatterDimensionNumbers(n["window"], n["collapsed"], n["to_operand"], n["batch"], n["batch"])
        return lax.scatter_add(jnp.zeros(node.shape, updates.dtype), indices[..., None], updates, numbers,
                               mode=lax.GatherScatterMode.FILL_OR_DROP)
    index = _take_index(node.shape, indices, node.attr("axis"), node.attr("batch_dims"))
    return jnp.zeros(node.shape, updates.dtype).at[index].add(updates, mode="drop")


_LOWERINGS: dict[OpKind, Callable[[Node, list], Any]] = {
    OpKind.CONSTANT: _constant,
    OpKind.IOTA: lambda n, a: lax.broadcasted_iota(jax_dtype(n.dtype), n.shape, n.attr("dim")),
    OpKind.DOT: _dot,
    OpKind.ELEMENTWISE: _elementwise,
    OpKind.BROADCAST: lambda n, a: lax.broadcast_in_dim(a[0], n.shape, n.attr("dims")),
    OpKind.RESHAPE: lambda n, a: jnp.reshape(a[0], n.shape),
    OpKind.TRANSPOSE: lambda n, a: lax.transpose(a[0], n.attr("perm")),
    OpKind.REDUCE: lambda n, a: _REDUCE[n.op](a[0], axis=tuple(n.attr("dims"))),
    OpKind.SLICE: lambda n, a: lax.slice(a[0], n.attr("start"), n.attr("limit")),
    OpKind.CONCATENATE: lambda n, a: lax.concatenate(a, n.attr("dim")),
    OpKind.DYNAMIC_SLICE: lambda n, a: lax.dynamic_slice(a[0], a[1:], n.shape),
    OpKind.GATHER: _gather,
    OpKind.SCATTER_ADD: _scatter_add,
    OpKind.TOP_K: lambda n, a: _top_k(n, a[0]),
}


def _top_k(node: Node, x: Any) -> Any:
    """values (output 0) or indices (output 1) of the k largest entries along the node's dim."""
    moved = jnp.moveaxis(x, node.attr("dim"), -1)
    values, indices = lax.top_k(moved, node.attr("k"))
    picked = values if node.attr("output") == 0 else indices.astype(jax_dtype(node.dtype))
    return jnp.moveaxis(picked, -1, node.attr("dim"))
