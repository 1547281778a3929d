"""The link model (meshplan.cost.links): one test per formula, written out by hand, and both
pricers (the closed form and the op-level model of the ILP and the stage DP) calling it."""

from __future__ import annotations

import pytest

from meshplan.cluster import Cluster, device_from_overrides, get_device
from meshplan.cost.collectives import CollectiveCosts, CollectiveKind
from meshplan.cost.kernels import DEFAULT_EFFICIENCY
from meshplan.cost.links import Group, Links, collective_seconds, exposed_seconds, send_seconds
from meshplan.inter.costs import LayerCost, LayerCosts, ViewCosts
from meshplan.inter.search import InterOptions, plan_pipeline
from meshplan.models.transformer import PRESETS
from meshplan.simulator import TrainingJob
from meshplan.simulator.analytic import price_layout
from meshplan.simulator.graph_pricing import price_layout_graph
from meshplan.simulator.layout import parse_layout

AR, AG, RS, A2A = (CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER,
                   CollectiveKind.ALL_TO_ALL)
LINKS = Links(intra_bandwidth=200e9, intra_latency=5e-6, inter_bandwidth=20e9, inter_latency=1e-5)
MB = 64e6


def test_ring_inside_a_node():
    """NCCL's ring: 2(n-1) steps for an all-reduce moving 2(n-1)/n of the buffer per rank, n-1
    steps and (n-1)/n for an all-gather or a reduce-scatter (nccl-tests' bus bandwidth)."""
    group = Group(8, 8)
    assert collective_seconds(AR, MB, group, LINKS) == pytest.approx(14 * 5e-6 + 2 * 7 / 8 * MB / 200e9)
    assert collective_seconds(AG, MB, group, LINKS) == pytest.approx(7 * 5e-6 + 7 / 8 * MB / 200e9)
    assert collective_seconds(RS, MB, group, LINKS) == pytest.approx(7 * 5e-6 + 7 / 8 * MB / 200e9)
    assert collective_seconds(AR, MB, Group(1, 1), LINKS) == 0.0


def test_one_rank_per_node_rings_at_its_nic_share():
    group = Group(16, 1)
    assert group.nodes == 16
    assert collective_seconds(AR, MB, group, LINKS) == pytest.approx(30 * 1e-5 + 2 * 15 / 16 * MB / 20e9)


def test_hierarchical_across_nodes_uses_every_nic():
    """8 ranks on each of 2 nodes: reduce-scatter in the node, an all-reduce of 1/8 of the buffer
    across the 2 nodes with the 8 ranks on their 8 NICs at once, all-gather in the node."""
    group = Group(16, 8)
    inside = 7 * 5e-6 + 7 / 8 * MB / 200e9
    across = 2 * 1e-5 + 2 * 1 / 2 * (MB / 8) / 20e9
    assert collective_seconds(AR, MB, group, LINKS) == pytest.approx(inside + across + inside)
    # An all-gather or a reduce-scatter runs half of the phases.
    across_half = 1e-5 + 1 / 2 * (MB / 8) / 20e9
    assert collective_seconds(AG, MB, group, LINKS) == pytest.approx(across_half + inside)
    assert collective_seconds(RS, MB, group, LINKS) == pytest.approx(inside + across_half)
    # Far cheaper than one flat ring at one NIC's share, which is what it replaced.
    flat = 30 * 1e-5 + 2 * 15 / 16 * MB / 20e9
    assert collective_seconds(AR, MB, group, LINKS) < 0.2 * flat


def test_all_to_all_splits_over_both_links():
    assert collective_seconds(A2A, MB, Group(8, 8), LINKS) == pytest.approx(7 * 5e-6 + 7 / 8 * MB / 200e9)
    # 4 ranks per node on 4 nodes: 3/16 of the bytes over NVLink, 12/16 over the NIC, at once.
    expected = 15 * 1e-5 + max(3 / 16 * MB / 200e9, 12 / 16 * MB / 20e9)
    assert collective_seconds(A2A, MB, Group(16, 4), LINKS) == pytest.approx(expected)


def test_groups_in_megatrons_rank_order():
    assert Group.strided(8, 1, 8) == Group(8, 8)  # tensor parallel inside a node
    assert Group.strided(16, 1, 8) == Group(16, 8)  # tensor parallel over two nodes
    assert Group.strided(32, 8, 8) == Group(32, 1)  # data parallel beside tp = 8
    assert Group.strided(32, 2, 8) == Group(32, 4)  # data parallel beside tp = 2
    assert Group.strided(1, 4, 8) == Group(1, 1)


def test_sends_and_overlap():
    assert send_seconds(MB, False, LINKS) == pytest.approx(5e-6 + MB / 200e9)
    assert send_seconds(MB, True, LINKS) == pytest.approx(1e-5 + MB / 20e9)
    assert exposed_seconds(10.0, 4.0, 0.1) == 6.0  # what the window does not hide
    assert exposed_seconds(10.0, 40.0, 0.1) == 1.0  # the last bucket's tail


def test_op_level_collectives_are_the_link_model():
    """A collective the ILP prices on a cluster's view is one NCCL communicator over its ranks:
    the same formula as the closed form's, at the same link efficiency; without a link
    efficiency (Alpa's setting, measured costs) the per-axis alpha-beta terms stay."""
    cluster = Cluster(2, 8, get_device("a100-80gb"))
    links = Links.of(cluster.device, DEFAULT_EFFICIENCY.link)
    node_aware = CollectiveCosts(link_efficiency=DEFAULT_EFFICIENCY.link)
    for view in cluster.logical_views((2, 8)):
        for axes in ((0,), (1,), (0, 1)):
            size, local = view.group_locality(axes)
            want = collective_seconds(AR, MB, Group(size, local), links)
            assert node_aware.cost(AR, view, axes, MB) == pytest.approx(want)
    view = cluster.logical_views((2, 8))[0]  # (2, 8): axis 0 crosses nodes, axis 1 stays inside
    assert view.group_locality((0,)) == (2, 1) and view.group_locality((1,)) == (8, 8)
    assert view.group_locality((0, 1)) == (16, 8)
    alpha_beta = CollectiveCosts().cost(AR, view, (1,), MB)
    assert alpha_beta == pytest.approx(view.alpha[1] + view.beta[1] * 2 * 7 / 8 * MB)


def test_three_axis_views_price_each_axis_on_the_links_it_crosses():
    """A 4x8x8 view of 256 A100s (32 nodes of 8): axis 2 inside a node (NVLink), axes 0 and 1
    across nodes (NICs). A collective over several axes is one communicator over the ranks they
    span: 8 per node whenever axis 2 is among them, one per node otherwise."""
    cluster = Cluster(32, 8, get_device("a100-80gb"))
    view = next(v for v in cluster.full_mesh_views(max_axes=3) if v.shape == (4, 8, 8))
    d = cluster.device
    assert view.beta == (d.inter_beta, d.inter_beta, d.intra_beta)
    assert view.alpha == (d.inter_latency, d.inter_latency, d.intra_latency)
    spans = {axes: view.group_locality(axes) for axes in ((0,), (1,), (2,), (0, 1), (1, 2), (0, 2), (0, 1, 2))}
    assert spans == {(0,): (4, 1), (1,): (8, 1), (2,): (8, 8), (0, 1): (32, 1), (1, 2): (64, 8), (0, 2): (32, 8),
                     (0, 1, 2): (256, 8)}
    links = Links.of(d, DEFAULT_EFFICIENCY.link)
    node_aware = CollectiveCosts(link_efficiency=DEFAULT_EFFICIENCY.link)
    for axes, (size, local) in spans.items():
        want = collective_seconds(AR, MB, Group(size, local), links)
        assert node_aware.cost(AR, view, axes, MB) == pytest.approx(want)
    # Inside the node the same bytes are an order of magnitude cheaper than across nodes.
    assert node_aware.cost(AR, view, (2,), MB) * 5 < node_aware.cost(AR, view, (1,), MB)
    # Per-axis alpha-beta (no link model): hierarchical over the axes, the cheapest order.
    inside_first = (view.alpha[2] + view.beta[2] * 2 * 7 / 8 * MB) + (view.alpha[1] + view.beta[1] * 2 * 7 / 8 * MB / 8)
    assert CollectiveCosts().cost(AR, view, (1, 2), MB) == pytest.approx(inside_first)


def test_tensor_parallel_over_two_nodes_is_about_twice_one_node():
    """LLaMA2-7B on 2 x 8 A100 with 8 x 100 Gb/s NICs: tp=16 over both nodes against tp=8 in
    one node (measured Megatron-LM runs: about 2x slower, not 10x). The closed form's
    tensor-parallel all-reduce is the link model's hierarchical one, and the graph pricer (the
    auto planner's op-level model, a mesh axis of 16 over two nodes) prices the same.

    Why about 2x: NCCL builds one ring (channel) per NIC, so the cross-node step of a 16-rank
    all-reduce carries 1/8 of the buffer per GPU over its own 12.5 GB/s NIC while NVLink does
    the reduce-scatter and all-gather inside the node; per layer that is a few times tp=8's
    NVLink-only all-reduce, on top of compute that does not shrink. With 8 NICs per node NCCL's
    tree does not beat its ring (nccl-tests issue #196), so the ring is what is priced. Pricing
    the whole ring at one NIC share for all 16 ranks (the old model) gave 15.6x the best layout."""
    device = device_from_overrides(get_device("a100-80gb"), inter_bandwidth=100e9 / 8)
    cluster = Cluster(2, 8, device)
    job = TrainingJob(PRESETS["llama2-7b"], 128, 4096)
    wide_layout = parse_layout("tp=16,pp=1,dp=1,mb=1,sp=on,recompute=selective")
    narrow_layout = parse_layout("tp=8,pp=1,dp=2,mb=1,sp=on,recompute=selective")
    wide, narrow = price_layout(job, cluster, wide_layout), price_layout(job, cluster, narrow_layout)
    assert 1.5 < wide.iteration_time / narrow.iteration_time < 2.5
    graph_ratio = (price_layout_graph(job, cluster, wide_layout).iteration_time
                   / price_layout_graph(job, cluster, narrow_layout).iteration_time)
    assert 1.5 < graph_ratio < 2.5
    links = Links.of(device, DEFAULT_EFFICIENCY.link)
    per_layer = 2 * collective_seconds(AR, 4096 * 4096 * 2, Group(16, 8), links)  # forward all-reduces
    tp_part = dict(wide.breakdown)["tensor/expert-parallel communication"]
    assert tp_part == pytest.approx(wide.num_microbatches * 32 * 2 * per_layer)


def test_stage_dp_hands_off_on_the_link_it_crosses():
    """Stages on part of a node hand off on the node's link, whole-node stages across nodes; the
    placed plan prices each hand-off on the link it actually crosses."""
    device = get_device("a100-80gb")
    layer = LayerCost(1.0, 0.3, 0, 0, 0.0, 0.0, 0.0, 0.0, 1e9)
    handoff = 256e6
    links = Links.of(device, 0.75)
    for cluster, submesh, crosses in ((Cluster(1, 2, device), (1, 1), False), (Cluster(2, 1, device), (1, 1), True)):
        costs = LayerCosts((ViewCosts(submesh, (1, 1), ((layer,), (layer,))),), (handoff,))
        plan = plan_pipeline(costs, cluster, 4, InterOptions(node_local_sends=True, link_efficiency=0.75))
        assert len(plan.stages) == 2
        assert plan.stages[0].latency == pytest.approx(1.0 + 2 * send_seconds(handoff, crosses, links))
