"""The batch proof (meshplan.ir.independence) and what rests on it: a dim is the batch only if
nothing mixes positions along it before sums end it; a batch that is not so proved is flagged
(UnprovenBatchWarning) and never cut into micro-batches; mark_pipeline_boundary is transparent to
capture and refuses Alpa's no-argument form.

Each case is a small JAX program captured as meshplan plans it; the mixing op is named.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshplan import OptionsError
from meshplan.capture import UnprovenBatchWarning, capture, find_batch_inputs, infer_batch_inputs
from meshplan.ir import GraphBuilder, OpKind
from meshplan.ir.dimflow import trace_dims
from meshplan.ir.independence import Mixing, find_mixing
from meshplan.parallel import DataParallel, PipeshardParallel, parallelize
from meshplan.runtime import mark_pipeline_boundary

KEYS = jax.random.split(jax.random.key(0), 4)
X = jax.random.normal(KEYS[0], (8, 16))
W = jax.random.normal(KEYS[1], (16, 16)) / 4


def mixing(fn, *args, dims):
    """How `fn` mixes positions along dims {argument: dim} ("" when it does not)."""
    c = capture(fn, *args)
    found = find_mixing(c.graph, [(c.input_nodes[i], d) for i, d in dims.items()])
    return "" if found is None else found.describe(c.graph)


def grad_of(loss):
    """The gradient with respect to the weights: the backward pass is checked too."""
    return lambda x, w: jax.grad(loss, argnums=1)(x, w)


def test_examples_of_a_per_example_model_stay_independent_through_its_gradient():
    assert mixing(grad_of(lambda x, w: jnp.mean(jnp.tanh(x @ w) ** 2)), X, W, dims={0: 0}) == ""
    ids, table = jax.random.randint(KEYS[2], (8, 4), 0, 32), jax.random.normal(KEYS[3], (32, 16))
    lookup = lambda ids, t: jax.grad(lambda t: jnp.mean(jnp.tanh(t[ids]) ** 2))(t)  # noqa: E731  (scatter-add back)
    assert mixing(lookup, ids, table, dims={0: 0}) == ""
    round_trip = lambda x, w: jnp.mean(jnp.tanh(x.reshape(-1).reshape(8, 16) @ w))  # noqa: E731
    assert mixing(round_trip, X, W, dims={0: 0}) == ""  # the batch is the major part of the merged dim


def test_a_loss_normalised_by_a_count_over_the_batch_only_scales_it():
    """lm1b's `sum(l * w) / sum(w)`: its gradient multiplies every example by the same scalar."""
    mask = (jnp.arange(8) % 3 > 0).astype(jnp.float32)
    loss = lambda x, m, w: jnp.sum(jnp.mean(jnp.tanh(x @ w) ** 2, axis=1) * m) / jnp.sum(m)  # noqa: E731
    assert mixing(lambda x, m, w: jax.grad(loss, argnums=2)(x, m, w), X, mask, W, dims={0: 0, 1: 0}) == ""


@pytest.mark.parametrize(("name", "fn", "why"), [
    ("attention", lambda x, w: jnp.mean(jax.nn.softmax((x @ w) @ x.T, axis=-1) @ x),
     r"dot f32\[8, 8\] \(%\d+\) holds it on dims 0 and 1"),
    ("softmax over it", lambda x, w: jnp.mean(jax.nn.log_softmax(x @ w, axis=0)), r"takes the max over it"),
    ("centering", lambda x, w: jnp.mean(jnp.tanh(x - x.mean(0)) @ w),
     r"elementwise sub f32\[8, 16\] \(%\d+\) combines it with .*, computed from a sum over it"),
    ("cumsum", lambda x, w: jnp.mean(jnp.cumsum(x @ w, axis=0)), r"runs a cumulative op along it"),
    ("slice", lambda x, w: jnp.mean(x[1:] @ w), r"slice f32\[7, 16\] .* keeps part of it"),
    ("sort", lambda x, w: jnp.mean(jnp.sort(x @ w, axis=0)[0]), r"sorts along it"),
    ("permutation", lambda x, w: jnp.mean(x[jnp.array([3, 1, 2, 0, 4, 5, 7, 6])] @ w), r"indexes along it"),
    ("minor reshape", lambda x, w: jnp.mean(x.T.reshape(-1)), r"merges it into a dim as its minor part"),
    ("contrastive", lambda x, w: jnp.mean(jax.nn.log_softmax((x @ w) @ (x @ w.T).T, axis=1)),
     r"holds it on dims 0 and 1"),
    ("second pass", lambda x, w: jnp.mean(x @ (w - jax.grad(lambda w: jnp.sum(x @ w))(w))),
     r"combines it with .*, computed from a sum over it"),
])
def test_ops_that_mix_positions_along_the_dim_are_named(name, fn, why):
    assert re.search(why, mixing(fn, X, W, dims={0: 0})), name


def test_the_proof_reads_graphs_alone():
    """No JAX: a per-example layer and a mean keep the rows apart; a Gram matrix pairs them."""
    b = GraphBuilder("rows")
    x, w = b.parameter((8, 16), name="x"), b.parameter((16, 4), name="w")
    loss = b.reduce(b.unary("tanh", b.dot(x, w, (1,), (0,))), (0, 1))
    gram = b.reduce(b.dot(x, x, (1,), (1,)), (0, 1))
    b.outputs(loss, gram)
    graph = b.build()
    assert find_mixing(graph, [(x, 0)]) == Mixing(gram - 1, "holds it on dims 0 and 1")
    b = GraphBuilder("mean")
    x, w = b.parameter((8, 16), name="x"), b.parameter((16, 4), name="w")
    b.outputs(b.reduce(b.unary("tanh", b.dot(x, w, (1,), (0,))), (0, 1)))
    assert find_mixing(b.build(), [(x, 0)]) is None


def test_a_leaf_holding_the_dims_twice_mixes_them():
    c = capture(lambda m: jnp.sum(jnp.tanh(m)), jnp.eye(8))
    found = find_mixing(c.graph, [(c.input_nodes[0], 0), (c.input_nodes[0], 1)])
    assert found is not None and found.why == "holds it on dims 0 and 1"


# --- the batch finder on a program whose only candidate is mixed ---------------------------------------

def batch_norm_step(params, x, y):
    """Normalising by the batch's statistics mixes the examples: micro-batches would change it."""
    def loss(p):
        h = x @ p["w1"]
        h = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-5)
        return jnp.mean((jnp.tanh(h) @ p["w2"] - y) ** 2)

    grads = jax.grad(loss)(params)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss(params)


def bn_args():
    params = {"w1": W, "w2": jax.random.normal(KEYS[2], (16, 4)) / 4}
    return params, X, jax.random.normal(KEYS[3], (8, 4))


def test_a_batch_nothing_proves_is_flagged_named_and_still_split_right():
    args = bn_args()
    c = capture(batch_norm_step, *args)
    found = infer_batch_inputs(c)
    assert found.dims == ((2, 0), (3, 0)) and not found.independent  # x's and y's rows, as before
    assert found.explain(c).startswith("args[1] f32[8, 16] (dim 0), args[2] f32[8, 4] (dim 0), inferred: not proved "
                                       "independent: ")
    assert "computed from a sum over it; taken as the candidate reaching the most values" in found.explain(c)
    parallel = parallelize(batch_norm_step, method=DataParallel())
    warning = (r"batch_norm_step: no input dim is proved to hold independent examples, so the batch split is a "
               r"guess: args\[1\] f32\[8, 16\] \(dim 0\).*pass parallelize\(\.\.\., batch_argnums=\(i, \.\.\.\)\)")
    with pytest.warns(UnprovenBatchWarning, match=warning):
        got = parallel(*args)
    want = jax.jit(batch_norm_step)(*args)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert "not proved independent" in parallel.describe_batch()
    with warnings.catch_warnings():  # given by the user: no warning
        warnings.simplefilter("error", UnprovenBatchWarning)
        parallelize(batch_norm_step, method=DataParallel(), batch_argnums=(1, 2))(*args)


def test_micro_batches_are_cut_only_along_a_proved_batch():
    args = bn_args()
    for argnums, how in ((None, "inferred"), ((1, 2), "given by batch_argnums")):
        with pytest.raises(OptionsError, match=rf"PipeshardParallel cuts batch_norm_step's batch into 2 micro-batches "
                                               rf"only along a dim whose examples are independent, and args\[1\] "
                                               rf"f32\[8, 16\] \(dim 0\), args\[2\] f32\[8, 4\] \(dim 0\) \({how}\) is "
                                               rf"not: not proved independent: .*computed from a sum over it.*"
                                               rf"num_micro_batches=1"):
            parallelize(batch_norm_step, method=PipeshardParallel(2), batch_argnums=argnums)(*args)

    def loss_fn(params, x, targets):  # the loss-function form: x and targets are cut along dim 0
        h = mark_pipeline_boundary(x @ params[0])
        h = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-5)
        return jnp.mean((h @ params[1] - targets) ** 2)

    params, x, y = bn_args()
    with pytest.raises(OptionsError, match=r"\(x and targets of a loss function\) is not: not proved independent"):
        parallelize(loss_fn, method=PipeshardParallel(2))([params["w1"], params["w2"]], x, y)


def test_given_batch_argnums_carry_the_proof_verdict():
    c = capture(batch_norm_step, *bn_args())
    given = find_batch_inputs(c, (1, 2), "batch_norm_step")
    assert not given.inferred and not given.independent and given.reason.startswith("not proved independent: ")
    assert given.explain(c).startswith("args[1] f32[8, 16] (dim 0), args[2] f32[8, 4] (dim 0), given by batch_argnums")


def test_an_unused_input_is_no_batch():
    def step(params, x, y, key):  # the key is never used: independent only trivially
        grads = jax.grad(lambda p: jnp.mean((jnp.tanh(x @ p) - y) ** 2))(params)
        return params - 0.1 * grads

    c = capture(step, W, X, jax.random.normal(KEYS[2], (8, 16)), jnp.zeros((64,)))
    found = infer_batch_inputs(c)
    assert found.dims == ((1, 0), (2, 0)) and found.independent


# --- mark_pipeline_boundary ---------------------------------------------------------------------------

def test_pipeline_boundaries_are_transparent_to_capture():
    def loss(w, x, y):
        return jnp.mean((mark_pipeline_boundary(jnp.tanh(x @ w)) @ w - y) ** 2)

    c = capture(loss, W, X, X)
    assert not any(n.kind is OpKind.OPAQUE for n in c.graph.nodes) and c.unsupported == ()
    reached = trace_dims(c.graph, {c.input_nodes[1]: 0})
    assert reached.get(c.output_nodes[0]) is None and any(n in reached for n in c.graph.users(c.input_nodes[2]))


def test_mark_pipeline_boundary_without_arrays_is_an_error():
    for args in ((), ({},)):
        with pytest.raises(OptionsError, match=r"mark_pipeline_boundary\(\) was given no arrays, so it marks nothing.*"
                                               r"`x = mark_pipeline_boundary\(x\)`"):
            mark_pipeline_boundary(*args)
