"""Capture: a JAX function and example arguments -> a meshplan Graph plus the maps back to JAX."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from meshplan.capture import convolution, indexing, ordering, prng, windows  # noqa: F401  (register their rules)
from meshplan.capture.flatten import FlatProgram, flatten
from meshplan.capture.rules import PASS_THROUGH, RULES, ir_dtype
from meshplan.ir import Graph, GraphBuilder


class UnsupportedPrimitiveWarning(UserWarning):
    """Some primitives have no meshplan rule; they were captured as opaque, replicated nodes."""


@dataclass(frozen=True, slots=True)
class Captured:
    """A traced function and its meshplan graph.

    Attributes:
        graph: the operator graph (nested calls inlined, static scans unrolled).
        jaxpr: the ClosedJaxpr from `jax.make_jaxpr`.
        program: the flat program the graph was built from (what the runtime re-evaluates).
        input_nodes: flat argument index -> parameter node id.
        output_nodes: flat result index -> node id.
        value_nodes: flat-program value id -> node id (the node computing that value).
        var_nodes: top-level jaxpr Var -> node id.
        in_tree, out_tree: pytree structures of the arguments and results.
        unsupported: names of primitives captured as opaque nodes, sorted.
    """

    graph: Graph
    jaxpr: jcore.ClosedJaxpr
    program: FlatProgram
    input_nodes: tuple[int, ...]
    output_nodes: tuple[int, ...]
    value_nodes: dict[int, int]
    var_nodes: dict[Any, int]
    in_tree: Any
    out_tree: Any
    unsupported: tuple[str, ...]


def capture(fn: Callable[..., Any], *example_args: Any, name: str | None = None) -> Captured:
    """Trace `fn` on `example_args` and build its meshplan Graph.

    Args:
        fn: a JAX-traceable function; arguments and results may be pytrees of arrays.
        *example_args: arrays (or `jax.ShapeDtypeStruct`s) fixing shapes and dtypes.
        name: the graph's name; defaults to `fn.__name__`.

    Returns:
        The Captured graph, jaxpr and maps between flat arguments/values/results and node ids.
        Primitives without a rule become opaque nodes; a warning names them.
    """
    name = name or getattr(fn, "__name__", "captured")
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*example_args)
    program = flatten(closed)
    builder = GraphBuilder(name)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(example_args)[0]]
    values: dict[int, int] = {}
    for vid, path in zip(program.inputs, paths, strict=True):
        aval = program.avals[vid]
        values[vid] = builder.parameter(aval.shape, ir_dtype(aval.dtype), name=f"args{path}")
    unsupported = _build_steps(builder, program, values)
    outputs = tuple(_node_of(builder, program, values, vid) for vid in program.outputs)
    builder.outputs(*dict.fromkeys(outputs))
    if unsupported:
        warnings.warn(
            f"capture of {name!r}: no meshplan rule for primitive(s) {', '.join(unsupported)}; they are "
            f"planned replicated (opaque). Rewrite them with supported ops to let the planner shard them.",
            UnsupportedPrimitiveWarning, stacklevel=2)
    var_nodes = {var: values[vid] for var, vid in program.top_vars.items() if vid in values}
    return Captured(builder.build(), closed, program, tuple(values[v] for v in program.inputs), outputs,
                    values, var_nodes, jax.tree_util.tree_structure(example_args),
                    jax.tree_util.tree_structure(out_shape), unsupported)


def tag_batch_inputs(captured: Captured, dims: Iterable[tuple[int, int]]) -> Captured:
    """Mark batch inputs: (flat input index, batch dim) pairs, e.g. `BatchInputs.dims`. Planned
    with a forced batch axis (`IntraOptions.force_batch_dim_to_mesh_dim`), they are split along
    that dim, and so is every value the dim reaches."""
    nodes = list(captured.graph.nodes)
    for leaf, dim in dims:
        node = nodes[captured.input_nodes[leaf]]
        nodes[node.id] = dataclasses.replace(node, attrs=tuple(sorted({**dict(node.attrs), "batch_dim": dim}.items())))
    return dataclasses.replace(captured, graph=dataclasses.replace(captured.graph, nodes=tuple(nodes)))


def _build_steps(builder: GraphBuilder, program: FlatProgram, values: dict[int, int]) -> tuple[str, ...]:
    """Add one or more nodes per step; return the names of primitives built as opaque nodes."""
    unsupported: set[str] = set()
    for step in program.steps:
        ins = [_node_of(builder, program, values, vid) for vid in step.inputs]
        if step.name in PASS_THROUGH and len(ins) == len(step.outputs):
            outs = ins
        else:
            outs = _apply_rule(builder, step, ins)
            if outs is None:
                unsupported.add(step.name)
                outs = [builder.opaque(ins, a.shape, ir_dtype(a.dtype), step.name) for a in step.avals]
        values.update(zip(step.outputs, outs, strict=True))
    return tuple(sorted(unsupported))


def _apply_rule(builder: GraphBuilder, step: Any, ins: list[int]) -> list[int] | None:
    rule = RULES.get(step.name)
    if rule is None:
        return None
    try:
        return rule(builder, step, ins)
    except NotImplementedError:  # the rule covers only some forms of the primitive (e.g. row gathers)
        return None


def _node_of(builder: GraphBuilder, program: FlatProgram, values: dict[int, int], vid: int) -> int:
    """The node of value `vid`; constants get their node on first use."""
    if vid not in values:
        aval, value = program.avals[vid], np.asarray(program.constants[vid])
        scalar = float(value) if value.ndim == 0 else None
        values[vid] = builder.constant(aval.shape, ir_dtype(aval.dtype), scalar)
    return values[vid]
