"""Runtime stage: run a captured function on a JAX mesh as an IntraPlan shards it."""

from meshplan.runtime.sharded import (
    ShardedFunction,
    axis_names,
    execute_sharded,
    make_jax_mesh,
    partition_spec,
)

__all__ = ["ShardedFunction", "axis_names", "execute_sharded", "make_jax_mesh", "partition_spec"]
