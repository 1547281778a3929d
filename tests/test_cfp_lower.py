"""CFP's JAX side on 8 CPU devices: every block compiles without communication inside, and a
lowered plan computes what the NumPy interpreter computes."""

from __future__ import annotations

import re

import numpy as np
import pytest

from meshplan.cfp import analyze, model_graph, model_spec
from meshplan.cfp.lower import lower
from meshplan.cfp.segments import block_signature, extract
from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.collectives import CollectiveKind
from meshplan.ir import GraphBuilder, OpKind
from meshplan.ir.interpret import evaluate
from meshplan.runtime.sharded import make_jax_mesh
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import Strategy

jax = pytest.importorskip("jax")

MESH = LogicalMesh((2, 4), (1e-5, 1e-5), (1e-9, 1e-9))
COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
# Collectives are placed by XLA's SPMD partitioner, before LLVM sees the program: compiling without
# LLVM's optimizations finds the same collectives (checked on every GPT-3 and LLaMA block) in a third of the time.
QUICK = {"xla_backend_optimization_level": 0}


def _analysis(model: str, layers: int, train: bool = False):
    return analyze(model_graph(model_spec(model, layers, batch=8, seq_len=32, train=train)), MESH)


@pytest.mark.parametrize(("model", "layers", "part"), [("gpt3-125m", 1, ""), ("llama2-7b", 1, ""),
                                                     ("moe-1.3b", 2, "layer1.mlp")])
def test_every_block_compiles_without_communication_inside(model, layers, part):
    """Each block alone, under each candidate's strategy map, compiles to HLO whose only
    collectives are all-reduces of its contractions' (and an MoE combine's scatter-add's) partial
    sums: none when no contracting dim is split, at least one and at most one per (contraction,
    mesh axis) when some are.
    Blocks of equal structure compile to the same program; each structure is compiled once
    (for the MoE, only its expert layer: its attention and dense MLP blocks are GPT's)."""
    a = _analysis(model, layers)
    mesh, seen, checked = make_jax_mesh(MESH), set(), 0
    for block in a.blocks:
        if block_signature(a.graph, block) in seen or not a.graph[block.lead].label.startswith(part):
            continue
        seen.add(block_signature(a.graph, block))
        cut = extract(a.graph, block.members)
        for k, candidate in enumerate(block.strategies):
            layouts = a.segment_layouts(cut, (block.index,), (k,))
            summing = (OpKind.DOT, OpKind.SCATTER_ADD)  # contractions, and an MoE's combine (a scatter-add)
            planned = [c for v, s in enumerate(layouts) if cut.graph[v].kind in summing for c in s.collectives]
            assert all(c.kind is CollectiveKind.ALL_REDUCE for c in planned)
            program = lower(cut.graph, layouts, MESH, mesh)
            hlo = program.jitted.lower(*program.abstract_args(cut.graph)).compile(QUICK).as_text()
            found = COLLECTIVE.findall(hlo)
            where = f"block {block.index} {candidate.label} ({candidate.name})"
            assert set(found) <= {"all-reduce"}, where
            assert (len(found) > 0) == bool(planned), where
            assert len(found) <= sum(len(c.axes) for c in planned), where
            checked += 1
    # The MoE layer: its router, expert up-projection and expert down-projection (with the combine).
    assert checked >= (36 if part else sum(len(b.strategies) for b in a.blocks[:6]))


@pytest.mark.parametrize(("model", "train"), [("gpt3-125m", False), ("llama2-7b", False), ("moe-1.3b", False),
                                            ("gpt3-125m", True)])
def test_lowered_plan_matches_the_interpreter(model, train):
    """A plan mixing candidates (so values are resharded between blocks) computes the model:
    its output, or in a training step every gradient."""
    a = _analysis(model, 2, train)
    choice = tuple((3 * b.index + 1) % len(b.strategies) for b in a.blocks)
    layouts = a.node_strategies(choice)
    program = lower(a.graph, layouts, MESH, make_jax_mesh(MESH))
    args = program.example_args(a.graph, seed=3)
    compiled = program.jitted.lower(*args).compile(QUICK)
    outs = compiled(*args)
    values = evaluate(a.graph, {p: np.asarray(x) for p, x in zip(program.parameters, args, strict=True)})
    assert len(outs) == len(a.graph.outputs) == (1 if not train else 1 + sum(
        n.kind is OpKind.PARAMETER for n in a.graph.nodes) - 2)  # x and every weight; not the cotangent
    for out, v, sharding in zip(outs, a.graph.outputs, compiled.output_shardings, strict=True):
        np.testing.assert_allclose(np.asarray(out), values[v], rtol=2e-4, atol=2e-5)
        assert out.sharding.spec == sharding.spec


def test_indexing_and_layout_ops_lower_like_the_interpreter():
    b = GraphBuilder("ops")
    table = b.parameter((16, 8), name="table")
    ids = b.parameter((8, 4), "i32", name="ids")
    x = b.gather(table, ids)  # [8, 4, 8]
    picked = b.gather(x, b.parameter((8, 4), "i32", name="cols"), axis=2, batch_dims=2)  # [8, 4]
    grad = b.scatter_add((16, 8), ids, x)
    t = b.transpose(b.reshape(x, (8, 32)), (1, 0))
    part = b.concatenate([b.slice(t, (0, 0), (16, 8)), b.slice(t, (16, 0), (32, 8))], dim=1)
    i = b.iota((16, 16), 1)
    start = b.constant((), "i32", 2)
    window = b.dynamic_slice(part, (start, start), (8, 8))
    b.outputs(picked, grad, window, b.reduce(b.mul(b.convert(i, "f32"), part), (1,), "max"))
    g = b.build()
    split = {table: ShardingSpec.of(None, 1), ids: ShardingSpec.of(0, None)}
    layouts = tuple(Strategy("test", split.get(n.id, ShardingSpec.replicated(n.rank)),
                             tuple(ShardingSpec.replicated(g[o].rank) for o in n.operands)) for n in g.nodes)
    program = lower(g, layouts, MESH, make_jax_mesh(MESH))
    rng = np.random.default_rng(0)
    values = {table: rng.standard_normal((16, 8)).astype(np.float32), ids: rng.integers(0, 16, (8, 4)),
              ids + 2: rng.integers(0, 4, (8, 4))}
    args = [jax.numpy.asarray(values[p], dtype=jax.numpy.int32 if g[p].dtype.short_name == "i32" else None)
            for p in program.parameters]
    got = program.jitted(*args)
    expected = evaluate(g, {p: np.asarray(a) for p, a in zip(program.parameters, args, strict=True)})
    for value, v in zip(got, g.outputs, strict=True):
        np.testing.assert_allclose(np.asarray(value), expected[v], rtol=1e-6, atol=1e-6)
