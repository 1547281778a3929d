"""The graph pricer (`meshplan simulate --layout X --pricer graph`): a layout as fixed per-op
strategies on the operator graph, priced by the op-level cost model the auto planner uses. It
agrees with the closed form (3 % in time, 5 % in peak memory) on a representative subset of the
published runs and on the best layout of the seed and Mixtral jobs; `benchmarks/
validate_published.py` checks every published run and the best layout of every job of
docs/simulator.md (minutes in all). The fixed strategies are Megatron's: the collectives each
layout implies are the ones it runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from meshplan.cluster import Cluster, get_device
from meshplan.cost.collectives import CollectiveKind
from meshplan.cost.fusion import BACKWARD, FORWARD, training_pass
from meshplan.cost.kernels import DEFAULT_EFFICIENCY
from meshplan.models.transformer import PRESETS
from meshplan.simulator import TrainingJob
from meshplan.simulator.analytic import price_layout, search_layouts
from meshplan.simulator.graph_pricing import GRAPH, GraphPricer, price_layout_graph
from meshplan.simulator.layout import parse_layout

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from published_runs import RUNS, price_run  # noqa: E402

TIME, MEMORY = 0.03, 0.05
# Sequence parallelism with selective recomputation and dropout; data parallelism over 32 nodes
# with full recomputation; fp8, interleaving, the distributed optimizer and overlap; context
# parallelism; ZeRO-1 on Omni-Path; a small GPT in fp8 on 64 data-parallel ranks.
SUBSET = ("korthikanti-22b-sp-selective", "narayanan-18.4b", "nemo-llama2-70b", "nemo-llama3-70b", "bloom-176b",
          "nemo-gpt3-5b")


def agree(job, cluster, layout) -> None:
    formula, graph = price_layout(job, cluster, layout), price_layout_graph(job, cluster, layout)
    assert graph.cost_model == GRAPH and formula.cost_model != graph.cost_model
    assert graph.iteration_time == pytest.approx(formula.iteration_time, rel=TIME), layout.text()
    assert graph.memory.total == pytest.approx(formula.memory.total, rel=MEMORY), layout.text()


@pytest.mark.parametrize("name", SUBSET)
def test_published_runs_agree(name):
    run = next(r for r in RUNS if r.name == name)
    agree(run.job, run.cluster, price_run(run).layout)


@pytest.mark.parametrize(("model", "nodes", "per_node", "device", "batch", "seq"),
                         [("llama2-13b", 50, 4, "v100-32gb", 1000, 4096),
                          ("mixtral-8x7b", 4, 8, "h100-80gb", 256, 4096)])
def test_best_layout_of_a_job_agrees(model, nodes, per_node, device, batch, seq):
    """The seed job (V100: no flash attention) and Mixtral (expert parallelism)."""
    job, cluster = TrainingJob(PRESETS[model], batch, seq), Cluster(nodes, per_node, get_device(device))
    agree(job, cluster, search_layouts(job, cluster).best.layout)


def collectives(pricer: GraphPricer, piece: str, passes: set[int]) -> list:
    """(kind, axes) of the collectives the piece's plan runs in `passes`, once each value."""
    priced = pricer.pieces[piece]
    graph, plan = priced.piece.graph, priced.plan
    found = [(c.kind, c.axes) for n in plan.nodes if training_pass(graph[n.node]) in passes
             and not graph[n.node].attr("accumulated") and graph[n.node].attr("kernel") != "stage_boundary"
             for c in n.collectives if c.nbytes > 1e6]
    moved = {(r.producer, r.src, r.dst): r for r in plan.reshardings if training_pass(graph[r.consumer_id]) in passes}
    return found + [(c.kind, c.axes) for r in moved.values() for c in r.collectives if c.nbytes > 1e6]


def test_megatron_tensor_parallel_collectives():
    """A GPT block at tp = 8: two all-reduces of the activations forward, two backward; with
    sequence parallelism two all-gathers and two reduce-scatters forward instead."""
    job, cluster = TrainingJob(PRESETS["gpt3-1.3b"], 8, 2048), Cluster(1, 8, get_device("a100-80gb"))
    plain = GraphPricer(job, cluster, parse_layout("tp=8,pp=1,dp=1,mb=8"), DEFAULT_EFFICIENCY)
    tensor = (3,)
    assert sorted(collectives(plain, "block", {FORWARD})) == [(CollectiveKind.ALL_REDUCE, tensor)] * 2
    assert sorted(collectives(plain, "block", {BACKWARD})) == [(CollectiveKind.ALL_REDUCE, tensor)] * 2
    sp = GraphPricer(job, cluster, parse_layout("tp=8,pp=1,dp=1,mb=8,sp=on"), DEFAULT_EFFICIENCY)
    forward = sorted(collectives(sp, "block", {FORWARD}), key=lambda c: c[0].value)
    assert forward == [(CollectiveKind.ALL_GATHER, tensor)] * 2 + [(CollectiveKind.REDUCE_SCATTER, tensor)] * 2


def test_distributed_optimizer_reduce_scatters_gradients_and_gathers_weights():
    job, cluster = TrainingJob(PRESETS["gpt3-1.3b"], 16, 2048), Cluster(2, 8, get_device("a100-80gb"))
    pricer = GraphPricer(job, cluster, parse_layout("tp=2,pp=1,dp=8,mb=2,zero=on"), DEFAULT_EFFICIENCY)
    priced = pricer.pieces["block"]
    graph, plan = priced.piece.graph, priced.plan
    grads = {c.kind for n in plan.nodes if graph[n.node].attr("accumulated") and n.memory > 1e6 for c in n.collectives}
    assert grads == {CollectiveKind.REDUCE_SCATTER}
    gathers = [c for r in plan.reshardings if graph[r.consumer_id].attr("relayout") for c in r.collectives]
    assert gathers and all(c.kind is CollectiveKind.ALL_GATHER and c.axes == (0,) for c in gathers)


def test_expert_parallel_dispatch_and_combine_are_all_to_alls():
    job = TrainingJob(PRESETS["mixtral-8x7b"].replace(layers=2), 16, 1024)
    cluster = Cluster(1, 8, get_device("h100-80gb"))
    pricer = GraphPricer(job, cluster, parse_layout("tp=1,pp=1,dp=8,ep=8,mb=2"), DEFAULT_EFFICIENCY)
    moved = collectives(pricer, "moe-block", {FORWARD, BACKWARD})
    assert moved.count((CollectiveKind.ALL_TO_ALL, (1,))) == 4  # dispatch and combine, forward and backward
