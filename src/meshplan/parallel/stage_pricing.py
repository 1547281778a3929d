"""The runtime's pricer: captured layers + the intra-op ILP -> LayerCosts -> the inter-op pass.

The layers are the pieces a loss function's `mark_pipeline_boundary` calls cut. The devices are
seen as a cluster (DeviceCosts.cluster: nodes of `devices_per_node` consecutive devices), so the
candidates are the simulator's: its sub-mesh shapes and their logical views (a size-1 axis
dropped: a (1, 4) view runs as a 1-D mesh of 4), with `mesh_axes=3` also the 3-D views of
sub-meshes of 8 or more devices (`Cluster.logical_views`). Each layer's forward + backward is planned by
the ILP on every view and its costs read off the plan (meshplan.inter.costs.layer_cost);
identical layers (same jaxpr, same shapes) are planned once. `meshplan.inter.plan_pipeline`
then picks the stages, sub-meshes and placement with the inter-op pass's memory rule (state
held, activations of the micro-batches in flight, the working memory of one layer).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from meshplan.cluster.cluster import Cluster
from meshplan.cluster.costs import DeviceCosts
from meshplan.cluster.mesh import LogicalMesh
from meshplan.errors import InfeasiblePlanError, MeshError
from meshplan.inter import InterOptions, InterPlan, LayerCost, LayerCosts, TrainingParts, ViewCosts, layer_cost
from meshplan.inter import plan_pipeline as run_inter_pass
from meshplan.intra.options import IntraOptions
from meshplan.parallel.pipeshard import StageAssignment
from meshplan.runtime.abstract import chain_inputs, shapes_of
from meshplan.runtime.stage_layout import plan_stage

_INFEASIBLE = LayerCost(math.inf, math.inf, 0.0, 0.0, math.inf, math.inf, math.inf, math.inf, 0.0)


@dataclass(frozen=True, slots=True)
class StageSearch:
    """What the inter-op pass chose for a captured program, and from what.

    Attributes:
        stages: the stages in pipeline order.
        inter: the inter-op pass's plan (predicted latencies, memory, placement).
        costs: every layer's priced costs per view.
    """

    stages: tuple[StageAssignment, ...]
    inter: InterPlan
    costs: LayerCosts

    def layer_times(self, layer: int) -> dict[tuple[int, ...], float]:
        """Layer `layer`'s planned time per micro-batch on each logical mesh (inf: it does not fit)."""
        return {view.view: view.entry(layer, 0).time for view in self.costs.views}


def search_stages(layer_fns: Sequence[Callable[..., Any]], layer_params: Sequence[Any], x: Any, targets: Any,
                  num_devices: int, num_micro_batches: int, options: IntraOptions,
                  costs: DeviceCosts | None = None, schedule: str = "1f1b", mesh_axes: int = 2) -> StageSearch:
    """Best stages for `layer_fns` on `num_devices` devices with `num_micro_batches` micro-batches.

    Args:
        layer_fns: from `split_into_stages`: `layer_k(params_k, act)`; the last also takes targets.
        layer_params: example params per layer (arrays or ShapeDtypeStructs).
        x, targets: example micro-batch input and targets.
        num_devices: devices the stages must use, all of them.
        num_micro_batches: micro-batches per step (the DP's B).
        options: the intra-op ILP's options.
        costs: the devices' costs and memory; default the placeholders.
        schedule: the pipeline schedule (how many micro-batches each stage holds).
        mesh_axes: 2 (2-D logical views) or 3 (also 3-D views of sub-meshes of 8+ devices).

    Raises:
        MeshError: no assignment of stages fits in the memory per device.
    """
    costs = costs or DeviceCosts()
    cluster = costs.cluster(num_devices)
    acts = chain_inputs(layer_fns, layer_params, x)
    layer_costs = price_layers(layer_fns, layer_params, acts, targets, cluster, num_micro_batches, options,
                               mesh_axes)
    budget = math.inf if costs.memory_bytes is None else costs.memory_bytes
    inter = run_inter_pass(layer_costs, cluster, num_micro_batches,
                           InterOptions(capacity_bytes=budget, schedule=schedule, recompute=("none",)))
    if inter is None:
        raise MeshError(f"no pipeline of the {len(layer_fns)} layers on {num_devices} devices fits in "
                        f"{budget / 1e9:.3g} GB per device (the cluster's memory); give the devices more memory, "
                        f"use smaller micro-batches (more num_micro_batches) or split the model into more layers")
    stages = tuple(StageAssignment(s.first, s.last, s.devices, s.view) for s in inter.stages)
    return StageSearch(stages, inter, layer_costs)


def price_layers(layer_fns: Sequence[Callable[..., Any]], layer_params: Sequence[Any], acts: list[Any],
                 targets: Any, cluster: Cluster, num_micro_batches: int, options: IntraOptions,
                 mesh_axes: int = 2) -> LayerCosts:
    """Every layer's costs on every view (of up to `mesh_axes` axes) of the cluster's sub-mesh shapes."""
    views = [(shape, _squeezed(view)) for shape in cluster.submesh_shapes()
             for view in cluster.logical_views(shape, max_axes=mesh_axes)]
    planned: dict[tuple[str, bool, bool], tuple[LayerCost, ...]] = {}  # identical layers: once
    per_layer = [_layer_costs(layer_fns, layer_params, acts, targets, k, [m for _, m in views], num_micro_batches,
                              options, planned) for k in range(len(layer_fns))]
    priced = tuple(ViewCosts(shape, mesh.shape, tuple((costs[j],) for costs in per_layer))
                   for j, (shape, mesh) in enumerate(views))
    return LayerCosts(priced, tuple(_bytes(a) for a in acts[1:]))


def _squeezed(mesh: LogicalMesh) -> LogicalMesh:
    """The mesh without its size-1 axes (a (1, 4) view runs as a 1-D mesh of 4)."""
    keep = [a for a, size in enumerate(mesh.shape) if size > 1] or [0]
    return LogicalMesh(tuple(mesh.shape[a] for a in keep), tuple(mesh.alpha[a] for a in keep),
                       tuple(mesh.beta[a] for a in keep), mesh.memory_per_device, mesh.device_ids)


def _layer_costs(layer_fns: Sequence[Callable[..., Any]], layer_params: Sequence[Any], acts: list[Any],
                 targets: Any, k: int, meshes: list[LogicalMesh], num_micro_batches: int, options: IntraOptions,
                 planned: dict[tuple[str, bool, bool], tuple[LayerCost, ...]]) -> tuple[LayerCost, ...]:
    """Layer k's cost on each mesh (infeasible where it does not fit); from `planned` when an
    identical layer was planned."""
    last = k == len(layer_fns) - 1
    params, t = shapes_of(layer_params[k]), shapes_of(targets) if last else None
    key = (str(jax.make_jaxpr(layer_fns[k])(params, acts[k], *(() if t is None else (t,)))), k == 0, last)
    if key not in planned:
        planned[key] = tuple(_plan_layer(layer_fns[k], mesh, options, params, acts[k], t, k, num_micro_batches)
                             for mesh in meshes)
    return planned[key]


def _plan_layer(fn: Callable[..., Any], mesh: LogicalMesh, options: IntraOptions, params: Any, act: Any, targets: Any,
                k: int, num_micro_batches: int) -> LayerCost:
    try:
        captured, backward, plan = plan_stage(fn, mesh, options, params, act, targets,
                                                    differentiate_input=k > 0, name=f"layer{k}")
    except InfeasiblePlanError:
        return _INFEASIBLE
    graph, grads = backward.graph, backward.grads
    num_params = len(jax.tree_util.tree_leaves(params))
    weights = captured.input_nodes[:num_params]
    given = set(captured.input_nodes)
    cotangents = tuple(n.id for n in graph.parameters() if n.id not in given)
    parts = TrainingParts(forward_end=len(captured.graph) - 1, backward_end=len(graph) - 1, weights=tuple(weights),
                          inputs=(*captured.input_nodes[num_params:], *cotangents),
                          recompute_inputs=tuple(captured.input_nodes[num_params:num_params + _leaves(act)]),
                          held=tuple(grads[i] for i in range(num_params) if i in grads))
    return layer_cost(graph, plan, parts, num_micro_batches)


def _leaves(tree: Any) -> int:
    return len(jax.tree_util.tree_leaves(tree))


def _bytes(tree: Any) -> float:
    return float(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(tree)))
