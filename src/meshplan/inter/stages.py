"""Stage estimates: time and memory of a layer range on one view of a sub-mesh, from layer costs.

The memory rule: a stage holds its layers' state all along, the activations of the micro-batches
in flight (the schedule says how many: under 1F1B the stage s-th from the end holds min(s, B)),
and the working memory of the one layer running. Two recomputation choices: none (keep every
saved activation) or full (keep the stage inputs; run each layer's forward again before its
backward). Hand-offs to the next stage are priced per device: each device of the sending view
sends its share of the boundary's activations, and receives its gradient, over the link it
crosses (meshplan.cost.links).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from meshplan.cluster.cluster import Cluster
from meshplan.cost.links import Links, bucketed_seconds, exposed_seconds, send_seconds
from meshplan.inter.costs import LayerCost, LayerCosts, ViewCosts
from meshplan.inter.schedules import Schedule

RECOMPUTE_CHOICES = ("none", "selective", "full")
_SUMMED = ("time", "forward_time", "sync_time", "update_time", "static_bytes", "activation_bytes", "input_bytes",
           "flops", "attention_forward_time", "attention_activation_bytes")


@dataclass(frozen=True, slots=True)
class IterationComm:
    """How a stage's once-per-iteration communication (gradient reductions, the optimizer's
    gathers) runs.

    Attributes:
        links: price it in buckets, one collective per kind and group for the whole stage (as
            Megatron and DDP bucket gradients), on these links (meshplan.cost.links); None: the
            layers' own per-tensor seconds added up.
        overlap_tail: overlapped with the last micro-batch's backward pass, exposing what it
            does not hide and at least this share (None: not overlapped).
    """

    links: Links | None = None
    overlap_tail: float | None = None

    def exposed(self, view: ViewCosts, menu: int, first: int, last: int, cost: dict[str, float]) -> float:
        """Seconds of the stage's once-per-iteration communication not hidden by its compute."""
        seconds = cost["sync_time"]
        if self.links is not None:
            seconds = _bucketed(view, menu, first, last, self.links, seconds)
        if self.overlap_tail is None:
            return seconds
        return exposed_seconds(seconds, cost["time"] - cost["forward_time"], self.overlap_tail)


def _bucketed(view: ViewCosts, menu: int, first: int, last: int, links: Links, fallback: float) -> float:
    """The layers' once-per-iteration collectives in buckets; `fallback` when the layers list
    none (a pricer that does not)."""
    listed = [c for k in range(first, last + 1) for c in view.entry(k, menu).iteration_collectives]
    return bucketed_seconds(listed, links) if listed else fallback


@dataclass(frozen=True, slots=True)
class StageEstimate:
    """One stage as planned: its layers, mesh, menu entry, recomputation, time and memory.

    `devices` are the global ids of the sub-mesh once placed (empty before placement).
    """

    first: int
    last: int
    submesh: tuple[int, int]
    view: tuple[int, ...]
    menu: int
    recompute: str
    latency: float
    sync_time: float
    update_time: float
    memory: float
    inflight: int
    flops: float
    devices: tuple[int, ...] = ()


def handoff_time(costs: LayerCosts, view: ViewCosts, last: int, cluster: Cluster, in_node: bool = False,
                 link_efficiency: float = 1.0) -> float:
    """Seconds to send one micro-batch's activations after layer `last` and get their gradient
    back, each device of `view` moving its share over the inter-node link, or the intra-node
    link when both stages sit in one node (0 after the last layer); links at `link_efficiency`
    of their nominal bandwidth (meshplan.cost.links)."""
    if last >= costs.num_layers - 1:
        return 0.0
    links = Links.of(cluster.device, link_efficiency)
    return 2 * send_seconds(costs.handoff_bytes[last] / view.devices, not in_node, links)


def handoff_in_node(view: ViewCosts, cluster: Cluster, node_local: bool) -> bool:
    """Whether the stage DP prices the hand-off after a stage on `view` on the intra-node link:
    with `node_local`, a stage on part of a node is placed beside the next one where it fits
    (placement then re-prices the hand-offs that do cross); a whole-node stage always hands off
    across nodes."""
    return node_local and view.submesh[1] < cluster.devices_per_node


def range_cost(view: ViewCosts, menu: int, first: int, last: int) -> dict[str, float]:
    """Summed costs of layers first..last under menu entry `menu`, plus the largest working
    memory and recomputed activations of any layer of the model (an upper bound per range, the
    same in the latency table)."""
    entries = [view.entry(k, menu) for k in range(first, last + 1)]
    total = {f: sum(getattr(e, f) for e in entries) for f in _SUMMED}
    largest = view.largest[menu]
    if largest is None:  # no layer can run on the view: the range's own
        largest = (max(e.transient_bytes for e in entries), max(e.peak_activation_bytes for e in entries))
    total["transient_bytes"], total["peak_activation_bytes"] = largest
    return total


def stage_memory(cost: dict[str, float], inflight: int, recompute: str) -> float:
    """Peak bytes per device: state held all along, activations of the micro-batches in flight,
    and the working memory of the one layer running (layers run one at a time). Full
    recomputation keeps each layer's input (one layer's activations live at a time); selective
    recomputation drops what only the attention cores keep."""
    if recompute == "full":
        held = cost["static_bytes"] + inflight * cost["input_bytes"] + cost["peak_activation_bytes"]
    else:
        dropped = cost["attention_activation_bytes"] if recompute == "selective" else 0.0
        held = cost["static_bytes"] + inflight * (cost["activation_bytes"] - dropped)
    return held + cost["transient_bytes"]


def stage_latency(cost: dict[str, float], recompute: str, transfer: float) -> float:
    """A micro-batch's forward and backward, the forward (full) or attention (selective) run
    again, and the hand-off."""
    return cost["time"] + _recomputed_time(cost, recompute) + transfer


def _recomputed_time(cost: dict[str, float], recompute: str) -> float:
    """Seconds of forward pass run again per micro-batch: all of it (full), the attention cores
    (selective) or none."""
    return {"full": cost["forward_time"], "selective": cost["attention_forward_time"]}.get(recompute, 0.0)


def stage_key(estimate: StageEstimate, num_microbatches: int) -> float:
    """What the DP minimises per stage: the micro-batch latency plus this stage's share of its
    once-per-iteration gradient sync and update (exact for one stage, close for several)."""
    return estimate.latency + (estimate.sync_time + estimate.update_time) / num_microbatches


def estimate_stage(view: ViewCosts, first: int, last: int, stages_left: int, num_microbatches: int,
                   capacity: float, transfer: float, schedule: Schedule,
                   recompute_choices: tuple[str, ...] = RECOMPUTE_CHOICES,
                   iteration: IterationComm = IterationComm()) -> StageEstimate | None:
    """The fastest (menu, recomputation) choice of a stage that fits in `capacity` bytes;
    `transfer` is its hand-off time to the next stage, `iteration` how its once-per-iteration
    communication runs."""
    inflight = schedule.inflight(stages_left, num_microbatches)
    best = None
    for menu in range(view.menu_size):
        cost = range_cost(view, menu, first, last)
        sync = iteration.exposed(view, menu, first, last, cost)
        for recompute in recompute_choices:
            memory = stage_memory(cost, inflight, recompute)
            if memory > capacity:
                continue
            estimate = StageEstimate(first, last, view.submesh, view.view, menu, recompute,
                                     stage_latency(cost, recompute, transfer), sync,
                                     cost["update_time"], memory, inflight, cost["flops"])
            if best is None or stage_key(estimate, num_microbatches) < stage_key(best, num_microbatches):
                best = estimate
    return best


def leanest_memory(view: ViewCosts, first: int, last: int, stages_left: int, num_microbatches: int,
                   schedule: Schedule) -> float:
    """The least memory any (menu, recomputation) choice of the stage needs."""
    inflight = schedule.inflight(stages_left, num_microbatches)
    return min(stage_memory(range_cost(view, menu, first, last), inflight, r)
               for menu in range(view.menu_size) for r in RECOMPUTE_CHOICES)


def latency_tables(costs: LayerCosts, per_shape: list[tuple[ViewCosts, ...]], cluster: Cluster,
                   num_microbatches: int, capacity: float, schedule: Schedule,
                   recompute_choices: tuple[str, ...] = RECOMPUTE_CHOICES, sends: Sequence[int] = (1,),
                   node_local: bool = False, link_efficiency: float = 1.0,
                   overlap_tail: float | None = None) -> Iterator[np.ndarray]:
    """Per entry of `sends`, as the caller reaches it: [first, last, sub-mesh, stages left] ->
    best stage key over views, menu entries and recomputation (inf: nothing fits). `sends` are
    hand-offs per micro-batch at the stage's end (the model chunks per device under the
    interleaved schedule), on the link `handoff_in_node` says; the once-per-iteration
    communication is overlapped with the backward pass when `overlap_tail` is given (per tensor
    here; the chosen stages are priced in buckets). The ranges' sums and memory fits do not
    depend on the hand-offs, so they are worked out once for every entry."""
    num_layers = costs.num_layers
    inflight = np.array([schedule.inflight(s, num_microbatches) for s in range(num_layers + 1)])
    grid = np.indices((num_layers, num_layers))
    # Flat index of [first, last, stage count] in a table's by_count array below.
    cell = (grid[0] * num_layers + grid[1]) * (num_layers + 2)
    choices_per_shape = []
    for views in per_shape:
        choices = []
        for view in views:
            in_node = handoff_in_node(view, cluster, node_local)
            handoff = np.array([handoff_time(costs, view, k, cluster, in_node, link_efficiency)
                                for k in range(num_layers)])
            for menu in range(view.menu_size):
                for valid, before, after, fits in _menu_choices(view, menu, num_microbatches, capacity, inflight,
                                                                recompute_choices, overlap_tail):
                    choices.append((handoff, valid, before, after, cell + fits))
        choices_per_shape.append(choices)
    for send in sends:
        table = np.full((num_layers, num_layers, len(per_shape), num_layers + 1), np.inf)
        for m, choices in enumerate(choices_per_shape):
            # by_count[k, i, c]: the best latency of a choice that fits for exactly the first c stage
            # counts; the table at s is then the best over c > s (a suffix minimum).
            by_count = np.full((num_layers, num_layers, num_layers + 2), np.inf)
            flat = by_count.reshape(-1)
            for handoff, valid, before, after, index in choices:
                latency = np.where(valid, before + send * handoff[None, :] + after, np.inf)
                flat[index] = np.minimum(flat[index], latency)
            suffix = np.minimum.accumulate(by_count[:, :, ::-1], axis=2)[:, :, ::-1]
            table[:, :, m, 1:] = suffix[:, :, 2:]
        yield table


def _menu_choices(view: ViewCosts, menu: int, num_microbatches: int, capacity: float, inflight: np.ndarray,
                  recompute_choices: tuple[str, ...], overlap_tail: float | None):
    """Per recomputation choice, over every range [first, last] under one menu entry: where the
    range is usable (not empty, no unusable layer), its latency before and after the hand-off is
    added (the stage key is before + hand-off + after, in that order, as `stage_latency` and
    `stage_key` add them), and how many leading stage counts (0, 1, ...) it fits in memory for."""
    num_layers = len(view.layers)
    entries: list[LayerCost] = [view.entry(k, menu) for k in range(num_layers)]
    # A layer that cannot run on this view (infinite costs) rules out every range holding it;
    # summing it would poison the prefix sums of the ranges after it.
    usable = np.array([e.is_usable() for e in entries])
    unusable = np.concatenate([[0], np.cumsum(~usable)])
    values = {f: [getattr(e, f) if ok else 0.0 for e, ok in zip(entries, usable, strict=True)] for f in _SUMMED}
    prefix = {f: np.concatenate([[0.0], np.cumsum(v)]) for f, v in values.items()}
    first = np.arange(num_layers)[:, None]
    last = np.arange(num_layers)[None, :]
    valid = (last >= first) & (unusable[last + 1] == unusable[first])
    sums = {f: prefix[f][last + 1] - prefix[f][first] for f in _SUMMED}
    # Working memory and recomputed activations of the largest layer (an upper bound per range).
    kept = [e for e, ok in zip(entries, usable, strict=True) if ok] or entries[:1]
    sums["transient_bytes"] = max(e.transient_bytes for e in kept)
    sums["peak_activation_bytes"] = max(e.peak_activation_bytes for e in kept)
    sync = sums["sync_time"]
    if overlap_tail is not None:
        sync = np.maximum(sync - (sums["time"] - sums["forward_time"]), overlap_tail * sync)
    after = (sync + sums["update_time"]) / num_microbatches  # see stage_key
    for recompute in recompute_choices:
        before = sums["time"] + _recomputed_time(sums, recompute)
        yield valid, before, after, _fitting_stage_counts(sums, inflight, recompute, capacity)


def _fitting_stage_counts(sums: dict, inflight: np.ndarray, recompute: str, capacity: float) -> np.ndarray:
    """Per range [first, last]: how many leading entries of `inflight` (indexed by stages left,
    from 0) fit in `capacity`. Memory grows with the micro-batches in flight, which never shrink as
    stages left grow, so the fitting entries are a prefix; found by bisection, with the same
    arithmetic as `stage_memory` (a range fits here exactly when it fits there)."""
    if np.any(np.diff(inflight) < 0):  # pragma: no cover - every registered schedule is monotone
        memory = stage_memory({f: (v[..., None] if isinstance(v, np.ndarray) else v) for f, v in sums.items()},
                              inflight[None, None, :], recompute)
        fits = memory <= capacity
        return np.where(fits.all(axis=2), len(inflight), np.argmin(fits, axis=2))
    shape = sums["time"].shape
    lo, hi = np.zeros(shape, dtype=int), np.full(shape, len(inflight))
    while np.any(lo < hi):
        mid = (lo + hi + 1) // 2
        probe = np.minimum(mid, len(inflight)) - 1
        ok = (stage_memory(sums, inflight[np.maximum(probe, 0)], recompute) <= capacity) & (lo < hi)
        lo = np.where(ok, mid, lo)
        hi = np.where(ok | (lo >= hi), hi, mid - 1)
    return lo
