"""The inter-op pass (layer costs -> table -> stage DP -> placement) equals exhaustive search."""

from __future__ import annotations

import itertools
import math
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cluster import Cluster, DeviceSpec
from meshplan.inter import InterOptions, LayerCost, LayerCosts, ViewCosts, get_schedule, plan_pipeline
from meshplan.inter.stages import estimate_stage, handoff_time, latency_tables, range_cost, stage_key

DEVICE = DeviceSpec("test", 1e12, 1e9, 1e9, 1e-6, 1e8, 1e-5)


def random_costs(rng: np.random.Generator, cluster: Cluster, num_layers: int, infeasible: float) -> LayerCosts:
    views = []
    for shape in cluster.submesh_shapes():
        for mesh in cluster.logical_views(shape):
            layers = []
            for _ in range(num_layers):
                menu = []
                for _ in range(int(rng.integers(1, 3))):
                    if rng.uniform() < infeasible:
                        menu.append(LayerCost(*(math.inf,) * 9))
                        continue
                    time = rng.uniform(0.1, 2.0) / mesh.num_devices ** 0.5
                    menu.append(LayerCost(time, time / 3, 0.0, 0.0, rng.uniform(1, 40) * 1e6, rng.uniform(1, 20) * 1e6,
                                          rng.uniform(0.1, 2) * 1e6, rng.uniform(0, 5) * 1e6, 1e9))
                layers.append(tuple(menu))
            views.append(ViewCosts(shape, mesh.shape, tuple(layers)))
    return LayerCosts(tuple(views), tuple(rng.uniform(1e5, 1e7, size=num_layers - 1)))


def best_stage(costs: LayerCosts, cluster: Cluster, shape, first, last, stages_left, b, capacity, recompute,
               chunks=1):
    """The fastest fitting choice for one stage, written out plainly from the memory rule."""
    best = math.inf
    for view in costs.views_of(shape):
        handoff = 0.0 if last == costs.num_layers - 1 else \
            2 * chunks * (DEVICE.inter_latency + costs.handoff_bytes[last] / view.devices / DEVICE.inter_bandwidth)
        for menu in range(view.menu_size):
            entries = [view.entry(k, menu) for k in range(first, last + 1)]
            every = [e for k in range(costs.num_layers) if math.isfinite((e := view.entry(k, menu)).time)]
            if any(not math.isfinite(e.time) for e in entries):
                continue
            transient = max(e.transient_bytes for e in every)
            peak = max(e.peak_activation_bytes for e in every)
            inflight = min(stages_left, b)
            static = sum(e.static_bytes for e in entries)
            for r in recompute:
                if r == "full":
                    memory = static + inflight * sum(e.input_bytes for e in entries) + peak + transient
                    time = sum(e.time + e.forward_time for e in entries)
                else:
                    memory = static + inflight * sum(e.activation_bytes for e in entries) + transient
                    time = sum(e.time for e in entries)
                if memory <= capacity:
                    best = min(best, time + handoff)
    return best


def brute_force(costs: LayerCosts, cluster: Cluster, b: int, capacity: float, recompute, chunks=1) -> float:
    shapes = cluster.submesh_shapes()
    n = costs.num_layers
    best = math.inf
    for mask in range(1 << (n - 1)):
        cuts = [k for k in range(n - 1) if mask >> k & 1]
        ranges = list(zip([0, *(c + 1 for c in cuts)], [*cuts, n - 1], strict=True))
        for assignment in itertools.product(shapes, repeat=len(ranges)):
            if sum(s[0] * s[1] for s in assignment) != cluster.num_devices:
                continue
            latencies = [best_stage(costs, cluster, shape, first, last, len(ranges) - j, b, capacity, recompute,
                                    chunks)
                         for j, ((first, last), shape) in enumerate(zip(ranges, assignment, strict=True))]
            if all(math.isfinite(t) for t in latencies):
                best = min(best, get_schedule("interleaved-1f1b").latency(latencies, b, chunks))
    return best


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 10**6), layers=st.integers(1, 4), b=st.integers(1, 6),
       capacity_mb=st.sampled_from([30, 60, 150, 1e6]), infeasible=st.sampled_from([0.0, 0.3]),
       recompute=st.sampled_from([("none",), ("none", "full")]), cluster=st.sampled_from([(1, 4), (2, 2), (1, 2)]))
def test_plan_pipeline_equals_exhaustive_search(seed, layers, b, capacity_mb, infeasible, recompute, cluster):
    cluster = Cluster(*cluster, DEVICE)
    costs = random_costs(np.random.default_rng(seed), cluster, layers, infeasible)
    options = InterOptions(capacity_bytes=capacity_mb * 1e6, recompute=recompute)
    plan = plan_pipeline(costs, cluster, b, options)
    want = brute_force(costs, cluster, b, capacity_mb * 1e6, recompute)
    if plan is None:
        assert math.isinf(want)
        return
    assert plan.pipeline_time == pytest.approx(want, rel=1e-12)
    assert [s.first for s in plan.stages] == [0, *(s.last + 1 for s in plan.stages[:-1])]
    assert plan.stages[-1].last == layers - 1
    assert sorted(i for s in plan.stages for i in s.devices) == list(range(cluster.num_devices))
    assert all(s.memory <= capacity_mb * 1e6 for s in plan.stages)
    for s in plan.stages:  # placed as sub-meshes of the cluster: whole nodes or part of one node
        nodes = {i // cluster.devices_per_node for i in s.devices}
        assert len(nodes) == s.submesh[0] and len(s.devices) == s.submesh[0] * s.submesh[1]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), layers=st.integers(1, 4), b=st.integers(1, 6),
       capacity_mb=st.sampled_from([60, 1e6]), cluster=st.sampled_from([(1, 4), (2, 2)]))
def test_interleaved_choice_equals_exhaustive_search(seed, layers, b, capacity_mb, cluster):
    """With chunks (1, 2, 3) the plan is the best of 1F1B and its interleaved variants, each
    found by exhaustive search with v hand-offs per stage and the fill and drain over v."""
    cluster = Cluster(*cluster, DEVICE)
    costs = random_costs(np.random.default_rng(seed), cluster, layers, 0.0)
    plan = plan_pipeline(costs, cluster, b, InterOptions(capacity_bytes=capacity_mb * 1e6, chunks=(1, 2, 3)))
    want = {v: brute_force(costs, cluster, b, capacity_mb * 1e6, ("none", "full"), v) for v in (1, 2, 3)}
    if plan is None:
        assert all(math.isinf(w) for w in want.values())
        return
    assert plan.pipeline_time == pytest.approx(min(want.values()), rel=1e-12)
    assert plan.pipeline_time == pytest.approx(want[plan.chunks], rel=1e-12)
    assert plan.schedule == ("1f1b" if plan.chunks == 1 else "interleaved-1f1b")


def test_interleaving_pays_off_with_few_micro_batches_and_cheap_sends():
    """Two equal stages, B = 2: 1F1B takes 2 t + t = 3 t; with 2 chunks 2 t + t / 2 = 2.5 t."""
    cluster = Cluster(2, 1, DEVICE)
    layer = LayerCost(1.0, 0.3, 0, 0, 0.0, 0.0, 0.0, 0.0, 1e9)
    costs = LayerCosts((ViewCosts((1, 1), (1, 1), ((layer,), (layer,))),), (0.0,))
    plain = plan_pipeline(costs, cluster, 2)
    both = plan_pipeline(costs, cluster, 2, InterOptions(chunks=(1, 2)))
    send = 2 * DEVICE.inter_latency
    assert plain.chunks == 1 and plain.pipeline_time == pytest.approx(3 * 1.0 + 2 * send)
    assert both.chunks == 2 and both.pipeline_time == pytest.approx(2 * (1 + 2 * send) + 1 / 2)


def test_consecutive_stages_in_one_node_hand_off_on_its_link():
    """Two one-device stages on a 1x2 cluster share the node: with node_local_sends the first
    stage's hand-off is priced on the intra-node link."""
    cluster = Cluster(1, 2, DEVICE)
    layer = LayerCost(1.0, 0.3, 0, 0, 0.0, 0.0, 0.0, 0.0, 1e9)
    costs = LayerCosts((ViewCosts((1, 1), (1, 1), ((layer,), (layer,))),), (4e6,))
    inter = plan_pipeline(costs, cluster, 8)
    local = plan_pipeline(costs, cluster, 8, InterOptions(node_local_sends=True))
    assert [s.devices for s in local.stages] == [(0,), (1,)]
    over_network = 2 * (DEVICE.inter_latency + 4e6 * DEVICE.inter_beta)
    in_node = 2 * (DEVICE.intra_latency + 4e6 * DEVICE.intra_beta)
    assert inter.stages[0].latency == pytest.approx(1.0 + over_network)
    assert local.stages[0].latency == pytest.approx(1.0 + in_node)
    assert local.stages[1].latency == inter.stages[1].latency == 1.0


def test_an_infeasible_layer_does_not_block_ranges_without_it():
    """Layer 1 cannot run on one device; layers 0 and 2 can, and the ranges around it stay open."""
    cluster = Cluster(1, 2, DEVICE)
    ok, bad = LayerCost(1.0, 0.3, 0, 0, 1e6, 1e6, 1e5, 1e5, 1e9), LayerCost(*(math.inf,) * 9)
    views = (ViewCosts((1, 1), (1, 1), ((ok,), (bad,), (ok,))),
             ViewCosts((1, 2), (1, 2), ((ok,), (ok,), (ok,))))
    plan = plan_pipeline(LayerCosts(views, (1.0, 1.0)), cluster, 4)
    assert plan is not None
    assert all(not (s.first <= 1 <= s.last) or s.submesh == (1, 2) for s in plan.stages)


def test_gpipe_holds_every_micro_batch():
    """Under GPipe every stage holds all B micro-batches' activations: a capacity that fits 1F1B's
    min(stages left, B) does not fit GPipe."""
    cluster = Cluster(1, 2, DEVICE)
    layer = LayerCost(1.0, 0.3, 0, 0, 0.0, 10e6, 1e5, 0.0, 1e9)
    costs = LayerCosts((ViewCosts((1, 1), (1, 1), ((layer,), (layer,))),), (1.0,))
    one_f_one_b = plan_pipeline(costs, cluster, 8, InterOptions(capacity_bytes=25e6, recompute=("none",)))
    assert one_f_one_b is not None and [s.inflight for s in one_f_one_b.stages] == [2, 1]
    assert plan_pipeline(costs, cluster, 8, InterOptions(capacity_bytes=25e6, schedule="gpipe",
                                                         recompute=("none",))) is None


def test_range_cost_charges_the_largest_usable_layer_and_survives_pickling():
    """A stage is charged the working memory and recomputed activations of the view's largest
    layer that can run (every layer when none can); ViewCosts reads them once, as a field that
    pickles with the view (pricing results cross processes)."""
    rng = np.random.default_rng(3)
    costs = random_costs(rng, Cluster(2, 2, DEVICE), 5, infeasible=0.3)
    dead = ViewCosts((1, 1), (1, 1), ((LayerCost(*(math.inf,) * 9),),) * 3)
    for view in (*costs.views, dead):
        assert pickle.loads(pickle.dumps(view)).largest == view.largest
        for menu in range(view.menu_size):
            every = [view.entry(k, menu) for k in range(len(view.layers))]
            usable = [e for e in every if e.is_usable()] or every[1:3]
            cost = range_cost(view, menu, 1, 2)
            assert cost["transient_bytes"] == max(e.transient_bytes for e in usable)
            assert cost["peak_activation_bytes"] == max(e.peak_activation_bytes for e in usable)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), b=st.integers(1, 6), capacity_mb=st.sampled_from([30, 60, 1e6]),
       infeasible=st.sampled_from([0.0, 0.3]))
def test_latency_tables_of_every_chunk_count_price_each_stage_as_estimated(seed, b, capacity_mb, infeasible):
    """The tables of several hand-off counts share the ranges' sums and memory fits; each entry
    is the best stage estimate (views, menus, recomputation) with that many hand-offs, or inf."""
    cluster = Cluster(2, 2, DEVICE)
    costs = random_costs(np.random.default_rng(seed), cluster, 4, infeasible)
    shapes = cluster.submesh_shapes()
    per_shape = [costs.views_of(shape) for shape in shapes]
    schedule = get_schedule("1f1b")
    sends = (1, 2, 4)
    tables = list(latency_tables(costs, per_shape, cluster, b, capacity_mb * 1e6, schedule, sends=sends))
    assert len(tables) == len(sends)
    for send, table in zip(sends, tables, strict=True):
        for first, last, m, left in itertools.product(range(4), range(4), range(len(shapes)), range(1, 5)):
            found = [estimate_stage(v, first, last, left, b, capacity_mb * 1e6,
                                    send * handoff_time(costs, v, last, cluster), schedule)
                     for v in per_shape[m]] if first <= last else []
            keys = [stage_key(e, b) for e in found if e is not None]
            want = min(keys, default=math.inf)
            assert table[first, last, m, left] == pytest.approx(want, rel=1e-12)
