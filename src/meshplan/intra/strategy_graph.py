"""StrategyGraph: node strategies with followers merged into their leaders' decisions.

Input: a Graph and the strategies of its nodes. Output: decision groups (one choice each),
their cost vectors, pairwise resharding cost matrices between groups, memory per node per
choice, live sets and alias pairs: all the numbers the ILP needs, and an exact evaluator of
any assignment, used to report plans and as the brute-force oracle in tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import numpy as np

from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.collectives import Collective, CollectiveCosts
from meshplan.cost.model import CostModel, ReshardingRule
from meshplan.ir.graph import Graph
from meshplan.ir.node import OpKind
from meshplan.sharding.resharding import resharding_collectives, resharding_cost_matrix
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import NodeStrategies


@dataclass(frozen=True, slots=True)
class Breakdown:
    """An objective split by term."""

    compute: float = 0.0
    communication: float = 0.0
    resharding: float = 0.0
    penalty: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.resharding + self.penalty


@dataclass(slots=True)
class StrategyGraph:
    """Decision groups over a graph.

    Attributes:
        graph, mesh, model: what was planned, on what, priced how.
        nodes: per node id, its strategies.
        leader: per node id, the node whose choice it shares (itself for free choices).
        groups: leader ids, in graph order.
        compute, communication, resharding: per group, cost vectors over its choices
            (followers' own costs and the resharding into them are folded in).
        edges: (leader a, leader b) -> matrix [choice of a, choice of b] of resharding costs.
        live_sets: per program point, the node ids whose values are held.
        aliases: (leader of parameter, leader of update, spec-equality matrix) triples.
        forbidden: per group, choices excluded (an alias inside one group that cannot hold).
    """

    graph: Graph
    mesh: LogicalMesh
    model: CostModel
    nodes: tuple[NodeStrategies, ...]
    leader: tuple[int, ...]
    groups: tuple[int, ...]
    compute: dict[int, np.ndarray] = field(default_factory=dict)
    communication: dict[int, np.ndarray] = field(default_factory=dict)
    resharding: dict[int, np.ndarray] = field(default_factory=dict)
    edges: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    live_sets: tuple[frozenset[int], ...] = ()
    aliases: tuple[tuple[int, int, np.ndarray], ...] = ()
    forbidden: dict[int, set[int]] = field(default_factory=dict)
    _reshard_cache: dict = field(default_factory=dict)
    _cost_cache: dict = field(default_factory=dict)
    _matrix_cache: dict = field(default_factory=dict)
    _signatures: dict = field(default_factory=dict)

    def size(self, group: int) -> int:
        return len(self.nodes[group].strategies)

    def memory(self, node_id: int) -> np.ndarray:
        """Bytes of the node's local output shard under each choice of its group."""
        return np.array([s.memory for s in self.nodes[node_id].strategies])

    def reshard(self, producer: int, src: ShardingSpec, dst: ShardingSpec) -> tuple[Collective, ...]:
        if src is dst or src.dims == dst.dims:
            return ()
        shape, dtype, (src, dst) = self._moved_value(producer, (src, dst))
        if src.dims == dst.dims:
            return ()
        key = (shape, dtype, src.dims, dst.dims)
        if key not in self._reshard_cache:
            self._reshard_cache[key] = resharding_collectives(shape, dtype.itemsize, src, dst, self.mesh, self.model)
        return self._reshard_cache[key]

    def reshard_costs(self, producer: int, produced: list[ShardingSpec], required: list[ShardingSpec]) -> np.ndarray:
        """[i, j]: `reshard_cost(producer, produced[i], required[j])`, priced as one matrix."""
        shape, dtype, specs = self._moved_value(producer, (*produced, *required))
        # Values of one shape meet the same spec lists again and again (a block's activations).
        key = (shape, dtype, tuple(s.dims for s in specs), len(produced))
        matrix = self._matrix_cache.get(key)
        if matrix is None:
            matrix = self._matrix_cache[key] = resharding_cost_matrix(
                shape, dtype.itemsize, specs[:len(produced)], specs[len(produced):], self.mesh, self.model)
        return matrix

    def _moved_value(self, producer: int, specs: tuple[ShardingSpec, ...]):
        """What a conversion of the producer's value moves: (shape, dtype, `specs` as layouts of it)."""
        node = self.graph[producer]
        if node.kind is OpKind.BROADCAST and self.model.resharding is ReshardingRule.EXACT:
            # A broadcast is fused into its consumers, never materialized: XLA converts its
            # operand (a bias, not the activation-sized result) and broadcasts again locally.
            operand = self.graph[node.operands[0]]
            return operand.shape, operand.dtype, tuple(spec.unbroadcast(node.attr("dims"), operand.shape, node.shape)
                                                       for spec in specs)
        if self.model.kernels is not None and node.kind is OpKind.BROADCAST:
            # Under kernel fusion a broadcast is never written: its (smaller) source moves and the
            # consumer's kernel broadcasts it again.
            kept = set(node.attr("dims"))
            return tuple(size if d in kept else 1 for d, size in enumerate(node.shape)), node.dtype, specs
        return node.shape, node.dtype, specs

    def once_per_iteration(self, node_id: int) -> float:
        """Weight of resharding into an optimizer-update node (it runs once per iteration)."""
        return self.model.accumulation_weight if self.graph[node_id].attr("per_iteration") else 1.0

    def reshard_cost(self, producer: int, src: ShardingSpec, dst: ShardingSpec) -> float:
        # Memoized per producer signature and spec pair: building the graph asks for the same
        # pair hundreds of thousands of times, a spec is its dims alone, and the many producers
        # of one shape (a layer's activations, its weights and their gradients) cost alike.
        signature = self._signatures.get(producer)
        if signature is None:
            signature = self._signatures[producer] = self._signature(producer)
        key = (signature, src.dims, dst.dims)
        cost = self._cost_cache.get(key)
        if cost is None:
            collectives = self.reshard(producer, src, dst)
            cost = self._cost_cache[key] = sum(c.cost for c in collectives) if collectives else 0.0
        return cost

    def _signature(self, producer: int) -> tuple:
        """Everything of the producer `reshard` reads: two producers with one signature convert
        alike (a broadcast converts its operand, or its source shape under kernel fusion)."""
        node = self.graph[producer]
        if node.kind is not OpKind.BROADCAST:
            return (node.shape, node.dtype)
        operand = self.graph[node.operands[0]]
        return (node.shape, node.dtype, tuple(node.attr("dims")), operand.shape, operand.dtype)

    # -- evaluation --------------------------------------------------------------------------

    def node_choices(self, group_choice: dict[int, int]) -> list[int]:
        """Per node, the index of its strategy when each group takes `group_choice[g]`."""
        return [group_choice[self.leader[v]] for v in range(len(self.graph))]

    def evaluate(self, group_choice: dict[int, int]) -> Breakdown:
        """Exact cost of an assignment, summed node by node from the strategies themselves."""
        choice = self.node_choices(group_choice)
        compute = communication = resharding = penalty = 0.0
        for node in self.graph.nodes:
            strategy = self.nodes[node.id].strategies[choice[node.id]]
            compute += strategy.compute
            communication += strategy.communication
            penalty += strategy.penalty
            weight = self.once_per_iteration(node.id)
            for operand, required in zip(node.operands, strategy.operands, strict=True):
                produced = self.nodes[operand].strategies[choice[operand]].output
                resharding += self.reshard_cost(operand, produced, required) * weight
        for node_id in self.graph.force_replicated:
            produced = self.nodes[node_id].strategies[choice[node_id]].output
            resharding += self.reshard_cost(node_id, produced, ShardingSpec.replicated(produced.rank))
        return Breakdown(compute, communication, resharding, penalty)

    def peak_memory(self, group_choice: dict[int, int]) -> float:
        choice = self.node_choices(group_choice)
        mems = [self.nodes[v].strategies[choice[v]].memory for v in range(len(self.graph))]
        return max((sum(mems[v] for v in live) for live in self.live_sets), default=0.0)

    def is_feasible(self, group_choice: dict[int, int], budget: float | None) -> bool:
        if any(group_choice[g] in bad for g, bad in self.forbidden.items()):
            return False
        for a, b, equal in self.aliases:
            if not equal[group_choice[a], group_choice[b]]:
                return False
        return budget is None or self.peak_memory(group_choice) <= budget * (1 + 1e-9)


def reprice_strategy_graph(sg: StrategyGraph, model: CostModel, nodes: tuple[NodeStrategies, ...]) -> StrategyGraph:
    """`sg` with node strategies `nodes` that differ from its own only in their penalties (e.g.
    another memory price): groups, resharding and compute stay; the communication vectors,
    where penalties are counted, are summed again in the same order as `build_strategy_graph`."""
    communication = {g: np.zeros(sg.size(g)) for g in sg.groups}
    for node in sg.graph.nodes:
        communication[sg.leader[node.id]] += [s.communication + s.penalty for s in nodes[node.id].strategies]
    return replace(sg, model=model, nodes=nodes, compute={g: v.copy() for g, v in sg.compute.items()},
                   communication=communication, resharding={g: v.copy() for g, v in sg.resharding.items()},
                   edges=dict(sg.edges), forbidden={g: set(v) for g, v in sg.forbidden.items()})


def build_strategy_graph(graph: Graph, mesh: LogicalMesh, model: CostModel,
                         nodes: tuple[NodeStrategies, ...]) -> StrategyGraph:
    """Merge followers into leaders and collect the costs the ILP needs."""
    leader: list[int] = []
    for ns in nodes:
        node = graph[ns.node]
        leader.append(ns.node if ns.follows is None else leader[node.operands[ns.follows]])
    groups = tuple(dict.fromkeys(leader))
    sg = StrategyGraph(graph, mesh, model, nodes, tuple(leader), groups,
                       _reshard_cache=reshardings_on(mesh, model.collectives, model.resharding))
    for g in groups:
        n = sg.size(g)
        sg.compute[g], sg.communication[g], sg.resharding[g] = np.zeros(n), np.zeros(n), np.zeros(n)
    for node in graph.nodes:
        _add_node_costs(sg, node.id)
    for node_id in graph.force_replicated:
        g = leader[node_id]
        for i, s in enumerate(nodes[node_id].strategies):
            sg.resharding[g][i] += sg.reshard_cost(node_id, s.output, ShardingSpec.replicated(s.output.rank))
    sg.live_sets = live_sets(graph, model.parameters_held)
    _add_aliases(sg)
    return sg


@functools.lru_cache(maxsize=8)
def reshardings_on(mesh: LogicalMesh, collectives: CollectiveCosts, rule: ReshardingRule) -> dict:
    """The conversions priced so far on `mesh` under these collective costs, (shape, dtype, src
    dims, dst dims) -> collectives, shared by the strategy graphs built on one mesh in this process:
    a task's pieces and the micro-batch sizes of one view convert the same weights, gradients and
    activations (the last few meshes are kept: a worker prices one view after another)."""
    del mesh, collectives, rule  # the key of the cache
    return {}


def _add_node_costs(sg: StrategyGraph, node_id: int) -> None:
    node, ns = sg.graph[node_id], sg.nodes[node_id]
    g = sg.leader[node_id]
    sg.compute[g] += [s.compute for s in ns.strategies]
    sg.communication[g] += [s.communication + s.penalty for s in ns.strategies]
    for position, operand in enumerate(node.operands):
        h = sg.leader[operand]
        produced = [s.output for s in sg.nodes[operand].strategies]
        required = [s.operands[position] for s in ns.strategies]
        weight = sg.once_per_iteration(node_id)
        if h == g:  # same decision: strategy i meets strategy i
            sg.resharding[g] += [sg.reshard_cost(operand, produced[i], required[i]) * weight
                                 for i in range(len(required))]
            continue
        matrix = _reshard_matrix(sg, operand, produced, required) * weight
        key, matrix = ((h, g), matrix) if h < g else ((g, h), matrix.T)
        sg.edges[key] = sg.edges[key] + matrix if key in sg.edges else matrix


def _reshard_matrix(sg: StrategyGraph, operand: int, produced: list[ShardingSpec],
                    required: list[ShardingSpec]) -> np.ndarray:
    """[produced i, required j] resharding costs, pricing each distinct spec pair once."""
    src, src_index = _distinct(produced)
    dst, dst_index = _distinct(required)
    return sg.reshard_costs(operand, src, dst)[np.ix_(src_index, dst_index)]


def _distinct(specs: list[ShardingSpec]) -> tuple[list[ShardingSpec], list[int]]:
    """The distinct specs (by dims, in first-seen order) and each spec's index among them."""
    position: dict[tuple, int] = {}
    distinct: list[ShardingSpec] = []
    index = []
    for spec in specs:
        i = position.setdefault(spec.dims, len(distinct))
        if i == len(distinct):
            distinct.append(spec)
        index.append(i)
    return distinct, index


def _add_aliases(sg: StrategyGraph) -> None:
    aliases = []
    for param, updated in sg.graph.aliases:
        a, b = sg.leader[param], sg.leader[updated]
        p_specs = [s.output for s in sg.nodes[param].strategies]
        u_specs = [s.output for s in sg.nodes[updated].strategies]
        if a == b:
            bad = {i for i in range(len(p_specs)) if p_specs[i] != u_specs[i]}
            if bad:
                sg.forbidden.setdefault(a, set()).update(bad)
            continue
        equal = np.array([[p == u for u in u_specs] for p in p_specs], dtype=bool)
        aliases.append((a, b, equal))
    sg.aliases = tuple(aliases)


def dominated_choices(sg: StrategyGraph, canon: dict[int, int], excluded: dict[int, set[int]]) -> dict[int, set[int]]:
    """Per canonical group, choices another choice beats on every term (exact presolve).

    Choice i dominates k when its own cost, the memory of every member node, every resharding
    cost towards every neighbour choice are no larger, and it is compatible with at least the
    alias partners k is compatible with. Dropping k then cannot worsen the optimum.
    """
    profiles: dict[int, list[np.ndarray]] = {}
    for g in sg.groups:
        parts = profiles.setdefault(canon[g], [])
        parts.append((sg.compute[g] + sg.communication[g] + sg.resharding[g])[:, None])
        parts.extend(sg.memory(v)[:, None] for v in range(len(sg.graph)) if sg.leader[v] == g)
    for (a, b), matrix in sg.edges.items():
        profiles[canon[a]].append(matrix)
        profiles[canon[b]].append(matrix.T)
    for a, b, equal in sg.aliases:
        profiles[canon[a]].append(-equal.astype(float))
        profiles[canon[b]].append(-equal.T.astype(float))
    dominated: dict[int, set[int]] = {}
    for c, parts in profiles.items():
        table = np.hstack(parts)
        bad = set(excluded.get(c, ()))
        for k in range(table.shape[0]):
            no_worse = np.all(table <= table[k] + 1e-12 * np.abs(table[k]), axis=1)
            better = no_worse & (np.any(table < table[k], axis=1) | (np.arange(table.shape[0]) < k))
            better[list(bad)] = False
            better[k] = False
            if better.any():
                bad.add(k)
        bad -= excluded.get(c, set())
        if bad:
            dominated[c] = bad
    return dominated


def live_ranges(graph: Graph, parameters_held: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Per node, the first and last program point (inclusive) at which its value is held.

    A value lives from its definition to its last use, outputs to the end. With
    `parameters_held` (the default), parameters (weights, optimizer state, inputs) are held for
    the whole step: they are the caller's buffers. Without it (Alpa's rule) a parameter lives
    from its position to its last use like any value.
    """
    n = len(graph)
    last_use = np.arange(n)
    for node in graph.nodes:
        for operand in node.operands:
            last_use[operand] = max(last_use[operand], node.id)
    for out in graph.outputs:
        last_use[out] = n - 1
    if not parameters_held:
        return np.arange(n, dtype=np.int64), last_use
    for node in graph.parameters():
        last_use[node.id] = n - 1
    first = np.array([0 if node.kind.value == "parameter" else node.id for node in graph.nodes], dtype=np.int64)
    return first, last_use


def live_sets(graph: Graph, parameters_held: bool = True) -> tuple[frozenset[int], ...]:
    """Per program point t, the values held while node t runs (see `live_ranges`)."""
    n = len(graph)
    first, last_use = live_ranges(graph, parameters_held)
    starts: list[list[int]] = [[] for _ in range(n)]
    ends: list[list[int]] = [[] for _ in range(n)]
    for v in range(n):
        starts[first[v]].append(v)
        ends[last_use[v]].append(v)
    sets, live = [], set()
    for t in range(n):
        live.update(starts[t])
        sets.append(frozenset(live))
        live.difference_update(ends[t])
    return tuple(sets)
