"""Price a layout as fixed per-op strategies on the operator graph: the auto planner's pricer.

Input: a TrainingJob, a Cluster and a `Layout`. Output: a `LayoutPrediction`, as the closed form
(meshplan.simulator.analytic) gives, so the two can be compared figure by figure.

The layout becomes a logical mesh with one axis per parallel degree, in Megatron's rank order
(data, expert, context, tensor-parallel; tensor-parallel fastest), and every node of the model's
training pieces (each kind of block, the embedding, the LM head; one micro-batch of every
data-parallel replica, so the batch dim is split over the data axis) gets the output spec the
layout gives the names of its dims (meshplan.ir.dimnames):

- attention heads, the MLP width, the vocabulary and the experts' width over the tensor axis
  (Megatron's column/row-parallel GEMMs, vocabulary-parallel embedding and head);
- the batch over the data (and expert) axes, the experts over the expert axis inside the
  expert computation (kernel "experts") and on the experts' weights, gradients and state;
- the sequence over the context axis, and over the tensor axis too where a floating-point value
  has no tensor-parallel dim under sequence parallelism (norms, residuals, dropout; token ids
  and labels stay whole on every tensor-parallel rank);
- with the distributed optimizer, gradients and optimizer state also over the data and context
  axes on their largest free dim (reduce-scattered gradients, all-gathered new weights).

Each piece is then planned by the intra-op ILP with those strategies fixed (the choices that
give a node its spec; resharding where consecutive specs differ, e.g. sequence parallelism's
all-gathers), under the same op-level cost model the auto planner uses (meshplan.cost: GEMM
curve, fused attention, memory-bound kernels under fusion, node-aware collectives). Stages,
pipeline, exposed data-parallel communication and memory parts are composed exactly as the
closed form composes its own per-layer costs (GraphPricer overrides those costs only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshplan.cluster.cluster import Cluster
from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.collectives import CollectiveCosts
from meshplan.cost.fusion import UPDATE, training_pass
from meshplan.cost.kernels import DEFAULT_EFFICIENCY, WORKSPACE_BYTES, KernelCosts, KernelEfficiency
from meshplan.cost.links import bucketed_seconds
from meshplan.cost.model import CostModel
from meshplan.errors import OptionsError
from meshplan.inter.costs import LayerCost, layer_cost
from meshplan.intra.options import IntraOptions
from meshplan.intra.plan import IntraPlan
from meshplan.intra.solve import solve_intra
from meshplan.ir import DType, Graph, OpKind
from meshplan.ir.dimnames import dim_names
from meshplan.models.training import PieceGraph
from meshplan.sharding.spec import ShardingSpec
from meshplan.simulator.analytic import (
    LayoutPrediction,
    LayoutPricer,
    MemoryBreakdown,
    _LayerTimes,
)
from meshplan.simulator.job import TrainingJob
from meshplan.simulator.layout import Layout
from meshplan.simulator.pricing import GRAPH, PiecePricing, piece_graphs, training_parts
from meshplan.simulator.stage_plans import piece_times

DATA, EXPERT, CONTEXT, TENSOR = range(4)  # the layout mesh's axes
TENSOR_DIMS = ("kv_heads", "ffn", "vocab", "expert_ffn")
# Seconds per byte held that the fixed-strategy ILP charges: where the layout's specs can be
# reached several ways, the one holding less wins unless it moves far more (a byte held weighs as
# one moved at 1 TB/s), e.g. an embedding gradient gathered per micro-batch over tensor-parallel
# ranks (Megatron) rather than a whole partial table reduce-scattered once per iteration.
HELD_BYTE_PRICE = 1e-12


def layout_mesh(cluster: Cluster, layout: Layout) -> LogicalMesh:
    """The first stage's devices as a (dp / ep, ep, cp, tp) mesh in Megatron's rank order."""
    shape = (layout.dp // layout.ep, layout.ep, layout.cp, layout.tp)
    ids = tuple(range(math.prod(shape)))
    topology = cluster.topology
    probe = LogicalMesh(shape, (0.0,) * 4, (0.0,) * 4, None, ids, topology)
    d = cluster.device
    inside = [probe.group_locality((a,))[1] == shape[a] for a in range(4)]
    alpha = tuple(d.intra_latency if i else d.inter_latency for i in inside)
    beta = tuple(d.intra_beta if i else d.inter_beta for i in inside)
    return LogicalMesh(shape, alpha, beta, None, ids, topology)


def layout_specs(graph: Graph, layout: Layout, mesh: LogicalMesh) -> tuple[tuple[int, ShardingSpec], ...]:
    """(node id, output spec) the layout gives every node whose dims are named."""
    names = dim_names(graph)
    fixed = []
    for node in graph.nodes:
        if node.kind in (OpKind.CONSTANT, OpKind.IOTA) or not node.rank or not any(names[node.id]):
            continue
        sharded = layout.distributed_optimizer and (training_pass(node) == UPDATE or node.attr("accumulated")) \
            and not node.attr("relayout")
        sp = layout.sp and node.dtype.itemsize > 1 and node.dtype.name.startswith(("F", "BF"))
        expert = node.attr("kernel") == "experts" or "expert_ffn" in names[node.id]  # expert-local values
        axes = _node_axes(names[node.id], node.shape, mesh, sp, sharded, expert)
        fixed.append((node.id, ShardingSpec(tuple(tuple(sorted(a)) for a in axes))))
    return tuple(fixed)


def _node_axes(names: tuple[str | None, ...], shape: tuple[int, ...], mesh: LogicalMesh, sp: bool,
               sharded_state: bool, expert: bool) -> list[list[int]]:
    """Mesh axes per dim, by the rules of the module docstring (each axis on one dim at most)."""
    axes: list[list[int]] = [[] for _ in names]
    used: set[int] = set()

    def place(dim: int | None, wanted: tuple[int, ...]) -> None:
        if dim is None:
            return
        for axis in wanted:
            size = mesh.shape[axis] * math.prod(mesh.shape[a] for a in axes[dim])
            if axis not in used and mesh.shape[axis] > 1 and shape[dim] >= size:
                axes[dim].append(axis)
                used.add(axis)

    def first(*wanted: str) -> int | None:
        return next((d for d, n in enumerate(names) if n in wanted), None)

    if expert:
        place(first("experts"), (EXPERT,))
    tensor = first(*TENSOR_DIMS)
    place(tensor, (TENSOR,))
    place(first("batch"), (DATA, EXPERT))
    place(first("seq"), (CONTEXT, TENSOR) if sp and tensor is None else (CONTEXT,))
    if sharded_state:  # over every data-parallel rank the value is not split over already
        free = [d for d in range(len(names)) if not axes[d]]
        place(max(free, key=lambda d: shape[d]) if free else None, (DATA, EXPERT, CONTEXT))
    return axes


@dataclass(frozen=True, slots=True)
class PricedPiece:
    """One piece of the layout planned with its fixed strategies."""

    piece: PieceGraph
    plan: IntraPlan
    cost: LayerCost


class GraphPricer(LayoutPricer):
    """The closed form's composition over per-layer costs read off fixed-strategy ILP plans."""

    cost_model = GRAPH

    def __init__(self, job: TrainingJob, cluster: Cluster, layout: Layout, eff: KernelEfficiency) -> None:
        super().__init__(job, cluster, layout, eff)
        if layout.fsdp:
            raise OptionsError(f"layout {layout.text()}: the graph pricer does not price fsdp=on (ZeRO-3 over "
                               "data parallel); use --pricer formula")
        if job.model.num_kv_heads % layout.tp:
            raise OptionsError(f"layout {layout.text()}: the graph pricer splits key/value heads over tp, and "
                               f"{job.model.num_kv_heads} are not divisible by tp={layout.tp}; use --pricer formula")
        self.mesh = layout_mesh(cluster, layout)
        pricing = PiecePricing(KernelCosts(cluster.device, eff, self.flash, layout.fp8),
                               4 if self._grad_bytes == 4 and job.dtype is not DType.F32 else None)
        blocks, embed, head = piece_graphs(job.model, layout.mb * layout.dp, job.seq_len, job.dtype, job.optimizer)
        self.pieces = {"embedding": self._priced(embed, pricing), "head": self._priced(head, pricing)}
        for moe, graph in blocks.items():
            self.pieces["moe-block" if moe else "block"] = self._priced(graph, pricing)

    def _priced(self, piece: PieceGraph, pricing: PiecePricing) -> PricedPiece:
        lay = self.layout
        hidden = (((TENSOR,), self.eff.tp_overlap_hidden),) if lay.tp_overlap else ()
        cost = CostModel(CollectiveCosts(link_efficiency=self.eff.link, hidden=hidden),
                         flops_per_second=self.device.peak_flops, accumulation_weight=1.0 / self.num_microbatches,
                         activation_price=HELD_BYTE_PRICE, kernels=pricing.kernels,
                         gradient_bytes=pricing.gradient_bytes)
        options = IntraOptions(cost=cost, reduce_scatter=True, gather_choices=True, time_limit=60.0, mip_gap=1e-6,
                               fixed_specs=layout_specs(piece.graph, lay, self.mesh))
        plan = solve_intra(piece.graph, self.mesh, options)
        return PricedPiece(piece, plan, layer_cost(piece.graph, plan, training_parts(piece, pricing),
                                                   self.num_microbatches))

    def _block(self, moe: bool) -> PricedPiece:
        return self.pieces["moe-block" if moe else "block"]

    # -- per-layer costs, read off the plans ---------------------------------------------------

    def _layer(self, moe: bool) -> _LayerTimes:
        priced = self._block(moe)
        cost, times = priced.cost, piece_times(priced.piece, priced.plan)
        backward = cost.time - cost.forward_time + self.eff.per_layer_overhead_s
        recompute = {"none": 0.0, "full": cost.forward_time,
                     "selective": 0.0 if self.flash else cost.attention_forward_time}[self.layout.recompute]
        communication = times.forward_communication + times.backward_communication
        return _LayerTimes(cost.forward_time, backward, recompute, cost.attention_forward_time, communication, 0.0)

    def _head(self) -> float:
        return self.pieces["head"].cost.time

    def _embedding(self) -> float:
        return self.pieces["embedding"].cost.time

    def _stage_pieces(self, j: int, layers: list[int]) -> list[tuple[PricedPiece, int]]:
        found = [(self._block(moe), n) for moe, n in self._kind_counts(layers)]
        if j == 0:
            found.append((self.pieces["embedding"], 1))
        if j == self.layout.pp - 1:
            found.append((self.pieces["head"], 1))
        return found

    def _stage_sync(self, j: int, layers: list[int]) -> tuple[float, float]:
        """The stage's once-per-iteration collectives in buckets, and its optimizer kernels."""
        pieces = self._stage_pieces(j, layers)
        listed = [c for priced, count in pieces for c in priced.cost.iteration_collectives * count]
        return bucketed_seconds(listed, self.links), sum(count * priced.cost.update_time for priced, count in pieces)

    def _stage_memory(self, j: int, layers: list[int]) -> MemoryBreakdown:
        lay = self.layout
        weights = gradients = optimizer = one = working = transient = 0.0
        for priced, count in self._stage_pieces(j, layers):
            held_weights, held_gradients, held_state = _static_parts(priced)
            weights += count * held_weights
            gradients += count * held_gradients
            optimizer += count * held_state
            cost = priced.cost
            if lay.recompute == "full":
                one += count * cost.input_bytes
                working = max(working, cost.peak_activation_bytes)
            else:
                dropped = cost.attention_activation_bytes if lay.recompute == "selective" and not self.flash else 0.0
                one += count * (cost.activation_bytes - dropped)
            transient = max(transient, cost.transient_bytes)
        held = self._held(j)
        return MemoryBreakdown(weights, gradients, optimizer, one, (held - 1) * one,
                               WORKSPACE_BYTES + max(working, transient))


def _static_parts(priced: PricedPiece) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per device the piece holds all along."""
    graph, plan, piece = priced.piece.graph, priced.plan, priced.piece
    weights = sum(plan.nodes[w].memory for w in piece.weights)
    parts = training_parts(piece)
    gradients = sum(plan.nodes[v].memory for v in parts.held)
    inputs = set(parts.inputs) | set(piece.weights)
    state = sum(plan.nodes[n.id].memory for n in graph.parameters() if n.id not in inputs)
    return weights, gradients, state


def price_layout_graph(job: TrainingJob, cluster: Cluster, layout: Layout,
                       efficiency: KernelEfficiency = DEFAULT_EFFICIENCY,
                       memory_fraction: float = 0.9) -> LayoutPrediction:
    """Time and memory of `layout` priced on the operator graph (check_layout first)."""
    return GraphPricer(job, cluster, layout, efficiency).predict(memory_fraction)
