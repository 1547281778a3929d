"""meshplan: automatic data, tensor and pipeline parallelism planning (after Alpa).

To capture a JAX function as a Graph: `meshplan.capture.capture(fn, *args)` (the subpackage
`meshplan.capture` takes that name once the runtime is loaded, so no lazy alias is offered).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from meshplan.cluster.cluster import Cluster
from meshplan.cluster.devices import get_device
from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.model import CostModel
from meshplan.errors import (
    GraphError,
    InfeasiblePlanError,
    LaunchError,
    MeshError,
    MeshplanError,
    ModelSpecError,
    OptionsError,
    PlanMismatchError,
    PlanValidationError,
    SolverError,
)
from meshplan.intra.options import IntraOptions
from meshplan.intra.plan import IntraPlan
from meshplan.intra.solve import solve_intra
from meshplan.ir import DType, Graph, GraphBuilder, OpKind, check_graph, format_graph
from meshplan.models import llama_forward
from meshplan.models.transformer import model_config
from meshplan.plan import Plan
from meshplan.sharding.spec import ShardingSpec
from meshplan.simulator import PlannerOptions, Simulation, TrainingJob, simulate

if TYPE_CHECKING:  # the runtime needs JAX (the `jax` extra); these load on first use
    from meshplan.parallel import (
        DataParallel,
        PipeshardParallel,
        PipeshardStage,
        ShardParallel,
        TensorParallel,
        Zero2Parallel,
        Zero3Parallel,
        apply_update,
        parallelize,
    )
    from meshplan.runtime import mark_pipeline_boundary
    from meshplan.serving import Decoder, Server, serve

_RUNTIME = {
    **dict.fromkeys(("parallelize", "ShardParallel", "DataParallel", "Zero2Parallel", "Zero3Parallel",
                     "TensorParallel", "PipeshardParallel", "PipeshardStage", "apply_update"), "meshplan.parallel"),
    "mark_pipeline_boundary": "meshplan.runtime",
    "serve": "meshplan.serving", "Server": "meshplan.serving", "Decoder": "meshplan.serving",
}


def __getattr__(name: str):
    if name in _RUNTIME:
        return getattr(importlib.import_module(_RUNTIME[name]), name)
    raise AttributeError(f"module 'meshplan' has no attribute {name!r}")


__all__ = [
    "Cluster", "CostModel", "DType", "Graph", "GraphBuilder", "GraphError", "InfeasiblePlanError", "IntraOptions",
    "IntraPlan", "LaunchError", "LogicalMesh", "MeshError", "MeshplanError", "ModelSpecError", "OpKind",
    "OptionsError", "Plan", "PlanMismatchError", "PlanValidationError", "PlannerOptions", "ShardingSpec",
    "Simulation", "SolverError", "TrainingJob", "check_graph", "format_graph", "get_device", "llama_forward",
    "model_config", "simulate", "solve_intra",
    # runtime, loaded on first use
    "DataParallel", "PipeshardParallel", "PipeshardStage", "ShardParallel", "TensorParallel", "Zero2Parallel",
    "Zero3Parallel", "apply_update", "mark_pipeline_boundary", "parallelize", "Decoder", "Server", "serve",
]
