"""Batch inputs found from the program: any argument order, optax state pytrees, clear errors.

Data-parallel steps with optax optimizers on 8 CPU devices equal `jax.jit` on one device
(losses and parameters: rtol = atol = 1e-5 for SGD, 1e-4 for the adaptive optimizers, whose
updates divide by near-zero gradient statistics and so magnify rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from meshplan import OptionsError
from meshplan.capture import capture, find_batch_inputs, infer_batch_inputs, updated_inputs
from meshplan.parallel import DataParallel, ShardParallel, Zero2Parallel, Zero3Parallel, parallelize

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def mlp_params(d_in=16, hidden=64, d_out=8, seed=0):
    k = jax.random.split(jax.random.key(seed), 2)
    return {"w1": jax.random.normal(k[0], (d_in, hidden)) / d_in**0.5, "b1": jnp.zeros((hidden,)),
            "w2": jax.random.normal(k[1], (hidden, d_out)) / hidden**0.5}


def mlp_loss(params, x, y):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def data(batch=32, d_in=16, d_out=8, seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (batch, d_in)), jax.random.normal(ky, (batch, d_out))


def optax_step(optimizer):
    """step(params, opt_state, x, y) -> (params, opt_state, loss): the order optax's docs use."""
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


OPTIMIZERS = {
    "sgd_momentum": (lambda: optax.sgd(0.05, momentum=0.9), 1e-5),
    "adam": (lambda: optax.adam(1e-2), 1e-4),
    "adamw": (lambda: optax.adamw(1e-2, weight_decay=0.1), 1e-4),
    "lion": (lambda: optax.lion(1e-3), 1e-4),
    "adafactor": (lambda: optax.adafactor(1e-2), 1e-4),
    "clip_schedule_adam": (lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=10))), 1e-4),
}
METHODS = [DataParallel(), Zero2Parallel(), Zero3Parallel()]


def train_steps(step, params, opt_state, x, y, steps=3):
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
    return params, losses


# Every optimizer under ZeRO-3 (its state split too), AdamW under the other two methods.
CASES = [(name, Zero3Parallel()) for name in OPTIMIZERS] + [("adamw", m) for m in METHODS[:2]]


@pytest.mark.parametrize(("name", "method"), CASES, ids=[f"{n}-{type(m).__name__}" for n, m in CASES])
def test_optax_steps_run_data_parallel_like_one_device(name, method):
    make, tol = OPTIMIZERS[name]
    optimizer, params, (x, y) = make(), mlp_params(), data()
    step = optax_step(optimizer)
    parallel = parallelize(step, method=method)
    got, got_losses = train_steps(parallel, params, optimizer.init(params), x, y)
    want, want_losses = train_steps(jax.jit(step), params, optimizer.init(params), x, y)
    np.testing.assert_allclose(got_losses, want_losses, rtol=tol, atol=tol)
    for key in params:
        np.testing.assert_allclose(got[key], want[key], rtol=tol, atol=tol, err_msg=key)
    batch = parallel._last.batch
    assert batch.inferred and batch.argnums == (2, 3)  # x and y, found behind params and the optax state
    specs = {c.name: str(c.output) for c in parallel.get_plan().nodes if c.op == "parameter"}
    assert specs["args[2]"] == specs["args[3]"] == "S0R"  # both split 8 ways along the batch


def test_state_is_what_the_step_returns_updated():
    optimizer = optax.adamw(1e-3)
    params, (x, y) = mlp_params(), data()
    c = capture(optax_step(optimizer), params, optimizer.init(params), x, y)
    names = {c.graph[c.input_nodes[i]].name for i in updated_inputs(c)}
    # params and both moments; not x or y, nor the step counter (count + 1 reads nothing else)
    assert names == {f"args[0]['{k}']" for k in params} | {f"args[1][0].{m}['{k}']" for m in ("mu", "nu")
                                                             for k in params}


@pytest.mark.parametrize("order", ["batch_first", "batch_middle", "dict_batch"])
def test_batch_is_found_in_any_argument_order(order):
    optimizer = optax.sgd(0.1, momentum=0.9)
    params, (x, y) = mlp_params(), data(batch=16)
    inner = optax_step(optimizer)
    if order == "batch_first":
        def step(x, y, params, opt_state):
            return inner(params, opt_state, x, y)
        args, batch_leaves = (x, y, params, optimizer.init(params)), ["args[0]", "args[1]"]
    elif order == "batch_middle":
        def step(params, x, opt_state, y):
            return inner(params, opt_state, x, y)
        args, batch_leaves = (params, x, optimizer.init(params), y), ["args[1]", "args[3]"]
    else:
        def step(state, batch):
            return inner(state["params"], state["opt"], batch["x"], batch["y"])
        args, batch_leaves = ({"params": params, "opt": optimizer.init(params)}, {"x": x, "y": y}), \
            ["args[1]['x']", "args[1]['y']"]
    c = capture(step, *args)
    found = infer_batch_inputs(c)
    assert [c.graph[c.input_nodes[i]].name for i, _ in found.dims] == batch_leaves
    assert {d for _, d in found.dims} == {0}
    got = parallelize(step, method=Zero3Parallel())(*args)
    want = jax.jit(step)(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_batch_dim_is_inferred_when_it_is_not_the_leading_dim():
    """Time-major inputs x[seq, batch, d]: the batch is the dim x shares with the targets."""
    params = mlp_params()

    def step(params, x, y):  # the last time step's features predict y[batch, d_out]
        grads = jax.grad(lambda p: mlp_loss(p, x[-1], y))(params)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    x, y = jax.random.normal(jax.random.key(0), (4, 32, 16)), jax.random.normal(jax.random.key(1), (32, 8))
    c = capture(step, params, x, y)
    found = infer_batch_inputs(c)
    assert {c.graph[c.input_nodes[i]].name: d for i, d in found.dims} == {"args[1]": 1, "args[2]": 0}
    parallel = parallelize(step, method=DataParallel())
    got = parallel(params, x, y)
    for key in params:
        np.testing.assert_allclose(got[key], jax.jit(step)(params, x, y)[key], rtol=1e-5, atol=1e-5)
    specs = {c.name: str(c.output) for c in parallel.get_plan().nodes if c.op == "parameter"}
    assert specs["args[1]"] == "RS0R" and specs["args[2]"] == "S0R"


def test_wrong_batch_argnums_name_the_argument_and_the_fix():
    optimizer = optax.adam(1e-3)
    params, (x, y) = mlp_params(), data()
    step, state = optax_step(optimizer), optimizer.init(params)
    cases = {
        (0,): r"argument 0 of step is updated by the step \(args\[0\]\['b1'\] f32\[64\] comes back as result 0\): "
              r"it is weights or optimizer state, not a batch; the batch looks like args\[2\] f32\[32, 16\] \(dim 0\), "
              r"args\[3\] f32\[32, 8\] \(dim 0\): pass batch_argnums=\(2, 3\), or leave batch_argnums out",
        (4,): r"position\(s\) \[4\] name no argument; step was called with 4 argument\(s\), at positions 0..3",
        (): r"position\(s\) \[\] name no argument",
    }
    for argnums, message in cases.items():
        with pytest.raises(OptionsError, match=message):
            parallelize(step, method=DataParallel(), batch_argnums=argnums)(params, state, x, y)

    def scaled(params, lr, x):
        return jax.tree_util.tree_map(lambda p: p - lr * jnp.mean(x), params)

    with pytest.raises(OptionsError, match=r"argument 1 of scaled holds no array with a dim to split \(only scalars\)"):
        parallelize(scaled, method=DataParallel(), batch_argnums=(1,))(params, jnp.float32(0.1), x)
    def two_sets(params, x, z):
        return jax.grad(lambda p: jnp.mean(x @ p["w1"]) + jnp.mean(z @ p["w1"]))(params)

    differ = r"leading dims differ \(args\[1\] f32\[32, 16\] vs args\[2\] f32\[8, 16\]\)"
    with pytest.raises(OptionsError, match=differ):
        parallelize(two_sets, method=DataParallel(), batch_argnums=(1, 2))(params, x, x[:8])


def test_given_batch_argnums_are_used_as_given():
    optimizer = optax.sgd(0.1)
    params, (x, y) = mlp_params(), data()
    step = optax_step(optimizer)
    c = capture(step, params, optimizer.init(params), x, y)
    given = find_batch_inputs(c, (2, 3), "step")
    assert not given.inferred and given.argnums == (2, 3)
    assert given.dims == infer_batch_inputs(c).dims


def test_a_step_whose_every_input_is_state_asks_for_batch_argnums():
    def heavy_ball(w, m):  # each input is updated from the other: both are state
        m = 0.9 * m + w
        return w - 0.1 * m, m

    w, m = mlp_params()["w1"], mlp_params(seed=1)["w1"]
    with pytest.raises(OptionsError, match=r"no input of heavy_ball looks like one: every input with a dim comes "
                                           r"back updated.*pass parallelize\(\.\.\., batch_argnums="):
        parallelize(heavy_ball, method=DataParallel())(w, m)
    out, _ = parallelize(heavy_ball, method=ShardParallel())(w, m)  # no batch needed: runs
    np.testing.assert_allclose(out, w - 0.1 * (0.9 * m + w), rtol=1e-5, atol=1e-6)
