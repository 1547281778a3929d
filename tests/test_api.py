"""parallelize: plain-JAX training steps run sharded on 8 fake CPU devices match one device.

Tolerances: float32, rtol 1e-5 plus atol 1e-5 for elements near zero — sharded sums add in
another order (test_runtime saw <= 1.1e-6 absolute; Adam's m / sqrt(v) amplifies that a little).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_models import transformer_args, transformer_block
from meshplan import IntraPlan, MeshError, OptionsError, Plan
from meshplan.capture import UnsupportedPrimitiveWarning
from meshplan.cluster.costs import default_mesh_shape
from meshplan.parallel import (
    DataParallel,
    ParallelizedFunction,
    ShardParallel,
    Zero2Parallel,
    Zero3Parallel,
    parallelize,
)
from meshplan.parallel import spmd as api_module

# Training steps in plain JAX: `step(state, batch) -> (state, loss)`, small float32 sizes.
LR = 0.05


def _normal(key, shape):
    return jax.random.normal(key, shape) / shape[0] ** 0.5


def _sgd(loss_fn):
    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        return jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads), loss
    return step


def _mlp_loss(params, x, y, act=jax.nn.relu):
    h = act(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def mlp_program(batch=64, d_in=128, hidden=256, d_out=64):
    """Two-layer ReLU MLP, MSE, SGD."""
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": _normal(k[0], (d_in, hidden)), "b1": jnp.zeros((hidden,)), "w2": _normal(k[1], (hidden, d_out))}
    return _sgd(_mlp_loss), params, (jax.random.normal(k[2], (batch, d_in)), jax.random.normal(k[3], (batch, d_out)))


def gelu_program(batch=64, d_in=128, hidden=256, d_out=64):
    """MLP with exact GELU (a custom_jvp activation), SGD."""
    step, params, data = mlp_program(batch, d_in, hidden, d_out)
    return _sgd(lambda p, x, y: _mlp_loss(p, x, y, lambda h: jax.nn.gelu(h, approximate=False))), params, data


def remat_program(batch=64, d_in=128, hidden=256, d_out=64):
    """MLP whose hidden layer is rematerialised in the backward pass (jax.checkpoint), SGD."""
    _, params, data = mlp_program(batch, d_in, hidden, d_out)

    def loss(p, x, y):
        h = jax.checkpoint(lambda x, w, b: jnp.tanh(x @ w + b))(x, p["w1"], p["b1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    return _sgd(loss), params, data


def transformer_program(batch=8, seq=16, hidden=64, ffn=256):
    """One pre-LN transformer block, forward and backward, SGD on a squared-output loss."""
    params, x = transformer_args(batch, seq, hidden, ffn)
    return _sgd(lambda p, x: jnp.mean(transformer_block(p, x) ** 2)), params, (x,)


def embedding_program(batch=64, vocab=256, dim=64, classes=32):
    """Embedding lookup (jnp.take) + linear classifier, cross-entropy, SGD."""
    k = jax.random.split(jax.random.key(1), 4)
    params = {"emb": jax.random.normal(k[0], (vocab, dim)), "w": _normal(k[1], (dim, classes))}
    tokens = jax.random.randint(k[2], (batch,), 0, vocab)
    labels = jax.random.randint(k[3], (batch,), 0, classes)

    def loss(p, tokens, labels):
        logits = jnp.take(p["emb"], tokens, axis=0) @ p["w"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

    return _sgd(loss), params, (tokens, labels)


def gpt_loss(params, tokens, heads=4):
    """Next-token cross-entropy of a one-block GPT (token + position embeddings, tied head)."""
    x = jnp.take(params["wte"], tokens[:, :-1], axis=0) + params["wpe"]
    x = transformer_block(params["block"], x, heads)
    logits = x @ params["wte"].T
    targets = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def adam_step(loss_fn, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
    """A training step with Adam written out: state = (params, m, v, t)."""
    def step(state, batch):
        params, m, v, t = state
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        t = t + 1
        m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
        v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
        scale = lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
        params = jax.tree_util.tree_map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + eps), params, m, v)
        return (params, m, v, t), loss
    return step


def gpt_params(vocab=64, seq=16, hidden=64, ffn=128, seed=2):
    k = jax.random.split(jax.random.key(seed), 2)
    block, _ = transformer_args(1, seq, hidden, ffn, seed)
    return {"wte": 0.1 * jax.random.normal(k[0], (vocab, hidden)),
            "wpe": 0.1 * jax.random.normal(k[1], (seq, hidden)), "block": block}


def gpt_program(batch=8, vocab=64, seq=16, hidden=64, ffn=128):
    """A small GPT training step with hand-written Adam."""
    params = gpt_params(vocab, seq, hidden, ffn)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    state = (params, zeros, zeros, jnp.zeros((), jnp.float32))
    tokens = jax.random.randint(jax.random.key(3), (batch, seq + 1), 0, vocab)
    return adam_step(gpt_loss), state, (tokens,)


PROGRAMS = {"mlp": mlp_program, "transformer": transformer_program, "gpt_adam": gpt_program,
            "embedding": embedding_program, "gelu": gelu_program, "remat": remat_program}


def mlp_adam_program(batch=64, d_in=128, hidden=256, d_out=64):
    """The MLP trained with hand-written Adam: state = (params, m, v, t)."""
    _, params, data = mlp_program(batch, d_in, hidden, d_out)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return adam_step(_mlp_loss), (params, zeros, zeros, jnp.zeros((), jnp.float32)), data


STEPS = 3
MESHES = [(8, 1), (1, 8), (2, 4), (4, 2)]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def train(step, state, batch, steps=STEPS):
    losses = []
    for _ in range(steps):
        state, loss = step(state, batch)
        losses.append(float(loss))
    return state, losses


def assert_same_training(parallel, step, state, batch):
    got_state, got_losses = train(parallel, state, batch)
    want_state, want_losses = train(jax.jit(step), state, batch)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5, atol=1e-5)
    got, want = jax.tree_util.tree_leaves(got_state), jax.tree_util.tree_leaves(want_state)
    assert len(got) == len(want)
    for value, expected in zip(got, want, strict=True):
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_shard_parallel_training_matches_single_device(program, shape):
    step, state, batch = PROGRAMS[program]()
    parallel = parallelize(step, method=ShardParallel(mesh_shape=shape))
    assert_same_training(parallel, step, state, batch)
    assert parallel.get_plan().mesh.shape == shape


def input_specs(parallel):
    """Planned layout of every input leaf, by capture label."""
    return {c.name: str(c.output) for c in parallel.get_plan().nodes if c.op == "parameter"}


# step(state, batch): the state is args[0] = (params, m, v, t), the batch args[1] = (x, y).
BATCH = {"args[1][0]": "S0R", "args[1][1]": "S0R"}
WEIGHTS = ("['w1']", "['w2']")


def state_specs(specs, slot):
    return [specs[f"args[0][{slot}]{w}"] for w in WEIGHTS]


@pytest.mark.parametrize("method", [DataParallel(), Zero2Parallel(), Zero3Parallel()], ids=lambda m: type(m).__name__)
def test_data_parallel_methods_match_and_shard_as_documented(method):
    step, state, batch = mlp_adam_program()
    parallel = parallelize(step, method=method)
    assert_same_training(parallel, step, state, batch)
    specs = input_specs(parallel)
    assert parallel.get_plan().mesh.shape == (8,)
    assert {k: specs[k] for k in BATCH} == BATCH
    weights, moments = state_specs(specs, 0), state_specs(specs, 1) + state_specs(specs, 2)
    if isinstance(method, Zero3Parallel):  # weights and both Adam moments split over the 8 devices
        assert "RR" not in weights + moments
    elif isinstance(method, Zero2Parallel):  # moments split, weights whole (used whole by the forward)
        assert weights == ["RR", "RR"] and "RR" not in moments
    else:
        assert weights == ["RR", "RR"]


@pytest.mark.parametrize("method", [DataParallel(), Zero3Parallel()], ids=lambda m: type(m).__name__)
def test_data_parallel_transformer_matches(method):
    step, state, batch = transformer_program()
    parallel = parallelize(step, method=method, batch_argnums=(1,))
    assert_same_training(parallel, step, state, batch)
    assert input_specs(parallel)["args[1][0]"] == "S0RR"  # batch [8, 16, 64] split 8 ways


def test_plan_is_cached_per_input_signature(monkeypatch):
    calls, solve = [], api_module.solve_intra

    def counting_solve(*args, **kwargs):
        calls.append(args[0].name)
        return solve(*args, **kwargs)

    monkeypatch.setattr(api_module, "solve_intra", counting_solve)
    step, params, (x, y) = mlp_program(batch=16)
    parallel = parallelize(step)
    params, _ = parallel(params, (x, y))
    params, _ = parallel(params, (x, y))
    assert len(calls) == 1
    first = parallel.get_plan()
    parallel(params, (x[:8], y[:8]))  # new batch size: new plan
    assert len(calls) == 2 and parallel.get_plan() is not first
    parallel(params, (x, y))  # back to the first signature: cached
    assert len(calls) == 2 and parallel.get_plan() is first
    parallel(params, (x.astype(jnp.bfloat16), y))  # new dtype: new plan
    assert len(calls) == 3


def test_decorator_forms_and_get_plan():
    @parallelize
    def double(x):
        return 2 * x

    @parallelize(method=ShardParallel(mesh_shape=(8,)))
    def triple(x):
        return 3 * x

    assert isinstance(double, ParallelizedFunction) and isinstance(triple, ParallelizedFunction)
    with pytest.raises(OptionsError, match="double has no plan yet; call it once"):
        double.get_plan()
    x = jnp.arange(64.0).reshape(16, 4)
    np.testing.assert_array_equal(double(x), 2 * x)
    np.testing.assert_array_equal(triple(x), 3 * x)
    assert isinstance(double.get_plan(), IntraPlan)
    assert double.get_plan().mesh.shape == (2, 4)  # default for 8 devices
    assert triple.get_plan().mesh.shape == (8,)


def test_devices_argument_picks_the_mesh():
    parallel = parallelize(lambda x: x + 1, devices=jax.devices()[:4])
    np.testing.assert_array_equal(parallel(jnp.zeros((8, 8))), jnp.ones((8, 8)))
    assert parallel.get_plan().mesh.shape == (2, 2)


def test_default_mesh_shape():
    assert [default_mesh_shape(n) for n in (1, 2, 3, 4, 6, 8)] == [(1,), (2,), (3,), (2, 2), (2, 3), (2, 4)]


def test_dump_debug_info_writes_every_file(tmp_path):
    step, params, batch = mlp_program(batch=16)
    parallel = parallelize(step)
    parallel(params, batch)
    paths = parallel.dump_debug_info(tmp_path / "debug")
    names = {"graph.txt", "plan.json", "hlo.txt", "memory.txt", "cost.json", "shardings.txt", "diagnostics.json",
             "collectives.json"}
    assert {p.name for p in paths} == names
    assert {p.name for p in (tmp_path / "debug").iterdir()} == names  # no temporary files left
    assert all(p.stat().st_size > 0 for p in paths)
    plan = Plan.from_json((tmp_path / "debug" / "plan.json").read_text())  # the one Plan schema
    assert plan.source == "parallelize" and plan.model == "step" and plan.option("method") == "ShardParallel"
    assert plan.stages[0].intra_plan == parallel.get_plan() and plan.stages[0].logical_mesh == (2, 4)
    assert (tmp_path / "debug" / "hlo.txt").read_text().startswith("HloModule")
    assert "flops" in json.loads((tmp_path / "debug" / "cost.json").read_text())
    shardings = (tmp_path / "debug" / "shardings.txt").read_text().splitlines()
    # inputs: b1, w1, w2 (dict keys sorted), x, y; outputs: b1, w1, w2, loss
    assert [line.split(":")[0] for line in shardings] == [f"input {i}" for i in range(5)] + [
        f"output {i}" for i in range(4)]
    assert "NamedSharding" in shardings[0]
    diagnostics = json.loads((tmp_path / "debug" / "diagnostics.json").read_text())
    assert diagnostics["involuntary_rematerializations"] == 0 and diagnostics["donated"] == []
    collectives = json.loads((tmp_path / "debug" / "collectives.json").read_text())
    assert collectives == {**parallel.get_collectives().to_dict(), "layout": collectives["layout"]}
    assert collectives["layout"].startswith("ShardParallel: every layout is the cost model's choice")


def test_unsupported_primitive_runs_and_warning_names_it():
    def doubling_until_large(x):  # a while loop whose trip count depends on the data: no static unrolling
        return jax.lax.while_loop(lambda v: jnp.sum(v) < 1e4, lambda v: v * 2.0, x) + 1.0

    parallel = parallelize(doubling_until_large)
    x = jnp.arange(32.0).reshape(8, 4)
    with pytest.warns(UnsupportedPrimitiveWarning, match=r"no meshplan rule for primitive\(s\) while"):
        out = parallel(x)
    np.testing.assert_allclose(out, doubling_until_large(x), rtol=1e-6)
    assert parallel.get_plan().unsupported_ops == ("while",)


def test_mesh_shape_that_does_not_match_the_devices_is_a_clear_error():
    parallel = parallelize(lambda x: x * 2, method=ShardParallel(mesh_shape=(2, 3)))
    message = r"ShardParallel\(mesh_shape=\(2, 3\)\) needs 6 devices but 8 are used; give a mesh_shape whose"
    with pytest.raises(MeshError, match=message):
        parallel(jnp.ones((8, 8)))


def test_unknown_method_and_bad_batch_argnums_are_clear_errors():
    with pytest.raises(OptionsError, match=r"parallelize\(method='dp'\): unknown method; use ShardParallel"):
        parallelize(lambda x: x, method="dp")
    parallel = parallelize(lambda x: x * 2, method=DataParallel(), batch_argnums=(1,))
    with pytest.raises(OptionsError, match=r"parallelize\(<lambda>, batch_argnums=\(1,\)\): position\(s\) \[1\] name "
                                           r"no argument; <lambda> was called with 1 argument\(s\), at positions 0..0"):
        parallel(jnp.ones((8, 8)))
    inferred = parallelize(lambda x: x * 2, method=DataParallel())  # x is rescaled, not updated: the batch
    assert np.array_equal(inferred(jnp.ones((8, 8))), 2 * jnp.ones((8, 8)))
    assert np.array_equal(parallelize(lambda x: x * 2, method=DataParallel(), batch_argnums=(0,))(
        jnp.ones((8, 8))), 2 * jnp.ones((8, 8)))


def gpt_optax_program(batch=8, vocab=64, seq=16, hidden=64, ffn=128):
    """The GPT step with optax's Adam: state = (params, optax state)."""
    import optax

    optimizer = optax.adam(1e-3)
    params = gpt_params(vocab, seq, hidden, ffn)

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(gpt_loss)(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    tokens = jax.random.randint(jax.random.key(3), (batch, seq + 1), 0, vocab)
    return step, (params, optimizer.init(params)), (tokens,)


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)])
def test_gpt_with_optax_adam_matches_single_device(shape):
    step, state, batch = gpt_optax_program()
    parallel = parallelize(step, method=ShardParallel(mesh_shape=shape))
    assert_same_training(parallel, step, state, batch)
