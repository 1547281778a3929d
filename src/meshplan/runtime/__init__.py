"""Runtime stage: run a captured function on a JAX mesh as an IntraPlan shards it, or pipelined."""

from meshplan.runtime.boundary import mark_pipeline_boundary, split_into_stages
from meshplan.runtime.diagnostics import CompileDiagnostics, RematerializationWarning, compile_lowered
from meshplan.runtime.donation import Donation, UnusedDonationWarning, pair_donated
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
    "CompileDiagnostics",
    "Donation",
    "Event",
    "Phase",
    "Pipeline",
    "PipelineResult",
    "RematerializationWarning",
    "ShardedFunction",
    "UnusedDonationWarning",
    "apply_update",
    "axis_names",
    "compile_lowered",
    "execute_sharded",
    "make_jax_mesh",
    "make_schedule",
    "mark_pipeline_boundary",
    "pair_donated",
    "partition_spec",
    "place_params",
    "run_pipeline",
    "split_into_stages",
]
