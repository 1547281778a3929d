"""Runtime stage: run a captured function on a JAX mesh as an IntraPlan shards it, or pipelined."""

from meshplan.inter.schedules import SCHEDULES, Event, Phase, make_schedule
from meshplan.runtime.boundary import mark_pipeline_boundary, split_into_stages
from meshplan.runtime.diagnostics import CompileDiagnostics, RematerializationWarning, compile_lowered
from meshplan.runtime.pipeline import (
    ForwardResult,
    Pipeline,
    PipelineResult,
    apply_update,
    place_params,
    run_forward,
    run_micro_batches,
    run_pipeline,
)
from meshplan.runtime.sharded import (
    ShardedFunction,
    axis_names,
    execute_sharded,
    make_jax_mesh,
    partition_spec,
)

__all__ = [
    "SCHEDULES",
    "CompileDiagnostics",
    "Event",
    "ForwardResult",
    "Phase",
    "Pipeline",
    "PipelineResult",
    "RematerializationWarning",
    "ShardedFunction",
    "apply_update",
    "axis_names",
    "compile_lowered",
    "execute_sharded",
    "make_jax_mesh",
    "make_schedule",
    "mark_pipeline_boundary",
    "partition_spec",
    "place_params",
    "run_forward",
    "run_micro_batches",
    "run_pipeline",
    "split_into_stages",
]
