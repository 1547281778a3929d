"""runtime: captured functions run on 8 fake CPU devices as IntraPlans shard them."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jax_models import mlp_args, mlp_step, transformer_args, transformer_block
from meshplan import CostModel, IntraOptions, LogicalMesh, MeshError, ShardingSpec, solve_intra
from meshplan.capture import capture, tag_batch_inputs
from meshplan.cost.collectives import CollectiveKind
from meshplan.runtime import execute_sharded, make_jax_mesh, partition_spec

MESHES = [(8, 1), (1, 8), (2, 4), (4, 2)]
OPTIONS = IntraOptions(cost=CostModel(flops_per_second=1e12))


def logical_mesh(shape):
    return LogicalMesh(shape, (1e-5, 1e-5), (1e-9, 1e-9))


def plan_and_run(fn, args, shape, options=OPTIONS):
    captured = capture(fn, *args)
    plan = solve_intra(captured.graph, logical_mesh(shape), options)
    return captured, plan, execute_sharded(captured, plan, make_jax_mesh(plan.mesh))


CASES = [(mlp_step, mlp_args(64, 32, 128, 16)), (transformer_block, transformer_args())]


@pytest.mark.parametrize(("fn", "args"), CASES, ids=["mlp_step", "transformer_block"])
@pytest.mark.parametrize("shape", MESHES)
def test_sharded_run_matches_single_device(fn, args, shape):
    captured, plan, sharded = plan_and_run(fn, args, shape)
    got = jax.tree_util.tree_leaves(sharded(*args))
    want = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    for value, expected, node in zip(got, want, captured.output_nodes, strict=True):
        # atol covers elements near zero: sharded sums add in another order (seen: <= 1.1e-6 abs)
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-5)
        assert value.sharding.spec == partition_spec(plan.strategy(node).output)


def test_transformer_batch_is_split_as_planned():
    captured, plan, sharded = plan_and_run(transformer_block, transformer_args(), (8, 1))
    x_node = captured.input_nodes[-1]
    assert plan.strategy(x_node).output == ShardingSpec.of(0, None, None)  # data parallel over axis 0
    compiled = sharded.lower(*transformer_args()).compile()
    assert compiled.input_shardings[0][-1].spec == PartitionSpec("x", None, None)


def count_all_reduces(hlo: str) -> int:
    """All-reduce instructions in compiled HLO (sync `all-reduce(` and async `all-reduce-start(`)."""
    return len(re.findall(r"\ball-reduce(?:-start)?\(", hlo))


def test_megatron_mlp_all_reduces_match_plan():
    """2-layer MLP training step, batch 8, hidden 1024 on a (1, 8) mesh.

    A 6 MB budget forbids replicating the two 4 MB weights, so the plan is Megatron's
    column->row split: w1 by columns, w2 by rows, activations' hidden dim split, and one
    all-reduce of the second matmul's partial sums (backward needs none: no input grads).
    XLA may combine all-reduces, so in general HLO <= plan; here there is one to combine,
    so we assert equality.
    """
    args = mlp_args(batch=8, d_in=1024, hidden=1024, d_out=1024)
    captured, plan, sharded = plan_and_run(mlp_step, args, (1, 8), OPTIONS.replace(memory_budget=6e6))
    w1, w2, x, y = captured.input_nodes
    assert plan.strategy(w1).output == ShardingSpec.of(None, 1)  # column split
    assert plan.strategy(w2).output == ShardingSpec.of(1, None)  # row split
    assert plan.strategy(x).output.is_replicated and plan.strategy(y).output.is_replicated
    planned = [c for c in plan.collectives() if c.kind is CollectiveKind.ALL_REDUCE]
    assert [(c.axes, c.nbytes) for c in planned] == [((1,), 8 * 1024 * 4)]
    hlo = sharded.lower(*args).compile().as_text()
    assert count_all_reduces(hlo) == len(planned) == 1
    assert not re.search(r"\b(all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(", hlo)
    for value, expected in zip(sharded(*args), jax.jit(mlp_step)(*args), strict=True):
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)


def test_mesh_larger_than_jax_devices_raises():
    with pytest.raises(MeshError, match=r"mesh 4x4 needs 16 devices .* but JAX sees 8 cpu device\(s\)"):
        make_jax_mesh(logical_mesh((4, 4)))


def test_mesh_with_wrong_device_list_raises():
    with pytest.raises(MeshError, match=r"mesh 2x2 needs 4 devices but 8 were given"):
        make_jax_mesh(logical_mesh((2, 2)), jax.devices())


def test_jax_mesh_follows_device_ids_with_auto_axes():
    mesh = make_jax_mesh(LogicalMesh((2, 2), (1, 1), (1, 1), device_ids=(4, 5, 6, 7)))
    assert mesh.axis_names == ("x", "y")
    assert [d.id for d in mesh.devices.flat] == [4, 5, 6, 7]
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2


@pytest.mark.parametrize(("spec", "expected"), [
    (ShardingSpec.of(None, None), PartitionSpec(None, None)),
    (ShardingSpec.of(1, None, 0), PartitionSpec("y", None, "x")),
    (ShardingSpec.of((0, 1), None), PartitionSpec(("x", "y"), None)),
    (ShardingSpec.of((1, 0)), PartitionSpec(("y", "x"))),
])
def test_partition_spec(spec, expected):
    assert partition_spec(spec) == expected


def test_unrolled_scan_runs_sharded():
    def rnn(w, h0, xs):
        return jax.lax.scan(lambda h, x: (jax.numpy.tanh(h @ w + x), h.sum()), h0, xs)

    k = jax.random.split(jax.random.key(1), 3)
    w, h0, xs = (jax.random.normal(key, shape) for key, shape in zip(k, [(64, 64), (32, 64), (3, 32, 64)], strict=True))
    args = (w / 8, h0, xs)
    _, _, sharded = plan_and_run(rnn, args, (2, 4))
    for value, expected in zip(jax.tree_util.tree_leaves(sharded(*args)), jax.tree_util.tree_leaves(rnn(*args)),
                               strict=True):
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-5)


def test_reduce_scattered_weight_gradient_runs_as_planned():
    """x^T @ dy over a batch split 8 ways (a data-parallel weight gradient): with reduce_scatter
    the plan scatters the partial sums over the output's rows, and each device ends up holding
    only its 8 rows. XLA's CPU backend lowers the reduce-scatter as an all-reduce plus a
    dynamic slice (GPU backends fuse it into a reduce-scatter): one collective either way."""
    def weight_grad(x, dy):
        return x.T @ dy

    args = (jax.random.normal(jax.random.key(0), (4096, 64)), jax.random.normal(jax.random.key(1), (4096, 128)))
    captured = tag_batch_inputs(capture(weight_grad, *args), [(0, 0), (1, 0)])  # both inputs split along the batch
    options = OPTIONS.replace(force_batch_dim_to_mesh_dim=0, reduce_scatter=True)
    plan = solve_intra(captured.graph, LogicalMesh((8,), (1e-5,), (1e-9,)), options)
    (dw,) = captured.output_nodes
    assert plan.strategy(dw).output == ShardingSpec.of(0, None)
    assert [c.kind for c in plan.collectives()] == [CollectiveKind.REDUCE_SCATTER]
    sharded = execute_sharded(captured, plan, make_jax_mesh(plan.mesh))
    hlo = sharded.lower(*args).compile().as_text()
    assert count_all_reduces(hlo) + len(re.findall(r"\breduce-scatter(?:-start)?\(", hlo)) == 1
    got = sharded(*args)
    assert {shard.data.shape for shard in got.addressable_shards} == {(8, 128)}
    # 4096-term sums of O(1) products: compare at the scale of the values (|dW| ~ 64).
    np.testing.assert_allclose(got, weight_grad(*args), rtol=1e-5, atol=1e-3)
