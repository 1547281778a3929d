"""Kernel models of the op-level cost model: the fused-kernel view of training graphs
(meshplan.cost.fusion) and the kernel formulas (meshplan.cost.kernels). The activations the graph
keeps equal the closed form's (Korthikanti et al. 2022, generalised), so the two pricers share
one memory model; the optimizer region moves the closed form's bytes per parameter."""

from __future__ import annotations

import math

import pytest

from meshplan.cluster import Cluster, get_device
from meshplan.cost.fusion import BACKWARD, UPDATE, fuse, training_pass
from meshplan.cost.kernels import (
    DEFAULT_EFFICIENCY,
    fused_attention_seconds,
    gemm_seconds,
    memory_seconds,
    optimizer_step_bytes,
)
from meshplan.ir import DType
from meshplan.models.training import block_training_graph
from meshplan.models.transformer import PRESETS
from meshplan.simulator import TrainingJob
from meshplan.simulator.analytic import price_layout
from meshplan.simulator.layout import Layout

H100 = get_device("h100-80gb")
SMALL_LLAMA = PRESETS["llama2-7b"].replace(hidden=512, heads=8, ffn=1376, layers=2)


def kept_bytes(model, flash: bool, seq: int = 256) -> tuple[float, float]:
    """(kept activations, those only attention keeps) per layer of one sequence, in bytes."""
    piece = block_training_graph(model, 0, 1, seq, DType.BF16, "adam")
    fusion = fuse(piece.graph, flash)
    arriving = {n.id for n in piece.graph.parameters() if n.name == "cotangent"}
    kept = [v for v in fusion.kept if v not in set(piece.weights) | arriving]
    return (sum(piece.graph[v].nbytes for v in kept),
            sum(piece.graph[v].nbytes for v in fusion.kept_by_attention))


@pytest.mark.parametrize("flash", [True, False])
def test_kept_activations_equal_the_closed_form(flash):
    """A LLaMA block keeps norm inputs and outputs, q, k, v, the context, the SwiGLU inputs and
    output (and the softmax output without flash attention): what the closed form counts."""
    seq = 256
    job = TrainingJob(SMALL_LLAMA, 1, seq)
    closed = price_layout(job, Cluster(1, 1, H100), Layout(mb=1, flash=flash)).memory.activations
    graph_bytes, attention_only = kept_bytes(SMALL_LLAMA, flash, seq)
    per_layer_norm_stats = 2 * seq * 2 + SMALL_LLAMA.heads * seq * 2  # [b, s] inverse RMS, softmax max
    assert graph_bytes * SMALL_LLAMA.layers == pytest.approx(closed + per_layer_norm_stats * SMALL_LLAMA.layers,
                                                             rel=0.02)
    # What selective recomputation drops: the probabilities and the softmax's row statistics
    # (without flash attention), the row statistics alone with it.
    probabilities, statistic = SMALL_LLAMA.heads * seq * seq * 2, SMALL_LLAMA.heads * seq * 2
    assert (0 if flash else probabilities) < attention_only <= (0 if flash else probabilities) + 2 * statistic


def test_optimizer_region_moves_the_closed_form_bytes():
    """Mixed-precision Adam as fused kernels: read the gradient (fp32 main gradient), master copy
    and moments, write them and the new bf16 weight: optimizer_step_bytes per parameter."""
    piece = block_training_graph(SMALL_LLAMA, 0, 1, 64, DType.BF16, "adam")
    graph = piece.graph
    fusion = fuse(graph, True)

    def nbytes(node_id: int) -> float:
        node = graph[node_id]
        return node.size * (4 if node.attr("accumulated") else node.dtype.itemsize)

    moved = 0.0
    for node in graph.nodes:
        if training_pass(node) != UPDATE:
            continue
        moved += nbytes(node.id) if node.id in fusion.materialized and node.kind.value != "parameter" else 0.0
        moved += sum(share * nbytes(node.operands[p]) for p, share in fusion.reads[node.id])
    params = sum(graph[w].size for w in piece.weights)
    assert moved / params == pytest.approx(optimizer_step_bytes(2, 4), rel=1e-9)


def test_backward_nodes_carry_the_attention_kernel_tag():
    piece = block_training_graph(SMALL_LLAMA, 0, 1, 64, DType.BF16, "adam")
    backward_attention = [n for n in piece.graph.nodes
                          if training_pass(n) == BACKWARD and n.attr("kernel") == "causal_attention"]
    dots = [n for n in backward_attention if n.kind.value == "dot"]
    assert len(dots) == 4  # d(probs), d(v), d(q), d(k)
    fusion = fuse(piece.graph, True)
    assert {n.id for n in backward_attention} <= fusion.attention
    assert not any(n.id in fusion.materialized for n in backward_attention if n.kind.value == "dot"
                   and n.shape[-1] == 64 and n.shape[-3] == 64)  # no [s, s] scores reach memory


def test_kernel_formulas():
    eff = DEFAULT_EFFICIENCY
    shape = (4096 / (4096 + eff.gemm_half)) ** 2 * (1024 / (1024 + eff.gemm_half))
    assert gemm_seconds(H100, eff, 4096, 4096, 1024, batch=3) == pytest.approx(
        3 * 2 * 4096 * 4096 * 1024 / (H100.peak_flops * eff.gemm_max * shape))
    assert gemm_seconds(H100, eff, 4096, 4096, 1024, fp8=True) == pytest.approx(
        2 * 4096 * 4096 * 1024 / (H100.fp8_flops * eff.fp8_max * shape))
    flops = 1e12
    forward = fused_attention_seconds(H100, eff, flops, causal=True)
    assert forward == pytest.approx(0.5 * flops / (H100.peak_flops * eff.attention))
    # The backward's two products per forward one, plus the recomputed scores: 2.5 forwards.
    assert fused_attention_seconds(H100, eff, 2 * flops, causal=True, backward=True) == pytest.approx(2.5 * forward)
    assert memory_seconds(H100, eff, 1e9) == pytest.approx(1e9 / (H100.memory_bandwidth * eff.memory))
    assert optimizer_step_bytes(2, 4) == 30 and optimizer_step_bytes(2, 2) == 28
    assert math.isclose(gemm_seconds(H100, eff, 0, 10, 10), 0.0)
