"""Training steps of models nobody here wrote (Hugging Face Flax GPT-2 and LLaMA, a Flax nnx MLP,
an Equinox MLP) with optax: 3 steps under every ShardParallel-family method and under whole-step
PipeshardParallel (2 and 4 stages, automatic layers) on 8 CPU devices equal 3 `jax.jit` steps on
one device.

Tolerances: AdamW's update divides by the root of near-zero gradient statistics and magnifies the
rounding of sums added in another order, so its steps are compared at rtol = atol = 1e-4; the SGD
step at 1e-5 (the issue's bounds). Measured: at most 1.5e-5 apart after 3 AdamW steps.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from framework_models import eqx_mlp_program, gpt2, llama, lm_step, nnx_mlp_program, tokens
from meshplan.capture import capture
from meshplan.errors import PlanMismatchError
from meshplan.parallel import (
    DataParallel,
    PipeshardParallel,
    ShardParallel,
    TensorParallel,
    Zero2Parallel,
    Zero3Parallel,
    parallelize,
)

from data_files import DATA

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
METHODS = [ShardParallel(), DataParallel(), Zero2Parallel(), Zero3Parallel(), TensorParallel()]
_MODELS = {}


def program(name, optimizer):
    """(step, params, batch arguments) of model `name`; HF models are built once per session."""
    if name in ("gpt2", "llama"):
        if name not in _MODELS:
            _MODELS[name] = gpt2() if name == "gpt2" else llama()
        model = _MODELS[name]
        return lm_step(model, optimizer), model.params, (tokens(),)
    return (nnx_mlp_program if name == "nnx_mlp" else eqx_mlp_program)(optimizer)


def train(step, params, opt_state, batch, steps=3):
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, *batch)
        losses.append(float(loss))
    return params, losses


_REFERENCE = {}


def assert_trains_like_one_device(parallel, step, params, optimizer, batch, tol, key):
    got, got_losses = train(parallel, params, optimizer.init(params), batch)
    if key not in _REFERENCE:  # one single-device run per model and optimizer, shared by the methods
        _REFERENCE[key] = train(jax.jit(step), params, optimizer.init(params), batch)
    want, want_losses = _REFERENCE[key]
    np.testing.assert_allclose(got_losses, want_losses, rtol=tol, atol=tol)
    flat_got, flat_want = jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(want)
    for (path, value), expected in zip(flat_got, flat_want, strict=True):
        np.testing.assert_allclose(value, expected, rtol=tol, atol=tol, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("method", METHODS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("name", ["gpt2", "llama", "nnx_mlp", "eqx_mlp"])
def test_adamw_steps_match_one_device(name, method):
    optimizer = optax.adamw(1e-3)
    step, params, batch = program(name, optimizer)
    parallel = parallelize(step, method=method)
    assert_trains_like_one_device(parallel, step, params, optimizer, batch, tol=1e-4, key=(name, "adamw"))
    assert parallel.get_plan().unsupported_ops == ()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_sgd_steps_match_one_device_at_1e_5(name):
    optimizer = optax.sgd(0.1)
    step, params, batch = program(name, optimizer)
    parallel = parallelize(step, method=DataParallel())
    assert_trains_like_one_device(parallel, step, params, optimizer, batch, tol=1e-5, key=(name, "sgd"))


@pytest.mark.parametrize("layers", [2, 4])
@pytest.mark.parametrize("name", ["gpt2", "llama", "nnx_mlp", "eqx_mlp"])
def test_adamw_steps_match_one_device_whole_step_pipeshard(name, layers):
    """The step as written (gradient and AdamW inside), its loss cut into `layers` layers by FLOPs,
    one stage of 8 / layers devices per layer, 2 micro-batches."""
    optimizer = optax.adamw(1e-3)
    step, params, batch = program(name, optimizer)
    parallel = parallelize(step, method=PipeshardParallel(2, layers=layers))
    assert_trains_like_one_device(parallel, step, params, optimizer, batch, tol=1e-4, key=(name, "adamw"))
    plan = parallel.get_plan()
    assert [len(s.devices) for s in plan.stages] == [8 // layers] * layers
    assert all(s.intra_plan.unsupported_ops == () for s in plan.stages)


def test_a_simulated_plan_runs_the_step_it_was_made_for():
    """`meshplan simulate --model gpt2_2layer_config.json --cluster 2x4 --global-batch 8 --seq-len 16 --dtype
    f32 --chunks 1 --out ...` (tests/data) planned 2 stages of 4 devices, (1, 4) meshes, 1 micro-batch:
    PipeshardParallel(1, plan=that file) runs them on the 2-layer GPT-2 of that config like one device; a
    batch of another size is refused."""
    path = DATA / "gpt2_2layer_2x4_simulate_plan.json"
    optimizer = optax.adamw(1e-3)
    model = gpt2(layers=2)
    step, params = lm_step(model, optimizer), model.params
    parallel = parallelize(step, method=PipeshardParallel(1, plan=path))
    assert_trains_like_one_device(parallel, step, params, optimizer, (tokens(),), tol=1e-4, key=("gpt2-2", "adamw"))
    plan = parallel.get_plan()
    assert [(s.devices, s.logical_mesh) for s in plan.stages] == [((0, 1, 2, 3), (1, 4)), ((4, 5, 6, 7), (1, 4))]
    with pytest.raises(PlanMismatchError, match="made for a batch of 8 sequences but step gets 16; re-plan with "
                                                "`meshplan simulate --global-batch 16`"):
        parallelize(step, method=PipeshardParallel(1, plan=path))(params, optimizer.init(params), tokens(batch=16))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_sgd_steps_match_one_device_at_1e_5_whole_step_pipeshard(name):
    optimizer = optax.sgd(0.1)
    step, params, batch = program(name, optimizer)
    parallel = parallelize(step, method=PipeshardParallel(2, layers=4))
    assert_trains_like_one_device(parallel, step, params, optimizer, batch, tol=1e-5, key=(name, "sgd"))


@pytest.mark.parametrize("name", ["gpt2", "llama", "nnx_mlp", "eqx_mlp"])
def test_training_step_captures_with_nothing_opaque(name):
    step, params, batch = program(name, optax.adamw(1e-3))
    assert capture(step, params, optax.adamw(1e-3).init(params), *batch).unsupported == ()


def test_flax_linen_gradient_with_dropout_captures_with_nothing_opaque():
    import flax.linen as nn
    import jax.numpy as jnp

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.Dropout(0.1, deterministic=not train)(nn.relu(nn.LayerNorm()(nn.Dense(64)(x))))
            return nn.Dense(8)(x)

    model, x = MLP(), jnp.ones((32, 16))
    params = model.init(jax.random.key(0), x, False)

    def loss(p, x, key):
        return jnp.mean(model.apply(p, x, True, rngs={"dropout": key}) ** 2)

    captured = capture(jax.grad(loss), params, x, jax.random.key(1))
    assert captured.unsupported == ()
    assert {n.op for n in captured.graph.nodes if n.kind.value == "random"} >= {"random_bits"}
