"""Wide-ResNet builders (Alpa's presets), their counts, and planning them through `simulate`."""

import json

import pytest
from typer.testing import CliRunner

from meshplan.cli import app
from meshplan.cluster.cluster import Cluster
from meshplan.cluster.devices import get_device
from meshplan.errors import ModelSpecError
from meshplan.inter import LayerCosts, plan_pipeline
from meshplan.ir import DType, OpKind
from meshplan.ir.counting import node_flops
from meshplan.models.registry import simulation_model
from meshplan.models.resnet import WRESNET_PRESETS, ResNetConfig, resnet_forward
from meshplan.models.training import training_pieces
from meshplan.models.unet import UNetConfig, unet_forward
from meshplan.plan import Plan
from meshplan.simulator import PlannerOptions, TrainingJob
from meshplan.simulator.planner import inter_options
from meshplan.simulator.pricing import PricingTask, ViewKey, handoff_bytes, planner_views, price_task

# Alpa's benchmark/alpa/suite_wresnet.py, `wresnet_specs`: (layers, base channels, width factor).
ALPA_SPECS = {"250m": (50, 160, 2), "500m": (50, 224, 2), "1b": (50, 320, 2), "2b": (50, 448, 2),
              "4b": (50, 640, 2), "6.8b": (50, 320, 16), "13b": (101, 320, 16)}


def test_presets_are_alpas_and_their_sizes_match_their_names():
    for size, (depth, channels, width) in ALPA_SPECS.items():
        cfg = WRESNET_PRESETS[f"wresnet-{size}"]
        assert (cfg.depth, cfg.channels, cfg.width_factor, cfg.image_size, cfg.num_classes) == \
            (depth, channels, width, 224, 1024)
        named = float(size[:-1]) * (1e6 if size.endswith("m") else 1e9)
        assert abs(cfg.num_params() / named - 1) < 0.07, size
    assert WRESNET_PRESETS["wresnet-13b"].layers == 33 and WRESNET_PRESETS["wresnet-2b"].layers == 16


def test_resnet50_counts_match_the_published_ones():
    """torchvision's ResNet-50 (v1.5: stride on the 3x3 conv, as Flax and Alpa): 25,557,032
    parameters and 4.09 GFLOPS, counted in multiply-adds, per 224x224 image."""
    cfg = WRESNET_PRESETS["resnet-50"]
    assert cfg.num_params() == 25_557_032
    assert cfg.forward_flops() / 2 == pytest.approx(4.09e9, rel=0.002)


@pytest.mark.parametrize("cfg", [WRESNET_PRESETS["resnet-50"],
                                 ResNetConfig("small-101", 101, 8, 4, image_size=64, num_classes=10)])
def test_graph_counts_equal_the_analytic_counts(cfg):
    graph = resnet_forward(cfg, batch=2)
    contractions = sum(node_flops(graph, n) for n in graph.nodes if n.kind in (OpKind.CONV, OpKind.DOT))
    assert contractions == 2 * cfg.forward_flops()
    weights = sum(n.size for n in graph.parameters() if n.name not in ("images", "labels"))
    assert weights == cfg.num_params()
    strided = [n for n in graph.nodes if n.kind is OpKind.CONV and max(n.attr("window_strides")) == 2]
    assert len(strided) == 1 + 2 * 3  # the stem, and the 3x3 conv and the projection of stages 2-4


def test_blocks_of_one_shape_share_a_piece_and_hand_off_their_outputs():
    cfg = WRESNET_PRESETS["wresnet-250m"]
    blocks, stem, head = training_pieces(cfg, 4, 1, DType.F32, "momentum")
    assert len(blocks) == 8  # per stage: the first (strided, projected) block and the rest
    assert [cfg.kind_name(cfg.layer_kind(i)) for i in (0, 1, 2, 3, 4, 15)] == \
        ["block0", "block1", "block1", "block3", "block4", "block14"]
    job = TrainingJob(cfg, 64, 1, DType.F32, "momentum")
    sent = handoff_bytes(job, 4)
    assert len(sent) == 15
    assert sent[0] == 4 * 56 * 56 * 4 * 160 * 4 and sent[-1] == 4 * 7 * 7 * 32 * 160 * 4
    momentum = [n for n in head.graph.parameters() if n.name.endswith(".momentum")]
    assert {n.name for n in momentum} == {"head.kernel.momentum", "head.bias.momentum"}
    assert stem.graph.nodes[stem.forward_end].kind is OpKind.REDUCE


def test_v100_prices_fp32_work_without_tensor_cores():
    v100 = get_device("v100-16gb")
    assert v100.for_itemsize(4).peak_flops == 15.7e12
    assert v100.for_itemsize(2).peak_flops == 125e12
    assert get_device("a100-80gb").for_itemsize(4) is get_device("a100-80gb")


def test_image_jobs_take_no_sequence_length():
    with pytest.raises(ModelSpecError, match="sequence length must be 1"):
        TrainingJob(WRESNET_PRESETS["wresnet-1b"], 64, 4096, DType.F32, "momentum")
    with pytest.raises(ModelSpecError, match="wresnet-2b"):
        simulation_model("wresnet-3b")


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory):
    """wresnet-250m on two V100s, planned by `meshplan simulate` (one micro-batch size, 1F1B)."""
    out = tmp_path_factory.mktemp("wresnet") / "plan.json"
    result = CliRunner().invoke(app, ["simulate", "--model", "wresnet-250m", "--cluster", "1x2", "--device",
                                      "v100-16gb", "--global-batch", "64", "--microbatch-sizes", "16", "--chunks", "1",
                                      "--workers", "1", "--executor", "inprocess", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return Plan.from_dict(json.loads(out.read_text())), result.output


def test_a_small_wresnet_plans_end_to_end_through_the_cli(small_plan):
    plan, printed = small_plan
    cfg = WRESNET_PRESETS["wresnet-250m"]
    assert "global batch 64 images" in printed and "images/s" in printed and "tokens" not in printed
    assert plan.sample_unit == "images" and plan.seq_len == 0 and plan.option("dtype") == "f32"
    assert plan.option("optimizer") == "momentum"
    assert plan.stages[0].first_layer == 0 and plan.stages[-1].last_layer == cfg.layers - 1
    assert sum(len(s.devices) for s in plan.stages) == 2
    # fp32 on V100: MFU against the 15.7 TFLOP/s fp32 peak; model FLOPs three times the forward's
    p = plan.prediction
    assert p.mfu == pytest.approx(p.tflops_per_device / 15.7, rel=1e-9)
    assert p.tflops_per_device * 1e12 * 2 * p.iteration_time_s == pytest.approx(3 * cfg.forward_flops() * 64)
    names = {b.name: b for b in plan.baselines}
    assert names["megatron"].prediction is None and "convolution" in names["megatron"].reason
    assert "megatron does not apply" in printed
    assert {"pp-dp", "data-parallel", "zero-2"} <= set(names)
    pieces = [piece.name for stage in plan.stages for piece in stage.pieces]
    assert pieces[0] == "stem" and pieces[-1] == "head" and "block1" in pieces


def test_cli_refuses_transformer_options_for_image_models():
    cli_runner = CliRunner()
    for extra, message in ((("--pricer", "formula"), "--pricer formula is the closed form"),
                           (("--layout", "tp=2"), "--layout prices Megatron-style transformer"),
                           (("--seq-len", "2048"), "drop --seq-len")):
        result = cli_runner.invoke(app, ["simulate", "--model", "wresnet-2b", "--cluster", "1x8", "--device",
                                         "v100-16gb", "--global-batch", "64", *extra])
        assert result.exit_code != 0
        assert message in result.output and "Traceback" not in result.output


def test_early_and_late_blocks_want_different_meshes_and_the_stage_dp_gives_them_both():
    """Wide-ResNet's early blocks hold large activations and few weights, its late blocks the
    reverse: on a (1, 4) sub-mesh the early ones run faster data-parallel (4, 1), the late ones
    faster model-parallel (1, 4) with a third of the memory. With Alpa's logical views of a
    sub-mesh inside a node (its `single_node_model_parallel` space: (4, 1) and (1, 4)), the stage
    DP on 8 V100s cuts wresnet-2b exactly as Alpa's search did (suite_wresnet.py,
    perf_test_auto_suite[8]): blocks 0-7 data-parallel, 8-15 model-parallel."""
    cfg = WRESNET_PRESETS["wresnet-2b"]
    job = TrainingJob(cfg, 1536, 1, DType.F32, "momentum")
    cluster = job.on(Cluster(1, 8, get_device("v100-16gb")))
    options, b = PlannerOptions(workers=1), 32
    views = {}
    for index, view in enumerate(planner_views(cluster, (1, 4))):
        if view.shape in ((4, 1), (1, 4)):
            task = PricingTask(ViewKey("view", b, (1, 4), index), job, cluster, 1536 // b, options, lean=False)
            views[view.shape] = price_task(task).costs
    data, model = views[(4, 1)].layers, views[(1, 4)].layers
    assert data[0][0].time < model[0][0].time and data[1][0].time < model[1][0].time
    assert model[-1][0].time < data[-1][0].time and model[-1][0].static_bytes < data[-1][0].static_bytes / 2
    plan = plan_pipeline(LayerCosts(tuple(views.values()), handoff_bytes(job, b)), cluster, 1536 // b,
                         inter_options(cluster, options))
    assert [(s.first, s.last, s.submesh, s.view) for s in plan.stages] == [(0, 7, (1, 4), (4, 1)),
                                                                           (8, 15, (1, 4), (1, 4))]


SMALL_UNET = UNetConfig("small-unet", 3, 8, 64)


def test_unet_counts_skips_and_pieces():
    graph = unet_forward(SMALL_UNET, batch=2)
    contractions = sum(node_flops(graph, n) for n in graph.nodes if n.kind in (OpKind.CONV, OpKind.DOT))
    assert contractions == 2 * SMALL_UNET.forward_flops()
    assert sum(n.size for n in graph.parameters() if n.name not in ("images", "targets")) == SMALL_UNET.num_params()
    assert [SMALL_UNET.kind_name(i) for i in range(SMALL_UNET.layers)] == \
        ["down0", "down1", "down2", "bottleneck", "up2", "up1", "up0"]
    level = [64 * 64 * 8, 32 * 32 * 16, 16 * 16 * 32, 8 * 8 * 64]  # values per image at levels 0-3
    # after down1: its output (skip 1) and skip 0; after the bottleneck: skips 0-2 wait for their up blocks
    assert SMALL_UNET.boundary_elements(1) == (level[0], level[1] + level[0], level[2] + level[1] + level[0],
                                               level[3] + level[2] + level[1] + level[0],
                                               level[2] + level[1] + level[0], level[1] + level[0])
    blocks, _, _ = training_pieces(SMALL_UNET, 4, 1, DType.F32, "momentum")
    up = blocks[4].graph
    assert [n.name for n in up.parameters()][:2] == ["activations", "skip"]
    assert len(up.outputs) > 2  # both inputs' gradients go back to their stages, then the new weights


def test_a_unet_view_prices_every_block():
    job = TrainingJob(SMALL_UNET, 32, 1, DType.F32, "momentum")
    cluster = job.on(Cluster(1, 2, get_device("v100-16gb")))
    index = next(i for i, v in enumerate(planner_views(cluster, (1, 2))) if v.shape == (2, 1))
    costs = price_task(PricingTask(ViewKey("view", 8, (1, 2), index), job, cluster, 4, PlannerOptions(workers=1),
                                   lean=False)).costs
    assert len(costs.layers) == SMALL_UNET.layers and all(menu[0].time > 0 for menu in costs.layers)
