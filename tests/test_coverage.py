"""Constructs beyond matmuls and elementwise ops: each captures with nothing opaque, its graph
computes what JAX computes (NumPy interpreter), its rule shapes the plan, and the planned run
on 8 CPU devices equals one device."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from meshplan import CostModel, LogicalMesh
from meshplan.capture import UnsupportedPrimitiveWarning, capture
from meshplan.ir import GraphBuilder, OpKind
from meshplan.ir.interpret import evaluate
from meshplan.parallel import ShardParallel, parallelize
from meshplan.sharding.enumerate import UnsupportedOpWarning, enumerate_strategies
from meshplan.sharding.spec import ShardingSpec

KEY = jax.random.split(jax.random.key(0), 4)
X = jax.random.normal(KEY[0], (16, 32))
W = jax.random.normal(KEY[1], (32, 32)) / 32**0.5
CACHE = jax.random.normal(KEY[2], (8, 12, 4, 8))  # [batch, length, heads, head_dim]
UPDATE = jax.random.normal(KEY[3], (8, 1, 4, 8))


def logical(x, w):
    keep = ((x > 0) & ~(x > 1)) | (x @ w < -1.0)
    return jnp.where(keep ^ (x < -2), x, 0.0)


def pad_split_concat(x, w):
    a, b = jnp.split(x @ w, 2, axis=1)
    return jnp.concatenate([jnp.pad(a, ((1, 2), (0, 0)), constant_values=0.5)[1:-2], b], axis=1) * 2.0


def cache_write(cache, update, i):
    return lax.dynamic_update_slice(cache, update, (0, i, 0, 0)) * 1.5


def running(x, w):
    y = x @ w
    return jnp.cumsum(y, axis=1) + lax.cumprod(jnp.tanh(y), axis=0, reverse=True) + lax.cummax(y, axis=1)


def ordering(x, w):
    y = x @ w
    values, indices = lax.top_k(y, 4)
    return jnp.sort(y, axis=1), jnp.argsort(y, axis=0), values, indices, jnp.argmax(y, axis=1)


def static_while(x, w):
    return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1]


def both_branches(x, w):
    return lax.cond(jnp.sum(x) > 0, lambda v: jnp.tanh(v @ w), lambda v: (2.0 * v) @ w.T, x)


def dropout(x, w, key):
    keep = jax.random.bernoulli(key, 0.8, (16, 32))
    return jnp.where(keep, (x @ w) / 0.8, 0.0)


CASES = {  # name: (function, arguments, the op kinds its capture must hold)
    "and_or_not_xor": (logical, (X, W), ()),
    "pad_split_concatenate": (pad_split_concat, (X, W), (OpKind.CONCATENATE, OpKind.SLICE)),
    "dynamic_update_slice": (cache_write, (CACHE, UPDATE, jnp.int32(5)), (OpKind.DYNAMIC_UPDATE_SLICE,)),
    "cumsum_cumprod_cummax": (running, (X, W), (OpKind.CUMULATIVE,)),
    "sort_argsort_top_k_argmax": (ordering, (X, W), (OpKind.SORT, OpKind.TOP_K, OpKind.ARG_REDUCE)),
    "while_static_trip_count": (static_while, (X, W), (OpKind.DOT,)),
    "cond": (both_branches, (X, W), (OpKind.DOT,)),
}


def strict_capture(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedPrimitiveWarning)
        return capture(fn, *args)


@pytest.mark.parametrize("name", list(CASES))
def test_construct_captures_and_its_graph_computes_what_jax_computes(name):
    fn, args, expected_kinds = CASES[name]
    c = strict_capture(fn, *args)
    assert c.unsupported == ()
    assert all(any(n.kind is kind for n in c.graph.nodes) for kind in expected_kinds)
    leaves = jax.tree_util.tree_leaves(args)
    values = evaluate(c.graph, {n: np.asarray(a) for n, a in zip(c.input_nodes, leaves, strict=True)})
    for node, want in zip(c.output_nodes, jax.tree_util.tree_leaves(fn(*args)), strict=True):
        np.testing.assert_allclose(values[node], want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("name", [*CASES, "dropout"])
def test_construct_runs_planned_on_8_devices_like_one_device(name):
    fn, args, _ = CASES[name] if name != "dropout" else (dropout, (X, W, KEY[3]), ())
    parallel = parallelize(fn, method=ShardParallel(mesh_shape=(2, 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedPrimitiveWarning)
        warnings.simplefilter("error", UnsupportedOpWarning)
        got = parallel(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(jax.jit(fn)(*args)), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6)


def test_while_with_a_static_trip_count_is_unrolled_and_cond_plans_both_branches():
    c = strict_capture(static_while, X, W)
    assert sum(n.kind is OpKind.DOT for n in c.graph.nodes) == 3  # three trips
    c = strict_capture(both_branches, X, W)
    assert sum(n.kind is OpKind.DOT for n in c.graph.nodes) == 2  # x @ w and 2x @ w.T: both planned
    assert sum(n.op == "select" for n in c.graph.nodes) == 1


def test_ops_along_a_dim_keep_that_dim_whole_in_the_plan():
    """Sorts, top_k, argmax and running reductions are replicated along their dim only."""
    for fn in (ordering, running):
        parallel = parallelize(fn, method=ShardParallel(mesh_shape=(2, 4)))
        parallel(X, W)
        plan, graph = parallel.get_plan(), parallel._last.captured.graph
        along = [n for n in graph.nodes if n.kind in (OpKind.SORT, OpKind.TOP_K, OpKind.CUMULATIVE, OpKind.ARG_REDUCE)]
        assert along
        for node in along:
            operand = plan.strategy(node.operands[0]).output if node.kind is OpKind.ARG_REDUCE else \
                plan.strategy(node.id).output
            assert operand.dims[node.attr("dim")] == (), node


def test_kv_cache_write_keeps_the_written_dim_whole_and_may_split_batch_and_heads():
    c = strict_capture(cache_write, CACHE, UPDATE, jnp.int32(5))
    node = next(n for n in c.graph.nodes if n.kind is OpKind.DYNAMIC_UPDATE_SLICE)
    outputs = {s.output for s in _strategies(c.graph, (2, 4))[node.id].strategies}
    assert all(spec.dims[1] == () for spec in outputs)  # the length dim the window covers in part
    assert ShardingSpec.of(0, None, 1, None) in outputs  # batch over axis 0, heads over axis 1


def test_concatenate_may_keep_a_split_of_the_joined_dim():
    b = GraphBuilder("concat")
    x = b.parameter((64, 32), name="x")
    y = b.concatenate([b.tanh(x), b.exp(x)], 0)
    b.outputs(b.neg(y))
    graph = b.build()
    strategies = _strategies(graph, (8,))[y].strategies
    pairs = {(s.output, s.operands[0]) for s in strategies}
    assert (ShardingSpec.of(0, None), ShardingSpec.of(None, None)) in pairs  # joined whole, result split
    assert (ShardingSpec.of(None, None), ShardingSpec.of(None, None)) in pairs


def test_partitionable_random_bits_may_be_split_and_keys_stay_replicated():
    c = strict_capture(dropout, X, W, KEY[3])
    graph = c.graph
    strategies = _strategies(graph, (2, 4))
    bits = [n for n in graph.nodes if n.kind is OpKind.RANDOM and n.op == "random_bits"]
    assert bits and all(n.attr("partitionable") for n in bits)
    assert any(not s.output.is_replicated for s in strategies[bits[0].id].strategies)
    keys = [n for n in graph.nodes if n.kind is OpKind.RANDOM and n.op != "random_bits"]
    assert all(s.output.is_replicated for n in keys for s in strategies[n.id].strategies)


def _strategies(graph, shape):
    mesh = LogicalMesh(shape, (1e-5,) * len(shape), (1e-9,) * len(shape))
    return enumerate_strategies(graph, mesh, CostModel(flops_per_second=1e11))
