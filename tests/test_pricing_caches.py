"""The pricing path's memos give what computing afresh gives: peeled MIP edges, resharding costs
shared by producer signature and by mesh, collectives priced once per mesh, fused views per graph."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from meshplan.cluster import Cluster, get_device
from meshplan.cost import CollectiveCosts, CollectiveKind
from meshplan.cost.fusion import fuse, fused
from meshplan.intra.search.mip import _peel
from meshplan.intra.solve import build_strategies
from meshplan.intra.strategy_graph import StrategyGraph, reshardings_on
from meshplan.ir import OpKind
from meshplan.models.transformer import PRESETS
from meshplan.simulator import PlannerOptions, TrainingJob
from meshplan.simulator.pricing import piece_graphs, piece_options, piece_pricing

SMALL = PRESETS["gpt3-125m"].replace(layers=2)


def _numpy_peel(m: np.ndarray):
    """The peeling as first written: np.unique over rows, then over the distinct rows' columns."""
    r = m - m.min(axis=1)[:, None]
    r = r - r.min(axis=0)[None, :]
    rows, row_class = np.unique(r, axis=0, return_inverse=True)
    cols, col_class = np.unique(rows, axis=1, return_inverse=True)
    return cols, row_class.ravel(), col_class.ravel()


@pytest.mark.parametrize("seed", range(6))
def test_peeled_edges_equal_numpy_unique(seed):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 4, size=(rng.integers(2, 7), rng.integers(2, 7))).astype(float)
    base[rng.random(base.shape) < 0.2] = np.inf  # forbidden pairs
    base[:, 0] = 0.0  # every row keeps a finite entry
    m = base[rng.integers(0, len(base), size=len(base) + 5)][:, rng.integers(0, base.shape[1], base.shape[1] + 4)]
    m = m * 0.1 + rng.integers(0, 3, size=(len(m), 1))  # repeated rows and columns, shifted
    peeled = _peel(m)
    cols, row_class, col_class = _numpy_peel(m)
    assert np.array_equal(peeled.residual, cols) and peeled.residual.dtype == cols.dtype
    assert np.array_equal(peeled.row_class, row_class) and np.array_equal(peeled.col_class, col_class)
    assert [list(x) for x in peeled.row_members] == [list(np.flatnonzero(row_class == p)) for p in range(len(cols))]
    assert [list(x) for x in peeled.col_members] == [list(np.flatnonzero(col_class == q))
                                                     for q in range(cols.shape[1])]


def _setting():
    job = TrainingJob(SMALL, 16, 256)
    cluster = job.on(Cluster(2, 4, get_device("a100-40gb")))
    options = PlannerOptions()
    blocks, embed, head = piece_graphs(SMALL, 4, 256, job.dtype, job.optimizer)
    intra = piece_options(1e14, 4, 0.0, 30.0, 0, True, piece_pricing(job, cluster, options))
    return cluster, intra, (blocks[SMALL.layer_kind(0)], embed, head)


def _fresh_mesh(cluster):
    return cluster.logical_views((2, 4))[0].with_memory(None)


def test_strategy_graph_on_warm_caches_equals_a_cold_build():
    cluster, intra, (block, embed, head) = _setting()
    reshardings_on.cache_clear()
    cold, _ = build_strategies(block.graph, _fresh_mesh(cluster), intra)
    reshardings_on.cache_clear()
    mesh = _fresh_mesh(cluster)
    for piece in (embed, head):  # fill the mesh's shared conversions and collectives first
        build_strategies(piece.graph, mesh, intra)
    warm, _ = build_strategies(block.graph, mesh, intra)
    assert warm.nodes == cold.nodes and warm.groups == cold.groups
    for part in ("compute", "communication", "resharding", "edges"):
        a, b = getattr(warm, part), getattr(cold, part)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert len(reshardings_on(mesh, intra.cost.collectives, intra.cost.resharding)) > 0


def test_resharding_costs_shared_by_producer_signature_equal_each_producers_own():
    cluster, intra, (block, _, _) = _setting()
    sg, _ = build_strategies(block.graph, _fresh_mesh(cluster), intra)
    graph = sg.graph
    alone = StrategyGraph(graph, _fresh_mesh(cluster), sg.model, sg.nodes, sg.leader, sg.groups)  # no caches shared
    checked = broadcasts = 0
    for node in graph.nodes:
        for position, operand in enumerate(node.operands):
            produced = {s.output for s in sg.nodes[operand].strategies}
            required = {s.operands[position] for s in sg.nodes[node.id].strategies}
            for src in sorted(produced, key=str)[:4]:
                for dst in sorted(required, key=str)[:4]:
                    own = sum(c.cost for c in alone.reshard(operand, src, dst))
                    assert sg.reshard_cost(operand, src, dst) == own
                    checked += 1
                    broadcasts += graph[operand].kind is OpKind.BROADCAST
    assert checked > 500 and broadcasts > 10
    assert len(sg._cost_cache) < checked  # producers did share their costs


def test_collectives_priced_once_per_mesh_and_pricer():
    cluster = Cluster(2, 4, get_device("a100-40gb"))
    mesh = cluster.logical_views((2, 4))[0]
    plain, linked = CollectiveCosts(), CollectiveCosts(link_efficiency=0.8)
    for costs in (plain, linked, plain):
        for kind in (CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_GATHER):
            for axes, nbytes in (((0,), 1e6), ((1,), 1e6), ((0, 1), 3e7)):
                found = costs.collective(kind, mesh, axes, nbytes)
                assert found.cost == costs.cost(kind, mesh, axes, nbytes) and found.axes == axes
    assert plain.collective(CollectiveKind.ALL_REDUCE, mesh, (0, 1), 3e7).cost != \
        linked.collective(CollectiveKind.ALL_REDUCE, mesh, (0, 1), 3e7).cost
    copy = pickle.loads(pickle.dumps(mesh))
    assert copy == mesh and hash(copy) == hash(mesh) and copy.priced == {}


def test_fused_view_is_remembered_per_graph_object():
    _, _, (block, embed, _) = _setting()
    first = fused(block.graph, True)
    assert fused(block.graph, True) is first and first == fuse(block.graph, True)
    assert fused(block.graph, False) == fuse(block.graph, False)
    assert fused(embed.graph, True) == fuse(embed.graph, True)
    twin = pickle.loads(pickle.dumps(block.graph))  # equal, another object: fused on its own
    assert fused(twin, True) == first and fused(twin, True) is not first
