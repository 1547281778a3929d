"""A captured forward function -> its graph with the vector-Jacobian product appended.

A pipeline stage runs its forward and its backward as separate steps, but its sharding must be
planned for both: gradients cost all-reduces that a forward-only plan never sees. The forward
nodes keep their ids, so a plan of the extended graph also lays out the captured values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    """

    graph: Graph
    grads: dict[int, int]
    cotangents: dict[int, int]
    contributions: dict[tuple[int, int], int]


def forward_only(graph: Graph) -> Backward:
    """A graph planned without its backward (no VJP rule on the way, or an inference stage)."""
    return Backward(graph, {}, {}, {})


def with_backward(captured: Captured, wrt_inputs: Sequence[int]) -> Backward | None:
    """The captured graph plus the gradient nodes of the flat inputs `wrt_inputs`.

    A single scalar result is the loss. Otherwise each floating-point result j gets a cotangent
    parameter c_j of its shape and the loss is sum_j sum(result_j * c_j): its gradients are the
    VJP at those cotangents, which is what the stage's backward computes.

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
    try:  # mixed-dtype results or an op without a VJP rule: no backward to plan
        loss = results[0] if len(captured.output_nodes) == 1 and graph[results[0]].shape == () else \
            _cotangent_loss(builder, graph, results)
        vjp = append_vjp(builder, loss, list(wrt.values()))
    except GraphError:
        return None
    builder.outputs(*dict.fromkeys([*captured.output_nodes, *vjp.grads.values()]))
    forward = range(len(graph))  # not the cotangent loss's own nodes
    return Backward(builder.build(), {i: vjp.grads[node] for i, node in wrt.items()},
                    {n: c for n, c in vjp.cotangents.items() if n in forward},
                    {(n, i): c for (n, i), c in vjp.contributions.items() if n in forward})


def _cotangent_loss(builder: GraphBuilder, graph: Graph, results: Sequence[int]) -> int:
    """sum_j sum(result_j * c_j) with a new cotangent parameter c_j per result."""
    loss = None
    for n in results:
        node = graph[n]
        cotangent = builder.parameter(node.shape, node.dtype, name=f"cotangent.{node.name or n}")
        product = builder.mul(n, cotangent)
        term = builder.reduce(product, range(node.rank)) if node.rank else product
        loss = term if loss is None else builder.add(loss, term)
    return loss
