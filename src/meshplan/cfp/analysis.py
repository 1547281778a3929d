"""CFP's analysis pass: Graph + LogicalMesh -> Analysis (ParallelBlocks, candidates, segments).

Pure Python: no JAX. The Analysis also turns block choices into per-node strategies, for a
segment's standalone program (what profiling runs) or for the whole graph (a plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from meshplan.cfp.blocks import ParallelBlock, find_blocks
from meshplan.cfp.segments import Extract, Occurrence, Segment, find_segments
from meshplan.cluster.costs import FLOPS_PER_SECOND
from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.model import CostModel
from meshplan.errors import OptionsError
from meshplan.intra.solve import check_mesh_fits
from meshplan.ir.graph import Graph, check_graph
from meshplan.sharding.context import RuleConfig
from meshplan.sharding.enumerate import enumerate_strategies
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import NodeStrategies, Strategy


@dataclass(frozen=True, slots=True)
class CfpOptions:
    """Options of the analysis (and of pricing, which uses the same cost model).

    Attributes:
        cost: prices compute, collectives and resharding (the mesh gives alpha and beta).
        max_combinations: a segment's blocks are cut so that their strategy combinations (what
            profiling runs) number at most this; larger segments capture more interaction
            between blocks, at the price of more programs to profile.
    """

    cost: CostModel = field(default_factory=lambda: CostModel(flops_per_second=FLOPS_PER_SECOND))
    max_combinations: int = 64

    def __post_init__(self) -> None:
        if self.max_combinations < 1:
            raise OptionsError(f"max_combinations must be at least 1, got {self.max_combinations}")


@dataclass(frozen=True, slots=True)
class Analysis:
    """The result of `analyze`.

    Attributes:
        graph, mesh, options: what was analysed, on what, how.
        strategies: meshplan's strategies of every node (indices in block strategy maps).
        blocks: the ParallelBlocks in sequence order.
        owner: the block of every node.
        segments: the unique segments.
        occurrences: every occurrence of a segment, in block order (they tile the blocks).
    """

    graph: Graph
    mesh: LogicalMesh
    options: CfpOptions
    strategies: tuple[NodeStrategies, ...]
    blocks: tuple[ParallelBlock, ...]
    owner: tuple[int, ...]
    segments: tuple[Segment, ...]
    occurrences: tuple[Occurrence, ...]

    def occurrences_of(self, segment: int) -> tuple[Occurrence, ...]:
        return tuple(o for o in self.occurrences if o.segment == segment)

    def node_strategies(self, block_choice: Sequence[int]) -> tuple[Strategy, ...]:
        """Every node's strategy when block b takes its candidate `block_choice[b]`."""
        index: dict[int, int] = {}
        for block, k in zip(self.blocks, block_choice, strict=True):
            index.update(block.strategies[k].choices)
        return tuple(self.strategies[v].strategies[index[v]] for v in range(len(self.graph)))

    def segment_layouts(self, cut: Extract, blocks: Sequence[int], combination: Sequence[int]) -> tuple[Strategy, ...]:
        """The strategy of every node of a standalone segment under `combination` (one
        candidate per block of `blocks`); a value from outside arrives as its first reader needs
        it, a parameter of the segment as its block lays it out."""
        index: dict[int, int] = {}
        for b, k in zip(blocks, combination, strict=True):
            index.update(self.blocks[b].strategies[k].choices)
        outside = set(cut.inputs)
        layouts: list[Strategy | None] = [None if k in outside else self.strategies[v].strategies[index[v]]
                                          for k, v in enumerate(cut.origin)]
        for k in cut.inputs:
            layouts[k] = input_strategy(cut.graph, k, layouts, self.mesh)
        return tuple(layouts)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary: blocks with candidates and members, segments, occurrences."""
        g = self.graph
        return {
            "graph": g.name, "mesh": list(self.mesh.shape), "nodes": len(g),
            "blocks": [{"index": b.index, "dots": [g[d].label for d in b.dots], "members": len(b.members),
                        "communication_free": b.communication_free,
                        "candidates": [{"label": s.label, "name": s.name} for s in b.strategies],
                        "dropped": [{"name": n, "because_of": m} for n, m in b.dropped]} for b in self.blocks],
            "segments": [{"index": s.index, "key": s.key, "structure": s.structure, "blocks": list(s.span),
                          "space": list(s.space), "combinations": s.combinations,
                          "occurrences": len(self.occurrences_of(s.index))} for s in self.segments],
            "occurrences": [{"blocks": [o.start, o.stop], "segment": o.segment,
                             "representative": list(self.segments[o.segment].span)} for o in self.occurrences],
        }


def analyze(graph: Graph, mesh: LogicalMesh, options: CfpOptions | None = None) -> Analysis:
    """Group `graph`'s operators into ParallelBlocks and find its unique segments.

    Args:
        graph: a forward graph (e.g. `meshplan.cfp.models.model_graph`).
        mesh: the logical mesh to plan for.
        options: cost model and segment size limit.

    Raises:
        GraphError: the graph is malformed or has no contraction.
        MeshError: a mesh axis is larger than every tensor dim.
    """
    options = options or CfpOptions()
    check_graph(graph)
    check_mesh_fits(graph, mesh)
    strategies = enumerate_strategies(graph, mesh, options.cost, RuleConfig(contractions_use_all_axes=True))
    blocks, owner = find_blocks(graph, mesh, options.cost, strategies)
    segments, occurrences = find_segments(graph, blocks, options.max_combinations)
    return Analysis(graph, mesh, options, strategies, blocks, owner, segments, occurrences)


def input_strategy(graph: Graph, k: int, layouts: Sequence[Strategy | None], mesh: LogicalMesh) -> Strategy:
    """An input laid out as its first reader needs it (replicated when nothing reads it)."""
    node = graph[k]
    spec = ShardingSpec.replicated(node.rank)
    for user in graph.users(k):
        if layouts[user] is not None:
            spec = layouts[user].operands[graph[user].operands.index(k)]
            break
    local = 1
    for size in spec.shard_shape(node.shape, mesh):
        local *= size
    return Strategy("input", spec, (), memory=float(local * node.dtype.itemsize))
