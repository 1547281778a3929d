"""capture: JAX functions -> meshplan graphs (nested calls inlined, opaque fallback, evaluation)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_models import mlp_args, mlp_step
from meshplan.capture import UnsupportedPrimitiveWarning, capture, ir_dtype
from meshplan.ir import DType, OpKind
from meshplan.ir.interpret import evaluate


def run_graph(captured, *args):
    """Evaluate the captured graph with meshplan's NumPy interpreter; return the flat results."""
    leaves = jax.tree_util.tree_leaves(args)
    values = evaluate(captured.graph, {n: np.asarray(a) for n, a in zip(captured.input_nodes, leaves, strict=True)})
    return [values[n] for n in captured.output_nodes]


def kinds(captured, kind):
    return [n for n in captured.graph.nodes if n.kind is kind]


def test_mlp_training_step_graph():
    args = mlp_args(batch=4, d_in=3, hidden=5, d_out=2)
    c = capture(mlp_step, *args)
    params = kinds(c, OpKind.PARAMETER)
    assert [(p.name, p.shape, p.dtype) for p in params] == [
        ("args[0][0]", (3, 5), DType.F32), ("args[0][1]", (5, 2), DType.F32),
        ("args[1]", (4, 3), DType.F32), ("args[2]", (4, 2), DType.F32)]
    assert c.input_nodes == tuple(p.id for p in params)
    w1, w2, x, _ = c.input_nodes
    dots = kinds(c, OpKind.DOT)
    # forward x@w1, h@w2; backward dw2 = h^T dz, dh = dz w2^T, dw1 = x^T dh
    assert [(d.shape, d.attr("lhs_contracting"), d.attr("rhs_contracting")) for d in dots] == [
        ((4, 5), (1,), (0,)), ((4, 2), (1,), (0,)), ((2, 5), (0,), (0,)), ((4, 5), (1,), (1,)), ((5, 3), (0,), (0,))]
    assert dots[0].operands == (x, w1)
    assert dots[1].operands[1] == w2 and dots[3].operands[1] == w2 and dots[4].operands[1] == x
    assert kinds(c, OpKind.REDUCE) == []  # the loss value itself is dead code in a grad-only step: pruned
    assert c.unsupported == ()
    assert [c.graph.nodes[n].shape for n in c.output_nodes] == [(3, 5), (5, 2)]
    for got, want in zip(run_graph(c, *args), jax.tree_util.tree_leaves(mlp_step(*args)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_nested_jit_and_custom_jvp_are_inlined():
    inner = jax.jit(lambda x: jax.nn.relu(x) * 2.0)

    def fn(x):
        return jax.nn.gelu(inner(x), approximate=False) + jax.nn.relu(x)

    x = jnp.linspace(-2.0, 2.0, 12).reshape(3, 4)
    c = capture(fn, x)
    assert {e.primitive.name for e in c.jaxpr.jaxpr.eqns} >= {"jit", "custom_jvp_call"}
    assert c.unsupported == () and kinds(c, OpKind.OPAQUE) == []
    ops = [n.op for n in c.graph.nodes if n.kind is OpKind.ELEMENTWISE]
    assert ops.count("max") == 2 and ops.count("erf") == 1  # relu twice; exact gelu's erfc = 1 - erf
    np.testing.assert_allclose(run_graph(c, x)[0], fn(x), rtol=1e-6)


def test_custom_vjp_and_checkpoint_are_inlined():
    @jax.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))

    def fn(w, x):
        return jnp.sum(jax.checkpoint(lambda v: jnp.tanh(clip_grad(v) @ w))(x))

    w, x = jnp.full((4, 4), 0.5), jnp.ones((2, 4))
    forward = capture(fn, w, x)
    assert {e.primitive.name for e in forward.jaxpr.jaxpr.eqns} >= {"remat2"}  # jax.checkpoint
    assert _nested(forward.jaxpr) >= {"custom_vjp_call", "dot_general"}
    assert forward.unsupported == ()
    np.testing.assert_allclose(run_graph(forward, w, x)[0], fn(w, x), rtol=1e-6)
    grad = jax.grad(fn, argnums=(0, 1))
    c = capture(grad, w, x)
    assert c.unsupported == ()
    for got, want in zip(run_graph(c, w, x), grad(w, x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5)


def _nested(closed):
    """Names of primitives one call level down (custom_vjp_call sits inside checkpoint)."""
    bodies = [eqn.params["jaxpr"] for eqn in closed.jaxpr.eqns if hasattr(eqn.params.get("jaxpr"), "eqns")]
    return {e.primitive.name for body in bodies for e in body.eqns}


def test_unsupported_primitive_becomes_opaque_with_warning():
    with pytest.warns(UnsupportedPrimitiveWarning, match=r"cumsum, sort.*planned replicated"):
        c = capture(lambda x: jax.lax.cumsum(x) + jnp.sort(x), jnp.ones(5))
    assert c.unsupported == ("cumsum", "sort")
    assert [(n.op, n.operands, n.shape) for n in kinds(c, OpKind.OPAQUE)] == [("cumsum", (0,), (5,)),
                                                                            ("sort", (0,), (5,))]


def test_supported_function_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture(lambda x: jnp.sum(x * x, axis=0), jnp.ones((3, 2)))


def test_static_scan_is_unrolled():
    def fn(c0, xs):
        return jax.lax.scan(lambda c, x: (c * x + 1.0, c), c0, xs)

    c0, xs = jnp.array([1.0, 2.0]), jnp.arange(6.0).reshape(3, 2)
    c = capture(fn, c0, xs)
    assert c.unsupported == ()
    assert sum(n.op == "mul" for n in c.graph.nodes) == 3
    got = run_graph(c, c0, xs)
    for g, w in zip(got, jax.tree_util.tree_leaves(fn(c0, xs)), strict=True):
        np.testing.assert_allclose(g, w)


def test_embedding_lookup_is_a_gather():
    table, ids = jnp.arange(12.0).reshape(6, 2), jnp.array([[5, 0], [2, 2]], dtype=jnp.int32)
    c = capture(lambda t, i: t[i], table, ids)
    (gather,) = kinds(c, OpKind.GATHER)
    assert gather.operands[0] == c.input_nodes[0] and gather.shape == (2, 2, 2)
    np.testing.assert_array_equal(run_graph(c, table, ids)[0], table[ids])


def test_literals_become_constants_and_maps_cover_top_level_vars():
    c = capture(lambda x: x * 3.0, jnp.ones(2))
    (const,) = kinds(c, OpKind.CONSTANT)
    assert const.attr("value") == 3.0 and const.shape == ()
    jaxpr = c.jaxpr.jaxpr
    assert c.var_nodes[jaxpr.invars[0]] == c.input_nodes[0]
    assert c.var_nodes[jaxpr.outvars[0]] == c.output_nodes[0]


@pytest.mark.parametrize(("dtype", "expected"), [
    (jnp.float32, DType.F32), (jnp.bfloat16, DType.BF16), (jnp.int32, DType.I32), (jnp.bool_, DType.PRED),
    (jnp.float16, DType.F16), (jnp.uint8, DType.U8)])
def test_dtypes_map_to_ir(dtype, expected):
    assert ir_dtype(dtype) is expected
    c = capture(lambda x: x, jnp.zeros(3, dtype))
    assert c.graph.nodes[c.input_nodes[0]].dtype is expected
