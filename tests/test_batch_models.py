"""The batch found right on models whose positions carry meaning, with their authors' train steps.

Rotary and sinusoidal position models (HF Mistral, an lm1b-style linen decoder, a gemma-style nnx
model) could have their sequence dim taken for the batch (it can reach more values: both dims of
every attention score). Now the batch is the proved-independent dim on every model here, and:
DataParallel splits Mistral's batch; whole-step PipeshardParallel cuts Mistral's micro-batches
along it and trains like one device (loss within 1e-5 absolute, parameters within 1e-4 mean
relative after 3 AdamW steps); Alpa's run_mlp pipeline test, batch inferred, equals one device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import batch_models as bm
import framework_models as fm
from meshplan.capture import capture, infer_batch_inputs
from meshplan.parallel import DataParallel, PipeshardParallel, parallelize
from meshplan.report.load import load_plan
from meshplan.report.text import header_lines

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CLM_BATCH = ["args[1]['attention_mask']", "args[1]['input_ids']", "args[1]['labels']"]
mistral, gpt2, llama = (functools.cache(make) for make in (bm.mistral, fm.gpt2, fm.llama))  # built once per run


def clm(model):
    return bm.clm_train_step, (bm.clm_state(model, optax.adamw(1e-3)), bm.clm_batch())


def lm_step(model):
    optimizer = optax.adamw(1e-3)
    return fm.lm_step(model, optimizer), (model.params, optimizer.init(model.params), fm.tokens())


def regression(program):
    step, params, (x, y) = program(optax.adamw(1e-3))
    return step, (params, optax.adamw(1e-3).init(params), x, y)


PROGRAMS = {  # name -> (make (step, args), the batch leaves, whether attention mixes the sequence)
    "hf_mistral_run_clm": (lambda: clm(mistral()), CLM_BATCH, True),
    "hf_gpt2_run_clm": (lambda: clm(gpt2()), CLM_BATCH, True),
    "hf_llama_run_clm": (lambda: clm(llama()), CLM_BATCH, True),
    "hf_gpt2_ids": (lambda: lm_step(gpt2()), ["args[2]"], True),
    "hf_llama_ids": (lambda: lm_step(llama()), ["args[2]"], True),
    "linen_lm1b_sinusoidal": (lambda: (lambda p: (p[0], p[1:]))(bm.lm1b_program(optax.adamw(1e-3))),
                              ["args[1]['inputs']", "args[1]['inputs_position']", "args[1]['inputs_segmentation']"],
                              True),
    "nnx_gemma_rotary": (lambda: (lambda p: (p[0], p[1:]))(bm.gemma_program(optax.adamw(1e-3))),
                         ["args[1]['inputs']", "args[1]['inputs_position']", "args[1]['targets']"], True),
    "nnx_mlp": (lambda: regression(fm.nnx_mlp_program), ["args[2]", "args[3]"], False),
    "equinox_mlp": (lambda: regression(fm.eqx_mlp_program), ["args[2]", "args[3]"], False),
    "alpa_pipeline_mlp": (lambda: (lambda p: (p[0], p[1:]))(bm.alpa_mlp_program()), ["args[1]['x']", "args[1]['y']"],
                          False),
}


@pytest.mark.parametrize("name", PROGRAMS)
def test_the_batch_is_the_dim_proved_to_hold_independent_examples(name):
    make, leaves, attention = PROGRAMS[name]
    step, args = make()
    c = capture(step, *args)
    found = infer_batch_inputs(c)
    assert [c.graph[c.input_nodes[i]].name for i, _ in found.dims] == leaves
    assert {d for _, d in found.dims} == {0} and found.inferred and found.independent
    text = found.explain(c)
    assert text.startswith(f"{leaves[0]} ")
    assert ", inferred: proved independent: nothing mixes positions along it" in text
    if attention:  # the sequence family reaches more values, and is passed over with the attention scores named
        assert f"other candidates: {leaves[0]} i32[" in text and "(dim 1)" in text
        assert "holds it on dims" in text.split("other candidates: ")[1].split(";")[0]


def test_data_parallel_splits_mistrals_batch_not_its_sequence(tmp_path):
    state, batch = bm.clm_state(mistral(), optax.adamw(1e-3)), bm.clm_batch(batch=8)
    parallel = parallelize(bm.clm_train_step, method=DataParallel())
    _, metrics = parallel(state, batch)
    _, want = jax.jit(bm.clm_train_step)(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(want["loss"]), rtol=1e-5)
    for key in ("input_ids", "attention_mask", "labels"):
        sharding = parallel.get_input_shardings()[1][key]
        assert sharding.shard_shape((8, 8)) == (1, 8), key  # 8 devices, one example each, whole sequences
    specs = {c.name: str(c.output) for c in parallel.get_plan().nodes if c.op == "parameter"}
    assert all(specs[name] == "S0R" for name in CLM_BATCH)
    described = parallel.describe_batch()
    assert described.startswith("args[1]['attention_mask'] i32[8, 8] (dim 0), args[1]['input_ids'] i32[8, 8] (dim 0), "
                                "args[1]['labels'] i32[8, 8] (dim 0), inferred: proved independent")
    parallel.dump_debug_info(tmp_path)  # the plan report shows the choice and its reason
    assert f"batch {described}" in header_lines(load_plan(tmp_path))


def max_mean_relative(got, want):
    return max(float(jnp.mean(jnp.abs(a - b)) / jnp.mean(jnp.abs(b)))
               for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True))


def test_whole_step_pipeshard_on_mistral_cuts_the_batch_and_trains_like_one_device():
    state, batch = bm.clm_state(mistral(), optax.adamw(1e-3)), bm.clm_batch()
    # two stages of one device each: the cut into micro-batches is the point, and compiling stays cheap
    parallel = parallelize(bm.clm_train_step, method=PipeshardParallel(num_micro_batches=2), devices=jax.devices()[:2])
    got, want, serial = state, state, jax.jit(bm.clm_train_step)
    for _ in range(3):
        got, metrics = parallel(got, batch)
        want, want_metrics = serial(want, batch)
        assert abs(float(metrics["loss"]) - float(want_metrics["loss"])) <= 1e-5
    assert max_mean_relative(got.params, want.params) <= 1e-4
    assert sorted(parallel._last.batch.items()) == [(i, 0) for i in sorted(parallel._last.batch)]  # all along dim 0
    assert parallel.describe_batch().startswith("args[1]['attention_mask'] i32[4, 8] (dim 0)")
    assert parallel.get_plan().option("batch") == parallel.describe_batch()


def test_alpas_pipeline_mlp_test_with_the_batch_inferred_equals_one_device():
    """Alpa's run_mlp: a boundary inside the model, 4 micro-batches, adam, 3 steps."""
    step, state, batch = bm.alpa_mlp_program()
    parallel = parallelize(step, method=PipeshardParallel(num_micro_batches=4))
    got, want, serial = state, state, jax.jit(step)
    for _ in range(3):
        got, value = parallel(got, batch)
        want, want_value = serial(want, batch)
        np.testing.assert_allclose(value, want_value, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(got.params), jax.tree_util.tree_leaves(want.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert parallel._last.layers.marked  # cut at the boundary, which capture saw through
    assert parallel.describe_batch().startswith("args[1]['x'] f32[64, 16] (dim 0), args[1]['y'] f32[64, 16] (dim 0), "
                                                "inferred: proved independent")
