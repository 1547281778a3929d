"""Model families as training graphs: MoE dispatch becomes an all-to-all; BERT and GQA plan."""

from __future__ import annotations

import warnings

import pytest

from meshplan.cluster import Cluster, get_device
from meshplan.cost import CollectiveKind
from meshplan.cost.model import CostModel
from meshplan.intra.options import IntraOptions
from meshplan.intra.solve import solve_intra
from meshplan.ir import OpKind
from meshplan.models.training import block_training_graph
from meshplan.models.transformer import PRESETS
from meshplan.sharding.spec import ShardingSpec
from meshplan.simulator import PlannerOptions, TrainingJob, simulate


def test_moe_experts_are_split_and_dispatch_is_all_to_all():
    """Tokens split over the devices and the experts' weights split over them too (expert
    parallelism, fixed here): the token permutation into the experts and back becomes all-to-alls."""
    piece = block_training_graph(PRESETS["moe-1.3b"], 1, 8, 256)
    view = Cluster(1, 8, get_device("a100-80gb")).logical_views((1, 8))[0]
    split = {"layer1.mlp.experts.w1": 0, "layer1.mlp.experts.w2": 0, "activations": 0, "cotangent": 0}
    fixed = tuple((n.id, ShardingSpec(tuple((1,) if d == split[n.name] else () for d in range(n.rank))))
                  for n in piece.graph.nodes if n.name in split)
    options = IntraOptions(cost=CostModel(flops_per_second=156e12, accumulation_weight=1 / 8), fixed_specs=fixed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = solve_intra(piece.graph, view, options)
    assert plan.strategy("layer1.mlp.experts.up").output.dims[0] == (1,)  # the expert dim over all 8 devices
    moved = [c for r in plan.reshardings if r.producer.startswith("layer1.mlp.dispatch") for c in r.collectives]
    assert any(c.kind is CollectiveKind.ALL_TO_ALL for c in moved)


def test_grouped_query_attention_has_fewer_kv_weights():
    piece = block_training_graph(PRESETS["llama2-70b"].replace(layers=1), 0, 1, 128)
    shapes = {piece.graph[w].name: piece.graph[w].shape for w in piece.weights}
    # One fused projection: per key/value head its 8 query heads, one key and one value head.
    assert shapes["layer0.attn.wqkv"] == (8192, 8, 8 + 2, 128)
    assert sum(1 for n in piece.graph if n.kind is OpKind.DOT) > 20  # forward and backward contractions


@pytest.mark.parametrize("model", ["bert-base", "llama2-7b"])
def test_small_models_simulate(model):
    cfg = PRESETS[model].replace(layers=2)
    sim = simulate(TrainingJob(cfg, 8, 128), Cluster(1, 4, get_device("a100-40gb")),
                   PlannerOptions(workers=1, microbatch_sizes=(4,)), baselines=False)
    assert sum(s.num_devices for s in sim.plan.stages) == 4
    assert sim.plan.prediction.iteration_time_s > 0
