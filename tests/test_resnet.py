"""Wide-ResNet builders (Alpa's presets), their counts, and planning them through `simulate`."""

import pytest
from typer.testing import CliRunner

from meshplan.cli import app
from meshplan.cluster.cluster import Cluster
from meshplan.cluster.devices import get_device
from meshplan.errors import ModelSpecError
from meshplan.ir import DType, OpKind
from meshplan.ir.counting import node_flops
from meshplan.models.registry import simulation_model
from meshplan.models.resnet import WRESNET_PRESETS, ResNetConfig, resnet_forward
from meshplan.models.training import training_pieces
from meshplan.simulator import PlannerOptions, TrainingJob, simulate
from meshplan.simulator.pricing import handoff_bytes

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


TINY = ResNetConfig("tiny-wresnet", 50, 8, 2, image_size=32, num_classes=16)


@pytest.fixture(scope="module")
def tiny_simulation():
    cluster = Cluster(1, 4, get_device("v100-16gb"))
    job = TrainingJob(TINY, 64, 1, DType.F32, "momentum")
    options = PlannerOptions(workers=1, microbatch_sizes=(16,), chunks=(1,))
    return simulate(job, cluster, options)


def test_a_small_wresnet_plans_end_to_end(tiny_simulation):
    plan = tiny_simulation.plan
    assert plan.sample_unit == "images" and plan.seq_len == 0
    assert plan.stages[0].first_layer == 0 and plan.stages[-1].last_layer == TINY.layers - 1
    assert sum(len(s.devices) for s in plan.stages) == 4
    # fp32 on V100: MFU against the 15.7 TFLOP/s fp32 peak, model FLOPs 3x the forward's
    p = plan.prediction
    assert p.mfu == pytest.approx(p.tflops_per_device / 15.7, rel=1e-9)
    assert p.tflops_per_device * 1e12 * 4 * p.iteration_time_s == pytest.approx(3 * TINY.forward_flops() * 64)
    names = {b.name: b for b in plan.baselines}
    assert names["megatron"].prediction is None and "convolution" in names["megatron"].reason
    assert {"pp-dp", "data-parallel", "zero-2"} <= set(names)
    pieces = [piece.name for stage in plan.stages for piece in stage.pieces]
    assert pieces[0] == "stem" and pieces[-1] == "head"


def test_cli_refuses_transformer_options_for_image_models():
    cli_runner = CliRunner()
    for extra, message in ((("--pricer", "formula"), "--pricer formula is the closed form"),
                           (("--layout", "tp=2"), "--layout prices Megatron-style transformer"),
                           (("--seq-len", "2048"), "drop --seq-len")):
        result = cli_runner.invoke(app, ["simulate", "--model", "wresnet-2b", "--cluster", "1x8", "--device",
                                         "v100-16gb", "--global-batch", "64", *extra])
        assert result.exit_code != 0
        assert message in result.output and "Traceback" not in result.output
