"""A captured forward function -> its graph with the vector-Jacobian product appended.

A pipeline stage runs its forward and its backward as separate steps, but its sharding must be
planned for both: gradients cost all-reduces that a forward-only plan never sees. The forward
nodes keep their ids, so a plan of the extended graph also lays out the captured values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from meshplan.capture.jaxpr import Captured
from meshplan.errors import GraphError
from meshplan.ir import Graph, GraphBuilder
from meshplan.ir.autodiff import FLOAT_DTYPES, append_vjp


@dataclass(frozen=True, slots=True)
class Backward:
    """A captured forward's graph with its VJP appended.

    Attributes:
        graph: the forward's nodes (ids unchanged), then the VJP's.
        grads: {flat input position: its gradient's node id}.
        cotangents: {forward node: its cotangent's node id} for the nodes the gradient flows through.
        contributions: {(forward node, operand position): the cotangent's node id it sends that operand}.
        seeds: {result node: the parameter holding its cotangent} (none for a scalar loss).
    """

    graph: Graph
    grads: dict[int, int]
    cotangents: dict[int, int]
    contributions: dict[tuple[int, int], int]
    seeds: dict[int, int]


def forward_only(graph: Graph) -> Backward:
    """A graph planned without its backward (no VJP rule on the way, or an inference stage)."""
    return Backward(graph, {}, {}, {}, {})


def with_backward(captured: Captured, wrt_inputs: Sequence[int]) -> Backward | None:
    """The captured graph plus the gradient nodes of the flat inputs `wrt_inputs`.

    A single scalar result is the loss. Otherwise each floating-point result gets a cotangent
    parameter of its shape and the VJP at those cotangents is appended, which is what the stage's
    backward computes (no loss sum(result * cotangent) is formed: the runtime never computes one,
    so the plan must not price its product and all-reduce).

    Args:
        captured: from `meshplan.capture.capture`.
        wrt_inputs: positions (into the flat arguments) of the inputs to differentiate; integer
            inputs are skipped.

    Returns:
        The extended graph, with the results and every gradient as outputs, and which nodes
        differentiate what (gradients of the floating-point inputs of `wrt_inputs`); None when
        some op on the way has no VJP rule (plan the forward alone then).
    """
    graph = captured.graph
    builder = GraphBuilder.from_graph(graph)
    results = [n for n in dict.fromkeys(captured.output_nodes) if graph[n].dtype in FLOAT_DTYPES]
    wrt = {i: captured.input_nodes[i] for i in wrt_inputs if graph[captured.input_nodes[i]].dtype in FLOAT_DTYPES}
    if not results:
        return None
    try:  # an op without a VJP rule: no backward to plan
        scalar_loss = len(captured.output_nodes) == 1 and graph[results[0]].shape == ()
        seeds = {results[0]: None} if scalar_loss else {n: _cotangent(builder, graph[n], n) for n in results}
        vjp = append_vjp(builder, seeds, list(wrt.values()))
    except GraphError:
        return None
    builder.outputs(*dict.fromkeys([*captured.output_nodes, *vjp.grads.values()]))
    return Backward(builder.build(), {i: vjp.grads[node] for i, node in wrt.items()}, vjp.cotangents,
                    vjp.contributions, {} if scalar_loss else seeds)


def _cotangent(builder: GraphBuilder, node: Any, n: int) -> int:
    """A new parameter holding result `n`'s cotangent."""
    return builder.parameter(node.shape, node.dtype, name=f"cotangent.{node.name or n}")
