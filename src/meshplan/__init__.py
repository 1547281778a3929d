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

__all__ = [
    "CostModel", "DType", "Graph", "GraphBuilder", "GraphError", "InfeasiblePlanError", "IntraOptions",
    "IntraPlan", "LogicalMesh", "MeshError", "MeshplanError", "ModelSpecError", "OpKind", "OptionsError",
    "ShardingSpec", "SolverError", "check_graph", "format_graph", "llama_forward", "solve_intra",
]
