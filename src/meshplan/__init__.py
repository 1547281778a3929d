"""meshplan: automatic data, tensor and pipeline parallelism planning (after Alpa)."""

from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.model import CostModel
from meshplan.errors import (
    GraphError,
    InfeasiblePlanError,
    MeshError,
    MeshplanError,
    ModelSpecError,
    OptionsError,
    SolverError,
)
from meshplan.intra.options import IntraOptions
from meshplan.intra.plan import IntraPlan
from meshplan.intra.solve import solve_intra
from meshplan.ir import DType, Graph, GraphBuilder, OpKind, check_graph, format_graph
from meshplan.models import llama_forward
from meshplan.sharding.spec import ShardingSpec

# The runtime needs JAX (the `jax` extra); its names load on first use so that planning and
# simulation work without it.
_RUNTIME = {
    "parallelize": "meshplan.api", "ShardParallel": "meshplan.api", "DataParallel": "meshplan.api",
    "Zero2Parallel": "meshplan.api", "Zero3Parallel": "meshplan.api", "TensorParallel": "meshplan.api",
    "PipeshardParallel": "meshplan.pipeshard",
    "capture": "meshplan.capture", "mark_pipeline_boundary": "meshplan.runtime",
}


def __getattr__(name: str):
    if name in _RUNTIME:
        import importlib

        return getattr(importlib.import_module(_RUNTIME[name]), name)
    raise AttributeError(f"module 'meshplan' has no attribute {name!r}")

__all__ = [
    "CostModel", "DType", "Graph", "GraphBuilder", "GraphError", "InfeasiblePlanError", "IntraOptions",
    "IntraPlan", "LogicalMesh", "MeshError", "MeshplanError", "ModelSpecError", "OpKind", "OptionsError",
    "ShardingSpec", "SolverError", "check_graph", "format_graph", "llama_forward", "solve_intra",
    *_RUNTIME,
]
