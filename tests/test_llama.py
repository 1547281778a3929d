"""LLaMA forward graph: structure, FLOPs, and planning with shared layers."""

from __future__ import annotations

import pytest

from meshplan import IntraOptions, LogicalMesh, ModelSpecError, llama_forward, solve_intra
from meshplan.cost import CostModel
from meshplan.intra.layers import canonical_nodes
from meshplan.ir import OpKind, graph_flops
from meshplan.models import forward_graph


def test_llama_matmul_flops_match_closed_form():
    b, s, h, heads, f, layers = 2, 16, 64, 4, 96, 3
    g = llama_forward(b, s, h, heads, layers, f)
    dots = sum(n.size * 2 * g[n.operands[0]].shape[n.attr("lhs_contracting")[0]] * (
        h // heads if n.name.endswith("attn_out") else 1) for n in g if n.kind is OpKind.DOT)
    per_layer = 2 * b * s * (4 * h * h + 3 * h * f) + 2 * 2 * b * s * s * h
    assert dots == layers * per_layer
    assert graph_flops(g) > dots  # plus norms, softmax, activations
    assert len(g.parameters()) == 1 + 9 * layers
    assert g.layers() == (0, 1, 2)


def test_repeated_layers_map_to_the_first():
    g = llama_forward(2, 16, 64, 4, 3, 96)
    canon = canonical_nodes(g)
    assert all(g[canon[n.id]].layer == 0 for n in g if n.layer is not None)


def test_shared_layers_match_unshared_on_small_llama():
    g = llama_forward(8, 64, 64, 4, 4, 128)
    mesh = LogicalMesh((2, 4), (1e-5, 1e-6), (1e-9, 1e-10), 2e9)
    options = IntraOptions(cost=CostModel(flops_per_second=1e12))
    shared = solve_intra(g, mesh, options.replace(share_layers=True))
    unshared = solve_intra(g, mesh, options)
    assert shared.num_variables < unshared.num_variables
    assert shared.objective >= unshared.objective - 1e-12
    assert shared.objective == pytest.approx(unshared.objective, rel=1e-6)


def test_unknown_model():
    with pytest.raises(ModelSpecError, match="llama2-13b"):
        forward_graph("llama2-13", 1, 1)
