"""Layer costs: what the inter-op pass is given, whoever priced the layers.

A pricer (the simulator's, from model specs; the runtime's, from captured programs) plans each
layer's training graph with the intra-op ILP on every logical view of every candidate
sub-mesh and reads a `LayerCost` off each plan (`layer_cost`). `LayerCosts` holds them, per
view and layer, with a menu per layer (the fastest plan first, then plans that hold less
memory for more time), plus the bytes each layer hands to the next. The inter-op pass
(meshplan.inter.search) turns them into a latency table, runs the stage DP and places the
stages; it never sees a model or a program.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from meshplan.cost.fusion import BOUNDARY
from meshplan.intra.plan import IntraPlan
from meshplan.ir import Graph, OpKind
from meshplan.ir.counting import node_flops


@dataclass(frozen=True, slots=True)
class LayerCost:
    """What a layer costs one device of a logical mesh (seconds, bytes).

    Attributes:
        time: forward + backward of one micro-batch (compute, communication, resharding).
        forward_time: the forward part (run again under activation recomputation).
        sync_time: gradient synchronisation, once per iteration.
        update_time: the optimizer step, once per iteration.
        static_bytes: weights, fp32 master copy, optimizer state and gradients held all along.
        activation_bytes: forward values kept for the backward pass, per micro-batch.
        input_bytes: the layer's input activations per micro-batch (all that is kept when the
            layer is recomputed).
        transient_bytes: working memory of one micro-batch beyond the above.
        flops: forward + backward FLOPs of one micro-batch (all devices together).
        peak_activation_bytes: the activations of the largest piece of the layer (a layer may
            stack pieces, e.g. the embedding and the first block), live at once when the layer
            is recomputed; -1 means `activation_bytes`.
        attention_forward_time: the forward time of the attention cores (paid again under
            selective recomputation).
        attention_activation_bytes: the activations only the attention cores keep (scores,
            probabilities; what selective recomputation drops).
        iteration_collectives: (kind, ranks, ranks sharing a node, bytes) of the collectives in
            `sync_time`, so a stage can run them in buckets (inter.stages.IterationComm).
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
    peak_activation_bytes: float = -1.0
    attention_forward_time: float = 0.0
    attention_activation_bytes: float = 0.0
    iteration_collectives: tuple[tuple[str, int, int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.peak_activation_bytes < 0:
            object.__setattr__(self, "peak_activation_bytes", self.activation_bytes)

    def is_usable(self) -> bool:
        """Whether the layer can run on its view at all (an unplaceable layer has infinite costs)."""
        return all(math.isfinite(v) for v in (
            self.time, self.forward_time, self.sync_time, self.update_time, self.static_bytes, self.activation_bytes,
            self.input_bytes, self.flops, self.attention_forward_time, self.attention_activation_bytes,
            self.transient_bytes))

    def stacked(self, other: LayerCost) -> LayerCost:
        """Two pieces run one after the other as one layer: times and held bytes add up; the
        working memory and the recomputed activations are those of the larger piece."""
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}  # tuples join
        summed["transient_bytes"] = max(self.transient_bytes, other.transient_bytes)
        summed["peak_activation_bytes"] = max(self.peak_activation_bytes, other.peak_activation_bytes)
        return LayerCost(**summed)


@dataclass(frozen=True, slots=True)
class ViewCosts:
    """Every layer's costs on one logical view of one sub-mesh shape.

    Attributes:
        submesh: the physical sub-mesh, (nodes, devices per node).
        view: the logical mesh shape the layers were planned on.
        layers: per layer, its menu: the fastest plan first, then leaner ones (a stage uses the
            same menu entry for all its layers; a shorter menu repeats its last entry).
        largest: per menu entry, the largest working memory and recomputed activations of the
            layers that can run on the view (None: none can); read off the layers once, as every
            stage estimate charges them (inter.stages.range_cost).
    """

    submesh: tuple[int, int]
    view: tuple[int, ...]
    layers: tuple[tuple[LayerCost, ...], ...]
    largest: tuple[tuple[float, float] | None, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        largest = []
        for menu in range(self.menu_size if self.layers else 0):
            usable = [e for k in range(len(self.layers)) if (e := self.entry(k, menu)).is_usable()]
            largest.append((max(e.transient_bytes for e in usable), max(e.peak_activation_bytes for e in usable))
                           if usable else None)
        object.__setattr__(self, "largest", tuple(largest))

    @property
    def devices(self) -> int:
        return self.submesh[0] * self.submesh[1]

    @property
    def menu_size(self) -> int:
        return max(len(menu) for menu in self.layers)

    def entry(self, layer: int, menu: int) -> LayerCost:
        """Layer `layer`'s cost under menu entry `menu`."""
        options = self.layers[layer]
        return options[min(menu, len(options) - 1)]


@dataclass(frozen=True, slots=True)
class LayerCosts:
    """What the inter-op pass plans from.

    Attributes:
        views: priced views; sub-mesh shapes without a view are not candidates.
        handoff_bytes: per boundary k (after layer k), the bytes of one micro-batch's
            activations sent to the next layer (its gradient comes back the same size).
    """

    views: tuple[ViewCosts, ...]
    handoff_bytes: tuple[float, ...]

    @property
    def num_layers(self) -> int:
        return len(self.handoff_bytes) + 1

    def views_of(self, submesh: tuple[int, int]) -> tuple[ViewCosts, ...]:
        """The priced views of one sub-mesh shape."""
        return tuple(v for v in self.views if v.submesh == submesh)


@dataclass(frozen=True, slots=True)
class TrainingParts:
    """Where a layer's training graph splits, to read its costs off a plan.

    Attributes:
        forward_end: id of the last forward node; backward nodes follow it.
        backward_end: id of the last backward node; optimizer nodes follow it.
        weights: trainable parameter ids (their forward uses are not saved activations).
        inputs: parameters that arrive per micro-batch (activations, cotangents, tokens): not held.
        recompute_inputs: the inputs kept when the layer is recomputed.
        held: nodes held all along besides the non-input parameters (e.g. accumulated gradients).
        saved: the forward values the backward pass keeps (a pricer that knows how the graph
            runs as fused kernels gives them); empty: every forward value a backward node reads.
        attention_saved: the part of `saved` only attention cores need (dropped when they are
            recomputed: selective recomputation).
        attention: the forward nodes of attention cores (run again under selective recomputation).
        fp8_saved: saved values kept in fp8 (GEMM inputs when GEMMs run in fp8).
    """

    forward_end: int
    backward_end: int
    weights: tuple[int, ...]
    inputs: tuple[int, ...]
    recompute_inputs: tuple[int, ...]
    held: tuple[int, ...]
    saved: tuple[int, ...] = ()
    attention_saved: tuple[int, ...] = ()
    attention: tuple[int, ...] = ()
    fp8_saved: tuple[int, ...] = ()


def layer_cost(graph: Graph, plan: IntraPlan, parts: TrainingParts, num_microbatches: int) -> LayerCost:
    """Read a layer's costs off the plan of its training graph.

    Nodes tagged `accumulated` (gradients summed over micro-batches) count their own collectives
    as once-per-iteration sync; nodes tagged `per_iteration` (the optimizer step) were priced
    1/B per micro-batch by the plan and count once per iteration: their kernels as the update,
    their collectives and resharding (the gather of new weights) as sync.
    """
    reshard = resharding_seconds(graph, plan, parts.forward_end)
    forward = backward = sync = update = 0.0
    for chosen in plan.nodes:
        node = graph[chosen.node]
        own = 0.0 if node.attr("kernel") == BOUNDARY else sum(c.cost for c in chosen.collectives)
        if node.attr("accumulated") or chosen.node > parts.backward_end:
            sync += own + (reshard[chosen.node] if chosen.node > parts.backward_end else 0.0)
            own = 0.0
        if chosen.node > parts.backward_end:
            update += chosen.compute * num_microbatches
            continue
        cost = chosen.compute + own + reshard[chosen.node]
        if chosen.node <= parts.forward_end:
            forward += cost
        else:
            backward += cost
    inputs = set(parts.inputs)
    static = sum(plan.nodes[n.id].memory for n in graph.parameters() if n.id not in inputs)
    static += sum(plan.nodes[v].memory for v in parts.held)
    activation = _saved_bytes(graph, plan, parts, parts.saved or _saved_activations(graph, parts))
    input_bytes = sum(plan.nodes[v].memory for v in parts.recompute_inputs)
    transient = max(0.0, plan.peak_memory - static - activation)
    flops = sum(node_flops(graph, n) for n in graph.nodes[: parts.backward_end + 1])
    attention_bytes = _saved_bytes(graph, plan, parts, parts.attention_saved)
    attention_time = sum(_node_time(plan, reshard, v) for v in parts.attention)
    return LayerCost(forward + backward, forward, sync, update, static, activation, input_bytes, transient, flops,
                     attention_forward_time=attention_time, attention_activation_bytes=attention_bytes,
                     iteration_collectives=iteration_collectives(graph, plan, parts))


def iteration_collectives(graph: Graph, plan: IntraPlan, parts: TrainingParts) -> tuple:
    """(kind, ranks, ranks sharing a node, bytes) of every once-per-iteration collective of the
    plan: accumulated gradients' reductions, the optimizer step's collectives and resharding."""
    found = [c for chosen in plan.nodes if graph[chosen.node].attr("accumulated") or chosen.node > parts.backward_end
             for c in chosen.collectives]
    moved = {(r.producer, r.src.dims, r.dst.dims): r for r in plan.reshardings if r.consumer_id > parts.backward_end}
    found += [c for r in moved.values() for c in r.collectives]
    return tuple((c.kind.value, *plan.mesh.group_locality(c.axes), c.nbytes) for c in found)


def resharding_seconds(graph: Graph, plan: IntraPlan, forward_end: int | None = None) -> list[float]:
    """Seconds of resharding charged to each consumer node, as the step runs it: a value moved to
    one layout is moved once however many consumers need it there, and (given where the forward
    pass ends) a forward value re-laid out for the backward pass (a saved activation gathered
    again, as Megatron's sequence parallelism does for weight gradients) is fetched ahead, under
    the backward pass's compute."""
    seconds = [0.0] * len(graph)
    seen: set[tuple] = set()
    for r in plan.reshardings:
        consumer = graph[r.consumer_id]
        producer = next((o for o in consumer.operands if graph[o].label == r.producer), r.consumer_id)
        key = (producer, r.src.dims, r.dst.dims)
        if key in seen:
            continue
        seen.add(key)
        if forward_end is not None and producer <= forward_end < r.consumer_id:
            continue
        seconds[r.consumer_id] += sum(c.cost for c in r.collectives)
    return seconds


def _node_time(plan: IntraPlan, reshard: list[float], node: int) -> float:
    chosen = plan.nodes[node]
    return chosen.compute + sum(c.cost for c in chosen.collectives) + reshard[node]


def _saved_bytes(graph: Graph, plan: IntraPlan, parts: TrainingParts, values) -> float:
    """Bytes per device of the saved `values`, each its local shard (a view kept for the
    backward pass holds its own part; fp8 copies at one byte per element)."""
    fp8 = set(parts.fp8_saved)
    total = 0.0
    for v in values:
        elements = math.prod(plan.nodes[v].output.shard_shape(graph[v].shape, plan.mesh))
        total += elements * (1 if v in fp8 else graph[v].dtype.itemsize)
    return total


def _saved_activations(graph: Graph, parts: TrainingParts) -> list[int]:
    """Forward values the backward pass reads: held from a micro-batch's forward to its backward."""
    weights = set(parts.weights)
    saved = []
    for node in graph.nodes[: parts.forward_end + 1]:
        if node.id in weights or node.kind in (OpKind.BROADCAST, OpKind.CONSTANT, OpKind.IOTA):
            continue
        if any(user > parts.forward_end for user in graph.users(node.id)):
            saved.append(node.id)
    return saved
