"""Whole-step pipeshard: `parallelize(step, method=PipeshardParallel(...))` on a train step that takes
its gradient and applies its optimizer itself equals the step on one device.

Covers the pieces (layer clustering against brute force, gradient marking, the loss cut into
layers) and the whole: an MLP with AdamW and SGD on 2 and 4 stages, tied embeddings with global
gradient clipping, manual marks, automatic stages, steps written with jax.grad, jax.jit and work
before the gradient, and the errors a wrong configuration gets.
Tolerances: SGD steps and losses rel. 1e-5, AdamW steps 1e-4 (the issue's bounds).
"""

from __future__ import annotations

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from meshplan.errors import MeshError, MeshplanError, OptionsError, PlanMismatchError
from meshplan.inter import cluster_layers, layer_flops
from meshplan.parallel import PipeshardParallel, parallelize
from meshplan.report.pipeshard_text import pipeshard_text
from meshplan.runtime import mark_pipeline_boundary
from meshplan.runtime.gradient import gradient_calls, trace_with_gradients
from meshplan.runtime.loss_layers import split_loss

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# --- layer clustering ------------------------------------------------------------------------------

def brute_force_layers(flops, cut_bytes, num_layers, tolerance=0.1):
    """Every choice of cuts: the least bottleneck, then the fewest bytes within (1 + tolerance) of it."""
    work, total = np.asarray(flops, float), float(np.sum(flops))
    anchors = work >= min(total / (10 * num_layers), float(np.sort(work)[-num_layers]))
    choices = []
    for cuts in itertools.combinations(range(1, len(work)), num_layers - 1):
        bounds = list(zip((0, *cuts), (*cuts, len(work)), strict=True))
        if all(anchors[a:b].any() for a, b in bounds):
            choices.append((max(work[a:b].sum() for a, b in bounds), sum(cut_bytes[c] for c in cuts)))
    cap = (1 + tolerance) * min(c[0] for c in choices)
    return min(b for heaviest, b in choices if heaviest <= cap * (1 + 1e-9)), cap


@pytest.mark.parametrize("seed", range(12))
def test_cluster_layers_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, layers = int(rng.integers(5, 10)), int(rng.integers(2, 4))
    flops = rng.choice([0.0, 1.0, 5.0, 40.0, 100.0], size=n)
    flops[rng.integers(n)] = 100.0
    flops[rng.integers(n)] = 40.0
    cut_bytes = rng.integers(1, 50, size=n).astype(float)
    starts = cluster_layers(flops, cut_bytes, layers)
    want, cap = brute_force_layers(flops, cut_bytes, layers)
    assert starts[0] == 0 and len(starts) == layers and list(starts) == sorted(set(starts))
    assert sum(cut_bytes[c] for c in starts[1:]) == want
    assert max(layer_flops(flops, starts)) <= cap * (1 + 1e-9)


def test_cluster_layers_balances_equal_blocks_and_cuts_where_least_crosses():
    # four equal blocks of (matmul, 3 elementwise ops); inside a block 10x more bytes cross than between blocks
    flops = [100.0, 1.0, 1.0, 1.0] * 4
    cut_bytes = [0.0] + [10.0 if i % 4 else 1.0 for i in range(1, 16)]
    assert cluster_layers(flops, cut_bytes, 4) == (0, 4, 8, 12)
    assert cluster_layers(flops, cut_bytes, 2) == (0, 8)


def test_cluster_layers_never_leaves_a_layer_of_light_ops():
    flops = [1000.0, 5.0, 1000.0, 3.0, 1.0, 1.0]  # two matmuls, then a cheap tail that crosses nothing
    cut_bytes = [0.0, 100.0, 100.0, 100.0, 0.0, 0.0]
    starts = cluster_layers(flops, cut_bytes, 2)
    assert all(f >= 1000 for f in layer_flops(flops, starts))


def test_cluster_layers_refuses_more_layers_than_operators():
    with pytest.raises(OptionsError, match="at most 2 layers"):
        cluster_layers([3.0, 0.0, 4.0], [0.0, 1.0, 1.0], 3)


# --- a model and its step ----------------------------------------------------------------------------

def mlp_params(depth=4, width=32, d_out=8, seed=0):
    k = jax.random.split(jax.random.key(seed), depth + 1)
    return {"layers": [{"w": jax.random.normal(k[i], (width, width)) / width ** 0.5, "b": jnp.zeros(width)}
                       for i in range(depth)],
            "out": jax.random.normal(k[-1], (width, d_out)) / width ** 0.5}


def mlp_loss(params, x, y):
    h = x
    for layer in params["layers"]:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    return jnp.mean((h @ params["out"] - y) ** 2)


def regression_data(batch=16, width=32, d_out=8):
    kx, ky = jax.random.split(jax.random.key(7))
    return jax.random.normal(kx, (batch, width)), jax.random.normal(ky, (batch, d_out))


def optax_step(loss_fn, optimizer):
    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}
    return step


def train(step, state, batch, steps=3):
    losses = []
    for _ in range(steps):
        *state, metrics = step(*state, *batch)
        losses.append(float(metrics["loss"] if isinstance(metrics, dict) else metrics))
    return state, losses


def assert_same_training(parallel, step, state, batch, tol):
    got, got_losses = train(parallel, state, batch)
    want, want_losses = train(jax.jit(step), jax.device_put(state, jax.devices()[0]), batch)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5, atol=1e-5)
    flat_got, flat_want = jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(want)
    for (path, value), expected in zip(flat_got, flat_want, strict=True):
        np.testing.assert_allclose(value, expected, rtol=tol, atol=tol, err_msg=jax.tree_util.keystr(path))
    return got


# --- gradient marking and the loss cut into layers -----------------------------------------------

def test_gradient_calls_are_marked_only_while_meshplan_traces():
    step, params = optax_step(mlp_loss, optax.sgd(0.1)), mlp_params()
    state = (params, optax.sgd(0.1).init(params), *regression_data())
    original = jax.grad, jax.value_and_grad
    closed, _ = trace_with_gradients(step, state)
    assert (jax.grad, jax.value_and_grad) == original
    (call,) = gradient_calls(closed.jaxpr)
    assert sum(call.differentiated) == len(jax.tree_util.tree_leaves(params))
    assert gradient_calls(jax.make_jaxpr(step)(*state).jaxpr) == []  # plain tracing is untouched
    # the marked program still runs: the gradient equation evaluates value_and_grad of its loss
    got = jax.jit(jax.extend.core.jaxpr_as_fun(closed))(*jax.tree_util.tree_leaves(state))
    want = jax.tree_util.tree_leaves(jax.jit(step)(*state))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_gradient_of_constants_is_left_to_jax():
    def step(p, x):
        scale = jax.grad(lambda a: a ** 2)(3.0)  # concrete while tracing: evaluated by JAX, not marked
        value, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p) ** 2) * scale)(p)
        return p - grads, value
    closed, _ = trace_with_gradients(step, (jnp.ones((4, 2)), jnp.ones((8, 4))))
    assert len(gradient_calls(closed.jaxpr)) == 1


def test_patch_is_restored_when_the_step_raises():
    def broken(params, x):
        jax.grad(lambda p: jnp.sum(p * x))(params)
        raise ValueError("inside the step")
    original = jax.grad, jax.value_and_grad
    with pytest.raises(ValueError, match="inside the step"):
        trace_with_gradients(broken, (jnp.ones(3), jnp.ones(3)))
    assert (jax.grad, jax.value_and_grad) == original


@pytest.mark.parametrize("num_layers", [2, 3, 5])
def test_split_loss_layers_chain_to_the_loss(num_layers):
    params, (x, y) = mlp_params(), regression_data()
    leaves = jax.tree_util.tree_leaves((params, x, y))
    closed = jax.make_jaxpr(lambda *flat: mlp_loss(*jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure((params, x, y)), flat)))(*leaves)
    weights = range(len(jax.tree_util.tree_leaves(params)))
    layers = split_loss(closed, weights, num_layers)
    assert layers.num_layers == num_layers and not layers.marked
    assert sorted({w for ws in layers.weights for w in ws}) == list(weights)  # every weight is read somewhere
    matmul = 2 * 16 * 32 * 32  # five matmuls: the heaviest layer holds ceil(5 / num_layers) of them
    assert max(layers.flops) <= 1.1 * (-(-5 // num_layers) * matmul + 16 * 32 * 5)
    act = tuple(leaves[len(weights):])
    for k, fn in enumerate(layers.fns):
        w = tuple(leaves[i] for i in layers.weights[k])
        act = fn(w, act, ()) if k == num_layers - 1 else fn(w, act)
    np.testing.assert_allclose(act, mlp_loss(params, x, y), rtol=1e-6)


# --- whole steps equal one device -----------------------------------------------------------------

@pytest.mark.parametrize("layers", [2, 4])
def test_adamw_mlp_step_on_2_and_4_stages(layers):
    optimizer = optax.adamw(1e-2)
    step, params = optax_step(mlp_loss, optimizer), mlp_params()
    parallel = parallelize(step, method=PipeshardParallel(4, layers=layers))
    new_params, new_state = assert_same_training(parallel, step, (params, optimizer.init(params)),
                                                 regression_data(), tol=1e-4)
    plan = parallel.get_plan()
    assert len(plan.stages) == layers and plan.option("stages") == "uniform" and plan.option("layers") == "flops"
    assert f"stage {layers - 1}" in pipeshard_text(plan)
    flops = [value for name, value in plan.metrics if name.startswith("layer_flops.")]
    assert len(flops) == layers and max(flops) <= 1.1 * -(-5 // layers) * (2 * 4 * 32 * 32 + 4 * 32 * 3)
    per = 8 // layers
    for layer in new_params["layers"] + [{"out": new_params["out"]}]:  # each weight updated on one stage's devices
        device_sets = {frozenset(leaf.sharding.device_set) for leaf in jax.tree_util.tree_leaves(layer)}
        assert all(len(s) == per for s in device_sets)
    assert len(parallel.last_events) == 2 * 4 * layers


def test_a_plan_from_get_plan_runs_again_and_a_mismatched_one_is_refused(tmp_path):
    """PipeshardParallel(plan=FILE) runs get_plan()'s stages with their intra-op plans as they are
    (not solved again: the solver's recorded wall time comes back), equal to one device; a plan made
    for other shapes, micro-batches or layers is refused naming the difference."""
    optimizer = optax.sgd(0.1)
    step, params = optax_step(mlp_loss, optimizer), mlp_params()
    state, batch = (params, optimizer.init(params)), regression_data()
    first = parallelize(step, method=PipeshardParallel(2, layers=4))
    first(*state, *batch)
    path = tmp_path / "plan.json"
    path.write_text(first.get_plan().to_json())
    again = parallelize(step, method=PipeshardParallel(2, plan=str(path)))
    assert_same_training(again, step, state, batch, tol=1e-5)
    planned, reused = first.get_plan(), again.get_plan()
    assert reused.option("stages") == "plan"
    assert [(s.first_layer, s.last_layer, s.devices, s.logical_mesh) for s in reused.stages] == [
        (s.first_layer, s.last_layer, s.devices, s.logical_mesh) for s in planned.stages]
    assert [s.intra_plan.to_dict() for s in reused.stages] == [s.intra_plan.to_dict() for s in planned.stages]

    wide = mlp_params(width=48)
    wide_state, wide_batch = (wide, optimizer.init(wide)), regression_data(width=48)
    with pytest.raises(PlanMismatchError, match=r"does not fit step: stage 0's operator 0 \(.*\) was planned as "
                                                r"parameter \[32, 32\] but is parameter \[48, 48\] in step"):
        parallelize(step, method=PipeshardParallel(2, plan=path))(*wide_state, *wide_batch)
    with pytest.raises(PlanMismatchError, match="it runs 2 micro-batches but PipeshardParallel"
                                                r"\(num_micro_batches=4\); pass num_micro_batches=2"):
        parallelize(step, method=PipeshardParallel(4, plan=path))(*state, *batch)
    with pytest.raises(PlanMismatchError, match=r"cuts the program into 4 layers but PipeshardParallel\(layers=2\)"):
        parallelize(step, method=PipeshardParallel(2, layers=2, plan=path))(*state, *batch)


@pytest.mark.parametrize(("schedule", "stage_sharding"),
                         [("gpipe", "auto"), ("1f1b", "auto"), ("1f1b", "data_parallel"), ("gpipe", "replicated")])
def test_sgd_mlp_step_at_1e_5(schedule, stage_sharding):
    optimizer = optax.sgd(0.1)
    step, params = optax_step(mlp_loss, optimizer), mlp_params()
    method = PipeshardParallel(2, layers=4, schedule=schedule, stage_sharding=stage_sharding)
    parallel = parallelize(step, method=method)
    assert_same_training(parallel, step, (params, optimizer.init(params)), regression_data(), tol=1e-5)


def tied_lm(vocab=64, dim=32, depth=3, seed=0):
    k = jax.random.split(jax.random.key(seed), depth + 1)
    params = {"emb": jax.random.normal(k[0], (vocab, dim)),
              "blocks": [{"w": jax.random.normal(k[i + 1], (dim, dim)) / dim ** 0.5} for i in range(depth)]}

    def loss(params, inputs, targets):
        h = jnp.take(params["emb"], inputs, axis=0)
        for block in params["blocks"]:
            h = h + jnp.tanh(h @ block["w"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ params["emb"].T, targets).mean()

    return params, loss


def test_tied_embedding_gradients_are_summed_across_stages(tmp_path):
    """The embedding is read by the first and the last stage; clipping by the global norm needs
    every stage's gradients; the tokens are cut into inputs and targets before the gradient."""
    optimizer = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1))
    params, loss = tied_lm()

    def step(state, ids):
        params, opt_state = state
        inputs, targets = ids[:, :-1], ids[:, 1:]
        value, grads = jax.value_and_grad(loss)(params, inputs, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    ids = jax.random.randint(jax.random.key(3), (8, 9), 0, 64)
    parallel = parallelize(step, method=PipeshardParallel(2, layers=4))
    state, want = (params, optimizer.init(params)), (params, optimizer.init(params))
    for _ in range(3):
        state, value = parallel(state, ids)
        want, want_value = jax.jit(step)(want, ids)
        np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    compiled = parallel._last
    emb = len(params["blocks"])  # flat position of params["emb"], after the blocks' weights
    assert compiled.owners[emb] == (0, 3)  # read by the first layer (lookup) and the last (logits)
    assert {p.stage for p in compiled.update.pieces} >= {0, 1, 2}
    files = {path.name: path for path in parallel.dump_debug_info(tmp_path)}
    placements = json.loads(files["placements.json"].read_text())
    assert placements["weight_stages"][str(emb)] == [0, 3] and placements["update"][0]["ops"] > 0


def test_marked_boundaries_in_a_whole_step():
    def loss(params, x, y):
        h = mark_pipeline_boundary(jnp.tanh(x @ params["w1"]))
        h = mark_pipeline_boundary(jnp.tanh(h @ params["w2"]))
        return jnp.mean((h @ params["w3"] - y) ** 2)

    k = jax.random.split(jax.random.key(1), 3)
    params = {f"w{i + 1}": jax.random.normal(k[i], (32, 32 if i < 2 else 8)) / 6 for i in range(3)}
    optimizer = optax.sgd(0.1)
    step = optax_step(loss, optimizer)
    parallel = parallelize(step, method=PipeshardParallel(2, stages=((0, 1, 2, 3), (4, 5), (6, 7))))
    assert_same_training(parallel, step, (params, optimizer.init(params)), regression_data(), tol=1e-5)
    assert parallel._last.layers.marked and parallel._last.layers.num_layers == 3
    assert parallel.get_plan().option("layers") == "marked"
    with pytest.raises(OptionsError, match="marks 3 layers"):
        parallelize(step, method=PipeshardParallel(2, layers=2))(params, optimizer.init(params), *regression_data())


def test_auto_stages_jax_grad_and_a_jitted_step():
    """jax.grad with argnums, a jax.jit-decorated step, and the inter-op pass choosing stages."""
    params, (x, y) = mlp_params(depth=2), regression_data()

    @jax.jit
    def step(params, x, y):
        grads = jax.grad(mlp_loss, argnums=0)(params, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), mlp_loss(params, x, y)

    parallel = parallelize(step, method=PipeshardParallel(2, layers=2, stages="auto"))
    got, want = params, params
    for _ in range(3):
        got, loss = parallel(got, x, y)
        want, want_loss = step(want, x, y)
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    stages = parallel.get_plan().stages
    assert stages[0].first_layer == 0 and stages[-1].last_layer == 1
    assert sum(len(s.devices) for s in stages) == 8


def test_equinox_filter_value_and_grad_closing_over_the_batch():
    """eqx.filter_value_and_grad calls jax.value_and_grad; the loss reads the batch from its closure."""
    import equinox as eqx

    model = eqx.nn.MLP(32, 8, 32, depth=3, activation=jax.nn.gelu, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    optimizer = optax.adamw(1e-3)

    def step(params, opt_state, x, y):
        @eqx.filter_value_and_grad
        def loss(p):
            return jnp.mean((jax.vmap(eqx.combine(p, static))(x) - y) ** 2)

        value, grads = loss(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, value

    parallel = parallelize(step, method=PipeshardParallel(2, layers=2))
    assert_same_training(parallel, step, (params, optimizer.init(params)), regression_data(), tol=1e-4)


def test_aux_values_are_joined_or_averaged_over_micro_batches():
    """has_aux: predictions (per example) are joined along the batch, a float metric is averaged."""
    def loss_with_aux(params, x, y):
        h = x
        for layer in params["layers"]:
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        pred = h @ params["out"]
        return jnp.mean((pred - y) ** 2), {"pred": pred.T, "mae": jnp.mean(jnp.abs(pred - y))}

    optimizer = optax.sgd(0.1)

    def step(params, opt_state, x, y):
        (loss, aux), grads = jax.value_and_grad(loss_with_aux, has_aux=True)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, **aux}

    def grad_step(params, x, y):  # jax.grad(has_aux=True) returns (grads, aux)
        grads, aux = jax.grad(loss_with_aux, has_aux=True)(params, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), aux["mae"]

    params, (x, y) = mlp_params(), regression_data()
    parallel = parallelize(step, method=PipeshardParallel(4, layers=2))
    got = parallel(params, optimizer.init(params), x, y)
    want = jax.jit(step)(params, optimizer.init(params), x, y)
    assert got[2]["pred"].shape == (8, 16)  # (features, batch): joined along dim 1
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    got = parallelize(grad_step, method=PipeshardParallel(2, layers=2))(params, x, y)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(grad_step(params, x, y)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# --- wrong configurations: one clear error each ----------------------------------------------------

def sgd_step(params, x, y):
    loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss


def test_wrong_configurations_give_clear_errors():
    params, (x, y) = mlp_params(depth=1), regression_data()
    cases = [
        (lambda p, x, y: jax.grad(mlp_loss, allow_int=True)(p, x, y), PipeshardParallel(2),
         r"differentiated with \['allow_int'\]"),
        (sgd_step, PipeshardParallel(2, layers=40), "at most"),
        (sgd_step, PipeshardParallel(3), "do not split into 3 equal micro-batches"),
        (lambda p, x, y: (jax.grad(mlp_loss)(p, x, y), jax.grad(mlp_loss)(p, x, y)), PipeshardParallel(2),
         "computes 2 gradients"),
        (lambda p, x, y: jax.grad(mlp_loss)(jax.tree_util.tree_map(lambda a: 2 * a, p), x, y), PipeshardParallel(2),
         "differentiates with respect to a value it computes"),
        (lambda p, x, y: jax.jit(jax.grad(mlp_loss))(p, x, y), PipeshardParallel(2), "nested"),
    ]
    for fn, method, message in cases:
        with pytest.raises(MeshplanError, match=message):
            parallelize(fn, method=method)(params, x, y)
    with pytest.raises(MeshError, match="covers 3 layers but the function has 2"):
        parallelize(sgd_step, method=PipeshardParallel(2, layers=2, stages=((0, 1), (2, 3), (4, 5))))(params, x, y)
    with pytest.raises(OptionsError, match="layers=0"):
        PipeshardParallel(2, layers=0)
    with pytest.raises(OptionsError, match="is a loss function"):
        parallelize(lambda ps, x, y: mlp_loss(ps[0], x, y), method=PipeshardParallel(2, layers=2))([params], x, y)


def test_step_returning_gradients_without_updates_cuts_the_batch_not_the_weights():
    # no updated state to tell weights from batch: the independence proof picks x and y's dim 0
    params, (x, y) = mlp_params(depth=1), regression_data()
    step = lambda p, x, y: jax.value_and_grad(lambda *a: (mlp_loss(*a), jnp.sum(a[1] > 0)), has_aux=True)(p, x, y)
    parallel = parallelize(step, method=PipeshardParallel(2))
    got, want = parallel(params, x, y), jax.jit(step)(params, x, y)
    assert parallel.describe_batch().startswith("args[1] f32[16, 32] (dim 0), args[2] f32[16, 8] (dim 0)")
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
