"""capture: JAX functions -> meshplan graphs (nested calls inlined, gathers and scatters, opaque fallback)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_models import mlp_args, mlp_step
from meshplan import CostModel, IntraOptions, LogicalMesh, solve_intra
from meshplan.capture import UnsupportedPrimitiveWarning, capture, ir_dtype
from meshplan.ir import DType, OpKind
from meshplan.ir.interpret import evaluate
from meshplan.runtime import execute_sharded, make_jax_mesh


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
    with pytest.warns(UnsupportedPrimitiveWarning, match=r"cbrt, reduce_precision.*planned replicated"):
        c = capture(lambda x: jnp.cbrt(x) + jax.lax.reduce_precision(x, 5, 10), jnp.ones(5))
    assert c.unsupported == ("cbrt", "reduce_precision")
    assert [(n.op, n.operands, n.shape) for n in kinds(c, OpKind.OPAQUE)] == [("cbrt", (0,), (5,)),
                                                                            ("reduce_precision", (0,), (5,))]


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


def check_against_jax(fn, *args):
    """Capture `fn`, run the graph with the interpreter and compare with JAX; return the capture."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedPrimitiveWarning)
        c = capture(fn, *args)
    for got, want in zip(run_graph(c, *args), jax.tree_util.tree_leaves(fn(*args)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # NaNs (filled gathers) must match too
    return c


def take_attrs(captured, kind):
    return [(n.attr("axis"), n.attr("batch_dims")) for n in kinds(captured, kind)]


RNG = np.random.default_rng(0)
TABLE = jnp.asarray(RNG.normal(size=(6, 3)), jnp.float32)
IDS = jnp.array([[1, 5], [3, 1]], jnp.int32)  # row 1 twice: its gradient sums two rows
LOGP = jnp.asarray(RNG.normal(size=(2, 4, 5)), jnp.float32)
LABELS = jnp.array([[1, 2, 4, 0], [3, 3, 0, 1]], jnp.int32)


@pytest.mark.parametrize("lookup", [lambda t, i: t[i], lambda t, i: jnp.take(t, i, axis=0)], ids=["index", "take"])
def test_embedding_gradient_is_a_scatter_add(lookup):
    c = check_against_jax(jax.grad(lambda t, i: jnp.sum(lookup(t, i) ** 2)), TABLE, IDS)
    (scatter,) = kinds(c, OpKind.SCATTER_ADD)
    assert take_attrs(c, OpKind.SCATTER_ADD) == [(0, 0)] and scatter.shape == (6, 3)
    assert c.output_nodes == (scatter.id,)  # scattered into zeros: no add of the operand


def test_scatter_add_onto_a_value_adds_it():
    updates = jnp.asarray(RNG.normal(size=(2, 2, 3)), jnp.float32)
    c = check_against_jax(lambda t, i, u: t.at[i].add(u), TABLE, IDS, updates)
    out = c.graph.nodes[c.output_nodes[0]]
    (scatter,) = kinds(c, OpKind.SCATTER_ADD)
    assert out.op == "add" and out.operands == (c.input_nodes[0], scatter.id)


def test_gradient_of_lookup_plus_other_use_sums_both():
    c = check_against_jax(jax.grad(lambda t, i: jnp.sum(t[i]) + jnp.sum(t * t)), TABLE, IDS)
    assert len(kinds(c, OpKind.SCATTER_ADD)) == 1


def _take_along_last(logp, labels):
    return jnp.take_along_axis(logp, labels[..., None], axis=-1)


def _pick_with_aranges(logp, labels):
    b, t = labels.shape
    return logp[jnp.arange(b)[:, None], jnp.arange(t)[None, :], labels]


@pytest.mark.parametrize("pick", [_take_along_last, _pick_with_aranges], ids=["take_along_axis", "arange_index"])
def test_label_pick_is_a_batched_gather_and_its_gradient_a_scatter(pick):
    c = check_against_jax(pick, LOGP, LABELS)
    assert take_attrs(c, OpKind.GATHER) == [(2, 2)] and kinds(c, OpKind.TRANSPOSE) == []
    g = check_against_jax(jax.grad(lambda x, y: jnp.sum(pick(x, y) ** 2)), LOGP, LABELS)
    assert take_attrs(g, OpKind.GATHER) == take_attrs(g, OpKind.SCATTER_ADD) == [(2, 2)]


def test_flat_arange_index_is_a_batched_gather():
    logp, labels = LOGP.reshape(8, 5), LABELS.reshape(8)
    c = check_against_jax(jax.grad(lambda x, y: -jnp.mean(x[jnp.arange(8), y] ** 3)), logp, labels)
    assert take_attrs(c, OpKind.GATHER) == take_attrs(c, OpKind.SCATTER_ADD) == [(1, 1)]


def test_out_of_range_labels_fill_with_nan_and_clip_mode_clamps():
    bad = jnp.array([[1, 7, -9, 0], [5, 3, -1, 2]], jnp.int32)  # 7, -9 (-> -4) and 5 are out of range
    c = check_against_jax(_take_along_last, LOGP, bad)
    assert np.isnan(c.graph.nodes[c.output_nodes[0]].attr("fill_value"))
    assert np.isnan(run_graph(c, LOGP, bad)[0]).sum() == 3
    clipped = check_against_jax(lambda t, i: t.at[i].get(mode="clip"), TABLE, jnp.array([7, -3, 2], jnp.int32))
    assert [n.attr("fill_value") for n in kinds(clipped, OpKind.GATHER)] == [None]


@pytest.mark.parametrize(("fn", "args"), [
    (lambda x, i: jnp.take_along_axis(x, i, axis=0), (LOGP[0].T, LABELS[:1])),
    (lambda x, i: jnp.take(x, i, axis=1), (LOGP, jnp.array([0, 4, 2], jnp.int32))),
], ids=["take_along_axis_0", "take_axis_1"])
def test_gathers_along_other_dims_map_with_transposes(fn, args):
    check_against_jax(fn, *args)
    c = check_against_jax(jax.grad(lambda x, i: jnp.sum(fn(x, i) ** 2)), *args)
    assert len(kinds(c, OpKind.GATHER)) == len(kinds(c, OpKind.SCATTER_ADD)) == 1


@pytest.mark.parametrize(("fn", "name"), [
    (lambda t, i: t[i, i], "gather"),  # two gathered dims
    (lambda t, i: t.at[i].set(1.0), "scatter"),
    (lambda t, i: t.at[i].add(1.0, mode="clip"), "scatter-add"),  # the IR's scatter drops, clip clamps
], ids=["two_index_arrays", "scatter_set", "clip_scatter_add"])
def test_other_gathers_and_scatters_stay_opaque(fn, name):
    with pytest.warns(UnsupportedPrimitiveWarning, match=rf"primitive\(s\) {name};"):
        c = capture(fn, TABLE, jnp.array([1, 2], jnp.int32))
    assert c.unsupported == (name,) and [n.op for n in kinds(c, OpKind.OPAQUE)] == [name]


def cross_entropy(params, tokens, labels):
    """Embedding lookup, a vocabulary projection and the label pick of a softmax cross-entropy."""
    logits = jnp.take(params["emb"], tokens, axis=0) @ params["w"]
    return -jnp.mean(_take_along_last(jax.nn.log_softmax(logits), labels))


def test_cross_entropy_gradient_runs_sharded_as_planned():
    k = jax.random.split(jax.random.key(0), 4)
    params = {"emb": jax.random.normal(k[0], (512, 32)), "w": jax.random.normal(k[1], (32, 512)) / 32 ** 0.5}
    tokens, labels = (jax.random.randint(key, (8, 16), 0, 512) for key in k[2:])
    step = jax.value_and_grad(cross_entropy)
    c = check_against_jax(step, params, tokens, labels)
    options = IntraOptions(cost=CostModel(flops_per_second=1e9), memory_budget=1.5e5)  # forces splits
    plan = solve_intra(c.graph, LogicalMesh((2, 4), (1e-5, 1e-5), (1e-9, 1e-9)), options)
    picks = [n.id for n in c.graph.nodes if n.kind in (OpKind.GATHER, OpKind.SCATTER_ADD) and n.attr("batch_dims")]
    assert len(picks) == 2 and all(not plan.strategy(n).output.is_replicated for n in picks)
    got = execute_sharded(c, plan, make_jax_mesh(plan.mesh))(params, tokens, labels)
    for value, expected in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(jax.jit(step)(
            params, tokens, labels)), strict=True):
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)


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
