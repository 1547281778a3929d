"""Runtime stage: run a captured function on a JAX mesh as an IntraPlan shards it, or pipelined."""

from meshplan.runtime.boundary import mark_pipeline_boundary, split_into_stages
from meshplan.runtime.pipeline import (
    SCHEDULES,
    Event,
    Phase,
    Pipeline,
    PipelineResult,
    apply_update,
    make_schedule,
    place_params,
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
    "Event",
    "Phase",
    "Pipeline",
    "PipelineResult",
    "ShardedFunction",
    "apply_update",
    "axis_names",
    "execute_sharded",
    "make_jax_mesh",
    "make_schedule",
    "mark_pipeline_boundary",
    "partition_spec",
    "place_params",
    "run_pipeline",
    "split_into_stages",
]
