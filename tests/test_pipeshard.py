"""pipeshard: parallelize(loss_fn, method=PipeshardParallel(...)) on 8 fake CPU devices equals
jax.value_and_grad on one device."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_models import PIPE_BATCH, PIPE_SIZES, pipe_data, pipe_layers, pipe_mlp_params
from meshplan.errors import MeshError, OptionsError
from meshplan.parallel import PipeshardFunction, PipeshardParallel, apply_update, parallelize
from meshplan.parallel import pipeshard_function as pipeshard_module
from meshplan.plan import Plan
from meshplan.runtime import Event, Phase, make_schedule, mark_pipeline_boundary

SIZES, BATCH = PIPE_SIZES, PIPE_BATCH
TOL = dict(rtol=1e-5, atol=1e-6)
mlp_layers, data, layers = pipe_mlp_params, pipe_data, pipe_layers


def staged_loss(params, x, y):
    """params[k] holds stage k's layers; a boundary after every stage but the last."""
    for stage in params[:-1]:
        x = mark_pipeline_boundary(layers(stage, x))
    return jnp.mean((layers(params[-1], x) - y) ** 2)


def stage_params(num_stages):
    full, per = mlp_layers(), (len(SIZES) - 1) // num_stages
    return [full[k * per:(k + 1) * per] for k in range(num_stages)]


def reference(params, x, y):
    return jax.jit(jax.value_and_grad(staged_loss))(*jax.device_put((params, x, y), jax.devices()[0]))


def assert_trees_close(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


def devices_of(tree):
    return {d for leaf in jax.tree_util.tree_leaves(tree) for d in leaf.sharding.device_set}


# --- numerics --------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_micro_batches", [1, 4])
def test_loss_and_grads_equal_value_and_grad(num_stages, schedule, num_micro_batches):
    params, (x, y) = stage_params(num_stages), data()
    f = parallelize(staged_loss, method=PipeshardParallel(num_micro_batches, schedule=schedule))
    assert isinstance(f, PipeshardFunction)
    loss, grads = f(params, x, y)
    want_loss, want_grads = reference(params, x, y)
    np.testing.assert_allclose(float(loss), float(want_loss), **TOL)
    assert_trees_close(grads, want_grads)
    per = 8 // num_stages
    for k, g in enumerate(grads):  # stage k's grads live on its contiguous group of devices
        assert devices_of(g) == set(jax.devices()[k * per:(k + 1) * per])


def test_three_sgd_steps_match_single_device():
    params, (x, y) = stage_params(2), data()
    sgd = lambda p, g: jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g)
    f = parallelize(staged_loss, method=PipeshardParallel(4))
    want = jax.device_put(params, jax.devices()[0])
    losses, want_losses = [], []
    for _ in range(3):
        loss, grads = f(params, x, y)
        params = apply_update(params, grads, sgd)
        want_loss, want_grads = reference(want, x, y)
        want = sgd(want, want_grads)
        losses.append(float(loss))
        want_losses.append(float(want_loss))
    np.testing.assert_allclose(losses, want_losses, **TOL)
    assert losses[2] < losses[0]
    assert_trees_close(params, want)


def test_explicit_disjoint_stages():
    params, (x, y) = stage_params(2), data()
    f = parallelize(staged_loss, method=PipeshardParallel(2, stages=[[7, 1, 3], (0,)]))
    loss, grads = f(params, x, y)
    want_loss, want_grads = reference(params, x, y)
    np.testing.assert_allclose(float(loss), float(want_loss), **TOL)
    assert_trees_close(grads, want_grads)
    devices = jax.devices()
    assert devices_of(grads[0]) == {devices[7], devices[1], devices[3]}
    assert devices_of(grads[1]) == {devices[0]}
    assert tuple(s.devices for s in f.get_plan().stages) == ((7, 1, 3), (0,))


# --- errors ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("stages", "message"), [
    (((0, 1), (1, 2)), "device index 1 is in stages 0 and 1; give each stage a disjoint set of devices"),
    (((0, 1), (8,)), "stage 1 uses device index 8, but only 8 devices exist; use indices in \\[0, 8\\)"),
    (((0, 1), (-1,)), "stage 1 uses device index -1"),
    (((0, 1), ()), "stage 1 has no devices"),
    (((0,), (1,), (2,)), "covers 3 layers but the function has 2"),
])
def test_bad_explicit_stages_are_rejected(stages, message):
    params, (x, y) = stage_params(2), data()
    f = parallelize(staged_loss, method=PipeshardParallel(2, stages=stages))
    with pytest.raises(MeshError, match=message):
        f(params, x, y)


def test_uniform_stages_need_a_divisible_device_count():
    params, (x, y) = stage_params(2), data()
    f = parallelize(staged_loss, method=PipeshardParallel(2), devices=jax.devices()[:7])
    with pytest.raises(MeshError, match="splits 7 devices into 2 equal stages \\(one per layer\\), but 7 is not "
                                        "divisible by 2; use a device count divisible by 2, stages='auto'"):
        f(params, x, y)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(num_micro_batches=0), "num_micro_batches=0"),
    (dict(num_micro_batches=2, schedule="zb"), "schedule='zb'"),
    (dict(num_micro_batches=2, stages="even"), "stages='even'"),
    (dict(num_micro_batches=2, stage_sharding="tp"), "stage_sharding='tp'"),
    (dict(num_micro_batches=2, stages="auto", stage_mesh_shape=(2, 2)), "applies to stages='uniform'"),
    (dict(num_micro_batches=2, stages="auto", mesh_axes=4), "mesh_axes=4"),
    (dict(num_micro_batches=2, mesh_axes=3), r"3-D views for stages='auto'"),
])
def test_bad_options_are_rejected(kwargs, message):
    with pytest.raises(OptionsError, match=message):
        PipeshardParallel(**kwargs)


def test_stages_are_planned_without_the_exchanges_only_single_programs_run():
    """A stage's backward is JAX's, partitioned by XLA, so its plan may not count on the halo
    exchange of max pooling's gradient that ShardParallel's runtime runs itself."""
    from meshplan.cluster.costs import DeviceCosts
    from meshplan.parallel import ShardParallel

    assert PipeshardParallel(2).options(DeviceCosts()).rules.runtime_exchanges is False
    assert ShardParallel().options(DeviceCosts()).rules.runtime_exchanges is True


def test_micro_batches_must_divide_the_batch():
    params, (x, y) = stage_params(2), data()
    f = parallelize(staged_loss, method=PipeshardParallel(3))
    with pytest.raises(OptionsError, match="x has leading sizes \\[8\\] which do not split into 3 equal"):
        f(params, x, y)


def test_get_plan_before_a_call_is_an_error():
    f = parallelize(staged_loss, method=PipeshardParallel(2))
    with pytest.raises(OptionsError, match="call it once with example arguments first"):
        f.get_plan()


# --- plan, debug info, cache ----------------------------------------------------------------------

def test_get_plan_describes_the_last_run():
    params, (x, y) = stage_params(4), data()
    f = parallelize(staged_loss, method=PipeshardParallel(4, schedule="1f1b"))
    f(params, x, y)
    plan = f.get_plan()
    assert isinstance(plan, Plan) and plan.num_stages == 4 and plan.schedule == "1f1b"
    assert tuple(s.devices for s in plan.stages) == ((0, 1), (2, 3), (4, 5), (6, 7)) and plan.num_microbatches == 4
    assert [(s.first_layer, s.last_layer, s.logical_mesh) for s in plan.stages] == [(k, k, (2,)) for k in range(4)]
    assert f.last_events == make_schedule("1f1b", 4, 4) and f.get_stage_search() is None
    assert plan.prediction is None and plan.option("stages") == "uniform"
    assert all(s.intra_plan is not None for s in plan.stages)  # stage_sharding="auto" plans every stage
    assert [layout.plan for layout in f.get_layouts()] == [s.intra_plan for s in plan.stages]
    assert f.last_events[:2] == (Event(0, 0, Phase.FORWARD), Event(0, 1, Phase.FORWARD))
    assert Plan.from_json(plan.to_json()) == plan  # a captured pipeshard plan round-trips exactly


def test_dump_debug_info(tmp_path):
    params, (x, y) = stage_params(2), data()
    f = parallelize(staged_loss, method=PipeshardParallel(2, schedule="gpipe", stage_sharding="replicated"))
    f(params, x, y)
    paths = f.dump_debug_info(tmp_path / "debug")
    assert [p.name for p in paths] == [f"stage_{k}_{part}" for k in (0, 1) for part in (
        "forward.hlo.txt", "backward.hlo.txt", "memory.txt")] + ["plan.json", "placements.json"]
    assert sorted(p.name for p in (tmp_path / "debug").iterdir()) == sorted(p.name for p in paths)  # no temp files
    # Two tanh layers per stage, traced at the micro-batch size 8 / 2 = 4; stage 1 also reads targets.
    first, second = paths[0].read_text(), paths[3].read_text()
    assert first.count(" tanh(") == 2 and second.count(" tanh(") == 2
    assert "f32[4,16]" in first and "f32[4,32]" in second and "f32[4,4]" in second
    assert "f32[4,16]" in paths[1].read_text()  # the backward, at the micro-batch size too
    assert "argument_size_in_bytes" in paths[2].read_text()
    plan = Plan.from_json(paths[6].read_text())
    assert plan == f.get_plan() and plan.source == "pipeshard" and plan.schedule == "gpipe"
    assert plan.num_microbatches == 2 and plan.option("stage_sharding") == "replicated" and plan.prediction is None
    assert [(s.first_layer, s.last_layer, s.devices, s.logical_mesh, s.intra_plan) for s in plan.stages] == [
        (0, 0, (0, 1, 2, 3), (2, 2), None), (1, 1, (4, 5, 6, 7), (2, 2), None)]
    summary = json.loads(paths[7].read_text())
    placements = summary["stages"]
    assert summary["events"] == ["F0.0", "F0.1", "F1.0", "F1.1", "B1.0", "B0.0", "B1.1", "B0.1"]
    assert len(placements) == 2 and len(placements[1]["inputs"]) == 4 + 1 + 1  # 2 layers' (w, b), x, targets
    assert [p["involuntary_rematerializations"] for p in placements] == [0, 0]


def test_second_call_with_the_same_shapes_does_not_resplit(monkeypatch):
    calls, split = [], pipeshard_module.split_into_stages

    def counting_split(*args, **kwargs):
        calls.append(1)
        return split(*args, **kwargs)

    monkeypatch.setattr(pipeshard_module, "split_into_stages", counting_split)
    params, (x, y) = stage_params(2), data()
    f = parallelize(staged_loss, method=PipeshardParallel(2))
    f(params, x, y)
    pipeline = f._cache[next(iter(f._cache))].pipeline
    f(params, x, y)
    assert len(calls) == 1 and f._cache[next(iter(f._cache))].pipeline is pipeline
    f(params, x[:4], y[:4])  # new batch size: new split
    assert len(calls) == 2
    f(params, x, y)  # back to the first signature: cached
    assert len(calls) == 2


# --- data parallelism inside each stage ------------------------------------------------------------

@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_micro_batches", [1, 2])
def test_data_parallel_stages_equal_value_and_grad(num_stages, schedule, num_micro_batches):
    params, (x, y) = stage_params(num_stages), data()
    method = PipeshardParallel(num_micro_batches, schedule=schedule, stage_sharding="data_parallel")
    f = parallelize(staged_loss, method=method)
    loss, grads = f(params, x, y)
    want_loss, want_grads = reference(params, x, y)
    np.testing.assert_allclose(float(loss), float(want_loss), **TOL)
    assert_trees_close(grads, want_grads)
    per = 8 // num_stages
    for k, g in enumerate(grads):  # grads summed over the stage's devices: replicated on them
        assert devices_of(g) == set(jax.devices()[k * per:(k + 1) * per])
        assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree_util.tree_leaves(g))
    assert f.get_plan().option("stage_sharding") == "data_parallel"


def test_data_parallel_stage_forwards_take_batch_split_activations(tmp_path):
    params, (x, y) = stage_params(2), data()
    f = parallelize(staged_loss, method=PipeshardParallel(2, stage_sharding="data_parallel"))
    f(params, x, y)
    first, _, _, second, _, _, summary, _ = f.dump_debug_info(tmp_path)
    # Micro-batches of 4 rows split over 4 devices per stage (one row each); weights whole.
    assert "f32[1,16]" in first.read_text() and "f32[16,32]" in first.read_text()
    assert "f32[4,16]" not in first.read_text()
    assert "f32[1,32]" in second.read_text() and "f32[1,4]" in second.read_text()
    assert json.loads(summary.read_text())["options"]["stage_sharding"] == "data_parallel"


def test_data_parallel_stages_need_a_micro_batch_divisible_by_stage_devices():
    params, (x, y) = stage_params(2), data()
    f = parallelize(staged_loss, method=PipeshardParallel(4, stage_sharding="data_parallel"))
    with pytest.raises(OptionsError, match="splits each micro-batch of 2 examples .* but stage 0 has 4 devices "
                                           "and 2 is not divisible by 4"):
        f(params, x, y)
