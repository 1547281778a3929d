"""Device table, Cluster, sub-mesh choices and logical views."""

from __future__ import annotations

import math

import pytest

from meshplan.cluster import DEVICES, Cluster, DeviceSpec, device_from_overrides, get_device, parse_cluster
from meshplan.cluster.cluster import axis_groups, three_axis_shapes
from meshplan.errors import MeshError, OptionsError
from meshplan.simulator import PlannerOptions
from meshplan.simulator.pricing import planner_views

GiB = 2**30


def test_device_table_values():
    a100 = get_device("a100-80gb")
    assert a100 == DeviceSpec("a100-80gb", 312e12, 80 * GiB, 300e9, 5e-6, 25e9, 1e-5, a100.description, 2.039e12,
                              0.0, True)
    assert get_device("A100-40GB").memory_bytes == 40 * GiB
    assert get_device("h100-80gb").peak_flops == 989e12
    assert get_device("h100-80gb").intra_bandwidth == 450e9
    assert get_device("h100-80gb").inter_bandwidth == 50e9
    v100 = get_device("v100-32gb")
    assert (v100.peak_flops, v100.memory_bytes, v100.intra_bandwidth) == (125e12, 32 * GiB, 150e9)
    assert v100.inter_bandwidth == 1.5625e9  # 100 Gb/s per node shared by 8 GPUs
    assert get_device("v100-16gb").memory_bytes == 16 * GiB
    assert sorted(DEVICES) == ["a100-40gb", "a100-40gb-pcie", "a100-80gb", "b200-192gb", "h100-80gb", "h200-141gb",
                               "mi300x-192gb", "v100-16gb", "v100-32gb"]
    assert get_device("h100-80gb").fp8_flops == 1979e12
    assert get_device("mi300x-192gb").peak_flops == pytest.approx(1307.4e12)
    assert get_device("h200-141gb").memory_bytes == 141 * GiB and get_device("b200-192gb").peak_flops == 2.25e15
    assert not get_device("v100-32gb").flash_attention and get_device("a100-40gb-pcie").flash_attention
    assert all(name == d.name and d.description for name, d in DEVICES.items())


def test_unknown_device_suggests_close_match():
    with pytest.raises(MeshError, match=r"unknown device 'a100-80g'; did you mean 'a100-80gb'\?.*h100-80gb"):
        get_device("a100-80g")
    with pytest.raises(MeshError) as info:
        get_device("tpu-v4")
    assert "did you mean" not in str(info.value) and "v100-32gb" in str(info.value)


def test_device_overrides():
    base = get_device("v100-32gb")
    custom = device_from_overrides(base, memory_bytes=24 * GiB)
    assert custom.name == "v100-32gb-custom" and custom.memory_bytes == 24 * GiB
    assert custom.peak_flops == base.peak_flops and "memory_bytes" in custom.description
    assert device_from_overrides(base, name="mine", inter_bandwidth=1e9).name == "mine"
    with pytest.raises(MeshError, match="memroy_bytes.*not a DeviceSpec field"):
        device_from_overrides(base, memroy_bytes=1)
    with pytest.raises(MeshError, match="peak_flops = -1"):
        device_from_overrides(base, peak_flops=-1)


def test_parse_cluster():
    assert parse_cluster("50x4") == (50, 4)
    assert parse_cluster(" 2 X 8 ") == (2, 8)
    for bad in ("50", "50x", "ax4", "2x4x2", ""):
        with pytest.raises(MeshError, match="NODESxDEVICES_PER_NODE"):
            parse_cluster(bad)
    with pytest.raises(MeshError, match="at least 1 node"):
        parse_cluster("0x4")


def test_cluster_validation():
    dev = get_device("a100-40gb")
    assert Cluster(50, 4, dev).num_devices == 200
    assert Cluster(50, 4, dev).name == "50x4 a100-40gb"
    for nodes, per_node in ((0, 4), (2, -1), (2.0, 4), (True, 4)):
        with pytest.raises(MeshError, match="must be a positive integer"):
            Cluster(nodes, per_node, dev)
    with pytest.raises(MeshError, match="must be a DeviceSpec"):
        Cluster(1, 1, "a100-40gb")


def test_submesh_shapes():
    dev = get_device("v100-32gb")
    assert Cluster(50, 4, dev).submesh_shapes() == ((1, 1), (1, 2), (1, 4), *((k, 4) for k in range(2, 51)))
    assert len(Cluster(50, 4, dev).submesh_shapes()) == 52
    assert Cluster(2, 8, dev).submesh_shapes() == ((1, 1), (1, 2), (1, 4), (1, 8), (2, 8))
    assert Cluster(3, 6, dev).submesh_shapes() == ((1, 1), (1, 2), (1, 4), (1, 6), (2, 6), (3, 6))
    assert Cluster(1, 1, dev).submesh_shapes() == ((1, 1),)


def test_views_of_multi_node_submesh():
    dev = get_device("a100-80gb")
    views = Cluster(50, 4, dev).logical_views((2, 4))
    assert [v.shape for v in views] == [(2, 4), (4, 2), (1, 8)]
    intra, inter = (dev.intra_latency, 1 / dev.intra_bandwidth), (dev.inter_latency, 1 / dev.inter_bandwidth)
    for view, axes in zip(views, ((inter, intra), (inter, intra), (intra, inter)), strict=True):
        assert (view.alpha, view.beta) == tuple(zip(*axes, strict=True))
        assert view.device_ids == tuple(range(8)) and view.memory_per_device == 80 * GiB
        assert math.prod(view.shape) == 8


def test_views_of_single_node_submesh():
    dev = get_device("h100-80gb")
    views = Cluster(2, 8, dev).logical_views((1, 8))
    assert [v.shape for v in views] == [(1, 8), (2, 4), (4, 2)]
    assert all(v.alpha == (5e-6, 5e-6) and v.beta == (1 / 450e9, 1 / 450e9) for v in views)
    assert [v.shape for v in Cluster(2, 8, dev).logical_views((1, 1))] == [(1, 1)]


def test_view_ids_tile_the_submesh():
    cluster = Cluster(4, 8, get_device("a100-40gb"))
    views = cluster.logical_views((2, 4), origin=(1, 4))
    expected = (12, 13, 14, 15, 20, 21, 22, 23)
    assert all(v.device_ids == expected for v in views)
    column = cluster.logical_views((2, 1), origin=(0, 3))
    assert [(v.shape, v.device_ids, v.beta[1]) for v in column] == [((1, 2), (3, 11), 1 / 25e9)]
    full = cluster.full_mesh_views()
    assert [v.shape for v in full] == [(4, 8), (8, 4), (16, 2), (1, 32)]
    assert all(sorted(v.device_ids) == list(range(32)) for v in full)


def test_view_axes_are_intra_node_exactly_when_every_group_is():
    """The links of each axis, brute force: an axis is intra-node (its alpha the device's
    intra-node latency) exactly when every device group along it sits in one node."""
    device = get_device("a100-80gb")
    for cluster in (Cluster(4, 8, device), Cluster(3, 6, device), Cluster(2, 4, device)):
        per_node = cluster.devices_per_node
        for shape in cluster.submesh_shapes():
            origins = [(0, 0)] + ([(1, cluster.devices_per_node - shape[1])] if shape[0] < cluster.nodes else [])
            for origin in origins:
                for mesh in cluster.logical_views(shape, origin, max_axes=3):
                    for k in range(len(mesh.shape)):
                        groups = axis_groups(mesh.shape, mesh.device_ids, k)
                        in_node = all(len({i // per_node for i in g}) == 1 for g in groups)
                        expected = device.intra_latency if in_node else device.inter_latency
                        assert mesh.alpha[k] == expected, (shape, origin, mesh.shape, k)


def test_views_reject_submesh_outside_cluster():
    cluster = Cluster(2, 4, get_device("a100-40gb"))
    for shape, origin in (((3, 4), (0, 0)), ((1, 8), (0, 0)), ((1, 2), (0, 3)), ((0, 1), (0, 0))):
        with pytest.raises(MeshError, match="does not fit cluster 2x4 a100-40gb"):
            cluster.logical_views(shape, origin)


def test_three_axis_views():
    """3-D views of sub-meshes of 8+ devices follow the 2-D ones: the last axis inside a node, every
    axis wholly intra- or inter-node, per-axis links from the groups along it."""
    dev = get_device("a100-80gb")
    cluster = Cluster(4, 8, dev)
    views = cluster.logical_views((2, 8), max_axes=3)
    assert [v.shape for v in views] == [(2, 8), (4, 4), (8, 2), (1, 16), (2, 2, 4), (2, 4, 2), (4, 2, 2)]
    assert [v.beta for v in views[4:]] == [(dev.inter_beta, dev.intra_beta, dev.intra_beta)] * 3
    assert [v.shape for v in cluster.logical_views((1, 4), max_axes=3)] == [(1, 4), (2, 2)]  # < 8 devices
    assert [v.shape for v in cluster.logical_views((1, 8), max_axes=3)][-1] == (2, 2, 2)
    assert three_axis_shapes(32, 8)[:2] == [(2, 16, 8), (4, 8, 8)] and len(three_axis_shapes(32, 8)) == 15
    assert three_axis_shapes(3, 6) == [(3, 2, 3), (3, 3, 2)]  # (2, 3, 3) would split a node's 6 as 9s
    planned = [v.shape for v in planner_views(cluster, (2, 8), max_axes=3)]
    assert planned == [(2, 8), (4, 4), (8, 2), (16, 1), (2, 2, 4), (2, 4, 2), (4, 2, 2)]
    assert [v.shape for v in planner_views(cluster, (2, 8))] == planned[:4]  # 2-D indices unchanged
    with pytest.raises(MeshError, match="use 2"):
        cluster.logical_views((2, 8), max_axes=4)
    for bad in (4, "refined", True):
        with pytest.raises(OptionsError, match="--mesh-axes 2, 3 or refine"):
            PlannerOptions(mesh_axes=bad)
    assert [PlannerOptions(mesh_axes=a).view_axes for a in (2, 3, "refine")] == [2, 3, 2]
