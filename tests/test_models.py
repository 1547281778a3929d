"""Model families as training graphs: MoE dispatch becomes an all-to-all; BERT and GQA plan."""

from __future__ import annotations

import warnings

import pytest

from meshplan.cluster import Cluster, get_device
from meshplan.cost import CollectiveKind
from meshplan.ir import OpKind
from meshplan.models.training import block_training_graph
from meshplan.models.transformer import PRESETS
from meshplan.simulator import PlannerOptions, TrainingJob, simulate
from meshplan.simulator.pricing import profile_piece


def test_moe_experts_are_split_and_dispatch_is_all_to_all():
    piece = block_training_graph(PRESETS["moe-1.3b"], 1, 8, 256)
    view = Cluster(1, 8, get_device("a100-80gb")).logical_views((1, 8))[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, plan = profile_piece(piece, view, 156e12, 8)
    experts = plan.strategy("layer1.mlp.experts.up")
    assert experts.output.dims[0] == (1,)  # expert parallelism: the expert dim over all 8 devices
    assert any(c.kind is CollectiveKind.ALL_TO_ALL for c in plan.collectives())


def test_grouped_query_attention_has_fewer_kv_weights():
    piece = block_training_graph(PRESETS["llama2-70b"].replace(layers=1), 0, 1, 128)
    shapes = {piece.graph[w].name: piece.graph[w].shape for w in piece.weights}
    assert shapes["layer0.attn.wk"] == (8192, 8, 128) and shapes["layer0.attn.wq"] == (8192, 8, 8, 128)
    assert sum(1 for n in piece.graph if n.kind is OpKind.DOT) > 20  # forward and backward contractions


@pytest.mark.parametrize("model", ["bert-base", "llama2-7b"])
def test_small_models_simulate(model):
    cfg = PRESETS[model].replace(layers=2)
    sim = simulate(TrainingJob(cfg, 8, 128), Cluster(1, 4, get_device("a100-40gb")),
                   PlannerOptions(workers=1, microbatch_sizes=(4,)), baselines=False)
    assert sum(s.num_devices for s in sim.plan.stages) == 4
    assert sim.plan.prediction.iteration_time_s > 0
