"""Stage estimates: time and memory of a layer range on a sub-mesh, from per-piece costs.

A stage runs blocks first..last (plus the embedding on the first stage and the head on the
last). Under 1F1B the stage that is s-th from the end holds min(s, B) micro-batches of
activations. Two recomputation choices: none (keep every saved activation) or full (keep
the stage inputs; run each block's forward again before its backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.inter.profile import ZERO_COST, PieceCost

RECOMPUTE_CHOICES = ("none", "full")


@dataclass(frozen=True, slots=True)
class ViewCosts:
    """Costs measured on one logical view of a sub-mesh for one micro-batch size.

    Attributes:
        shape: the physical sub-mesh (nodes, devices per node); view: the logical mesh shape.
        blocks: per block index, its menu (fastest first, then leaner in memory).
        embedding, head: menus of the first stage's embedding and the last stage's head (a
            stage uses the same menu entry for all its pieces).
        transfer: seconds to send one micro-batch's activations to the next stage and its
            gradient back.
    """

    shape: tuple[int, int]
    view: tuple[int, ...]
    blocks: tuple[tuple[PieceCost, ...], ...]
    embedding: tuple[PieceCost, ...]
    head: tuple[PieceCost, ...]
    transfer: float

    @property
    def devices(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclass(frozen=True, slots=True)
class StageEstimate:
    """One stage as planned: its layers, mesh, menu entry, recomputation, time and memory."""

    first: int
    last: int
    shape: tuple[int, int]
    view: tuple[int, ...]
    menu: int
    recompute: str
    latency: float
    sync_time: float
    update_time: float
    memory: float
    inflight: int
    flops: float


def range_cost(costs: ViewCosts, menu: int, first: int, last: int) -> PieceCost:
    """Summed costs of blocks first..last with menu entry `menu`, plus embedding/head at the ends."""
    total = sum((_entry(costs.blocks[layer], menu) for layer in range(first, last + 1)), start=ZERO_COST)
    if first == 0:
        total = total + _entry(costs.embedding, menu)
    if last == len(costs.blocks) - 1:
        total = total + _entry(costs.head, menu)
    return total


def menu_size(costs: ViewCosts) -> int:
    return max(len(m) for m in (*costs.blocks, costs.embedding, costs.head))


def _entry(menu: tuple[PieceCost, ...], index: int) -> PieceCost:
    return menu[min(index, len(menu) - 1)]


def stage_memory(cost: PieceCost, inflight: int, recompute: str, largest_activation: float,
                 largest_transient: float) -> float:
    """Peak bytes per device: state held all along, activations of the micro-batches in
    flight, and the working memory of the one piece running (pieces run one at a time)."""
    if recompute == "full":
        return cost.static_bytes + inflight * cost.input_bytes + largest_activation + largest_transient
    return cost.static_bytes + inflight * cost.activation_bytes + largest_transient


def _largest(costs: ViewCosts, menu: int, first: int, last: int, field: str) -> float:
    pieces = [_entry(costs.blocks[k], menu) for k in range(first, last + 1)]
    pieces += [_entry(costs.embedding, menu)] if first == 0 else []
    pieces += [_entry(costs.head, menu)] if last == len(costs.blocks) - 1 else []
    return max(getattr(p, field) for p in pieces)


def stage_latency(cost: PieceCost, recompute: str, transfer: float) -> float:
    return cost.time + (cost.forward_time if recompute == "full" else 0.0) + transfer


def estimate_stage(costs: ViewCosts, first: int, last: int, stages_left: int, num_microbatches: int,
                   capacity: float, recompute_choices: tuple[str, ...] = RECOMPUTE_CHOICES) -> StageEstimate | None:
    """The fastest (menu, recomputation) choice of a stage that fits in `capacity` bytes."""
    inflight = min(stages_left, num_microbatches)
    transfer = costs.transfer if last < len(costs.blocks) - 1 else 0.0
    best = None
    for menu in range(menu_size(costs)):
        cost = range_cost(costs, menu, first, last)
        # The largest piece of the model, as in `latency_table` (an upper bound per range).
        largest = _largest(costs, menu, 0, len(costs.blocks) - 1, "activation_bytes")
        transient = _largest(costs, menu, 0, len(costs.blocks) - 1, "transient_bytes")
        for recompute in recompute_choices:
            memory = stage_memory(cost, inflight, recompute, largest, transient)
            if memory > capacity:
                continue
            latency = stage_latency(cost, recompute, transfer)
            estimate = StageEstimate(first, last, costs.shape, costs.view, menu, recompute, latency,
                                     cost.sync_time, cost.update_time, memory, inflight, cost.flops)
            if best is None or stage_key(estimate, num_microbatches) < stage_key(best, num_microbatches):
                best = estimate
    return best


def stage_key(estimate: StageEstimate, num_microbatches: int) -> float:
    """What the DP minimises per stage: the micro-batch latency plus this stage's share of its
    once-per-iteration gradient sync and update (exact for one stage, close for several)."""
    return estimate.latency + (estimate.sync_time + estimate.update_time) / num_microbatches


def leanest_memory(costs: ViewCosts, first: int, last: int, stages_left: int, num_microbatches: int) -> float:
    """The least memory any (menu, recomputation) choice of the stage needs."""
    inflight = min(stages_left, num_microbatches)
    needs = []
    for menu in range(menu_size(costs)):
        cost = range_cost(costs, menu, first, last)
        largest = _largest(costs, menu, 0, len(costs.blocks) - 1, "activation_bytes")
        transient = _largest(costs, menu, 0, len(costs.blocks) - 1, "transient_bytes")
        needs += [stage_memory(cost, inflight, r, largest, transient) for r in RECOMPUTE_CHOICES]
    return min(needs)


def best_estimate(views: list[ViewCosts], first: int, last: int, stages_left: int, num_microbatches: int,
                  capacity: float) -> StageEstimate | None:
    """The fastest fitting estimate over the logical views of one sub-mesh."""
    found = [estimate_stage(v, first, last, stages_left, num_microbatches, capacity) for v in views]
    found = [e for e in found if e is not None]
    return min(found, key=lambda e: stage_key(e, num_microbatches)) if found else None


def latency_table(per_shape: list[list[ViewCosts]], num_layers: int, num_microbatches: int,
                  capacity: float) -> np.ndarray:
    """[first, last, sub-mesh, stages left] -> best stage latency over views, menu entries and
    recomputation (inf: nothing fits)."""
    max_stages = num_layers
    table = np.full((num_layers, num_layers, len(per_shape), max_stages + 1), np.inf)
    for m, views in enumerate(per_shape):
        for costs in views:
            for menu in range(menu_size(costs)):
                _fill_menu(table, m, costs, menu, num_microbatches, capacity)
    return table


def _fill_menu(table: np.ndarray, m: int, costs: ViewCosts, menu: int, num_microbatches: int,
               capacity: float) -> None:
    """Vectorised over (first, last, stages left) for one menu entry."""
    k_layers = len(costs.blocks)
    entries = [_entry(costs.blocks[k], menu) for k in range(k_layers)]
    embedding, head = _entry(costs.embedding, menu), _entry(costs.head, menu)
    fields = ("time", "forward_time", "sync_time", "update_time", "static_bytes", "activation_bytes", "input_bytes")
    prefix = {f: np.concatenate([[0.0], np.cumsum([getattr(e, f) for e in entries])]) for f in fields}
    first = np.arange(k_layers)[:, None]
    last = np.arange(k_layers)[None, :]
    valid = last >= first
    sums = {f: prefix[f][last + 1] - prefix[f][first] for f in fields}
    for f in fields:
        ends = np.zeros((k_layers, k_layers))
        ends += np.where(first == 0, getattr(embedding, f), 0.0)
        ends += np.where(last == k_layers - 1, getattr(head, f), 0.0)
        sums[f] = sums[f] + ends
    # Working memory and recomputed activations of the largest piece (an upper bound per range).
    transient = max(e.transient_bytes for e in [*entries, embedding, head])
    largest = max(e.activation_bytes for e in [*entries, embedding, head])
    transfer = np.where(last < k_layers - 1, costs.transfer, 0.0)
    stages = np.arange(table.shape[3])
    inflight = np.minimum(stages, num_microbatches)[None, None, :]
    for recompute in RECOMPUTE_CHOICES:
        if recompute == "full":
            memory = sums["static_bytes"][..., None] + inflight * sums["input_bytes"][..., None] + largest
            latency = sums["time"] + sums["forward_time"] + transfer
        else:
            memory = sums["static_bytes"][..., None] + inflight * sums["activation_bytes"][..., None]
            latency = sums["time"] + transfer
        latency = latency + (sums["sync_time"] + sums["update_time"]) / num_microbatches  # see stage_key
        memory = memory + transient
        ok = (memory <= capacity) & valid[..., None]
        ok[:, :, 0] = False
        candidate = np.where(ok, latency[..., None], np.inf)
        table[:, :, m, :] = np.minimum(table[:, :, m, :], candidate)
