"""ZeRO that shards, measured: per-device memory of the compiled step (`memory_analysis()`)
under Zero2Parallel and Zero3Parallel against DataParallel on Alpa's MLP and BERT layers (the
runs of tests/method_runs.py, which tests/test_method_layouts.py checks for collectives, state
layout at rest, donation and one-device equality), and a Hugging Face Flax BERT MLM step under
Zero3Parallel equal to one device.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from meshplan.parallel import Zero3Parallel, parallelize
from method_runs import STEPS, nbytes, one_device, split_eight_ways, trained


@pytest.mark.parametrize("program", ["mlp", "bert"])
def test_state_memory_per_device_is_an_eighth_of_data_parallel(program):
    """Argument bytes per device of the compiled step, measured: DataParallel holds the whole state
    S, Zero2Parallel the weights P and an eighth of the rest, Zero3Parallel an eighth of it all
    (scalars, the step counts, stay whole); each also holds an eighth of the batch B. The results
    reuse the arguments' buffers. Sizes are those of a state after a step (TrainState's step
    starts as a Python int)."""
    memory = {m: trained(program, m)[0]._last.sharded.executable.memory_analysis() for m in ("dp", "zero2", "zero3")}
    _, batch, (state, _) = one_device(program)
    eighth = lambda tree: sum(x.nbytes / (8 if x.ndim else 1) for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
    data = nbytes(batch) / 8
    whole = nbytes(state)
    expected = {"dp": whole, "zero2": whole - nbytes(state.opt_state) + eighth(state.opt_state), "zero3": eighth(state)}
    for method, analysis in memory.items():
        assert analysis.argument_size_in_bytes == pytest.approx(expected[method] + data, abs=0.5), method
        assert analysis.alias_size_in_bytes == pytest.approx(expected[method], abs=0.5), method
    held = {m: memory[m].argument_size_in_bytes - data for m in memory}  # the state's share
    assert held["zero3"] < held["dp"] / 7


def test_hugging_face_bert_mlm_under_zero3_equals_one_device():
    """FlaxBertForMaskedLM (small config, random weights) trained as Hugging Face's MLM example
    writes the step; Zero3Parallel shards it 8 ways. The one difference between plan and
    executable: XLA gathers the [batch, seq] label gradient of the cross-entropy's
    take_along_axis before its scatter-add (it does not see the scatter as parallel along the
    batch), 1 KB the plan does not list."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers warns that its Flax models are deprecated
        from transformers import BertConfig, FlaxBertForMaskedLM
    config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=16)
    model, optimizer = FlaxBertForMaskedLM(config, _do_init=False), optax.adamw(1e-3)
    # initialised in one jitted program: eagerly, each initializer compiles alone (half the test's time)
    initial = jax.jit(model.init_weights, static_argnums=1)(jax.random.key(0), (1, 1))
    ids = jax.random.randint(jax.random.key(3), (16, 16), 0, config.vocab_size)
    labels = jnp.where(jax.random.uniform(jax.random.key(4), ids.shape) < 0.15, ids, -100)

    def step(params, opt_state, ids, labels):
        def loss_fn(params):
            logits = model(ids, params=params, train=False).logits
            mask = labels >= 0
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, labels, 0))
            return jnp.sum(loss * mask) / jnp.sum(mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def run(fn):
        params, opt_state, losses = initial, optimizer.init(initial), []
        for _ in range(STEPS):
            params, opt_state, loss = fn(params, opt_state, ids, labels)
            losses.append(float(loss))
        return params, opt_state, losses

    parallel = parallelize(step, method=Zero3Parallel(), batch_argnums=(2, 3), donate_argnums=(0, 1))
    params, opt_state, losses = run(parallel)
    want_params, _, want_losses = run(jax.jit(step))
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-5)
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(t)]) for t in (params, want_params))
    assert np.mean(np.abs(a - b)) / np.mean(np.abs(b)) <= 1e-4
    state = (params, opt_state)
    assert len(parallel._last.donation.pairs) == len(jax.tree_util.tree_leaves(state))
    assert all(split_eight_ways(x) for x in jax.tree_util.tree_leaves(state) if x.ndim and x.shape[-1] % 8 == 0)
    memory = parallel._last.sharded.executable.memory_analysis()
    assert memory.argument_size_in_bytes == pytest.approx((nbytes(state) + nbytes((ids, labels))) / 8, rel=0.02)
    check = parallel.get_collectives()
    assert check.missing == () and [(k, a, b, op) for k, a, b, op in check.unplanned] == [
        ("all-gather", (0,), ids.size * 4, "jit(run)/scatter-add")]
