"""CFP profiling on 8 CPU devices: every combination timed, out of memory recorded not fatal,
the cache reused and keyed by mesh, and the searched plan runs."""

from __future__ import annotations

import pytest

from meshplan.cfp import (
    CfpOptions,
    ProfileCache,
    ProfileSettings,
    analyze,
    load_profiles,
    model_graph,
    model_spec,
    profile,
    search,
)
from meshplan.cfp.export import house_plan
from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.model import CostModel
from meshplan.errors import InfeasiblePlanError, PlanValidationError
from meshplan.plan import Plan

jax = pytest.importorskip("jax")

MESH = LogicalMesh((8,), (1e-5,), (1e-9,))
SETTINGS = ProfileSettings(runs=2, warmup=1)


@pytest.fixture(scope="module")
def analysis():
    graph = model_graph(model_spec("gpt3-125m", 2, batch=8, seq_len=16, hidden=64))
    return analyze(graph, MESH, CfpOptions(CostModel(flops_per_second=1e11), max_combinations=4))


def test_measured_profiles_are_cached_and_searched(analysis, tmp_path):
    cache, calls = ProfileCache(tmp_path), []
    first = profile(analysis, SETTINGS, cache, progress=lambda *args: calls.append(args))
    assert len(first.segments) == len(analysis.segments) == 6  # two layers, profiled once
    combos = [c for p in first.segments for c in p.combinations]
    assert len(combos) == sum(s.combinations for s in analysis.segments)
    assert all(c.ok and c.time_s > 0 and c.min_s <= c.median_s and c.peak_memory > 0 for c in combos)
    assert {p.device for p in first.segments} == {f"{jax.devices()[0].device_kind} x8"}
    assert calls[-1] == ("segment 5", 3, 3) and first.cached == ()
    again = profile(analysis, SETTINGS, cache)
    assert again.cached == tuple(range(6)) and again.segments == first.segments
    assert load_profiles(analysis, cache).segments == first.segments
    plan = search(analysis, first)
    assert len(plan.block_choice) == len(analysis.blocks) and plan.predicted_time > 0
    spec = model_spec("gpt3-125m", 2, batch=8, seq_len=16, hidden=64)
    house = house_plan(analysis, plan, spec, first.segments[0].device, {"mean_s": 0.5})
    assert Plan.from_json(house.to_json()) == house  # the house's one plan format, exactly
    layouts = analysis.node_strategies(plan.block_choice)
    assert [n.output for n in house.stages[0].intra_plan.nodes] == [s.output for s in layouts]
    assert house.source == "cfp" and house.prediction.iteration_time_s == plan.predicted_time
    assert len(house.notes) == len(analysis.blocks) and dict(house.metrics)["measured.mean_s"] == 0.5


def test_out_of_memory_is_recorded_not_fatal(analysis):
    limited = profile(analysis, ProfileSettings(runs=1, warmup=0, memory_limit=1e3))
    combos = [c for p in limited.segments for c in p.combinations]
    assert {c.status for c in combos} == {"oom"}
    assert all("MB per device" in c.message and c.peak_memory > 1e3 for c in combos)
    with pytest.raises(InfeasiblePlanError, match="failed or ran out of memory"):
        search(analysis, limited)


def test_search_refuses_a_cache_from_another_mesh(analysis, tmp_path):
    profile(analysis, ProfileSettings(analytic=True), ProfileCache(tmp_path))
    other = analyze(analysis.graph, LogicalMesh((2, 4), (1e-5, 1e-5), (1e-9, 1e-9)), analysis.options)
    with pytest.raises(PlanValidationError, match=r"for mesh 8 \(analytic\), not for mesh 2x4"):
        load_profiles(other, ProfileCache(tmp_path), analytic=True)
    with pytest.raises(PlanValidationError, match="has no profiles"):
        load_profiles(analysis, ProfileCache(tmp_path / "empty"), analytic=True)


def test_segments_profiled_on_a_process_pool_equal_those_profiled_here(analysis):
    from meshplan.distributed import PoolExecutor, TaskRunner

    settings = ProfileSettings(analytic=True)
    here = profile(analysis, settings)
    with TaskRunner(PoolExecutor(2)) as runner:
        pooled = profile(analysis, settings, runner=runner)
    assert pooled == here and len(here.segments) >= 1
