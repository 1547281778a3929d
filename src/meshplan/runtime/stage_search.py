"""Inter-op pass for captured programs: group layers into stages and size each stage's sub-mesh.

The layers are the segments a loss function's `mark_pipeline_boundary` calls cut. Each layer's
forward + backward is planned by the intra-op ILP on every logical mesh a sub-mesh of the
candidate sizes can form; a range of layers on a sub-mesh costs the sum of its layers' plan
objectives on the best common logical shape plus the activation hand-off, and the stage DP
(meshplan.inter.stage_dp, Alpa §5) picks the stages minimising the 1F1B latency with every
device used. Identical layers (same jaxpr, same shapes) are planned once. With a memory per
device (DeviceCosts.memory_bytes) each layer is planned within it, and a range whose layers'
peak memories add up to more is not a candidate (one micro-batch in flight: the 1F1B extra
in-flight activations are not counted).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from meshplan.errors import InfeasiblePlanError, MeshError
from meshplan.inter.stage_dp import plan_stages
from meshplan.intra.options import IntraOptions
from meshplan.runtime.abstract import chain_inputs, shapes_of
from meshplan.runtime.defaults import DeviceCosts
from meshplan.runtime.stage_layout import plan_stage


@dataclass(frozen=True, slots=True)
class StageAssignment:
    """One pipeline stage: layers `first..last` (inclusive) on `devices` viewed as `mesh_shape`."""

    first: int
    last: int
    devices: tuple[int, ...]  # indices into the device list
    mesh_shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StageSearch:
    """What the search chose and why.

    Attributes:
        stages: the stages in pipeline order.
        latency: the predicted pipeline latency of one step (seconds, cost-model units).
        stage_latencies: per stage, the predicted time of one micro-batch's forward + backward.
        layer_costs: per layer, {logical mesh shape: planned cost of one micro-batch} (inf: the
            layer does not fit in the memory per device on that mesh).
    """

    stages: tuple[StageAssignment, ...]
    latency: float
    stage_latencies: tuple[float, ...]
    layer_costs: tuple[dict[tuple[int, ...], float], ...]


def submesh_sizes(num_devices: int) -> tuple[int, ...]:
    """Candidate sub-mesh sizes: the divisors of the device count."""
    return tuple(d for d in range(1, num_devices + 1) if num_devices % d == 0)


def logical_shapes(size: int) -> tuple[tuple[int, ...], ...]:
    """Logical meshes of `size` devices: 1-D, and every 2-D factorisation with both sides > 1."""
    return ((size,), *((a, size // a) for a in range(2, size) if size % a == 0 and size // a > 1))


def search_stages(layer_fns: Sequence[Callable[..., Any]], layer_params: Sequence[Any], x: Any, targets: Any,
                  num_devices: int, num_micro_batches: int, options: IntraOptions,
                  costs: DeviceCosts | None = None) -> StageSearch:
    """Best stages for `layer_fns` on `num_devices` devices with `num_micro_batches` micro-batches.

    Args:
        layer_fns: from `split_into_stages`: `layer_k(params_k, act)`; the last also takes targets.
        layer_params: example params per layer (arrays or ShapeDtypeStructs).
        x, targets: example micro-batch input and targets.
        num_devices: devices the stages must use, all of them.
        num_micro_batches: micro-batches per step (the DP's B).
        options: the intra-op ILP's options.
        costs: collective costs of the devices (sub-meshes are priced as if they started at a
            node boundary; hand-offs on the inter-node link); default the placeholders.

    Raises:
        MeshError: no assignment of stages fits in the memory per device.
    """
    costs = costs or DeviceCosts()
    num_layers = len(layer_fns)
    acts = chain_inputs(layer_fns, layer_params, x)
    planned: dict[tuple[str, bool, bool], dict[tuple[int, ...], tuple[float, float]]] = {}  # identical: once
    layer_plans = [_layer_costs(layer_fns, layer_params, acts, targets, k, num_devices, options, costs, planned)
                   for k in range(num_layers)]
    layer_costs = tuple({shape: cost for shape, (cost, _) in plans.items()} for plans in layer_plans)
    budget = math.inf if costs.memory_bytes is None else costs.memory_bytes
    sizes = submesh_sizes(num_devices)
    latency = np.full((num_layers, num_layers, len(sizes), num_layers + 1), np.inf)
    best_shape: dict[tuple[int, int, int], tuple[int, ...]] = {}
    for first in range(num_layers):
        for last in range(first, num_layers):
            handoff = 0.0 if last == num_layers - 1 else \
                2 * (costs.inter_alpha + _bytes(acts[last + 1]) * costs.inter_beta)
            for m, size in enumerate(sizes):
                totals = {shape: sum(layer_costs[j][shape] for j in range(first, last + 1))
                          if sum(layer_plans[j][shape][1] for j in range(first, last + 1)) <= budget else math.inf
                          for shape in logical_shapes(size)}
                shape = min(totals, key=totals.get)
                best_shape[first, last, m] = shape
                latency[first, last, m, 1:] = totals[shape] + handoff
    found = plan_stages(latency, sizes, num_devices, num_micro_batches)
    if found is None:
        raise MeshError(f"no pipeline of the {num_layers} layers on {num_devices} devices fits in "
                        f"{budget / 1e9:.3g} GB per device (the cluster's memory); give the devices more memory, "
                        f"use smaller micro-batches (more num_micro_batches) or split the model into more layers")
    stages, start = [], 0
    for slot in found.stages:
        size = sizes[slot.submesh]
        stages.append(StageAssignment(slot.first, slot.last, tuple(range(start, start + size)),
                                      best_shape[slot.first, slot.last, slot.submesh]))
        start += size
    return StageSearch(tuple(stages), found.total, tuple(s.latency for s in found.stages), layer_costs)


def _layer_costs(layer_fns: Sequence[Callable[..., Any]], layer_params: Sequence[Any], acts: list[Any],
                 targets: Any, k: int, num_devices: int, options: IntraOptions, costs: DeviceCosts,
                 planned: dict[tuple[str, bool, bool], dict[tuple[int, ...], tuple[float, float]]],
                 ) -> dict[tuple[int, ...], tuple[float, float]]:
    """Layer k's planned (cost, peak memory) per logical shape, (inf, inf) where it does not fit;
    from `planned` when an identical layer was planned."""
    last = k == len(layer_fns) - 1
    params, t = shapes_of(layer_params[k]), shapes_of(targets) if last else None
    key = (str(jax.make_jaxpr(layer_fns[k])(params, acts[k], *(() if t is None else (t,)))), k == 0, last)
    if key in planned:
        return planned[key]
    by_shape = {}
    for size in submesh_sizes(num_devices):
        for shape in logical_shapes(size):
            try:
                plan = plan_stage(layer_fns[k], costs.mesh(shape), options, params, acts[k], t,
                                  differentiate_input=k > 0, name=f"layer{k}")[2]
            except InfeasiblePlanError:
                by_shape[shape] = (math.inf, math.inf)
                continue
            by_shape[shape] = (plan.objective, plan.peak_memory)
    planned[key] = by_shape
    return by_shape


def _bytes(tree: Any) -> float:
    return float(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(tree)))
