"""The user API: `parallelize` a JAX function with a method (one Method protocol) and run it.

SPMD methods (ShardParallel, DataParallel, Zero2Parallel, Zero3Parallel, TensorParallel) shard
one step over one logical mesh (SpmdFunction); PipeshardParallel pipelines a whole train step
(its loss cut into layers, the optimizer update per stage; pipeshard_step) or a loss function
cut by hand over sub-meshes, each stage sharded by its own plan (PipeshardFunction). Both share the
ParallelizedFunction skeleton: a plan per input signature, `get_plan`, `dump_debug_info`.
"""

from meshplan.parallel.api import parallelize
from meshplan.parallel.donation import Donation, UnusedDonationWarning
from meshplan.parallel.function import ParallelizedFunction
from meshplan.parallel.methods import (
    DataParallel,
    Method,
    ShardParallel,
    SpmdMethod,
    TensorParallel,
    Zero2Parallel,
    Zero3Parallel,
)
from meshplan.parallel.pipeshard import PipeshardParallel, PipeshardStage
from meshplan.parallel.pipeshard_function import PipeshardFunction
from meshplan.parallel.spmd import SpmdFunction
from meshplan.runtime.pipeline import apply_update

__all__ = [
    "DataParallel",
    "Donation",
    "Method",
    "ParallelizedFunction",
    "PipeshardFunction",
    "PipeshardParallel",
    "PipeshardStage",
    "ShardParallel",
    "SpmdFunction",
    "SpmdMethod",
    "TensorParallel",
    "UnusedDonationWarning",
    "Zero2Parallel",
    "Zero3Parallel",
    "apply_update",
    "parallelize",
]
