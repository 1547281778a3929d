"""runtime.pipeline / runtime.boundary: a 4-layer MLP pipelined over disjoint CPU sub-meshes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jax_models import PIPE_BATCH, PIPE_SIZES, pipe_data, pipe_layers, pipe_mlp_params
from meshplan.errors import GraphError, MeshError, OptionsError
from meshplan.runtime import (
    Event,
    Phase,
    Pipeline,
    apply_update,
    make_schedule,
    mark_pipeline_boundary,
    place_params,
    run_pipeline,
    split_into_stages,
)

SIZES, BATCH = PIPE_SIZES, PIPE_BATCH
TOL = dict(rtol=1e-5, atol=1e-6)
mlp_params, data, layers = pipe_mlp_params, pipe_data, pipe_layers
F, B = Phase.FORWARD, Phase.BACKWARD


def loss_of(out, y):
    return jnp.mean((out - y) ** 2)


def full_loss(params, x, y):
    return loss_of(layers(params, x), y)


def stage_meshes(num_stages):
    devices = np.array(jax.devices()[:8]).reshape(num_stages, -1)
    return [Mesh(row, ("x",), axis_types=(AxisType.Auto,)) for row in devices]


def mlp_pipeline(num_stages):
    """Stage k runs layers [k*L/S, (k+1)*L/S); params_per_stage[k] is the list of those layers."""
    per = (len(SIZES) - 1) // num_stages
    fns = [layers] * (num_stages - 1) + [lambda p, x, y: loss_of(layers(p, x), y)]
    params = mlp_params()
    return Pipeline(fns, stage_meshes(num_stages)), [params[k * per:(k + 1) * per] for k in range(num_stages)]


def reference(params, x, y):
    device = jax.devices()[0]
    return jax.jit(jax.value_and_grad(full_loss))(*jax.device_put((params, x, y), device))


def flat_grads(grads_per_stage):
    return [g for stage in grads_per_stage for g in stage]


def assert_trees_close(got, want):
    got_leaves, want_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


# --- boundary marker -------------------------------------------------------------------------


def test_boundary_marker_keeps_value_and_grad():
    params, (x, y) = mlp_params(), data()

    def marked(params, x, y):
        h = mark_pipeline_boundary(layers(params[:2], x))
        h, y2 = mark_pipeline_boundary(layers(params[2:3], h), y)
        return loss_of(layers(params[3:], h), y2)

    assert str(jax.make_jaxpr(marked)(params, x, y)).count("pipeline_boundary") == 2
    assert float(marked(params, x, y)) == float(full_loss(params, x, y))
    assert_trees_close(jax.grad(marked)(params, x, y), jax.grad(full_loss)(params, x, y))
    assert_trees_close(jax.jit(jax.grad(marked))(params, x, y), jax.grad(full_loss)(params, x, y))
    per_example = jax.vmap(lambda xi: marked(params, xi[None], y[:1]))(x)
    assert per_example.shape == (BATCH,)


# --- schedules (pure Python) -----------------------------------------------------------------


def events(*triples):
    return tuple(Event(s, m, p) for s, m, p in triples)


def test_1f1b_order_two_stages_four_micro_batches():
    assert make_schedule("1f1b", 2, 4) == events(
        (0, 0, F),
        (0, 1, F), (1, 0, F),
        (1, 0, B),
        (0, 0, B), (1, 1, F),
        (0, 2, F), (1, 1, B),
        (0, 1, B), (1, 2, F),
        (0, 3, F), (1, 2, B),
        (0, 2, B), (1, 3, F),
        (1, 3, B),
        (0, 3, B),
    )


def test_gpipe_order_two_stages_four_micro_batches():
    assert make_schedule("gpipe", 2, 4) == events(
        (0, 0, F),
        (0, 1, F), (1, 0, F),
        (0, 2, F), (1, 1, F),
        (0, 3, F), (1, 2, F),
        (1, 3, F),
        (1, 0, B),
        (0, 0, B), (1, 1, B),
        (0, 1, B), (1, 2, B),
        (0, 2, B), (1, 3, B),
        (0, 3, B),
    )


def test_1f1b_per_stage_order_has_stages_minus_index_minus_one_warmup_forwards():
    order = make_schedule("1f1b", 4, 4)
    per_stage = {s: [(e.micro_batch, e.phase.value) for e in order if e.stage == s] for s in range(4)}
    assert per_stage[0] == [(0, "F"), (1, "F"), (2, "F"), (3, "F"), (0, "B"), (1, "B"), (2, "B"), (3, "B")]
    assert per_stage[1] == [(0, "F"), (1, "F"), (2, "F"), (0, "B"), (3, "F"), (1, "B"), (2, "B"), (3, "B")]
    assert per_stage[2] == [(0, "F"), (1, "F"), (0, "B"), (2, "F"), (1, "B"), (3, "F"), (2, "B"), (3, "B")]
    assert per_stage[3] == [(0, "F"), (0, "B"), (1, "F"), (1, "B"), (2, "F"), (2, "B"), (3, "F"), (3, "B")]


def test_unknown_schedule_is_rejected():
    with pytest.raises(OptionsError, match="unknown pipeline schedule 'zb'"):
        make_schedule("zb", 2, 4)


# --- execution on 8 CPU devices ---------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_micro_batches", [1, 2, 4])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_pipeline_matches_value_and_grad(num_stages, num_micro_batches, schedule):
    pipeline, params = mlp_pipeline(num_stages)
    x, y = data()
    result = run_pipeline(pipeline, params, x, y, num_micro_batches, schedule)
    want_loss, want_grads = reference(mlp_params(), x, y)
    np.testing.assert_allclose(float(result.loss), float(want_loss), **TOL)
    assert_trees_close(flat_grads(result.grads), want_grads)
    assert result.events == make_schedule(schedule, num_stages, num_micro_batches)


@pytest.mark.parametrize("num_stages", [2, 4])
def test_params_and_grads_live_only_on_their_stage_devices(num_stages):
    pipeline, params = mlp_pipeline(num_stages)
    x, y = data()
    result = run_pipeline(pipeline, params, x, y, 2)
    new_params = apply_update(params, result.grads, lambda p, g: p)
    for k, mesh in enumerate(pipeline.stage_meshes):
        want = set(mesh.devices.flat)
        assert len(want) == 8 // num_stages
        for leaf in jax.tree_util.tree_leaves((result.grads[k], new_params[k])):
            assert leaf.sharding.device_set == want
    assert result.loss.sharding.device_set == set(pipeline.stage_meshes[-1].devices.flat)


def test_three_sgd_steps_match_single_device():
    pipeline, params = mlp_pipeline(2)
    x, y = data()
    sgd = lambda p, g: jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g)
    want = jax.device_put(mlp_params(), jax.devices()[0])
    for _ in range(3):
        params = apply_update(params, run_pipeline(pipeline, params, x, y, 4).grads, sgd)
        want = jax.jit(lambda p: sgd(p, jax.grad(full_loss)(p, x, y)))(want)
    assert_trees_close([layer for stage in params for layer in stage], want)


def test_overlapping_stage_meshes_are_rejected():
    mesh = stage_meshes(2)[0]
    with pytest.raises(MeshError, match="give each stage a disjoint subset of devices"):
        Pipeline([layers, layers], [mesh, mesh])


def test_micro_batches_must_divide_the_batch():
    pipeline, params = mlp_pipeline(2)
    x, y = data()
    with pytest.raises(OptionsError, match="do not split into 3 equal micro-batches"):
        run_pipeline(pipeline, params, x, y, 3)


# --- splitting a marked forward function --------------------------------------------------------


def marked_mlp(params, x, y):
    """Two stages: params[0] is layers 0-1, params[1] is layers 2-3."""
    h = mark_pipeline_boundary(layers(params[0], x))
    return loss_of(layers(params[1], h), y)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_split_into_stages_runs_pipelined_like_value_and_grad(schedule):
    full = mlp_params()
    params, (x, y) = [full[:2], full[2:]], data()
    fns = split_into_stages(marked_mlp, params, x[:2], y[:2])
    result = run_pipeline(Pipeline(fns, stage_meshes(2)), params, x, y, 4, schedule)
    want_loss, want_grads = reference(full, x, y)
    np.testing.assert_allclose(float(result.loss), float(want_loss), **TOL)
    assert_trees_close(flat_grads(result.grads), want_grads)


def test_split_rejects_a_stage_reading_another_stages_params():
    def leaky(params, x, y):
        h = mark_pipeline_boundary(layers(params[0], x))
        return loss_of(layers(params[1], h) + params[0][0]["b"][:4], y)

    full, (x, y) = mlp_params(), data()
    with pytest.raises(GraphError, match="stage 1 op slice reads"):
        split_into_stages(leaky, [full[:2], full[2:]], x, y)


def test_split_rejects_a_boundary_count_that_does_not_match_params():
    full, (x, y) = mlp_params(), data()
    unmarked = lambda params, x, y: full_loss([*params[0], *params[1], *params[2]], x, y)
    with pytest.raises(GraphError, match="0 top-level pipeline boundaries but params has 3"):
        split_into_stages(unmarked, [full[:1], full[1:2], full[2:]], x, y)


def test_split_handles_custom_jvp_ops_and_a_two_value_boundary():
    def fn(params, x, y):
        h = mark_pipeline_boundary(jax.nn.relu(x @ params[0]), jax.nn.gelu(x @ params[0], approximate=False))
        return jnp.mean((jax.nn.logsumexp(h[0] @ params[1] + h[1] @ params[1], axis=-1) - y) ** 2)

    params = [jnp.full((4, 3), 0.3, jnp.float32), jnp.full((3, 2), -0.2, jnp.float32)]
    x, y = jnp.arange(16.0, dtype=jnp.float32).reshape(4, 4) / 16, jnp.ones(4, jnp.float32)
    first, last = split_into_stages(fn, params, x, y)
    assert isinstance(first(params[0], x), tuple) and len(first(params[0], x)) == 2
    split = lambda p: last(p[1], first(p[0], x), y)
    np.testing.assert_allclose(float(split(params)), float(fn(params, x, y)), **TOL)
    assert_trees_close(jax.grad(split)(params), jax.grad(fn)(params, x, y))


# --- data parallelism inside each stage ---------------------------------------------------------


def recording_pipeline(num_stages, seen):
    """`mlp_pipeline` with data_parallel=True whose stages record the sharding their input is compiled with."""
    def record(k, x):
        jax.debug.inspect_array_sharding(x, callback=lambda s: seen.setdefault(k, []).append(s))
        return x

    per = (len(SIZES) - 1) // num_stages
    fns = [lambda p, x, k=k: layers(p, record(k, x)) for k in range(num_stages - 1)]
    fns.append(lambda p, x, y: loss_of(layers(p, record(num_stages - 1, x)), y))
    params = mlp_params()
    pipeline = Pipeline(fns, stage_meshes(num_stages), data_parallel=True)
    return pipeline, [params[k * per:(k + 1) * per] for k in range(num_stages)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_micro_batches", [1, 2])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_data_parallel_stages_match_value_and_grad_and_split_the_batch(num_stages, num_micro_batches, schedule):
    seen = {}
    pipeline, params = recording_pipeline(num_stages, seen)
    x, y = data()
    result = run_pipeline(pipeline, params, x, y, num_micro_batches, schedule)
    want_loss, want_grads = reference(mlp_params(), x, y)
    np.testing.assert_allclose(float(result.loss), float(want_loss), **TOL)
    assert_trees_close(flat_grads(result.grads), want_grads)
    per_stage, micro = 8 // num_stages, BATCH // num_micro_batches
    per = (len(SIZES) - 1) // num_stages
    for k, mesh in enumerate(pipeline.stage_meshes):
        assert pipeline.activation_sharding(k) == NamedSharding(mesh, PartitionSpec(("x",)))
        # Each device of stage k computes on micro / per_stage rows of the stage's input.
        width = SIZES[k * per]
        assert seen[k] and {s.shard_shape((micro, width)) for s in seen[k]} == {(micro // per_stage, width)}
        for leaf in jax.tree_util.tree_leaves(result.grads[k]):  # grads summed over the stage: replicated
            assert leaf.sharding.is_fully_replicated and leaf.sharding.device_set == set(mesh.devices.flat)


@pytest.mark.parametrize(("data_parallel", "all_reduces"), [(False, 0), (True, 1)])
def test_data_parallel_backward_sums_param_grads_with_one_all_reduce(data_parallel, all_reduces):
    base, params = mlp_pipeline(2)
    pipeline = Pipeline(base.stage_fns, base.stage_meshes, data_parallel=data_parallel)
    x, _ = data()
    y, vjp_fn = pipeline._forwards[0](place_params(pipeline, params)[0],
                                      jax.device_put(x[:4], pipeline.activation_sharding(0)))
    hlo = pipeline._backwards[0].lower(vjp_fn, y).compile().as_text()
    # XLA combines the four param grads into one all-reduce; the input cotangent stays split.
    assert hlo.count("all-reduce(") == all_reduces and hlo.count("all-gather(") == 0


def test_data_parallel_activation_sharding_gives_each_device_its_rows():
    pipeline, params = mlp_pipeline(2)
    pipeline = Pipeline(pipeline.stage_fns, pipeline.stage_meshes, data_parallel=True)
    x, _ = data()
    placed = jax.device_put(x[:4], pipeline.activation_sharding(1))
    assert placed.sharding.device_set == set(pipeline.stage_meshes[1].devices.flat)
    assert [s.data.shape for s in placed.addressable_shards] == [(1, SIZES[0])] * 4


def test_replicated_stages_keep_activations_replicated():
    pipeline, _ = mlp_pipeline(2)
    assert pipeline.activation_sharding(0) == NamedSharding(pipeline.stage_meshes[0], PartitionSpec())


def test_data_parallel_micro_batch_must_divide_by_stage_devices():
    pipeline, params = mlp_pipeline(2)
    pipeline = Pipeline(pipeline.stage_fns, pipeline.stage_meshes, data_parallel=True)
    x, y = data()
    with pytest.raises(OptionsError, match=r"splits stage 0's micro-batch \(shape \(2, 16\)\) along dim 0 over "
                                           r"its 4 devices, but 2 rows are not divisible by 4"):
        run_pipeline(pipeline, params, x, y, 4)
