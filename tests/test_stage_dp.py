"""The stage-mesh DP equals its brute-force twin; a hand-checkable pipeline case."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.inter.schedules import pipeline_latency, replayed_latency
from meshplan.inter.stage_dp import _BandTable, _compositions, brute_force_stages, plan_stages


@st.composite
def instances(draw):
    layers = draw(st.integers(1, 5))
    sizes = draw(st.sampled_from([[1, 2], [1, 2, 4], [1, 3]]))
    devices = draw(st.sampled_from([2, 3, 4, 6]))
    seed = draw(st.integers(0, 10**6))
    rng = np.random.default_rng(seed)
    lat = rng.uniform(0.5, 10.0, size=(layers, layers, len(sizes), layers + 1))
    lat[rng.uniform(size=lat.shape) < draw(st.sampled_from([0.0, 0.2, 0.5]))] = np.inf  # memory-infeasible
    for k in range(layers):
        lat[k, :k] = np.inf
    return lat, sizes, devices, draw(st.integers(1, 12))


@settings(max_examples=300, deadline=None)
@given(instances(), st.sampled_from([1, 1, 2, 3]))
def test_dp_equals_brute_force(instance, chunks):
    """Also interleaved (v chunks: v B in the DP's unit), where few micro-batches make the price
    more than the closed form the DP's bounds use."""
    lat, sizes, devices, microbatches = instance
    dp = plan_stages(lat, sizes, devices, chunks * microbatches, chunks=chunks)
    brute = brute_force_stages(lat, sizes, devices, chunks * microbatches, chunks=chunks)
    assert (dp is None) == (brute is None)
    if dp is not None:
        assert dp.total == pytest.approx(brute.total, rel=1e-12)
        assert sum(sizes[s.submesh] for s in dp.stages) == devices
        assert dp.stages[0].first == 0 and dp.stages[-1].last == lat.shape[0] - 1
        latency = pipeline_latency([s.latency for s in dp.stages], microbatches, chunks)
        assert dp.total == pytest.approx(chunks * latency)


@st.composite
def memory_bound_instances(draw):
    """Tables shaped like real ones: a stage holds at most so many layers per device, fewer the
    more micro-batches it keeps in flight (more stages after it), so F(s, k, d) is finite only
    in a band of (k, d); the DP skips the rows and columns outside it."""
    layers = draw(st.integers(3, 7))
    sizes = draw(st.sampled_from([[1, 2, 4], [2, 4], [1, 2, 4, 8]]))
    devices = draw(st.sampled_from([4, 6, 8]))
    per_device = draw(st.sampled_from([0.5, 1.0, 1.5]))
    rng = np.random.default_rng(draw(st.integers(0, 10**6)))
    lat = np.full((layers, layers, len(sizes), layers + 1), np.inf)
    for k in range(layers):
        for i in range(k, layers):
            for m, size in enumerate(sizes):
                for left in range(1, layers + 1):
                    if (i - k + 1) * (1 + 0.25 * left) <= 2 * per_device * size:
                        lat[k, i, m, left] = (i - k + 1) * rng.uniform(0.9, 1.1) / size + 0.05
    return lat, sizes, devices, draw(st.integers(1, 16))


@settings(max_examples=60, deadline=None)
@given(memory_bound_instances())
def test_dp_equals_brute_force_on_memory_bound_tables(instance):
    lat, sizes, devices, microbatches = instance
    dp = plan_stages(lat, sizes, devices, microbatches)
    brute = brute_force_stages(lat, sizes, devices, microbatches)
    assert (dp is None) == (brute is None)
    if dp is not None:
        assert dp.total == pytest.approx(brute.total, rel=1e-12)
        assert sum(sizes[s.submesh] for s in dp.stages) == devices



@settings(max_examples=60, deadline=None)
@given(instances())
def test_branch_and_bound_starts_below_every_plans_sum(instance):
    """The search's first bound on the latency sum (no DP solved) is at most the sum of every
    cut of the layers, whatever sub-meshes and devices it uses: equal to the cheapest one."""
    lat, sizes, devices, _ = instance
    table = _BandTable(lat, np.asarray(sizes), devices)
    cuttings = [cuts for cuts in _compositions(lat.shape[0]) if len(cuts) <= table.max_stages]
    sums = [sum(lat[a, b, :, len(cuts) - j].min() for j, (a, b) in enumerate(cuts)) for cuts in cuttings]
    # Fastest over every stage count: the bound does not know how many stages follow.
    fastest = [sum(lat[a, b, :, 1:table.max_stages + 1].min() for a, b in cuts) for cuts in _compositions(lat.shape[0])]
    assert table.least_sum() <= min(sums, default=np.inf)
    cheapest = min(fastest)
    assert table.least_sum() == (pytest.approx(cheapest, rel=1e-12) if np.isfinite(cheapest) else 0.0)

def textbook_table(layer_time=1.0, overhead=0.1):
    """4 equal layers on 1 host x 2 devices: a layer takes 1 on one device, 1/2 + 0.1 on two."""
    lat = np.full((4, 4, 2, 5), np.inf)
    for k in range(4):
        for i in range(k, 4):
            n = i - k + 1
            lat[k, i, 0, 1:] = n * layer_time
            lat[k, i, 1, 1:] = n * (layer_time / 2 + overhead)
    return lat


@pytest.mark.parametrize(("microbatches", "stages"), [(1, 1), (4, 1), (6, 2), (16, 2), (64, 2)])
def test_textbook_two_device_pipeline(microbatches, stages):
    """One 2-device stage costs B * 4 * 0.6 = 2.4 B; two 1-device stages of 2 layers cost
    2 * 2 + (B - 1) * 2 = 2 B + 2. The pipeline wins once 2 B + 2 < 2.4 B, i.e. B > 5 (they tie at 5)."""
    plan = plan_stages(textbook_table(), [1, 2], 2, microbatches)
    assert len(plan.stages) == stages
    if stages == 1:
        assert plan.total == pytest.approx(2.4 * microbatches)
        assert plan.stages[0].submesh == 1
    else:
        assert plan.total == pytest.approx(2 * microbatches + 2)
        assert [(s.first, s.last, s.submesh) for s in plan.stages] == [(0, 1, 0), (2, 3, 0)]


def test_interleaved_with_fewer_micro_batches_than_stages_is_priced_as_replayed():
    """4 layers on 4 devices, 2 chunks, B = 2. Four 1-device stages of t = 1: the fill-and-drain
    form says 2 + 3 / 2 = 3.5, but the replayed schedule takes 4 + 1 / 2 = 4.5 (each micro-batch
    passes every stage twice); two 2-device stages of t = 2 (0.5 + 0.3) = 1.6 take 2 * 1.6 + 1.6 / 2
    = 4.0. The DP picks the two stages, at the replayed price."""
    lat = textbook_table(overhead=0.3)
    plan = plan_stages(lat, [1, 2], 4, 2 * 2, chunks=2)
    assert [(s.first, s.last, s.submesh) for s in plan.stages] == [(0, 1, 1), (2, 3, 1)]
    assert plan.total / 2 == pytest.approx(4.0)
    assert plan.total / 2 == pytest.approx(replayed_latency("interleaved-1f1b", [1.6 / 3] * 2, [3.2 / 3] * 2, 2, 2))
    four = pipeline_latency([1.0] * 4, 2, chunks=2)
    assert four == pytest.approx(4.5)
    assert four == pytest.approx(replayed_latency("interleaved-1f1b", [1 / 3] * 4, [2 / 3] * 4, 2, 2))


def test_no_plan_when_nothing_fits():
    lat = np.full((2, 2, 1, 3), np.inf)
    assert plan_stages(lat, [1], 1, 4) is None
    assert brute_force_stages(lat, [1], 1, 4) is None


def test_bucketed_t_max_stays_close():
    rng = np.random.default_rng(3)
    lat = rng.uniform(1, 2, size=(6, 6, 2, 7))
    for k in range(6):
        lat[k, :k] = np.inf
    exact = plan_stages(lat, [1, 2], 4, 32)
    bucketed = plan_stages(lat, [1, 2], 4, 32, relative_bucket=0.01)
    assert exact.total <= bucketed.total <= exact.total * 1.01


def test_placement_tiles_alpa_submeshes():
    from meshplan.inter.placement import place_submeshes

    origins = place_submeshes([(1, 2), (2, 4), (1, 1), (1, 4), (1, 1)], nodes=4, per_node=4)
    assert origins == [(3, 0), (0, 0), (3, 2), (2, 0), (3, 3)]
    # Three 4-device pieces cannot tile two nodes of 6 devices.
    assert place_submeshes([(1, 4), (1, 4), (1, 4)], nodes=2, per_node=6) is None
    # Keeping neighbours: pipeline order first (consecutive stages share a node) ...
    assert place_submeshes([(1, 1), (1, 1), (1, 2)], 1, 4, keep_neighbours=True) == [(0, 0), (0, 1), (0, 2)]
    assert place_submeshes([(1, 1), (1, 1), (1, 2)], 1, 4) == [(0, 2), (0, 3), (0, 0)]
    # ... and largest first when pipeline order does not tile: 2 + 1 leaves a hole a 2 cannot use.
    assert place_submeshes([(1, 2), (1, 1), (1, 2), (1, 1), (1, 2)], 2, 4, keep_neighbours=True) == \
        place_submeshes([(1, 2), (1, 1), (1, 2), (1, 1), (1, 2)], 2, 4)


def test_interleaved_schedule_shrinks_fill_and_drain():
    # 4 equal stages of 1 s, 8 micro-batches: 1F1B takes 8 + 3 = 11 s; with 3 chunks the
    # fill and drain shrink to 3/3 s (Narayanan et al. 2021, the bubble divided by v).
    assert pipeline_latency([1.0] * 4, 8) == 11.0
    assert pipeline_latency([1.0] * 4, 8, chunks=3) == pytest.approx(9.0)
    assert pipeline_latency([2.0, 1.0], 4) == 2.0 * 4 + 1.0
