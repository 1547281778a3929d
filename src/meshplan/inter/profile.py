"""Per-micro-batch cost of one model piece on one logical mesh, from the intra-op ILP.

Input: a piece's training graph (forward + backward of a block, the embedding or the head)
and a logical mesh. Output: a `PieceCost`: time per micro-batch split into forward and
backward, gradient synchronisation per iteration, and the memory a device holds (weights,
gradients, activations saved for backward, transient working memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.model import CostModel
from meshplan.intra.options import IntraOptions
from meshplan.intra.plan import IntraPlan
from meshplan.intra.solve import solve_intra
from meshplan.ir.counting import node_flops
from meshplan.ir.node import OpKind
from meshplan.models.training import PieceGraph


@dataclass(frozen=True, slots=True)
class PieceCost:
    """What a piece costs one device of a logical mesh (seconds, bytes).

    Attributes:
        time: forward + backward of one micro-batch (compute, communication, resharding).
        forward_time: the forward part (run again under activation recomputation).
        sync_time: gradient synchronisation, once per iteration.
        update_time: the optimizer step, once per iteration.
        static_bytes: weights, fp32 master copy, Adam state and gradients held all along.
        activation_bytes: forward values kept for the backward pass, per micro-batch.
        input_bytes: the piece's input activations per micro-batch (all that is kept when
            the piece is recomputed).
        transient_bytes: working memory of one micro-batch beyond the above.
        flops: forward + backward FLOPs of one micro-batch (all devices together).
    """

    time: float
    forward_time: float
    sync_time: float
    update_time: float
    static_bytes: float
    activation_bytes: float
    input_bytes: float
    transient_bytes: float
    flops: float

    def __add__(self, other: PieceCost) -> PieceCost:
        return PieceCost(*(a + b for a, b in zip(self._values(), other._values(), strict=True)))

    def _values(self) -> tuple[float, ...]:
        return (self.time, self.forward_time, self.sync_time, self.update_time, self.static_bytes,
                self.activation_bytes, self.input_bytes, self.transient_bytes, self.flops)


ZERO_COST = PieceCost(0, 0, 0, 0, 0, 0, 0, 0, 0)
# Memory prices tried per mesh, in units of the slowest axis' seconds per byte (holding a byte
# costs as much as moving it once over that axis): 0 gives the fastest plan, larger prices
# plans that shard optimizer state and weights further.
MEMORY_PRICES = (0.0, 1.0, 16.0)
# Seconds per byte charged on every value: breaks ties between equally fast plans towards the
# one that holds less (100 GB weigh 1 ms), so unpriced choices never replicate big tensors.
ACTIVATION_PRICE = 1e-14


def profile_piece(piece: PieceGraph, mesh: LogicalMesh, flops_per_second: float, num_microbatches: int,
                  memory_price: float = 0.0, time_limit: float = 30.0,
                  force_batch_axis: int | None = 0, reduce_scatter: bool = False) -> tuple[PieceCost, IntraPlan]:
    """Solve the piece's sharding on `mesh` (no memory limit: the stage DP checks memory) and
    read its costs off the plan; `reduce_scatter` as in IntraOptions."""
    options = IntraOptions(cost=CostModel(flops_per_second=flops_per_second,
                                          accumulation_weight=1.0 / num_microbatches, memory_price=memory_price,
                                          activation_price=ACTIVATION_PRICE),
                           force_batch_dim_to_mesh_dim=force_batch_axis, time_limit=time_limit, mip_gap=1e-4,
                           reduce_scatter=reduce_scatter)
    plan = solve_intra(piece.graph, mesh.with_memory(None), options)
    return piece_cost(piece, plan, num_microbatches), plan


def profile_menu(piece: PieceGraph, mesh: LogicalMesh, flops_per_second: float, num_microbatches: int,
                 prices: tuple[float, ...] = MEMORY_PRICES, force_batch_axis: int | None = 0,
                 reduce_scatter: bool = False) -> tuple[PieceCost, ...]:
    """Pareto-style menu: the fastest plan and plans that hold less memory for more time."""
    fastest, _ = profile_piece(piece, mesh, flops_per_second, num_microbatches, force_batch_axis=force_batch_axis,
                               reduce_scatter=reduce_scatter)
    menu = [fastest]
    unit = max(mesh.beta)
    for factor in prices:
        if factor <= 0:
            continue
        cost, _ = profile_piece(piece, mesh, flops_per_second, num_microbatches, memory_price=factor * unit,
                                force_batch_axis=force_batch_axis, reduce_scatter=reduce_scatter)
        if cost.static_bytes < menu[-1].static_bytes * 0.999:
            menu.append(cost)
    return tuple(menu)


def piece_cost(piece: PieceGraph, plan: IntraPlan, num_microbatches: int) -> PieceCost:
    """Read a piece's costs off its plan (the plan priced optimizer nodes 1/B per micro-batch)."""
    graph = piece.graph
    reshard = [0.0] * len(graph)
    for r in plan.reshardings:
        reshard[r.consumer_id] += sum(c.cost for c in r.collectives)
    forward = backward = sync = update = 0.0
    for chosen in plan.nodes:
        node = graph[chosen.node]
        own = sum(c.cost for c in chosen.collectives)
        if node.attr("accumulated"):
            sync += own
            own = 0.0
        compute = chosen.compute * (num_microbatches if node.attr("per_iteration") else 1)
        cost = compute + own + reshard[chosen.node]
        if chosen.node <= piece.forward_end:
            forward += cost
        elif chosen.node <= piece.backward_end:
            backward += cost
        else:
            update += cost
    inputs = {n.id for n in graph.parameters() if n.name in ("activations", "cotangent", "tokens", "labels")}
    static = sum(plan.nodes[n.id].memory for n in graph.parameters() if n.id not in inputs)
    static += sum(plan.nodes[v].memory for v in range(len(graph)) if graph[v].attr("accumulated")
                  and graph[v].kind not in (OpKind.TRANSPOSE, OpKind.RESHAPE, OpKind.BROADCAST))
    activation = sum(plan.nodes[v].memory for v in _saved_activations(piece))
    input_bytes = sum(plan.nodes[v].memory for v in inputs if graph[v].name == "activations")
    transient = max(0.0, plan.peak_memory - static - activation)
    flops = sum(node_flops(graph, n) for n in graph.nodes[: piece.backward_end + 1])
    return PieceCost(forward + backward, forward, sync, update, static, activation, input_bytes, transient, flops)


def _saved_activations(piece: PieceGraph) -> list[int]:
    """Forward values the backward pass reads: held from a micro-batch's forward to its backward."""
    graph = piece.graph
    weights = set(piece.weights)
    saved = []
    for node in graph.nodes[: piece.forward_end + 1]:
        if node.id in weights or node.kind in (OpKind.BROADCAST, OpKind.CONSTANT, OpKind.IOTA):
            continue
        if any(user > piece.forward_end for user in graph.users(node.id)):
            saved.append(node.id)
    return saved
