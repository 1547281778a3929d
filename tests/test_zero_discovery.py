"""The auto planner's ILP finds ZeRO by itself (as Alpa reports): a data-parallel block is
planned with the fp32 master copy and Adam's moments split over the data-parallel devices, the
weight gradients reduce-scattered onto that split and the new weights gathered back to their
layout, from nothing but per-op strategies and their costs: the optimizer step runs on 1/8 of
the state and a reduce-scatter plus an all-gather move what one all-reduce moves, so it is
faster than keeping the state whole, and it holds less."""

from __future__ import annotations

from meshplan.cluster import Cluster, get_device
from meshplan.cost.collectives import CollectiveKind
from meshplan.intra.solve import solve_intra
from meshplan.models.transformer import PRESETS
from meshplan.sharding.spec import ShardingSpec
from meshplan.simulator import PlannerOptions, TrainingJob
from meshplan.simulator.pricing import piece_graphs, piece_options, piece_pricing, planner_views

JOB = TrainingJob(PRESETS["gpt3-1.3b"], 64, 1024)
CLUSTER = Cluster(1, 8, get_device("a100-40gb"))


def plan(fixed=()):
    mesh = next(v for v in planner_views(CLUSTER, (1, 8)) if v.shape == (8, 1))  # data parallel over 8
    blocks, _, _ = piece_graphs(JOB.model, 8, JOB.seq_len, JOB.dtype, JOB.optimizer)
    piece = blocks[False]
    options = piece_options(CLUSTER.device.peak_flops * 0.5, 8, 0.0, 60.0, 0, True,
                            piece_pricing(JOB, CLUSTER, PlannerOptions())).replace(fixed_specs=fixed)
    return piece, solve_intra(piece.graph, mesh.with_memory(None), options)


def optimizer_state(graph) -> list[int]:
    """The fp32 master copies and Adam moments of the weight matrices (the vectors, norm gains
    and biases, are a ten-thousandth of the state: their reductions stay all-reduces)."""
    return [n.id for n in graph.parameters() if n.name.endswith((".master", ".adam_m", ".adam_v")) and n.rank > 1]


def test_the_ilp_finds_zero_by_itself():
    piece, found = plan()
    graph = piece.graph
    state = optimizer_state(graph)
    assert state and all(not found.nodes[v].output.is_replicated for v in state)  # every one split
    gradients = [n for n in found.nodes if graph[n.node].attr("accumulated") and graph[n.node].kind.value == "dot"
                 and graph[n.node].rank > 1]
    assert gradients and all(c.kind is CollectiveKind.REDUCE_SCATTER for n in gradients for c in n.collectives)
    gathered = [r for r in found.reshardings if graph[r.consumer_id].attr("relayout")]
    weights = {found.nodes[w].output for w in piece.weights if graph[w].rank > 1}
    assert gathered and {r.dst for r in gathered} >= weights  # new weights gathered back to their layout
    assert all(c.kind is CollectiveKind.ALL_GATHER for r in gathered for c in r.collectives)
    # Keeping the optimizer state whole (plain data parallelism) costs more and holds more.
    whole = tuple((v, ShardingSpec.replicated(graph[v].rank)) for v in state)
    _, replicated = plan(whole)
    assert found.objective < replicated.objective
    assert sum(found.nodes[v].memory for v in state) <= sum(replicated.nodes[v].memory for v in state) / 8 * 1.01
