"""profile-cluster: alpha/beta fit, measurement on 8 CPU devices, cluster files for the planner."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from meshplan import MeshError
from meshplan.cluster import Cluster, load_cluster_file
from meshplan.cluster.costs import DeviceCosts
from meshplan.cluster.devices import DeviceSpec
from meshplan.cost.kernels import KernelEfficiency
from meshplan.files import write_json_atomic
from meshplan.runtime.calibrate import fit_alpha_beta, fit_gemm_curve, profile_cluster


def test_fit_recovers_alpha_beta():
    sizes = [1e4, 1e5, 1e6]
    seconds = [2e-5 + 1e-9 * 2 * 3 / 4 * b for b in sizes]
    alpha, beta = fit_alpha_beta(sizes, seconds, devices=4)
    assert alpha == pytest.approx(2e-5, rel=1e-6) and beta == pytest.approx(1e-9, rel=1e-6)


def test_measured_cluster_file_plans(tmp_path):
    data = profile_cluster(2, 4, 8e9, sizes=(1 << 12, 1 << 16, 1 << 18), repeats=1)
    device = data["device"]
    for key in ("peak_flops", "intra_bandwidth", "inter_bandwidth"):
        assert math.isfinite(device[key]) and device[key] > 0
    assert set(data["measured"]["all_reduce"]) == {"x", "y"}
    path = tmp_path / "cluster.json"
    write_json_atomic(path, data)
    cluster = load_cluster_file(str(path))
    assert (cluster.nodes, cluster.devices_per_node, cluster.device.memory_bytes) == (2, 4, 8e9)
    view = cluster.logical_views((2, 4))[0]
    assert view.beta == pytest.approx((1 / device["inter_bandwidth"], 1 / device["intra_bandwidth"]))
    # The measured GEMM curve is what `simulate --efficiency-file` reads from the same file.
    efficiency = KernelEfficiency.from_file(path)
    assert efficiency.gemm_max == data["kernel_efficiency"]["gemm_max"] and 0 < efficiency.gemm_max <= 1
    assert max(data["measured"]["gemm"]["flops"]) <= device["peak_flops"]


def test_gemm_curve_fit_recovers_its_parameters():
    truth = KernelEfficiency(gemm_max=0.7, gemm_half=120.0)
    shapes = [(32, 32, 32), (128, 128, 128), (512, 64, 512), (1024, 1024, 1024), (4096, 4096, 256)]
    rates = [1e12 * truth.gemm(*s) for s in shapes]
    gemm_max, half = fit_gemm_curve(shapes, rates, 1e12)
    assert gemm_max == pytest.approx(0.7, rel=0.02) and half == pytest.approx(120.0, rel=0.03)


def test_bad_cluster_files_and_device_counts(tmp_path):
    with pytest.raises(MeshError, match="does not exist"):
        load_cluster_file(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nodes": 1}))
    with pytest.raises(MeshError, match="not a meshplan cluster file"):
        load_cluster_file(str(bad))
    with pytest.raises(MeshError, match="JAX sees 8"):
        profile_cluster(3, 3, 8e9)


# --- planning the runtime with measured costs ------------------------------------------------------

INTRA, INTER = (1e-6, 1e-10), (1e-4, 1e-8)  # (latency s, s/byte): a slow link between nodes


def two_node_cluster(nodes=2, per_node=4):
    device = DeviceSpec("measured", 1e12, 8e9, 1 / INTRA[1], INTRA[0], 1 / INTER[1], INTER[0])
    return Cluster(nodes, per_node, device)


def test_device_costs_give_each_mesh_axis_its_link():
    costs = DeviceCosts.from_cluster(two_node_cluster())
    assert costs.flops_per_second == 1e12 and costs.num_devices == 8
    links = lambda mesh: tuple(zip(mesh.alpha, mesh.beta, strict=True))  # noqa: E731
    assert links(costs.mesh((2, 4))) == (INTER, INTRA)  # rows are nodes
    assert links(costs.mesh((4, 2))) == (INTER, INTRA)  # 0 -> 2 -> 4 -> 6 crosses; 0 -> 1 does not
    assert links(costs.mesh((8,))) == (INTER,)
    assert links(costs.mesh((2, 2), devices=(4, 5, 6, 7))) == (INTRA, INTRA)  # all on node 1
    assert links(costs.mesh((2,), devices=(3, 4))) == (INTER,)
    assert links(DeviceCosts().mesh((2, 4))) == ((1e-5, 1e-9), (1e-5, 1e-9))  # placeholders


def test_parallelize_plans_with_a_cluster_file(tmp_path):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from meshplan.parallel import parallelize

    path = tmp_path / "cluster.json"
    cluster = two_node_cluster()
    write_json_atomic(path, {"nodes": 2, "devices_per_node": 4, "device": dataclasses.asdict(cluster.device)})

    def step(w, x):
        return jnp.tanh(x @ w).sum()

    w, x = jnp.ones((64, 64)) / 64, jax.random.normal(jax.random.key(0), (32, 64))
    f = parallelize(step, cluster=str(path))
    np.testing.assert_allclose(float(f(w, x)), float(jax.jit(step)(w, x)), rtol=1e-5)
    mesh = f.get_plan().mesh
    assert mesh.shape == (2, 4) and mesh.alpha == (INTER[0], INTRA[0]) and mesh.beta == (INTER[1], INTRA[1])
    wrong = parallelize(step, cluster=two_node_cluster(1, 4))
    with pytest.raises(MeshError, match=r"the cluster describes 4 devices but 8 are used; measure these devices"):
        wrong(w, x)
    with pytest.raises(MeshError, match="does not exist"):
        parallelize(step, cluster=str(tmp_path / "missing.json"))


def test_pipeshard_stages_plan_on_their_links():
    import jax
    import jax.numpy as jnp

    from meshplan.parallel import PipeshardParallel, PipeshardStage, parallelize
    from meshplan.runtime import mark_pipeline_boundary

    def loss(params, x, y):
        h = mark_pipeline_boundary(jnp.tanh(x @ params[0]))
        return jnp.mean((h @ params[1] - y) ** 2)

    params = [jnp.ones((16, 16)) / 16, jnp.ones((16, 4)) / 16]
    x, y = jax.random.normal(jax.random.key(0), (8, 16)), jnp.zeros((8, 4))
    stages = (PipeshardStage((0, 0), (0, 1, 4, 5), (2, 2)), PipeshardStage((1, 1), (2, 3, 6, 7), (2, 2)))
    f = parallelize(loss, method=PipeshardParallel(2, stages=stages), cluster=two_node_cluster())
    f(params, x, y)
    for stage in f.get_plan().stages:  # each stage spans both nodes along axis 0 only
        assert stage.intra_plan.mesh.alpha == (INTER[0], INTRA[0])
