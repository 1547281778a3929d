"""Alpa's test models (tests/alpa_models.py) trained under each SPMD method, compiled once per
test session and shared by tests/test_method_layouts.py (collectives and layouts) and
tests/test_zero.py (memory at rest): each (program, method) pair is planned and compiled once,
trained 3 Adam steps, and compared with plain jax.jit on one device."""

from __future__ import annotations

import functools
import warnings

import jax
import numpy as np

from alpa_models import bert_program, mlp_program, moe_program, mse_step_with_loss
from meshplan.cluster.cluster import Cluster
from meshplan.cluster.devices import DeviceSpec
from meshplan.parallel import DataParallel, ShardParallel, TensorParallel, Zero2Parallel, Zero3Parallel, parallelize
from meshplan.parallel.donation import UnusedDonationWarning
from meshplan.runtime.diagnostics import RematerializationWarning

PROGRAMS = {"mlp": functools.partial(mlp_program, layers=4), "bert": bert_program,
            "bert_remat": functools.partial(bert_program, remat=True), "moe": moe_program}
# Slow compute makes ShardParallel split work instead of replicating these small models.
SLOW = Cluster(1, 8, DeviceSpec("slow-cpu", 1e8, float("inf"), 1e9, 1e-5, 1e9, 1e-5))
METHODS = {"dp": DataParallel(), "zero2": Zero2Parallel(), "zero3": Zero3Parallel(), "tp": TensorParallel(),
           "shard8": ShardParallel(mesh_shape=(8,)), "shard2x4": ShardParallel(mesh_shape=(2, 4)),
           "shard4x2": ShardParallel(mesh_shape=(4, 2)), "shard2x2x2": ShardParallel(mesh_shape=(2, 2, 2))}
DATA_PARALLEL = ("dp", "zero2", "zero3")  # methods that promise the state's layout at rest: state donated
STEPS = 3


@functools.cache
def one_device(program: str):
    """(initial state, batch, final state and losses of plain jax.jit on one device)."""
    _, state, batch = PROGRAMS[program]()
    return state, batch, train(jax.jit(mse_step_with_loss), state, batch)


@functools.cache
def trained(program: str, method: str):
    """(the parallelized step, its final state and losses). The data-parallel methods donate the
    whole state (every pair must be kept: an UnusedDonationWarning fails); no plan may make XLA
    rematerialize a value."""
    state, batch, _ = one_device(program)
    donate = (0,) if method in DATA_PARALLEL else ()
    cluster = SLOW if method.startswith("shard") else None
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematerializationWarning)
        warnings.simplefilter("error", UnusedDonationWarning)
        parallel = parallelize(mse_step_with_loss, method=METHODS[method], batch_argnums=(1,),
                               donate_argnums=donate, cluster=cluster)
        return parallel, train(parallel, state, batch)


def train(step, state, batch):
    """(final state, losses) after STEPS steps."""
    losses = []
    for _ in range(STEPS):
        state, loss = step(state, batch)
        losses.append(float(loss))
    return state, losses


def assert_same_training(got, want):
    """Losses within 1e-5; parameters within 1e-4 mean relative error over the whole tree (a
    per-leaf ratio is meaningless for an attention key bias, whose gradient is zero up to
    rounding, which Adam's normalisation turns into updates of either sign)."""
    (got_state, got_losses), (want_state, want_losses) = got, want
    np.testing.assert_allclose(got_losses, want_losses, rtol=0, atol=1e-5)
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(s.params)])
            for s in (got_state, want_state))
    assert np.mean(np.abs(a - b)) / np.mean(np.abs(b)) <= 1e-4


def nbytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree))


def split_eight_ways(leaf) -> bool:
    """Each of the 8 devices holds an eighth of `leaf` (scalars count as split: they cannot be)."""
    return leaf.ndim == 0 or (leaf.addressable_shards[0].data.size * 8 == leaf.size
                              and len(leaf.sharding.device_set) == 8)


def whole_everywhere(leaf) -> bool:
    return all(s.data.size == leaf.size for s in leaf.addressable_shards) and len(leaf.sharding.device_set) == 8
