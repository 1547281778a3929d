"""CFP analysis: ParallelBlocks, candidates, strategy maps and segments (pure Python, no JAX)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from meshplan.cfp import analyze, model_graph, model_spec
from meshplan.cfp.price import price
from meshplan.cfp.segments import extract, structural_hash
from meshplan.cluster.mesh import LogicalMesh
from meshplan.errors import GraphError
from meshplan.ir import GraphBuilder, OpKind
from meshplan.models.training import block_training_graph
from meshplan.models.transformer import PRESETS

MESH = LogicalMesh((2, 4), (1e-5, 1e-5), (1e-9, 1e-9))
# The dots of one layer, grouped as blocks: sibling projections of one input share a block
# (LLaMA's up and gate; q, k and v come from one fused projection, as Megatron-LM computes them).
LAYER_BLOCKS = {
    "gpt3-125m": [("qkv",), ("scores",), ("context",), ("out",), ("up",), ("down",)],
    "llama2-7b": [("qkv",), ("scores",), ("context",), ("out",), ("up", "gate"), ("down",)],
}


def _analysis(model: str, layers: int, mesh: LogicalMesh = MESH, train: bool = False):
    return analyze(model_graph(model_spec(model, layers, batch=8, train=train)), mesh)


def _short(label: str) -> str:
    return label.rsplit(".", 1)[-1]


@pytest.mark.parametrize("model", sorted(LAYER_BLOCKS))
@pytest.mark.parametrize("layers", [2, 4, 8])
def test_one_block_per_contraction_chain(model, layers):
    a = _analysis(model, layers)
    g = a.graph
    expected = [(f"layer{i}", dots) for i in range(layers) for dots in LAYER_BLOCKS[model]]
    found = [(g[b.lead].label.split(".")[0], tuple(_short(g[d].label) for d in b.dots)) for b in a.blocks]
    assert found == expected
    assert sorted(a.owner) == sorted(b.index for b in a.blocks for _ in b.members)  # every node in one block
    assert all(g[d].kind is OpKind.DOT for b in a.blocks for d in b.dots)
    assert all(b.communication_free and b.strategies for b in a.blocks)


@pytest.mark.parametrize("model", sorted(LAYER_BLOCKS))
def test_training_steps_have_as_many_unique_segments_at_every_depth(model):
    """Forward and backward: the VJP dots join their forward blocks, so a layer is still one
    repeated block sequence (its first and last layers differ: the input gradient, the seed)."""
    counts = {layers: len(_analysis(model, layers, train=True).segments) for layers in (2, 4, 8)}
    assert counts[2] == counts[4] == counts[8], counts
    a = _analysis(model, 4, train=True)
    assert len(a.blocks) == 4 * len(LAYER_BLOCKS[model])
    assert len(a.occurrences) > 2 * len(a.segments)


@pytest.mark.parametrize("model", sorted(LAYER_BLOCKS))
def test_repeated_layers_map_to_the_first_and_unique_count_is_constant(model):
    counts = []
    for layers in (2, 4, 8):
        a = _analysis(model, layers)
        per_layer = len(LAYER_BLOCKS[model])
        for occ in a.occurrences:
            rep = a.segments[occ.segment].span
            layer = occ.start // per_layer
            assert occ.stop <= (layer + 1) * per_layer  # segments never straddle layers
            assert rep == (occ.start - layer * per_layer, occ.stop - layer * per_layer)
        assert [o.start for o in a.occurrences] == sorted(o.start for o in a.occurrences)
        assert a.occurrences[-1].stop == len(a.blocks)
        counts.append(len(a.segments))
    assert counts[0] == counts[1] == counts[2] >= 1


def test_norm_before_a_projection_joins_the_block_it_feeds():
    """Layer 1's attention norm follows layer 0's residual add in meshplan's rules, but feeds only
    layer 1's fused q, k, v projection: it belongs to its block, so layer 0 and layer 1 are the
    same program."""
    a = _analysis("gpt3-125m", 2)
    g = a.graph
    by_name = {n.label: n.id for n in g.nodes}
    qkv1 = a.owner[by_name["layer1.attn.qkv"]]
    assert a.owner[by_name["layer1.attn_norm.gain"]] == qkv1
    norm_ops = [n.id for n in g.nodes if n.layer == 1 and n.kind is OpKind.REDUCE and n.id < by_name["layer1.attn.qkv"]]
    assert norm_ops and {a.owner[v] for v in norm_ops} == {qkv1}
    assert a.owner[by_name["layer0.ffn_residual"]] == a.owner[by_name["layer0.mlp.down"]]


@pytest.mark.parametrize(("model", "train"), [("gpt3-125m", False), ("llama2-7b", False), ("moe-1.3b", False),
                                            ("gpt3-125m", True), ("llama2-7b", True)])
def test_strategy_maps_keep_blocks_free_of_communication(model, train):
    """Under every candidate, the cost model finds inside each block no resharding and no
    collective but partial-sum all-reduces: of its contractions, and where the candidate says so
    of other reductions (in a training step a bias gradient over a split batch; an MoE's combine,
    a scatter-add summing the experts' rows, when the experts are split). The JAX twin compiles
    the forward blocks: test_cfp_lower."""
    a = _analysis(model, 2, train=train)
    for block in a.blocks:
        cut = extract(a.graph, block.members)
        scatters = any(cut.graph[v].kind is OpKind.SCATTER_ADD for v in range(len(cut.graph)))
        for k, candidate in enumerate(block.strategies):
            layouts = a.segment_layouts(cut, (block.index,), (k,))
            p = price(cut.graph, layouts, a.mesh, a.options.cost)
            kinds = (OpKind.DOT, OpKind.REDUCE, OpKind.SCATTER_ADD) if candidate.reduces else (OpKind.DOT,)
            own = [c for v, s in enumerate(layouts) if cut.graph[v].kind in kinds for c in s.collectives]
            assert p.resharding == 0.0, (block.index, candidate.name)
            assert list(p.collectives) == own, (block.index, candidate.name)
            assert all(c.kind.value == "all-reduce" for c in own)
            assert candidate.communication_free and (train or scatters or not candidate.reduces)
            if not train and not candidate.reduces:
                assert ("allreduce" in candidate.name) == bool(own)


def test_candidate_names_in_cfp_notation():
    b = GraphBuilder("matmul")
    b.outputs(b.matmul(b.parameter((64, 32), name="x"), b.parameter((32, 16), name="w")))
    a = analyze(b.build(), LogicalMesh((2, 2), (1, 1), (1, 1)))
    names = {s.label: s.name for s in a.blocks[0].strategies}
    assert names["M0 N1"] == "SS = SR x RS @ {0,1}"
    assert names["N0 K1"] == "RS = RS x SS @ {1,0} (allreduce @ 1)"
    assert names["M0 M1"] == "SR = SR x RR @ {01}"
    assert len(names) == 9  # three groups, two axes


def test_structural_hash_ignores_names_but_not_shapes():
    def graph(name: str, n: int):
        b = GraphBuilder(name)
        b.outputs(b.exp(b.matmul(b.parameter((8, n), name=f"{name}.x"), b.parameter((n, 4), name=f"{name}.w"))))
        return b.build()

    assert structural_hash(graph("a", 16)) == structural_hash(graph("b", 16))
    assert structural_hash(graph("a", 16)) != structural_hash(graph("a", 32))


def test_graph_without_contraction_is_refused():
    b = GraphBuilder("no_dots")
    b.outputs(b.exp(b.parameter((8, 8), name="x")))
    with pytest.raises(GraphError, match="has no contraction"):
        analyze(b.build(), MESH)


def test_training_graph_backward_dots_join_their_forward_block():
    """The two VJP dots of a projection read its weight or its input: they join its block."""
    cfg = dataclasses.replace(PRESETS["gpt3-125m"], hidden=64, heads=4, ffn=128)
    g = block_training_graph(cfg, 0, 8, 16, optimizer="sgd").graph
    a = analyze(g, MESH)
    forward = [b for b in a.blocks if g[b.lead].layer == 0 and g[b.lead].name.startswith("layer0.")]
    assert len(a.blocks) == len(forward) == 6
    by_name = {n.label: n.id for n in g.nodes}
    for weight in ("layer0.attn.wqkv", "layer0.attn.wo", "layer0.mlp.w1", "layer0.mlp.w2"):
        readers = {a.owner[u] for u in g.users(by_name[weight]) if g[u].kind is OpKind.DOT}
        assert len(readers) == 1  # forward dot and the dot of its input gradient
        assert a.owner[by_name[f"grad.{weight}"]] in readers
    assert all(b.strategies for b in a.blocks)


def test_analysis_and_search_do_not_import_jax():
    code = ("import sys; import meshplan.cfp.analysis, meshplan.cfp.search, meshplan.cfp.profile, "
            "meshplan.cfp.compare; print('jax' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
