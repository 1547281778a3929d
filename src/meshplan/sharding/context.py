"""RuleContext: what a strategy rule sees (graph, mesh, cost model, earlier nodes' strategies)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.collectives import Collective, CollectiveKind
from meshplan.cost.fusion import Fusion
from meshplan.cost.model import CostModel
from meshplan.ir.counting import node_flops
from meshplan.ir.graph import Graph
from meshplan.ir.node import Node, OpKind
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import NodeStrategies, StrategySpace


@dataclass(frozen=True, slots=True)
class RuleConfig:
    """Choices that shape the strategy lists.

    Attributes:
        space: FULL (every axis-to-dim assignment) or ALPA (Alpa's playground lists).
        allow_replicated_parameters: keep the replicated strategy of parameters.
        force_batch_dim_to_mesh_dim: if set, contractions keep only strategies that split the
            batch dim (traced from the inputs tagged `batch_dim`, else from the first
            parameter's dim 0) over this mesh axis.
        contractions_use_all_axes: contractions must split work over every mesh axis; None
            means only when compute is free (otherwise replication would look free). True
            prunes the strategy space (much faster ILPs) at the price of never replicating a
            contraction along an axis.
        reduce_scatter: contractions over split dims may also reduce-scatter their partial
            sums onto a whole output dim instead of all-reducing them (FULL space only).
        gather_choices: embedding lookups, their gradients and token scatters are choices of
            their own, as Megatron runs them: a table may be split along the looked-up dim
            (vocabulary-parallel embedding, partial results summed), a token scatter (an MoE's
            combine) may take its updates moved onto its batch dims (an all-to-all); and
            element-wise ops follow an operand that is not a broadcast row statistic (so a split
            vocabulary stays split through the cross-entropy).
        fixed: node id -> the output spec it must take (a given layout as fixed per-op
            strategies); nodes not listed choose freely.
        halo_splits: convolutions and poolings may split a dim their window slides along
            (spatial parallelism, halo exchanges priced; sharding/rules/conv.py); False keeps
            such dims whole.
        runtime_exchanges: max pooling's gradient may keep a windowed dim split, its halo
            exchanged by the runtime itself (runtime/halo_pooling.py, in single-program
            methods); False where the program's backward is JAX's own, partitioned by XLA
            (pipeshard stages), which sends other blocks than priced: the dim is gathered.
    """

    space: StrategySpace = StrategySpace.FULL
    allow_replicated_parameters: bool = True
    force_batch_dim_to_mesh_dim: int | None = None
    contractions_use_all_axes: bool | None = None
    reduce_scatter: bool = False
    gather_choices: bool = False
    fixed: tuple[tuple[int, ShardingSpec], ...] = ()
    halo_splits: bool = True
    runtime_exchanges: bool = True


@dataclass(slots=True)
class RuleContext:
    graph: Graph
    mesh: LogicalMesh
    model: CostModel
    config: RuleConfig
    depth: tuple[int, ...]
    batch_dims: dict[int, int]
    constant_like: frozenset[int] = frozenset()  # values computed from constants alone
    # How the graph runs as fused kernels (with the cost model's kernel models, else None).
    fusion: Fusion | None = None
    # RuleConfig.fixed as a mapping: node id -> the output spec a given layout gives it.
    fixed: dict[int, ShardingSpec] = field(default_factory=dict)
    # Optimizer state and the update ops that follow it (filled as rules run).
    state_derived: set[int] = field(default_factory=set)
    done: dict[int, NodeStrategies] = field(default_factory=dict)
    _local_bytes: dict[tuple[int, tuple], float] = field(default_factory=dict)

    @property
    def axes(self) -> tuple[int, ...]:
        """Mesh axes with more than one device: the only ones worth splitting over."""
        return tuple(a for a, s in enumerate(self.mesh.shape) if s > 1)

    def fits(self, size: int, axes: Sequence[int]) -> bool:
        """A dim of `size` may be split over `axes` (uneven splits are padded up)."""
        return size >= self.mesh.axis_size(axes)

    def spec_fits(self, shape: Sequence[int], spec: ShardingSpec) -> bool:
        return all(not a or self.fits(s, a) for s, a in zip(shape, spec.dims, strict=True))

    def local_bytes(self, node: Node, spec: ShardingSpec) -> float:
        """Bytes of the node's local shard; accumulated gradients at the cost model's
        `gradient_bytes` per element."""
        key = (node.id, spec.dims)
        found = self._local_bytes.get(key)
        if found is None:  # rules ask for the same (node, spec) many times
            itemsize = node.dtype.itemsize
            if self.model.gradient_bytes and node.attr("accumulated"):
                itemsize = self.model.gradient_bytes
            found = self._local_bytes[key] = math.prod(spec.shard_shape(node.shape, self.mesh)) * itemsize
        return found

    def held_bytes(self, node: Node, spec: ShardingSpec) -> float:
        """Device memory the node's value takes: its local shard, or nothing for a value fused
        kernels never write."""
        if self.fusion is not None and node.id not in self.fusion.materialized:
            return 0.0
        return self.local_bytes(node, spec)

    def memory_bound_cost(self, node: Node, out: ShardingSpec, operands: Sequence[ShardingSpec]) -> float | None:
        """Seconds of the node as a memory-bound kernel: the local bytes it writes (when its
        value is written) and the operand bytes its fused region reads from memory; None without
        kernel models (price it by FLOPs)."""
        if self.fusion is None or self.model.kernels is None:
            return None
        if self.fusion.is_fused_attention(node.id) or node.id in self.fusion.free:
            return 0.0  # inside a fused attention kernel (priced with its products), or no kernel
        written = self.local_bytes(node, out) if node.id in self.fusion.materialized else 0.0
        if node.kind is OpKind.GATHER:  # reads the picked rows: as many bytes as it writes
            return self.model.kernels.memory(2 * written)
        read = sum(share * self.local_bytes(self.graph[node.operands[p]], operands[p])
                   for p, share in self.fusion.reads[node.id])
        return self.model.kernels.memory(written + read)

    def local_flops(self, node: Node, spec_axes: Sequence[int]) -> float:
        """FLOPs one device runs when the node's work is split over `spec_axes`."""
        return node_flops(self.graph, node) / self.mesh.axis_size(tuple(set(spec_axes)))

    def communication_weight(self, node: Node) -> float:
        """Gradient synchronisation (nodes marked `accumulated`) and the optimizer update (marked
        `per_iteration`) run once per iteration, not once per micro-batch."""
        if self.fusion is not None and node.id in self.fusion.free:
            return 0.0  # the stage's boundary stands for the rest of the model: nothing runs
        once = node.attr("accumulated") or node.attr("per_iteration")
        return self.model.accumulation_weight if once else 1.0

    def compute_weight(self, node: Node) -> float:
        return self.model.accumulation_weight if node.attr("per_iteration") else 1.0

    def collective(self, kind: CollectiveKind, axes: Sequence[int], nbytes: float) -> Collective:
        return self.model.collectives.collective(kind, self.mesh, axes, nbytes)

    def operand(self, node: Node, position: int) -> Node:
        return self.graph[node.operands[position]]

    def strategies_of(self, node_id: int) -> NodeStrategies:
        return self.done[node_id]
