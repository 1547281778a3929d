"""The solver's searches on generated contest-shaped instances: the generator itself, the
portfolio of two processes against the exact MIP, repeatable runs under a seed, and an
interrupted command that leaves its last good plan behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from iopddl_score import FORBIDDEN_AT, peak_usage, score
from meshplan.intra import ProblemOptions, SolveStatus, solve_problem
from meshplan.intra.problem.generate import GeneratorOptions, random_instance
from meshplan.intra.problem.iopddl import problem_from_iopddl
from meshplan.intra.problem.memory import memory_rows
from meshplan.intra.problem.presolve import presolve
from meshplan.intra.search.candidates import candidates_first, restrict
from meshplan.intra.search.lazy_rows import NoHooks, solve_lazy
from meshplan.intra.search.problem_solver import whole_block

ROOT = Path(__file__).resolve().parents[1]


def _problem(seed: int, **shape):
    raw = random_instance(seed, GeneratorOptions(**shape))
    return raw, problem_from_iopddl(raw)


@pytest.mark.parametrize("training", [True, False])
def test_generated_instances_have_the_contest_structure(training):
    shape = GeneratorOptions(layers=3, ops_per_layer=3, training=training, forbid=0.1)
    raw, p = random_instance(3, shape), problem_from_iopddl(random_instance(3, shape))
    assert raw == random_instance(3, shape) and raw != random_instance(4, shape)  # seeded
    nodes, edges = raw["problem"]["nodes"], raw["problem"]["edges"]
    assert p.num_nodes == len(nodes["costs"]) and p.num_edges == len(edges["nodes"])
    assert all(u < v for u, v in edges["nodes"])  # producers before consumers: program order
    assert any(FORBIDDEN_AT in c for c in nodes["costs"]) and any(FORBIDDEN_AT in m for m in edges["costs"])
    intervals = [tuple(iv) for iv in nodes["intervals"]]
    weights = [iv for iv in intervals if iv[0] == 0 and iv[1] == max(hi for _, hi in intervals)]
    assert len(weights) >= 3  # every layer's weight is live throughout
    if training:  # forward activations live until their gradient: nested intervals, as in a tree
        spans = sorted((lo, hi) for lo, hi in intervals if (lo, hi) not in weights)
        nested = sum(a[0] < b[0] and b[1] <= a[1] for a, b in zip(spans, spans[1:], strict=False))
        assert nested >= 3
    leanest = [int(np.argmin(u)) for u in nodes["usages"]]
    cheapest = [int(np.argmin(c)) for c in nodes["costs"]]
    limit = raw["problem"]["usage_limit"]
    assert peak_usage(raw["problem"], leanest) <= limit < peak_usage(raw["problem"], cheapest)


@pytest.mark.parametrize("seed", range(4))
def test_portfolio_reaches_the_exact_optimum(seed):
    """Two workers (prices here, the MIP with lazily added memory rows in a child process)
    prove the optimum the single-process MIP finds; every plan re-scored independently."""
    raw, p = _problem(seed, layers=2 + seed, ops_per_layer=3, mesh=(2, 4), tightness=0.2)
    exact = solve_problem(p, ProblemOptions(time_limit=60))
    both = solve_problem(p, ProblemOptions(time_limit=60, workers=2, seed=seed))
    assert exact.status is SolveStatus.OPTIMAL and both.status is SolveStatus.OPTIMAL
    assert both.cost == exact.cost and score(raw["problem"], both.choice.tolist()) == (both.cost, True)
    assert both.bound == both.cost


def test_bounds_told_while_the_mip_runs_hold():
    """The MIP tells its bounds as it proves them (a portfolio's child is killed at the deadline,
    before its run returns): they rise, and none is above the optimum it ends by proving."""
    _, p = _problem(2, layers=4, ops_per_layer=3, mesh=(2, 4), tightness=0.2)
    pre = presolve(p)
    q = pre.problem
    block = replace(whole_block(pre, memory_rows(q.memory.lo, q.memory.hi, pre.base, q.usage_limit)), offset=0.0)
    told: list[float] = []

    class Recorder(NoHooks):
        def proved(self, bound: float) -> None:
            told.append(bound)

    out = solve_lazy(block, None, time.perf_counter() + 60, Recorder())
    assert out.optimal and len(told) > out.runs  # more than one per HiGHS run: told from inside runs
    assert told == sorted(told) and told[-1] <= out.cost * (1 + 1e-12)


def test_candidate_strategies_map_plans_and_never_beat_the_optimum():
    """The MIP over a few strategies per node: plans lift and lower without change of cost,
    and from the optimum's plan or from nothing it ends at a feasible plan no better than the
    optimum (it is no relaxation), the optimum itself when started there."""
    raw, p = _problem(2, layers=4, ops_per_layer=3, mesh=(2, 4), tightness=0.2)
    pre = presolve(p)
    q = pre.problem
    block = replace(whole_block(pre, memory_rows(q.memory.lo, q.memory.hi, pre.base, q.usage_limit)), offset=0.0)
    exact = solve_lazy(block, None, time.perf_counter() + 60)
    assert exact.optimal
    score_of = np.random.default_rng(0).random(int(q.sizes.sum()))
    r = restrict(block, score_of, (exact.choice,), per_node=2)
    assert (r.block.sizes <= 3).all() and r.block.sizes.sum() < q.sizes.sum()
    low = r.lower(exact.choice)
    assert (r.lift(low) == exact.choice).all() and r.block.cost_of(low) == block.cost_of(exact.choice)
    for start in (exact.choice, None):
        found = candidates_first(block, score_of, start, time.perf_counter() + 30, NoHooks(), None, per_node=2)
        if found is None:
            assert start is None  # without a start the restriction may admit nothing
            continue
        assert found.shape == exact.choice.shape and block.cost_of(found) >= exact.cost * (1 - 1e-12)
        full = pre.expand(found)
        assert score(raw["problem"], full.tolist()) == (block.cost_of(found) + pre.offset, True)
        if start is not None:
            assert block.cost_of(found) == exact.cost


@pytest.mark.parametrize("seed", [0, 1])
def test_search_alone_stays_feasible_and_bounded(seed):
    """Without the whole MIP (prices and windows, in two processes): a feasible plan within
    the proven bound and the exact optimum."""
    raw, p = _problem(seed, layers=4, ops_per_layer=3, mesh=(2, 4), tightness=0.2)
    exact = solve_problem(p, ProblemOptions(time_limit=60)).cost
    found = solve_problem(p, ProblemOptions(time_limit=2, full_mip_columns=0, workers=2, seed=seed))
    assert score(raw["problem"], found.choice.tolist()) == (found.cost, True)
    assert found.bound <= exact <= found.cost


def test_lockstep_portfolio_repeats_under_a_seed():
    """With lockstep the two processes trade plans only at numbered epochs, so a seed gives the
    same run: the same plans found in the same order, the same rounds, the same answer."""
    _, p = _problem(3, layers=6, mesh=(2, 4), tightness=0.2)
    runs = []
    for _ in range(2):
        plans: list[float] = []
        result = solve_problem(p, ProblemOptions(time_limit=120, workers=2, lockstep=True, seed=5),
                               on_plan=lambda choice, cost, plans=plans: plans.append(cost))
        runs.append((plans, result.cost, result.choice.tolist(), result.stats["price_rounds"],
                     result.stats["best_from"]))
    assert runs[0] == runs[1]
    plans, _, _, rounds, best_from = runs[0]
    assert rounds >= 1 and len(plans) >= 2 and best_from == "exact"  # both sides found plans


def test_interrupted_command_leaves_its_last_good_plan(tmp_path):
    """SIGTERM in the middle of a long search: the command writes its best plan so far and
    leaves at once; the plan is feasible by the independent scorer."""
    raw = random_instance(11, GeneratorOptions(layers=40, ops_per_layer=5, mesh=(4, 4), tightness=0.1))
    problem_file, out = tmp_path / "p.json", tmp_path / "s.json"
    problem_file.write_text(json.dumps(raw))
    env = os.environ | {"PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, "-m", "meshplan.cli", "solve-problem", str(problem_file), "--out", str(out),
               "--time-limit", "300"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        waited = time.perf_counter()
        while not out.exists() and time.perf_counter() - waited < 120:  # the first plan is written as found
            time.sleep(0.2)
        assert out.exists(), "no plan was written while searching"
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "interrupted" in stderr
    data = json.loads(out.read_text())
    assert data["status"] in ("interrupted", "feasible")
    assert score(raw["problem"], data["solution"]) == (data["cost"], True)


def test_hard_stop_ends_a_run_stuck_in_one_call():
    """The command's last resort against running past its limit: a C call that holds the
    interpreter (a signal handler would wait for it to return) is ended all the same."""
    code = "from meshplan.cli import _hard_stop; _hard_stop(1.0); sum(range(10**12))"  # hours without it
    env = os.environ | {"PYTHONPATH": str(ROOT / "src")}
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120, check=False)
    assert proc.returncode != 0 and time.perf_counter() - began < 60


def test_mip_seeded_with_priced_rows_proves_the_same_optimum():
    """The rows memory prices found binding, given to the MIP from its start, change what it
    proves in no way, and spare the restarts that meeting them in its plans costs."""
    from meshplan.intra.problem.memory import term_index
    from meshplan.intra.search.lagrange import MemoryPricing
    from meshplan.intra.search.local_search import least_memory_choice
    from meshplan.intra.search.pairwise import pairwise_index

    _, p = _problem(2, layers=4, ops_per_layer=3, mesh=(2, 4), tightness=0.2)  # unseeded: 2 runs
    pre = presolve(p)
    q = pre.problem
    rows = memory_rows(q.memory.lo, q.memory.hi, pre.base, q.usage_limit)
    block = replace(whole_block(pre, rows), offset=0.0)
    terms = term_index(rows, q.memory.node, q.memory.usages, q.costs.ptr)
    pricing = MemoryPricing(q, pairwise_index(q), terms, least_memory_choice(q, rows), True, np.random.default_rng(0))
    for _ in range(12):
        pricing.step(time.perf_counter() + 10)
    binding = pricing.binding_rows()
    assert len(binding) and (pricing.ever_priced[binding]).all() and len(pricing.binding_rows(most=1)) == 1
    plain = solve_lazy(block, None, time.perf_counter() + 60)
    seeded = solve_lazy(block, None, time.perf_counter() + 60, rows=binding)
    assert plain.optimal and seeded.optimal and seeded.cost == pytest.approx(plain.cost, rel=1e-12)
    assert seeded.runs <= plain.runs
