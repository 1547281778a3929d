"""CFP search: the ILP equals exhaustive enumeration over block strategies (analytic profiles,
also perturbed and with failed combinations), under memory budgets; infeasible is reported."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from meshplan.cfp import (
    CfpOptions,
    Profiles,
    ProfileSettings,
    analyze,
    model_graph,
    model_spec,
    profile,
    run_task,
    search,
    search_exhaustive,
    segment_tasks,
)
from meshplan.cfp.price import price
from meshplan.cfp.search import build_problem, evaluate
from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.model import CostModel
from meshplan.errors import InfeasiblePlanError

MESH = LogicalMesh((4,), (1e-5,), (1e-9,))


def _analysis(model: str, max_combinations: int):
    graph = model_graph(model_spec(model, 1, batch=8, seq_len=32))
    return analyze(graph, MESH, CfpOptions(CostModel(flops_per_second=1e11), max_combinations))


def _perturbed(profiles: Profiles, seed: int, fail_every: int = 0) -> Profiles:
    """Profiles with every time scaled by a random factor in [0.5, 2), and every
    `fail_every`-th combination out of memory: profiles the cost model would not produce."""
    rng = np.random.default_rng(seed)
    segments = []
    for prof in profiles.segments:
        combos = []
        for k, c in enumerate(prof.combinations):
            t = c.time_s * rng.uniform(0.5, 2.0)
            failed = fail_every and k % fail_every == fail_every - 1
            combos.append(dataclasses.replace(c, status="oom" if failed else "ok", time_s=None if failed else t,
                                              median_s=t, min_s=t))
        segments.append(dataclasses.replace(prof, combinations=tuple(combos)))
    return Profiles(tuple(segments), (), "measured")


CASES = [("gpt3-125m", 64, 0), ("llama2-7b", 64, 1), ("gpt3-125m", 4, 2), ("llama2-7b", 4, 3)]


@pytest.mark.parametrize(("model", "max_combinations", "seed"), CASES)
def test_search_equals_exhaustive(model, max_combinations, seed):
    a = _analysis(model, max_combinations)
    analytic = profile(a, ProfileSettings(analytic=True))
    for profiles in (analytic, _perturbed(analytic, seed), _perturbed(analytic, seed + 10, fail_every=3)):
        ilp, brute = search(a, profiles), search_exhaustive(a, profiles)
        assert ilp.predicted_time == pytest.approx(brute.predicted_time, rel=1e-9)
        options, edges = build_problem(a, profiles)
        chosen = [[o.choice for o in opts].index(c) for opts, c in zip(options, ilp.occurrence_choice, strict=True)]
        assert evaluate(options, edges, chosen)[0] == pytest.approx(ilp.predicted_time, rel=1e-12)
    assert len(a.occurrences) >= 2 and edges  # values cross between occurrences: resharding is priced


def test_analytic_plan_price_equals_the_cost_model_on_the_whole_graph():
    """With analytic profiles, segments and resharding between them add up to the cost model's
    price of the whole graph under the chosen plan."""
    a = _analysis("gpt3-125m", 4)
    plan = search(a, profile(a, ProfileSettings(analytic=True)))
    whole = price(a.graph, a.node_strategies(plan.block_choice), a.mesh, a.options.cost)
    assert plan.predicted_time == pytest.approx(whole.time, rel=1e-9)
    assert plan.resharding_time >= 0.0


@pytest.mark.parametrize("model", ["gpt3-125m", "llama2-7b"])
def test_memory_budget_binds_like_exhaustive(model):
    a = _analysis(model, 64)
    profiles = _perturbed(profile(a, ProfileSettings(analytic=True)), 7)
    free = search(a, profiles)
    options, edges = build_problem(a, profiles)
    least = min(evaluate(options, edges, p)[1] for p in np.ndindex(*(len(o) for o in options)))
    assert least < free.predicted_memory  # the fastest plan is not the smallest one
    budget = (least + free.predicted_memory) / 2
    ilp, brute = search(a, profiles, budget), search_exhaustive(a, profiles, budget)
    assert ilp.predicted_time == pytest.approx(brute.predicted_time, rel=1e-9)
    assert ilp.predicted_memory <= budget * (1 + 1e-9) and ilp.predicted_time >= free.predicted_time
    with pytest.raises(InfeasiblePlanError, match="the least any plan needs") as info:
        search(a, profiles, least * 0.99)
    assert info.value.min_budget_bytes == pytest.approx(least, rel=1e-6)


def test_segment_task_is_picklable_and_runs_alone():
    a = _analysis("gpt3-125m", 64)
    tasks = segment_tasks(a, ProfileSettings(analytic=True))
    copy = pickle.loads(pickle.dumps(tasks[0]))
    assert run_task(copy) == run_task(tasks[0])
    assert len(copy.combinations) == a.segments[0].combinations


def test_analytic_profile_records_oom_against_the_memory_limit():
    a = _analysis("gpt3-125m", 64)
    peaks = [c.peak_memory for p in profile(a, ProfileSettings(analytic=True)).segments for c in p.combinations]
    limit = float(np.median(peaks))
    limited = profile(a, ProfileSettings(analytic=True, memory_limit=limit))
    statuses = [(c.status, c.peak_memory) for p in limited.segments for c in p.combinations]
    assert {s for s, _ in statuses} == {"ok", "oom"}
    assert all((s == "ok") == (m <= limit) for s, m in statuses)
