"""Flax's convolutional examples (tests/conv_steps.py: the ImageNet ResNet step with BatchNorm's
mutable batch statistics and SGD with Nesterov momentum, and the MNIST CNN) trained 3 steps under
DataParallel, Zero3Parallel, ShardParallel and whole-step PipeshardParallel(layers="auto") equal
plain jax.jit on one device: losses within 1e-5 relative, parameters within 1e-4 mean relative
error, batch statistics equal to float32 rounding (2e-6 relative, 1e-6 absolute). Under the SPMD
methods the compiled collectives are the planned ones, and no op of the step is planned as opaque.

A spatially split plan (one image larger than its channels, four devices: the planner splits the
image's rows, each convolution exchanging halo rows with its neighbours) trains like one device
too, and its compiled collectives (collective-permutes for the halos, all-reduces for the kernel
gradients' partial sums) are the planned ones; so on a 2x2 mesh with two images (images over
one axis, rows or columns over the other), for a forward pass with max pooling, and for the
ResNet stem (7x7 conv, 3x3 max pool, stride 2) in training, whose max pooling gradient the
runtime runs with the planned exchanges (`runtime/halo_pooling.py`).

ShardParallel runs with slow compute (so it splits work: batch and channel splits, input-channel
contractions all-reduced) on a 1-D mesh of 8 and on a 2-D one ((2, 4) for the ResNet, (4, 2) for the
CNN), where values change layouts between mesh axes: there the collective check holds because the
runtime converts each value through the steps the plan priced (`sharding.spec.conversion_path`).

PipeshardParallel cuts the ResNet's batch into one micro-batch: BatchNorm's statistics over the
batch would differ per micro-batch (such losses are refused, tests/test_pipeshard_forms.py); the
CNN runs 2 micro-batches.
"""

from __future__ import annotations

import functools
import warnings

import jax
import numpy as np
import pytest

import conv_steps
from meshplan.capture.jaxpr import UnsupportedPrimitiveWarning
from meshplan.cluster.cluster import Cluster
from meshplan.cluster.devices import DeviceSpec
from meshplan.parallel import DataParallel, PipeshardParallel, ShardParallel, Zero3Parallel, parallelize
from method_runs import SLOW

STEPS = 3
METHODS = {"dp": lambda name: DataParallel(), "zero3": lambda name: Zero3Parallel(),
           "shard8": lambda name: ShardParallel(mesh_shape=(8,)),
           "shard2d": lambda name: ShardParallel(mesh_shape=(2, 4) if name == "resnet" else (4, 2)),
           "pipeshard": lambda name: PipeshardParallel(1 if name == "resnet" else 2, layers="auto")}
CASES = [(p, m) for p in ("resnet", "mnist") for m in METHODS]


@functools.cache
def program(name: str):
    return getattr(conv_steps, f"{name}_program")()


def run(step, state, batch):
    metrics = []
    for _ in range(STEPS):
        state, m = step(state, batch)
        metrics.append(jax.tree_util.tree_map(np.asarray, m))
    return state, metrics


@functools.cache
def one_device(name: str):
    step, state, _, batch = program(name)
    return run(jax.jit(step), state, batch)


def flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(tree)])


@pytest.mark.parametrize(("name", "method"), CASES, ids=[f"{p}-{m}" for p, m in CASES])
def test_flax_conv_steps_train_like_one_device(name, method):
    step, state, _, batch = program(name)
    parallel = parallelize(step, method=METHODS[method](name), batch_argnums=(1,),
                           cluster=SLOW if method.startswith("shard") else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedPrimitiveWarning)  # nothing captured as opaque
        got_state, got = run(parallel, state, batch)
    want_state, want = one_device(name)
    for got_metrics, want_metrics in zip(got, want, strict=True):
        np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], rtol=1e-5)
        np.testing.assert_allclose(got_metrics["accuracy"], want_metrics["accuracy"])
    a, b = flat(got_state.params), flat(want_state.params)
    assert np.mean(np.abs(a - b)) / np.mean(np.abs(b)) <= 1e-4
    if name == "resnet":
        np.testing.assert_allclose(flat(got_state.batch_stats), flat(want_state.batch_stats), rtol=2e-6, atol=1e-6)
    assert int(got_state.step) == STEPS
    if method == "pipeshard":
        plan = parallel.get_plan()
        assert len(plan.stages) >= 2 and plan.option("step") == "whole"
        return
    check = parallel.get_collectives()
    assert check.agrees, (check.missing, check.unplanned)
    nodes = parallel.get_plan().nodes
    convs = [n for n in nodes if n.op == "conv"]
    kernels = [x for x in jax.tree_util.tree_leaves(state.params) if x.ndim == 4]
    assert len(convs) >= 2 * len(kernels) - 1  # forward, kernel gradient, input gradient (not the stem's)
    if method in ("dp", "zero3"):  # each kernel gradient sums (or reduce-scatters) the devices' batch shares
        assert sum(bool(n.collectives) for n in convs) == len(kernels)


NHWC = ("NHWC", "HWIO", "NHWC")
SLOW4 = Cluster(1, 4, DeviceSpec("slow-cpu", 1e8, float("inf"), 1e9, 1e-5, 1e9, 1e-5))


def halo_loss(params, image, pool: bool):
    """3x3 conv (stride 1) -> relu -> 3x3 conv (stride 2) [-> 3x3 max pool] -> mean square."""
    h = jax.nn.relu(jax.lax.conv_general_dilated(image, params["w1"], (1, 1), "SAME", dimension_numbers=NHWC))
    h = jax.lax.conv_general_dilated(h, params["w2"], (2, 2), "SAME", dimension_numbers=NHWC)
    if pool:
        h = jax.lax.reduce_window(h, -np.inf, jax.lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")
    return jax.numpy.mean(h * h)


def stem_loss(params, image, pool: str):
    """Flax's ImageNet ResNet's stem: 7x7 conv (stride 2, padding 3) -> relu -> 3x3 max (or
    average) pool (stride 2, "SAME": one padding row after) -> a 3x3 conv -> mean square."""
    h = jax.nn.relu(jax.lax.conv_general_dilated(image, params["w1"], (2, 2), ((3, 3), (3, 3)),
                                                 dimension_numbers=NHWC))
    if pool == "max":
        h = jax.lax.reduce_window(h, -np.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
    else:
        h = jax.lax.reduce_window(h, 0.0, jax.lax.add, (1, 3, 3, 1), (1, 2, 2, 1), "SAME") / 9
    h = jax.lax.conv_general_dilated(h, params["w2"], (1, 1), "SAME", dimension_numbers=NHWC)
    return jax.numpy.mean(h * h)


HALO_CASES = {"train": (jax.value_and_grad(functools.partial(halo_loss, pool=False)), (4,)),
              "forward-pool": (functools.partial(halo_loss, pool=True), (4,)),
              "train-2x2": (jax.value_and_grad(functools.partial(halo_loss, pool=False)), (2, 2)),
              "train-maxpool": (jax.value_and_grad(functools.partial(stem_loss, pool="max")), (4,)),
              "train-avgpool": (jax.value_and_grad(functools.partial(stem_loss, pool="avg")), (4,))}


@pytest.mark.parametrize("case", HALO_CASES)
def test_spatial_split_runs_like_one_device_with_the_planned_halo_exchanges(case):
    """One image on 4 devices (rows split 4 ways), or two on a 2x2 mesh (images over one axis,
    rows over the other: the two axes cost alike, so either way round is optimal). With the
    ResNet stem's max pooling in training ("train-maxpool": 2 channels, which do not split 4
    ways), the rows stay split through the pooling and its gradient: the gradient receives the
    pooled input's next row and sends the next device the sums on that row (one row of 32
    columns x 2 channels x 4 B each way), run by the runtime's own exchange (`runtime/halo_pooling.py`).
    With an average pooling ("train-avgpool"), its gradient (one window sum of the dilated
    cotangent) receives the cotangent's row before (16 columns x 2 channels x 4 B), sent by XLA."""
    rng = np.random.default_rng(5)
    stem = case in ("train-maxpool", "train-avgpool")
    channels = 2 if stem else 8
    params = {"w1": rng.standard_normal((7, 7, 2, 2) if stem else (3, 3, 2, 8)).astype(np.float32) / 4,
              "w2": rng.standard_normal((3, 3, channels, channels)).astype(np.float32) / 8}
    step, mesh_shape = HALO_CASES[case]
    images = len(mesh_shape)
    image = rng.standard_normal((images, 64, 64, 2)).astype(np.float32)
    parallel = parallelize(step, method=ShardParallel(mesh_shape=mesh_shape), devices=jax.devices()[:4],
                           cluster=SLOW4)
    got, want = parallel(params, image), jax.jit(step)(params, image)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    nodes = parallel.get_plan().nodes
    convs = [n for n in nodes if n.op == "conv"]
    assert len(convs) == (2 if case == "forward-pool" else 5)
    # The image dim (rows or columns: a square image) and mesh axis the first convolution splits.
    (spatial,) = [d for d in (1, 2) if convs[0].output.dims[d]]
    rows = convs[0].output.dims[spatial]
    assert len(rows) == 1 and convs[0].output.dims[0] == tuple(a for a in range(len(mesh_shape)) if a not in rows)
    for conv in convs:
        kinds = [c.kind.value for c in conv.collectives]
        if conv.shape[0] == images:  # forward and input gradient: rows split, a halo from one or both neighbours
            assert conv.output.dims[spatial] == rows and kinds and set(kinds) == {"collective-permute"}
        else:  # a kernel gradient: rows split in the input and the cotangent, partial sums all-reduced
            assert conv.operands[0].dims[spatial] == conv.operands[1].dims[spatial] == rows
            assert kinds[-1] == "all-reduce"
    if case == "forward-pool":  # the max pooling keeps the rows split, a halo row from each neighbour
        (pool,) = [n for n in nodes if n.op == "max" and n.shape == (1, 32, 32, 8) and n.collectives]
        assert [c.kind.value for c in pool.collectives] == ["collective-permute"] * 2
    if case == "train-maxpool":
        (gradient,) = [n for n in nodes if n.op == "select_and_scatter_add"]
        assert gradient.output.dims[spatial] == rows and gradient.operands[0].dims[spatial] == rows
        assert [(c.kind.value, c.nbytes) for c in gradient.collectives] == [("collective-permute", 32 * 2 * 4)] * 2
    if case == "train-avgpool":
        (gradient,) = [n for n in nodes if n.op == "sum" and n.shape == (1, 32, 32, 2)]
        assert gradient.output.dims[spatial] == rows and gradient.operands[0].dims[spatial] == rows
        assert [(c.kind.value, c.nbytes) for c in gradient.collectives] == [("collective-permute", 16 * 2 * 4)]
    check = parallel.get_collectives()
    assert check.agrees, (check.missing, check.unplanned)


@pytest.mark.parametrize("train", [False, True], ids=["forward", "train"])
def test_one_image_on_a_2x2_mesh_runs_like_one_device(train):
    """One 64x64 image on a 2x2 mesh. The forward pass of its two 3x3 convolutions splits rows
    over one axis and columns over the other (32x32 tiles); the first receives a row from each
    row neighbour (32 columns x 2 channels x 4 B), then a column of the 34 rows grown by them
    (corners included) from each column neighbour; the stride-2 one the next row and column
    only. The training step too equals one device: it used to split rows over one axis and
    output features over the other, which XLA's partitioner (JAX 0.10.2) computes wrongly (the
    loss came out 16 times too large), so the conv rule no longer offers that pair. The
    compiled collectives are the planned ones."""
    rng = np.random.default_rng(5)
    params = {"w1": rng.standard_normal((3, 3, 2, 8)).astype(np.float32) / 4,
              "w2": rng.standard_normal((3, 3, 8, 8)).astype(np.float32) / 8}
    image = rng.standard_normal((1, 64, 64, 2)).astype(np.float32)
    step = functools.partial(halo_loss, pool=False)
    step = jax.value_and_grad(step) if train else step
    parallel = parallelize(step, method=ShardParallel(mesh_shape=(2, 2)), devices=jax.devices()[:4], cluster=SLOW4)
    got, want = parallel(params, image), jax.jit(step)(params, image)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    check = parallel.get_collectives()
    assert check.agrees, (check.missing, check.unplanned)
    if train:
        return
    first, second = [n for n in parallel.get_plan().nodes if n.op == "conv"]
    (rows,), (columns,) = first.output.dims[1:3]
    assert {rows, columns} == {0, 1} and second.output.dims[1:3] == first.output.dims[1:3]
    assert [(c.axes, c.nbytes) for c in first.collectives] == [((rows,), 32 * 2 * 4)] * 2 + [
        ((columns,), 34 * 2 * 4)] * 2
    assert [(c.axes, c.nbytes) for c in second.collectives] == [((rows,), 32 * 8 * 4), ((columns,), 33 * 8 * 4)]
