"""profile-cluster: alpha/beta fit, measurement on 8 CPU devices, cluster files for the planner."""

from __future__ import annotations

import json
import math

import pytest

from meshplan import MeshError
from meshplan.cluster import load_cluster_file
from meshplan.files import write_json_atomic
from meshplan.runtime.calibrate import fit_alpha_beta, profile_cluster


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


def test_bad_cluster_files_and_device_counts(tmp_path):
    with pytest.raises(MeshError, match="does not exist"):
        load_cluster_file(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nodes": 1}))
    with pytest.raises(MeshError, match="not a meshplan cluster file"):
        load_cluster_file(str(bad))
    with pytest.raises(MeshError, match="JAX sees 8"):
        profile_cluster(3, 3, 8e9)
