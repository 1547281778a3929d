"""Whole-step PipeshardParallel on the forms users write: exact micro-batching of losses and aux
values, constants before the gradient, dropout, inference steps and donation.

* The micro-batching rules (meshplan.runtime.micro_batching) on loss forms, without a pipeline:
  the micro-batches' losses and gradients add up to the full batch's (mean, sum, weighted mean,
  a regularizer, batch statistics of the inputs, integer counts, dropout masks, per-example keys)
  and the forms that cannot are refused with the construct named.
* Steps as the Flax examples (lm1b in linen, gemma in nnx) and Hugging Face's Flax scripts
  summarization, CLM, MLM) write them (tests/example_steps.py), 3 steps under PipeshardParallel
  against plain jax.jit on one device: metrics and losses within rtol 1e-5, integer metrics
  exactly equal, parameters within 1e-4 mean relative error (sum |got - want| / sum |want| over
  all parameters: AdamW turns the rounding noise of a gradient that is exactly zero in theory,
  such as an attention key bias, into lr-sized steps on that one leaf). Dropout draws the same
  bits as one device, so the numbers agree with dropout on.
* The gemma-style model has rotary positions and lm1b sinusoidal ones, for which the batch
  finder may pick the sequence dim (issue 18 item 1, fixed elsewhere); every example passes
  `batch_argnums=(1,)`, the batch dict, as Alpa users do.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend.core import jaxpr_as_fun

import example_steps
from meshplan.errors import OptionsError
from meshplan.parallel import PipeshardParallel, parallelize
from meshplan.parallel.donation import UnusedDonationWarning
from meshplan.parallel.pipeshard_step import loss_program, trace_step
from meshplan.runtime.micro_batching import Rule, micro_batch_program
from meshplan.runtime.random_rows import counter_based, draw_rows

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


# --- the micro-batching rules, without a pipeline ---------------------------------------------------

B, ROWS = 4, 16  # micro-batches, examples
_k = jax.random.split(jax.random.key(0), 6)
W = jax.random.normal(_k[0], (8, 5))
X, Y = jax.random.normal(_k[1], (ROWS, 8)), jax.random.normal(_k[2], (ROWS, 5))
MASK = (jax.random.uniform(_k[3], (ROWS,)) > 0.3).astype(jnp.float32)
IDS = jax.random.randint(_k[4], (ROWS,), 0, 5)
KEY = jax.random.key(42)


def per_example(w, x, y):
    return ((x @ w - y) ** 2).mean(-1)


def rows(value, m):
    """Micro-batch m of a batch value (leading dim ROWS); other values whole."""
    if np.ndim(value) and np.shape(value)[0] == ROWS:
        return value[m * ROWS // B:(m + 1) * ROWS // B]
    return value


def micro_batched(loss, args):
    """(program, sum of the micro-batches' results as their rules say, and of the loss's gradient)."""
    full = jax.make_jaxpr(loss)(*args)
    micro = jax.make_jaxpr(loss)(*(rows(a, 0) for a in args))
    program = micro_batch_program(full, micro, (0,), B, "loss")
    stats = jaxpr_as_fun(program.statistics)(*(args[p] for p in program.statistic_inputs)) if program.statistics else []
    run_micro = jax.jit(jaxpr_as_fun(program.closed))

    def results(w):
        return [run_micro(w, *(rows(a, m) for a in args[1:]), *stats, *([jnp.int32(m)] if program.indexed else []))
                for m in range(B)]

    outs = results(W)
    rebuilt = []
    for j, rule in enumerate(program.rules):
        values = [o[j] for o in outs]
        rebuilt.append(sum(values[1:], values[0]) if rule.how == "sum" else
                       jnp.concatenate(values, rule.dim) if rule.how == "join" else values[0])
    grad = jax.grad(lambda w: sum(o[0] for o in results(w)))(W)
    return program, rebuilt, grad


LOSSES = {
    "mean": (lambda w, x, y: jnp.mean((x @ w - y) ** 2), (W, X, Y)),
    "sum": (lambda w, x, y: jnp.sum((x @ w - y) ** 2), (W, X, Y)),
    "weighted mean": (lambda w, x, y, mask: jnp.sum(per_example(w, x, y) * mask) / jnp.sum(mask), (W, X, Y, MASK)),
    "mean plus a regularizer": (lambda w, x, y, mask: jnp.sum(per_example(w, x, y) * mask) / jnp.sum(mask)
                                + 0.1 * jnp.sum(w ** 2), (W, X, Y, MASK)),
    "sum over a weight norm": (lambda w, x, y: jnp.sum(per_example(w, x, y)) / jnp.sum(w ** 2), (W, X, Y)),
    "inputs normalized by the batch": (lambda w, x, y: jnp.mean(((x - x.mean(0)) @ w - y) ** 2), (W, X, Y)),
}


@pytest.mark.parametrize("name", LOSSES)
def test_micro_batch_losses_and_gradients_add_up_to_the_full_batch(name):
    loss, args = LOSSES[name]
    program, (total,), grad = micro_batched(loss, args)
    assert program.rules == (Rule("sum"),)
    np.testing.assert_allclose(total, loss(*args), rtol=1e-6)
    np.testing.assert_allclose(grad, jax.grad(loss)(*args), rtol=1e-5, atol=1e-6)
    assert (program.statistics is not None) == (name in ("weighted mean", "mean plus a regularizer",
                                                          "inputs normalized by the batch"))
    assert program.indexed == (name == "mean plus a regularizer")  # the regularizer counted in micro-batch 0


def test_aux_values_are_summed_joined_or_taken_once_integers_exactly():
    def loss(w, x, y, mask, ids):
        logits = x @ w
        return (jnp.sum(per_example(w, x, y) * mask), {
            "tokens": jnp.sum(mask.astype(jnp.int32)),  # int32, weight-independent: counted once on the full batch
            "correct": jnp.sum(jnp.argmax(logits, -1) == ids),  # int32 sum over examples
            "logits": logits,  # per example: joined
            "mean": jnp.mean(logits),  # a float mean: summed micro-batch parts
            "norm": jnp.sum(w ** 2)})  # does not depend on the batch: taken once

    args = (W, X, Y, MASK, IDS)
    program, rebuilt, _ = micro_batched(lambda *a: (lambda r: (r[0], *jax.tree_util.tree_leaves(r[1])))(loss(*a)),
                                        args)
    want_loss, want_aux = loss(*args)
    names = sorted(want_aux)  # the flat order of the aux dict
    assert dict(zip(names, program.rules[1:], strict=True)) == {
        "correct": Rule("sum"), "logits": Rule("join", 0), "mean": Rule("sum"), "norm": Rule("same"),
        "tokens": Rule("same")}
    np.testing.assert_allclose(rebuilt[0], want_loss, rtol=1e-6)
    for name, value in zip(names, rebuilt[1:], strict=True):
        assert value.dtype == want_aux[name].dtype
        if jnp.issubdtype(value.dtype, jnp.integer):
            assert int(value) == int(want_aux[name])
        else:
            np.testing.assert_allclose(value, want_aux[name], rtol=1e-6, atol=1e-6)


def dropout_loss(w, x, y, key):
    h = x @ w
    keep = jax.random.bernoulli(jax.random.fold_in(key, 3), 0.7, h.shape)
    return jnp.mean((jnp.where(keep, h / 0.7, 0) - y) ** 2)


def per_example_keys_loss(w, x, y, key):
    keys = jax.random.split(key, x.shape[0])  # one key per example, as the user wrote it
    keep = jax.vmap(lambda k, row: jax.random.bernoulli(k, 0.7, row.shape))(keys, x @ w)
    return jnp.mean((jnp.where(keep, x @ w / 0.7, 0) - y) ** 2)


@pytest.mark.parametrize("loss", [dropout_loss, per_example_keys_loss], ids=["mask", "per-example keys"])
def test_dropout_draws_the_full_batch_bits_in_each_micro_batch(loss):
    program, (total,), grad = micro_batched(loss, (W, X, Y, KEY))
    assert program.indexed
    np.testing.assert_allclose(total, loss(W, X, Y, KEY), rtol=1e-6)
    np.testing.assert_allclose(grad, jax.grad(loss)(W, X, Y, KEY), rtol=1e-5, atol=1e-6)


def test_counter_draws_equal_slices_of_the_full_draw():
    eqn = jax.make_jaxpr(lambda k: jax.random.bits(k, (4, 6)))(KEY).jaxpr.eqns[0]
    assert counter_based(eqn)  # threefry, partitionable: only the micro-batch's rows are computed
    full = jax.random.bits(KEY, (12, 6))
    for counters in (True, False):
        got = jax.jit(lambda k, start, c=counters: draw_rows(eqn, k, (12, 6), 0, start, c))(KEY, 8)
        np.testing.assert_array_equal(got, full[8:12])
    costs = [jax.jit(lambda k, start, c=c: draw_rows(eqn, k, (1200, 6), 0, start, c)).lower(KEY, 0).compile()
             .cost_analysis()["flops"] for c in (True, False)]
    # The counter path runs threefry on 4 rows, the other on all 1200; the analysis still counts the
    # full-shape counters (an iota) that the compiled loop fuses into the slice.
    assert costs[0] < costs[1] / 5


REFUSED = {  # the loss, the primitive named, the reason given
    "max": (lambda w, x, y: jnp.max(per_example(w, x, y)), "reduce_max",
            "over the batch of a value computed from the weights"),
    "log of a mean": (lambda w, x, y: jnp.log(jnp.mean(per_example(w, x, y))), "log",
                      "applied to a sum over the batch"),
    "batch statistics of activations": (lambda w, x, y: jnp.mean(((x @ w) - (x @ w).mean(0) - y) ** 2), "sub",
                                        r"uses a sum over the batch of weight-dependent values per example \(batch "
                                        r"statistics of activations, e.g. BatchNorm"),
    "a product of sums": (lambda w, x, y: jnp.mean(per_example(w, x, y)) * jnp.sum(x @ w), "mul",
                          "applied to a sum over the batch"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_losses_that_do_not_add_up_are_refused_naming_the_construct(name):
    loss, primitive, reason = REFUSED[name]
    with pytest.raises(OptionsError, match=rf"its loss cannot be rebuilt exactly from micro-batches: `{primitive}` at "
                                           rf"\S*test_pipeshard_forms.py:\d+:\d+ \(<lambda>\) {reason}"):
        micro_batched(loss, (W, X, Y))


def test_constants_before_the_gradient_are_folded_into_the_loss():
    """`jnp.where(x > 0, 1, 0)`, `inputs > pad_id` and `fold_in(rng, step)` before the gradient
    (Literals in the step's jaxpr) used to fail with "unhashable type: 'Literal'"."""
    def step(w, x, y, rng, count):
        weights = jnp.where(x[:, 0] > 0, 1, 0).astype(jnp.float32)
        keep = x > 0.5
        key = jax.random.fold_in(rng, count)

        def loss_fn(w):
            h = jnp.where(keep, x, 0) @ w + 1e-3 * jax.random.normal(key, (ROWS, 5))
            return jnp.sum(((h - y) ** 2).mean(-1) * weights) / weights.sum()

        loss, grad = jax.value_and_grad(loss_fn)(w)
        return w - 0.1 * grad, count + 1, loss

    traced = trace_step(step, (W, X, Y, KEY, jnp.int32(3)), "step")
    loss = loss_program(traced, "step")
    assert loss.inputs == (0, 1, 2, 3, 4) and loss.weights == (0,)
    np.testing.assert_allclose(jaxpr_as_fun(loss.closed)(W, X, Y, KEY, jnp.int32(3))[0],
                               jax.jit(step)(W, X, Y, KEY, jnp.int32(3))[2], rtol=1e-6)


@pytest.mark.parametrize("reduce", [lambda e, y: jnp.sum(e),
                                    lambda e, y: jnp.sum(e * (y[:, 0] > 0)) / jnp.sum(y[:, 0] > 0)],
                         ids=["sum", "weighted mean"])
def test_a_loss_function_cut_by_hand_must_be_a_mean(reduce):
    """A loss function `f(params, x, targets)` keeps Alpa's rule, the mean of the micro-batch
    losses: exact only for a mean over examples, so other forms are refused, pointing to the
    whole-step form that splits them exactly."""
    from meshplan.runtime import mark_pipeline_boundary

    def loss(params, x, y):
        h = mark_pipeline_boundary(jnp.tanh(x @ params[0]))
        return reduce(((h @ params[1] - y) ** 2).mean(-1), y)

    params = [jnp.ones((8, 8)) / 8, jnp.ones((8, 5))]
    with pytest.raises(OptionsError, match="loss is not a mean over the batch's examples .* Pass the whole train step"):
        parallelize(loss, method=PipeshardParallel(2))(params, X, Y)


# --- example steps under PipeshardParallel vs one device ----------------------------------------------

_REFERENCE: dict[str, tuple] = {}


def run(step, state, batch, extra, steps=3):
    """(final state, metrics per step); a step returning a third value (run_mlm's new dropout key)
    passes it to the next call."""
    metrics = []
    for _ in range(steps):
        out = step(state, batch, *extra)
        state, extra = out[0], (out[2],) if len(out) == 3 else extra
        metrics.append(jax.tree_util.tree_map(np.asarray, out[1]))
    return state, metrics


def assert_trains_like_one_device(name, method):
    step, state, extra, batch = getattr(example_steps, f"{name}_program")()[:4]
    parallel = parallelize(step, method=method, batch_argnums=(1,))
    got_state, got = run(parallel, state, batch, extra)
    if name not in _REFERENCE:
        _REFERENCE[name] = run(jax.jit(step), state, batch, extra)
    want_state, want = _REFERENCE[name]
    for got_metrics, want_metrics in zip(got, want, strict=True):
        for key, value in want_metrics.items():
            if np.issubdtype(value.dtype, np.integer):
                np.testing.assert_array_equal(got_metrics[key], value, err_msg=key)
            else:
                np.testing.assert_allclose(got_metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    got_leaves, want_leaves = (jax.tree_util.tree_leaves(s.params) for s in (got_state, want_state))
    error = sum(float(np.abs(np.asarray(a) - np.asarray(b)).sum()) for a, b in zip(got_leaves, want_leaves,
                                                                                    strict=True))
    assert error / sum(float(np.abs(np.asarray(b)).sum()) for b in want_leaves) <= 1e-4
    assert int(got_state.step) == int(want_state.step) == 3
    return parallel


# Each example once (a run plans and compiles ~25 XLA programs: a minute on a loaded 2-core machine),
# the two configurations spread over them; every pair was run once (docs/design.md, "Runtime:
# whole-step pipeshard").
CASES = [("lm1b", PipeshardParallel(2, layers=2)), ("gemma", PipeshardParallel(4, layers="auto")),
         ("summarization", PipeshardParallel(2, layers=2)), ("clm", PipeshardParallel(4, layers="auto")),
         ("mlm", PipeshardParallel(4, layers=2))]


@pytest.mark.parametrize(("name", "method"), CASES,
                         ids=[f"{n}-{m.num_micro_batches}x-layers={m.layers}" for n, m in CASES])
def test_example_steps_train_like_one_device(name, method):
    parallel = assert_trains_like_one_device(name, method)
    compiled = parallel._last
    plan = parallel.get_plan()
    assert len(plan.stages) == 2 and plan.option("step") == "whole"
    dropout = name != "gemma"
    assert compiled.program.indexed == dropout  # dropout: draws in rows of the full batch, by micro-batch index
    if name in ("lm1b", "gemma"):  # loss / weight_sum, weight_sum = sum of the non-padding weights
        assert compiled.program.num_statistics >= 1 and compiled.program.rules == (Rule("sum"), Rule("join", 0))
    if name == "summarization":  # a summed loss and its int32 token count (the metrics' "num_labels")
        assert compiled.program.rules == (Rule("sum"), Rule("same"))
    if method.num_micro_batches == 2:  # 2 stages of 4 devices on (2, 2) meshes: the stages run their plans
        assert [s.logical_mesh for s in plan.stages] == [(2, 2), (2, 2)]
        for check in parallel.get_collectives():
            assert check.agrees, (check.missing, check.unplanned)


def test_summarization_eval_step_runs_forward_only_like_one_device():
    _, state, _, batch, eval_step = example_steps.summarization_program()
    params = state.params
    parallel = parallelize(eval_step, method=PipeshardParallel(2, layers=2), batch_argnums=(1,))
    got, want = parallel(params, batch), jax.jit(eval_step)(params, batch)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    assert got["num_labels"].dtype == want["num_labels"].dtype and int(got["num_labels"]) == int(want["num_labels"])
    assert parallel.get_plan().option("step") == "forward"
    assert {e.phase.value for e in parallel.last_events} == {"F"} and len(parallel.last_events) == 2 * 2


# --- donation ---------------------------------------------------------------------------------------

def mlp_adamw_program():
    k = jax.random.split(jax.random.key(1), 4)
    params = {"w1": jax.random.normal(k[0], (32, 64)) / 6, "w2": jax.random.normal(k[1], (64, 64)) / 8,
              "w3": jax.random.normal(k[2], (64, 8)) / 8}
    x, y = jax.random.normal(k[3], (16, 32)), jnp.ones((16, 8))
    optimizer = optax.adamw(1e-2)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            h = jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"])
            return jnp.mean((h @ p["w3"] - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, optimizer.init(params)), (x, y)


def shard_pointers(tree):
    return sorted(s.data.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(tree) for s in x.addressable_shards)


def arrays_and_scalars(tree):
    leaves = jax.tree_util.tree_leaves(tree)
    return [x for x in leaves if x.ndim], [x for x in leaves if not x.ndim]


def test_donated_state_is_updated_in_place():
    step, state, batch = mlp_adamw_program()
    parallel = parallelize(step, method=PipeshardParallel(2, layers=2), donate_argnums=(0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedDonationWarning)
        warnings.filterwarnings("error", message="Some donated buffers were not usable")
        *first, _ = parallel(*state, *batch)
        assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(state))  # moved, so copied first
        arrays, scalars = arrays_and_scalars(first)
        pointers = shard_pointers(arrays)
        *second, loss = parallel(*first, *batch)
    # scalars (Adam's count) come back on the last stage beside the loss, so that eager code can
    # combine a step's scalars; the next update copies them to their stage (4 bytes) and leaves
    # the returned one valid. Every other leaf is written into the buffer it was donated in.
    assert all(x.is_deleted() for x in arrays) and len(scalars) == 1
    assert not any(x.is_deleted() for x in scalars)
    assert all(x.sharding.mesh == parallel._last.parts.pipeline.stage_meshes[-1] for x in scalars)
    assert shard_pointers(arrays_and_scalars(second)[0]) == pointers  # new weights and moments in the old buffers
    update = parallel._last.update
    donated = sum(len(d) for d in update.donations)
    assert donated == len(jax.tree_util.tree_leaves(state)) and update.not_donated == ()
    aliases = 0
    for n in range(len(update.pieces)):  # the compiled update pieces alias each donated input to a result
        compiled = update.compiled_piece(n)
        aliases += len(re.findall(r"may-alias", compiled.as_text().splitlines()[0]))
        assert compiled.memory_analysis().alias_size_in_bytes > 0
    assert aliases == donated
    want = jax.jit(step)(*jax.jit(step)(*state, *batch)[:2], *batch)
    np.testing.assert_allclose(loss, want[2], rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(second), jax.tree_util.tree_leaves(want[:2]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_donation_that_cannot_be_used_warns():
    step, state, batch = mlp_adamw_program()

    def keeps_lr(params, opt_state, x, y, lr):
        new_params, new_state, loss = step(params, opt_state, x, y)
        return new_params, new_state, lr, loss  # lr returned as it is: nothing replaces its buffer

    parallel = parallelize(keeps_lr, method=PipeshardParallel(2, layers=2), donate_argnums=(0, 1, 4))
    with pytest.warns(UnusedDonationWarning, match=r"args\[4\] are not donated .* returns it as it is"):
        parallel(*state, *batch, jnp.float32(0.1))
