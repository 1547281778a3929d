"""Pipeshard with planned (intra-op) stages: six training programs cut into two pipeline stages
train for 3 steps exactly like one device; the planner's stage layouts are really applied; the
inter-op search ("auto" stages) picks the pipeline it predicts best.

Tolerances: float32, rtol 1e-5 plus atol 1e-5 near zero on losses and params over 3 steps, and
at every step the pipelined grads equal one device's grads at the same params (atol 1e-6).
Adam's params after 3 steps get atol 2 * lr: micro-batches sum gradients in another order
(~1e-7), and Adam scales each element's step by its own gradient, so an element whose gradient
is below that noise (one of the GPT's is -5e-9) takes a step of +-lr with a random sign.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_models import transformer_args, transformer_block
from meshplan.cluster import Cluster
from meshplan.cluster.devices import DeviceSpec
from meshplan.errors import MeshError
from meshplan.inter.schedules import pipeline_latency
from meshplan.parallel import PipeshardParallel, PipeshardStage, parallelize
from meshplan.plan import Plan
from meshplan.report.pipeshard_text import pipeshard_text
from meshplan.runtime import mark_pipeline_boundary

STEPS, LR, TOL = 3, 0.05, dict(rtol=1e-5, atol=1e-5)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _normal(key, shape):
    return jax.random.normal(key, shape) / shape[0] ** 0.5


# --- six programs as (loss with one boundary, params per layer, x, targets, update) ---------------

def _sgd(params, grads, state):
    return jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads), state


def _mlp(act):
    def loss(params, x, y):
        first, second = params
        h = mark_pipeline_boundary(act(x @ first["w1"] + first["b1"]))
        return jnp.mean((h @ second["w2"] - y) ** 2)
    return loss


def _mlp_data(batch=16, d_in=128, hidden=256, d_out=64):
    k = jax.random.split(jax.random.key(0), 4)
    params = [{"w1": _normal(k[0], (d_in, hidden)), "b1": jnp.zeros((hidden,))}, {"w2": _normal(k[1], (hidden, d_out))}]
    return params, jax.random.normal(k[2], (batch, d_in)), jax.random.normal(k[3], (batch, d_out))


def mlp_program():
    return _mlp(jax.nn.relu), *_mlp_data(), _sgd


def gelu_program():
    return _mlp(lambda h: jax.nn.gelu(h, approximate=False)), *_mlp_data(), _sgd


def remat_program():
    def loss(params, x, y):
        first, second = params
        h = jax.checkpoint(lambda x, w, b: jnp.tanh(x @ w + b))(x, first["w1"], first["b1"])
        return jnp.mean((mark_pipeline_boundary(h) @ second["w2"] - y) ** 2)
    return loss, *_mlp_data(), _sgd


def transformer_program():
    def loss(params, x, y):
        h = mark_pipeline_boundary(transformer_block(params[0], x))
        return jnp.mean((transformer_block(params[1], h) - y) ** 2)
    (first, x), (second, y) = transformer_args(8, 16, 64, 256, seed=0), transformer_args(8, 16, 64, 256, seed=1)
    return loss, [first, second], x, y, _sgd


def embedding_program(batch=16, vocab=256, dim=64, classes=32):
    def loss(params, tokens, labels):
        h = mark_pipeline_boundary(jnp.take(params[0]["emb"], tokens, axis=0))
        logits = h @ params[1]["w"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))
    k = jax.random.split(jax.random.key(1), 4)
    params = [{"emb": jax.random.normal(k[0], (vocab, dim))}, {"w": _normal(k[1], (dim, classes))}]
    return (loss, params, jax.random.randint(k[2], (batch,), 0, vocab),
            jax.random.randint(k[3], (batch,), 0, classes), _sgd)


def gpt_program(batch=8, vocab=64, seq=16, hidden=64, ffn=128):
    """A two-block GPT, one block per stage, next-token cross-entropy, optax Adam."""
    def loss(params, tokens, targets):
        first, second = params
        h = jnp.take(first["wte"], tokens, axis=0) + first["wpe"]
        h = mark_pipeline_boundary(transformer_block(first["block"], h))
        logits = transformer_block(second["block"], h) @ second["head"]
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    k = jax.random.split(jax.random.key(2), 4)
    params = [{"wte": 0.1 * jax.random.normal(k[0], (vocab, hidden)),
               "wpe": 0.1 * jax.random.normal(k[1], (seq, hidden)),
               "block": transformer_args(1, seq, hidden, ffn, 2)[0]},
              {"block": transformer_args(1, seq, hidden, ffn, 3)[0], "head": _normal(k[2], (hidden, vocab))}]
    tokens = jax.random.randint(k[3], (batch, seq + 1), 0, vocab)
    tx = optax.adam(1e-3)

    def adam(p, g, state):
        state = tx.init(p) if state is None else state
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state

    return loss, params, tokens[:, :-1], tokens[:, 1:], adam


PROGRAMS = {"mlp": mlp_program, "transformer": transformer_program, "gpt_adam": gpt_program,
            "embedding": embedding_program, "gelu": gelu_program, "remat": remat_program}


@functools.cache
def program_of(name):
    """PROGRAMS[name]() built once: the stage meshes and auto stages of one program share its one-device runs."""
    return PROGRAMS[name]()


@functools.cache
def one_device_value_and_grad(name):
    return jax.jit(jax.value_and_grad(program_of(name)[0]))


def train_pipelined(f, name):
    """3 steps: pipelined loss and grads (checked against one device's at the same params), then
    `update` per layer on the layer's stage devices."""
    _, params, x, y, update = program_of(name)
    states, losses = [None] * len(params), []
    for _ in range(STEPS):
        loss, grads = f(params, x, y)
        want_loss, want_grads = one_device_value_and_grad(name)(*jax.device_put((params, x, y), jax.devices()[0]))
        np.testing.assert_allclose(float(loss), float(want_loss), **TOL)
        for g, w in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
        step = jax.jit(update)
        new = []
        for k, (p, g) in enumerate(zip(params, grads, strict=True)):
            p = jax.tree_util.tree_map(lambda a, b: jax.device_put(a, b.sharding), p, g)
            p, states[k] = step(p, g, states[k])
            new.append(p)
        params = new
        losses.append(float(loss))
    return params, losses


@functools.cache
def train_single_device(name):
    """The reference: 3 steps on one device, run once per program."""
    _, params, x, y, update = program_of(name)
    params, x, y = jax.device_put((params, x, y), jax.devices()[0])
    states, losses = [None] * len(params), []
    for _ in range(STEPS):
        loss, grads = one_device_value_and_grad(name)(params, x, y)
        stepped = [jax.jit(update)(p, g, s) for p, g, s in zip(params, grads, states, strict=True)]
        params, states = [p for p, _ in stepped], [s for _, s in stepped]
        losses.append(float(loss))
    return params, losses


PARAM_TOL = {"gpt_adam": dict(rtol=1e-5, atol=2e-3)}  # 2 * Adam's lr, see the module docstring


def assert_same_training(method, program):
    f = parallelize(program_of(program)[0], method=method)
    got, got_losses = train_pipelined(f, program)
    want, want_losses = train_single_device(program)
    np.testing.assert_allclose(got_losses, want_losses, **TOL)
    for value, expected in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(value), np.asarray(expected), **PARAM_TOL.get(program, TOL))
    return f


# --- numerics -----------------------------------------------------------------------------------

@pytest.mark.parametrize("stage_mesh", [(4, 1), (1, 4), (2, 2)], ids=["4x1", "1x4", "2x2"])
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_planned_stages_train_like_one_device(program, stage_mesh):
    """Two stages of 4 devices each (the (8,1), (1,8), (2,4), (4,2) meshes cut in two)."""
    method = PipeshardParallel(2, schedule="1f1b", stage_mesh_shape=stage_mesh)
    f = assert_same_training(method, program)
    plan = f.get_plan()
    assert [s.logical_mesh for s in plan.stages] == [stage_mesh, stage_mesh]
    assert all(s.intra_plan.mesh.shape == stage_mesh for s in plan.stages)
    if stage_mesh == (2, 2):
        assert_collectives_as_planned(f)


def assert_collectives_as_planned(f):
    """Every stage's forward and backward executables run exactly its plan's collectives."""
    checks = f.get_collectives()
    assert len(checks) == len(f.get_plan().stages)
    for check in checks:
        assert check.agrees, (check.missing, check.unplanned)
    return checks


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_auto_stages_train_like_one_device(program):
    f = assert_same_training(PipeshardParallel(2, stages="auto", schedule="gpipe"), program)
    stages = f.get_plan().stages
    assert stages[0].first_layer == 0 and stages[-1].last_layer == 1 and sum(len(s.devices) for s in stages) == 8


# --- the plan is what runs ------------------------------------------------------------------------

def wide_mlp_loss(params, x, y):
    h = mark_pipeline_boundary(jnp.tanh(x @ params[0]["w1"]))
    return jnp.mean((jnp.tanh(h @ params[1]["w2"]) @ params[1]["w3"] - y) ** 2)


def wide_mlp(batch=8, width=1024):
    k = jax.random.split(jax.random.key(4), 5)
    params = [{"w1": _normal(k[0], (width, width))},
              {"w2": _normal(k[1], (width, width)), "w3": _normal(k[2], (width, width))}]
    return params, jax.random.normal(k[3], (batch, width)), jax.random.normal(k[4], (batch, width))


def _wide_mlp_like_one_device(loss_fn):
    """`loss_fn` on the wide MLP's data under 2 pipeshard stages of (1, 4), its loss and gradients
    checked against one device; the parallel function and its gradients."""
    params, x, y = wide_mlp()
    f = parallelize(loss_fn, method=PipeshardParallel(2, stage_mesh_shape=(1, 4)))
    loss, grads = f(params, x, y)
    want_loss, want_grads = jax.jit(jax.value_and_grad(loss_fn))(params, x, y)
    np.testing.assert_allclose(float(loss), float(want_loss), **TOL)
    for g, w in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)
    return f, grads


def test_planned_stage_shards_weights_as_its_plan_says():
    """Big weights, tiny micro-batches: the stage plans split the contractions over the weights'
    columns (Megatron-style; gradient all-reduces of 4 MB weights would cost more than
    all-reducing 4-row activations), so weight gradients come back split, in exactly the planned
    layouts, numerically equal to one device."""
    f, grads = _wide_mlp_like_one_device(wide_mlp_loss)
    for k, layout in enumerate(f.get_layouts()):
        leaves = jax.tree_util.tree_leaves(grads[k])
        assert not all(leaf.sharding.is_fully_replicated for leaf in leaves)
        for leaf, planned in zip(leaves, jax.tree_util.tree_leaves(layout.param_grads), strict=True):
            assert leaf.sharding.is_equivalent_to(planned, leaf.ndim)
    checks = assert_collectives_as_planned(f)
    assert any(check.planned for check in checks)  # the column splits' all-reduces


def remat_wide_mlp_loss(params, x, y):
    """The wide MLP's first stage as a `jax.checkpoint` body reading its weight twice."""
    h = mark_pipeline_boundary(jax.checkpoint(lambda x, w: jnp.tanh(jnp.tanh(x @ w) @ w))(x, params[0]["w1"]))
    return jnp.mean((jnp.tanh(h @ params[1]["w2"]) @ params[1]["w3"] - y) ** 2)


def test_remat_body_runs_its_plan():
    """Inside a checkpoint body the recomputed forward and its backward keep the plan's layouts.
    Unpinned, the body's backward ran all-reduces the plan does not have; with its values pinned
    but not its inputs, XLA split the whole input for the recompute and gathered it again (16
    KB); with a plain constraint on the weight, it gathered the weight's split cotangent (4 MB)."""
    f, grads = _wide_mlp_like_one_device(remat_wide_mlp_loss)
    checks = assert_collectives_as_planned(f)
    assert checks[0].planned  # the body's planned gather of its first activation


def test_explicit_stage_with_layer_range_and_mesh_shape():
    params, x, y = wide_mlp(width=64)
    stages = (PipeshardStage(layers=(0, 1), devices=(6, 2, 4, 0), mesh_shape=(2, 2)),)
    f = parallelize(wide_mlp_loss, method=PipeshardParallel(4, stages=stages))
    loss, grads = f(params, x, y)
    want_loss, _ = jax.jit(jax.value_and_grad(wide_mlp_loss))(params, x, y)
    np.testing.assert_allclose(float(loss), float(want_loss), **TOL)
    devices = {d for leaf in jax.tree_util.tree_leaves(grads) for d in leaf.sharding.device_set}
    assert devices == {jax.devices()[i] for i in (0, 2, 4, 6)}
    assert f.get_plan().stages[0].logical_mesh == (2, 2)


# --- the inter-op search ---------------------------------------------------------------------------

def test_search_picks_the_best_predicted_pipeline():
    """The chosen stages' predicted latency is the 1F1B formula of their stage latencies, and no
    worse than the single stage over all 8 devices (a candidate the DP must have compared)."""
    params, x, y = wide_mlp(width=256)
    f = parallelize(wide_mlp_loss, method=PipeshardParallel(4, stages="auto"))
    f(params, x, y)
    search, plan = f.get_stage_search(), f.get_plan()
    latency = search.inter.pipeline_time
    assert latency == pytest.approx(pipeline_latency([s.latency for s in search.inter.stages], 4))
    whole = [(8,), (2, 4), (4, 2)]  # the logical views of one sub-mesh of all 8 devices
    one_stage = min(sum(search.layer_times(k)[view] for k in range(2)) for view in whole)
    assert latency <= 4 * one_stage * (1 + 1e-9)
    used = sorted(i for s in search.stages for i in s.devices)
    assert used == list(range(8))
    assert plan.prediction.pipeline_time_s == latency and plan.option("stages") == "auto"
    assert [s.latency_s for s in plan.stages] == [s.latency for s in search.inter.stages]
    assert Plan.from_json(plan.to_json()) == plan
    text = pipeshard_text(plan)
    assert f"predicted step latency {latency * 1e3:.3f} ms" in text
    assert text.count("\nstage ") == len(search.stages) and "stage 0: layer(s) 0" in text
    assert "args[0][0]['w1']" in text and " grad " in text  # every stage lists its params' layouts


def memory_cluster(memory_bytes):
    """8 local devices in one node with the placeholder link costs and `memory_bytes` each."""
    return Cluster(1, 8, DeviceSpec("small", 1e11, memory_bytes, 1e9, 1e-5, 1e9, 1e-5))


def test_search_keeps_every_stage_within_the_memory_per_device():
    """Layer 1 holds 8 MB of weights and 8 MB of gradients: on a 10 MB device it cannot sit
    whole on one device, so the search gives it a sub-mesh whose plan splits it, and every
    stage's plan stays within 10 MB."""
    params, x, y = wide_mlp(width=1024)
    budget = 10e6
    f = parallelize(wide_mlp_loss, method=PipeshardParallel(4, stages="auto"), cluster=memory_cluster(budget))
    loss, _ = f(params, x, y)
    np.testing.assert_allclose(float(loss), float(jax.jit(wide_mlp_loss)(params, x, y)), **TOL)
    plan = f.get_plan()
    assert all(s.intra_plan.peak_memory <= budget for s in plan.stages)
    assert all(s.intra_plan.mesh.memory_per_device == budget for s in plan.stages)
    assert all(s.memory_bytes <= budget for s in plan.stages)  # the inter-op pass's memory rule
    holder = next(s for s in plan.stages if s.first_layer <= 1 <= s.last_layer)
    assert len(holder.devices) > 1
    assert math.isinf(f.get_stage_search().layer_times(1)[(1,)])  # whole on one device does not fit
    assert math.isinf(dict(plan.metrics)["layer_s.1.1"])
    with pytest.raises(MeshError, match=r"no pipeline of the 2 layers on 8 devices fits in 0.001 GB per device"):
        parallelize(wide_mlp_loss, method=PipeshardParallel(4, stages="auto"), cluster=memory_cluster(1e6))(
            params, x, y)


def tokens_mlp_loss(params, x, y):
    return jnp.mean((jnp.tanh(jnp.tanh(x @ params[0]["w1"]) @ params[0]["w2"]) - y) ** 2)


def test_search_with_three_axis_views_runs_a_2x2x2_stage_like_one_device():
    """`mesh_axes=3`: the runtime's stage pricer also prices the 3-D view of the 8-device sub-mesh,
    (2, 2, 2), as the simulator's stage search does. Two nodes of 4 with slow links between them
    and latency-free links inside (so splitting the node's 4 devices into 2 x 2 costs no extra
    step), micro-batches of 2 sequences of 256 tokens: the 3-D view (batch over the nodes, two
    ways to split inside the node) is predicted fastest, runs as one stage on a 2x2x2 JAX mesh,
    equals one device, and its compiled collectives are the planned ones."""
    k = jax.random.split(jax.random.key(5), 4)
    params = [{"w1": _normal(k[0], (512, 512)), "w2": _normal(k[1], (512, 512))}]
    x, y = jax.random.normal(k[2], (4, 256, 512)), jax.random.normal(k[3], (4, 256, 512))
    cluster = Cluster(2, 4, DeviceSpec("two nodes", 1e11, 1e12, 1e11, 0.0, 1e8, 1e-5))
    f = parallelize(tokens_mlp_loss, method=PipeshardParallel(2, stages="auto", mesh_axes=3), cluster=cluster)
    loss, grads = f(params, x, y)
    want_loss, want_grads = jax.jit(jax.value_and_grad(tokens_mlp_loss))(params, x, y)
    np.testing.assert_allclose(float(loss), float(want_loss), **TOL)
    for g, w in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    times = f.get_stage_search().layer_times(0)
    assert (2, 2, 2) in times and times[(2, 2, 2)] < min(t for view, t in times.items() if view != (2, 2, 2))
    (stage,) = f.get_plan().stages
    assert stage.intra_plan.mesh.shape == (2, 2, 2)
    layout = f.get_layouts()[0]
    assert {a for c in layout.plan.nodes for a in c.output.axes()} == {0, 1, 2}
    mesh = jax.tree_util.tree_leaves(layout.params)[0].mesh
    assert mesh.axis_names == ("x", "y", "z")
    (check,) = assert_collectives_as_planned(f)
    assert len(check.planned) >= 3  # the loss's all-reduce and the backward's conversions and partial sums
    assert any(row.axes and len(row.axes) > 1 and row.compiled for row in check.rows)  # over two axes at once
