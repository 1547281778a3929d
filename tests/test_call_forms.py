"""The call forms users write, under every method, equal to jax.jit / nnx.jit on one device:
static arguments (static_argnums/static_argnames, a config object, changing between calls),
keyword arguments (the batch passed by keyword), in-place Flax nnx steps written as Flax's MNIST
tutorial writes them, jax.jit- and nnx.jit-decorated steps, the manual mark_pipeline_boundary loss
form, and the errors for forms that cannot work.

Tolerances (after 3 steps): loss within 1e-5, parameters within 1e-4 mean relative difference.
"""

from __future__ import annotations

import dataclasses
import warnings

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from meshplan import OptionsError
from meshplan.parallel import DataParallel, PipeshardParallel, ShardParallel, Zero3Parallel, parallelize
from meshplan.runtime import mark_pipeline_boundary

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

METHODS = {"shard": ShardParallel, "data": DataParallel, "zero3": Zero3Parallel,
           "pipeshard": lambda: PipeshardParallel(num_micro_batches=2, layers=2)}
STEPS = 3


def assert_same_training(got_losses, want_losses, got_params, want_params):
    np.testing.assert_allclose(np.asarray(got_losses, np.float32), np.asarray(want_losses, np.float32), rtol=0,
                               atol=1e-5)
    got_leaves, want_leaves = jax.tree_util.tree_leaves(got_params), jax.tree_util.tree_leaves(want_params)
    assert len(got_leaves) == len(want_leaves) > 0
    for g, w in zip(got_leaves, want_leaves, strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.mean(np.abs(g - w)) <= 1e-4 * np.mean(np.abs(w)), (g, w)


# --- static and keyword arguments (plain JAX) -------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Config:
    """A hashable training config, passed as one static argument (as Flax's gemma example passes its
    learning-rate function and label smoothing)."""

    learning_rate: float
    activation: str


ACTIVATIONS = {"tanh": jnp.tanh, "gelu": jax.nn.gelu}


def config_step(params, batch, config, *, clip=None):
    """SGD on a two-layer MLP; `config` and `clip` are static (Python values that shape the program)."""
    def loss_fn(p):
        h = ACTIVATIONS[config.activation](batch["x"] @ p["w1"])
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    if clip is not None:
        grads = jax.tree_util.tree_map(lambda g: jnp.clip(g, -clip, clip), grads)
    return jax.tree_util.tree_map(lambda p, g: p - config.learning_rate * g, params, grads), loss


def mlp_data(batch=16, d_in=16, hidden=32, d_out=8):
    rng = np.random.default_rng(0)
    params = {"w1": normal(rng, (d_in, hidden)) / d_in ** 0.5, "w2": normal(rng, (hidden, d_out)) / hidden ** 0.5}
    return params, {"x": normal(rng, (batch, d_in)), "y": normal(rng, (batch, d_out))}


def normal(rng, shape):
    """Random float32 data made with NumPy (jax.random would compile a program per shape)."""
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def run(step, params, batch, steps, **kwargs):
    losses = []
    for _ in range(steps):
        params, loss = step(params, batch=batch, **kwargs)
        losses.append(loss)
    return params, losses


@pytest.mark.parametrize("name", METHODS)
def test_static_config_and_keyword_batch_equal_jax_jit(name):
    """`step(params, batch=batch, config=Config(...), clip=...)`: keyword calls, a static config that
    changes between calls (a new plan each, cached), equal to jax.jit with the same static names."""
    params, batch = mlp_data()
    want_step = jax.jit(config_step, static_argnames=("config", "clip"))
    got_step = parallelize(config_step, method=METHODS[name](), static_argnames=("config", "clip"))
    first, second = Config(0.1, "tanh"), Config(0.05, "gelu")

    got, got_losses = run(got_step, params, batch, STEPS, config=first)
    want, want_losses = run(want_step, params, batch, STEPS, config=first)
    assert_same_training(got_losses, want_losses, got, want)

    got, got_losses = run(got_step, got, batch, 1, config=second, clip=0.5)  # another value: another plan
    want, want_losses = run(want_step, want, batch, 1, config=second, clip=0.5)
    assert_same_training(got_losses, want_losses, got, want)
    assert len(got_step._cache) == 2
    got_step(got, batch, first)  # the first config again, by position: its cached plan
    assert len(got_step._cache) == 2


def test_static_argnums_and_the_batch_by_keyword_are_found():
    """static_argnums counts positional parameters even when the value comes by keyword; the batch
    passed by keyword is still found and split (describe_batch names it by position)."""
    params, batch = mlp_data()
    step = parallelize(config_step, method=DataParallel(), static_argnums=2)
    step(params, config=Config(0.1, "tanh"), batch=batch)
    described = step.describe_batch()
    assert "args[1]['x']" in described and "args[1]['y']" in described and "args[0]" not in described
    given = parallelize(config_step, method=DataParallel(), static_argnums=2, batch_argnames="batch")
    given(params, batch, Config(0.1, "tanh"))
    assert "given by batch_argnums" in given.describe_batch()
    assert given.describe_batch().replace("given by batch_argnums", "inferred") == step.describe_batch()


def test_donate_argnames_reuses_the_named_argument():
    params, batch = mlp_data()
    step = parallelize(config_step, method=ShardParallel(), static_argnames="config", donate_argnames="params")
    new, _ = step(params, batch, Config(0.1, "tanh"))  # first call: copies are donated, `params` stays valid
    assert len(step._last.donation.pairs) == 2
    again, _ = step(new, batch, Config(0.1, "tanh"))  # laid out as planned: consumed
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(new))
    assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(params))


def test_keyword_only_and_extra_keyword_arguments():
    """Keyword-only parameters and **kwargs: traced by name, static by name."""
    def step(params, *, batch, **options):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"]
                                                             - batch["y"]) ** 2) * options["scale"])(params)
        return jax.tree_util.tree_map(lambda p, g: p - options["lr"] * g, params, grads), loss

    params, batch = mlp_data()
    got = parallelize(step, method=DataParallel(), static_argnames="lr")(params, batch=batch, lr=0.1, scale=2.0)
    want = jax.jit(step, static_argnames="lr")(params, batch=batch, lr=0.1, scale=2.0)
    assert_same_training([got[1]], [want[1]], got[0], want[0])


@pytest.mark.parametrize("name", ["shard", "pipeshard"])
def test_a_jax_jit_step_keeps_its_static_arguments(name):
    """A step already decorated with jax.jit(static_argnames=...) is unwrapped; its statics hold."""
    params, batch = mlp_data()
    jitted = jax.jit(config_step, static_argnames="config")
    got, got_losses = run(parallelize(jitted, method=METHODS[name]()), params, batch, STEPS, config=Config(0.1, "gelu"))
    want, want_losses = run(jitted, params, batch, STEPS, config=Config(0.1, "gelu"))
    assert_same_training(got_losses, want_losses, got, want)


# --- the manual loss form -----------------------------------------------------------------------------

def marked_loss(params, x, targets, power):
    """Two layers cut by hand; `power` is static."""
    h = mark_pipeline_boundary(jnp.tanh(x @ params[0]["w"]))
    return jnp.mean(jnp.abs(h @ params[1]["w"] - targets) ** power)


def test_marked_loss_with_a_static_argument_and_keywords():
    rng = np.random.default_rng(4)
    params = [{"w": normal(rng, (16, 32)) / 4}, {"w": normal(rng, (32, 8)) / 6}]
    x, y = normal(rng, (8, 16)), normal(rng, (8, 8))
    f = parallelize(marked_loss, method=PipeshardParallel(num_micro_batches=2), static_argnames="power")
    for power in (2, 3):
        loss, grads = f(params, x, targets=y, power=power)
        want_loss, want_grads = jax.jit(jax.value_and_grad(marked_loss), static_argnums=3)(params, x, y, power)
        assert_same_training([loss], [want_loss], grads, want_grads)
    assert len(f._cache) == 2


# --- in-place Flax nnx steps ---------------------------------------------------------------------------

class MLP(nnx.Module):
    """A small classifier in the form of Flax's MNIST tutorial (its CNN's dense head on flattened images)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(8 * 8, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


def loss_fn(model: MLP, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"]).mean()
    return loss, logits


def train_step(model: MLP, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
    """Train for a single step, in place; returns nothing."""
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def nnx_objects():
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(learning_rate=0.005, b1=0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    return model, optimizer, metrics


def images(batch=16):
    rng = np.random.default_rng(7)
    return {"image": normal(rng, (batch, 8, 8, 1)), "label": jnp.asarray(rng.integers(0, 10, batch), jnp.int32)}


@pytest.mark.parametrize("name, decorated", [("shard", False), ("data", True), ("zero3", False), ("pipeshard", False),
                                             ("pipeshard", True)])
def test_in_place_nnx_step_equals_nnx_jit(name, decorated):
    """The tutorial's loop runs unchanged: the parallelized step updates model, optimizer and metrics
    in place, as nnx.jit does."""
    batch = images()
    want = nnx_objects()
    reference = nnx.jit(train_step)
    for _ in range(STEPS):
        reference(*want, batch)

    got = nnx_objects()
    step = parallelize(nnx.jit(train_step) if decorated else train_step, method=METHODS[name]())
    for _ in range(STEPS):
        assert step(*got, batch) is None
    got_metrics, want_metrics = got[2].compute(), want[2].compute()
    assert_same_training([got_metrics["loss"]], [want_metrics["loss"]], nnx.state(got[0], nnx.Param),
                         nnx.state(want[0], nnx.Param))
    assert float(got_metrics["accuracy"]) == float(want_metrics["accuracy"])
    assert int(got[1].step[...]) == STEPS
    assert_same_training([], [], nnx.state(got[1], nnx.OptState), nnx.state(want[1], nnx.OptState))


def test_nnx_step_with_dropout_rngs_and_donation():
    """Rngs advance in place (dropout keys equal nnx.jit's); a step returning its loss; the objects
    donated (donate_argnums names the model and the optimizer)."""
    class Dropped(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs)

        def __call__(self, x):
            return self.down(self.drop(nnx.relu(self.up(x))))

    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    def objects():
        model = Dropped(nnx.Rngs(0, dropout=5))
        return model, nnx.Optimizer(model, optax.adamw(0.01), wrt=nnx.Param)

    _, batch = mlp_data()
    want, got = objects(), objects()
    reference = nnx.jit(step)
    want_losses = [reference(*want, batch["x"], batch["y"]) for _ in range(STEPS)]
    parallel = parallelize(step, method=DataParallel(), donate_argnums=(0, 1))
    got_losses = [parallel(*got, batch["x"], batch["y"]) for _ in range(STEPS)]
    assert_same_training(got_losses, want_losses, nnx.state(got[0], nnx.Param), nnx.state(want[0], nnx.Param))
    assert int(got[0].drop.rngs.count[...]) == STEPS
    assert parallel._last.donation.pairs


def test_a_variable_passed_alone_is_updated_in_place_and_a_state_is_a_value():
    def accumulate(total, params, x):
        total[...] = total[...] + jnp.sum(x @ params["kernel"][...], axis=0)
        return jnp.mean(x)

    model = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
    total, params = nnx.Variable(jnp.zeros(4)), nnx.state(model)
    x = mlp_data()[1]["x"]
    step = parallelize(accumulate)
    for _ in range(2):
        step(total, params, x)
    np.testing.assert_allclose(np.asarray(total[...]), 2 * np.asarray(jnp.sum(x @ model.kernel[...], axis=0)),
                               rtol=1e-5, atol=1e-5)
    assert len(step.call.bind((total, params, x), {}).objects) == 1  # the State stays an argument


# --- errors ------------------------------------------------------------------------------------------

def test_unhashable_static_value_is_refused():
    params, batch = mlp_data()
    step = parallelize(config_step, static_argnames="config")
    with pytest.raises(OptionsError, match=r"config_step's static argument 'config' is a dict, which is not "
                                           r"hashable; .* pass a hashable value"):
        step(params, batch, {"learning_rate": 0.1, "activation": "tanh"})


@pytest.mark.parametrize("options, message", [
    (dict(static_argnames="cfg"), r"config_step has no parameter named 'cfg'; its parameters are "
                                  r"\(params, batch, config, clip\)"),
    (dict(static_argnums=5), r"config_step has no positional argument 5"),
    (dict(donate_argnames="state"), r"donate_argnums=...\): config_step has no parameter named 'state'"),
    (dict(static_argnames="config", batch_argnames="config"), r"names 'config', a static argument"),
    (dict(static_argnums=1, batch_argnums=(1,)), r"names 'batch', a static argument"),
])
def test_bad_names_and_positions_are_refused(options, message):
    with pytest.raises(OptionsError, match=message):
        parallelize(config_step, **options)


def test_call_that_does_not_fit_the_signature_is_refused():
    params, batch = mlp_data()
    step = parallelize(config_step, static_argnames="config")
    with pytest.raises(OptionsError, match=r"config_step\(params, batch, config, \*, clip=None\) cannot be called "
                                           r"with these arguments: got an unexpected keyword argument 'lr'"):
        step(params, batch, Config(0.1, "tanh"), lr=0.1)


def test_nnx_forms_that_cannot_work_are_refused():
    model, optimizer, _ = nnx_objects()

    def returns_the_model(model, optimizer, batch):
        _, grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        return model

    def grows_the_model(model, batch):
        model.extra = nnx.Param(jnp.zeros(3))
        return loss_fn(model, batch)[0]

    with pytest.raises(OptionsError, match=r"returns nnx object\(s\) at result; .* return only arrays"):
        parallelize(returns_the_model)(model, optimizer, images())
    with pytest.raises(OptionsError, match=r"changes the structure of the nnx objects .* outside the step"):
        parallelize(grows_the_model)(model, images())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(OptionsError, match=r"called with nnx objects but computes no gradient"):
            parallelize(lambda m, x, y: jnp.mean(m(x) - y), method=PipeshardParallel(2))(
                model, images()["image"], jnp.zeros((16, 10)))
