"""Strategy maps: a block's candidates and, under each, every member's strategy (block -> maps).

Under a candidate of the leading contraction (`strategies.py`), each group of members (nodes
sharing a strategy index under meshplan's rules) takes, in order: joined dots the strategy that
reads the shared operand as the block lays it out (the lead's axis-to-group pattern first);
every other group the cheapest strategy that exchanges nothing with the members already
chosen. A candidate is kept when the whole block then runs without communication, apart from
completing partial sums (see the levels below); a block where none manages keeps its candidates
with their cheapest layouts, flagged.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.cfp.strategies import DotCandidate, dot_candidates
from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.collectives import CollectiveKind
from meshplan.cost.model import CostModel
from meshplan.ir.graph import Graph
from meshplan.ir.node import OpKind
from meshplan.sharding.resharding import resharding_collectives
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import NodeStrategies

# How much communication a block member may need, lowest first: only contractions' partial-sum
# all-reduces; also other reductions' (a reduce over a split dim: a bias gradient summed over the
# batch in a training graph); anything (the fallback when no candidate manages the first two).
DOTS_ONLY, PARTIAL_SUMS, ANY = 0, 1, 2


class CommunicatingBlockWarning(UserWarning):
    """No candidate of a block runs without communication inside; its best ones were kept."""


@dataclass(frozen=True, slots=True)
class BlockStrategy:
    """One candidate of a block and the strategy it implies for every member.

    Attributes:
        name: the leading contraction's candidate in CFP notation.
        label: which group each mesh axis splits, e.g. "M0 N1".
        choices: (node id, strategy index) for every member, in node order.
        communication_free: members communicate only to complete partial sums (all-reduces
            after a contraction, or after a reduction when `reduces` is set): no layout changes.
        reduces: some non-contraction member all-reduces its partial sums.
    """

    name: str
    label: str
    choices: tuple[tuple[int, int], ...]
    communication_free: bool = True
    reduces: bool = False


@dataclass(frozen=True, slots=True)
class Derived:
    """A block's kept candidates, those dropped (with the member that would communicate), or
    the joined dot no candidate can derive (it must lead a block of its own)."""

    kept: tuple[BlockStrategy, ...] = ()
    dropped: tuple[tuple[str, str], ...] = ()
    unmatched: int | None = None


def is_local_slice(src: ShardingSpec, dst: ShardingSpec) -> bool:
    """Every device already holds its `dst` piece under `src`: each dim's `src` axes are the
    leading (major) axes of its `dst` axes."""
    return all(d[:len(a)] == a for a, d in zip(src.dims, dst.dims, strict=True))


class StrategyMaps:
    """Derives the strategy of every member of a block under each of its candidates."""

    def __init__(self, graph: Graph, mesh: LogicalMesh, model: CostModel, strategies: Sequence[NodeStrategies],
                 lead: Sequence[int]) -> None:
        self.graph, self.mesh, self.model = graph, mesh, model
        self.strategies, self.lead = strategies, lead
        self._reshards: dict = {}
        self._candidates: dict[int, tuple[DotCandidate, ...]] = {}

    def derive(self, index: int, dots: tuple[int, ...], members: tuple[int, ...]) -> Derived:
        """The candidates of the block with these dots and members, with their strategy maps."""
        candidates = dot_candidates(self.graph, self.graph[dots[0]], self.mesh, self.strategies[dots[0]])
        kept, dropped, failures = [], [], []
        for candidate in candidates:
            choice, level, failed = self._derive(candidate, dots, members, PARTIAL_SUMS)
            if failed is None:
                kept.append(self._strategy(candidate, choice, level, members))
            else:
                dropped.append((candidate.name, self.graph[failed].label))
                failures.append(failed)
        joined = [f for f in failures if f in dots[1:]]
        if not kept and joined and len(joined) == len(failures):
            return Derived(unmatched=joined[0])
        if not kept:
            kept = [self._strategy(c, *self._derive(c, dots, members, ANY)[:2], members) for c in candidates]
            warnings.warn(f"block {index} (led by {self.graph[dots[0]].label}) communicates inside under every "
                          f"candidate (first: {dropped[0][1] if dropped else '?'}); its candidates are kept with "
                          f"their cheapest layouts", CommunicatingBlockWarning, stacklevel=3)
        return Derived(tuple(kept), tuple(dropped))

    def _strategy(self, candidate: DotCandidate, choice: dict[int, int], level: int,
                  members: tuple[int, ...]) -> BlockStrategy:
        return BlockStrategy(candidate.name, candidate.label, tuple((v, choice[self.lead[v]]) for v in members),
                             level <= PARTIAL_SUMS, level == PARTIAL_SUMS)

    def _derive(self, candidate: DotCandidate, dots: tuple[int, ...], members: tuple[int, ...],
                most: int) -> tuple[dict[int, int], int, int | None]:
        """Group leader -> strategy index for every group of the block, the highest
        communication level any group needed, and the first member that needs more than
        `most` (None when none does)."""
        member_set = set(members)
        groups: dict[int, list[int]] = {}
        for v in members:
            groups.setdefault(self.lead[v], []).append(v)
        choice = {dots[0]: candidate.index}
        order = [d for d in dots[1:] if d in groups]
        order += sorted((g for g in groups if g not in choice and g not in order), key=lambda g: -max(groups[g]))
        level = next((lv for lv in range(most + 1)
                      if self._check(groups[dots[0]], choice, member_set, lv) is None), None)
        failed = None if level is not None else groups[dots[0]][0]
        level = level or 0
        for g in order:
            best, used, best_failed = self._best(g, groups[g], self._options(g, candidate, dots), choice,
                                                 member_set, most)
            choice[g] = best
            level = max(level, used)
            failed = failed if failed is not None else best_failed
        return choice, level, failed

    def _options(self, group: int, candidate: DotCandidate, dots: tuple[int, ...]) -> list[list[int]]:
        """Strategy indices to try for a group, in tiers: a joined dot first tries the lead's
        axis-to-group pattern, then any CFP candidate, then any strategy."""
        every = list(range(len(self.strategies[group].strategies)))
        if group not in dots:
            return [every]
        if group not in self._candidates:
            self._candidates[group] = dot_candidates(self.graph, self.graph[group], self.mesh, self.strategies[group])
        own = self._candidates[group]
        same = [c.index for c in own if c.groups == candidate.groups]
        return [same, [c.index for c in own], every]

    def _best(self, group: int, nodes: list[int], tiers: list[list[int]], choice: dict[int, int],
              member_set: set[int], most: int) -> tuple[int, int, int | None]:
        """(index, level, failed): the cheapest index of the first tier that runs at the lowest
        communication level, trying levels up to `most`; ANY counts resharding in the cost. Ties
        go to the layout its readers take as it is (a parameter laid out as the block reads it,
        not sliced from a whole copy), then to the lowest index."""
        for level in range(most + 1):
            for tier in tiers:
                scored = [(self._cost(nodes, {**choice, group: i}, member_set),
                           self._slices(nodes, {**choice, group: i}, member_set), i) for i in tier
                          if self._check(nodes, {**choice, group: i}, member_set, level) is None]
                if scored:
                    return min(scored)[2], level, None
        return tiers[-1][0], most, nodes[0]

    def _slices(self, nodes: list[int], choice: dict[int, int], member_set: set[int]) -> int:
        """How many edges from `nodes` to chosen members hand over a layout that differs."""
        count = 0
        for v in nodes:
            out = self._chosen(v, choice).output
            for user in self.graph.users(v):
                if user in member_set and self.lead[user] in choice:
                    used = self._chosen(user, choice)
                    count += sum(o == v and used.operands[p] != out for p, o in enumerate(self.graph[user].operands))
        return count

    def _check(self, nodes: list[int], choice: dict[int, int], member_set: set[int], level: int) -> int | None:
        """The first node of `nodes` that communicates beyond `level` under `choice` (only edges
        to members whose group is chosen count), or None."""
        if level >= ANY:
            return None
        for v in nodes:
            s = self._chosen(v, choice)
            if s.collectives and not self._own_reduction(v, s, level):
                return v
            if self._edge_collectives(v, choice, member_set):
                return v
        return None

    def _own_reduction(self, v: int, s, level: int) -> bool:
        """Whether `s`'s collectives only complete partial sums the level allows: a contraction's
        always, any other reduction's (a reduce over a split dim) from PARTIAL_SUMS on."""
        if self.graph[v].kind is OpKind.DOT:
            return True
        return level >= PARTIAL_SUMS and all(c.kind is CollectiveKind.ALL_REDUCE for c in s.collectives)

    def _edge_collectives(self, v: int, choice: dict[int, int], member_set: set[int]) -> bool:
        """Whether some edge into or out of `v` inside the block needs a collective, or a value
        from outside that `v` reads must be laid out differently for another reader (it arrives
        once, as its first reader in the block needs it)."""
        s = self._chosen(v, choice)
        for operand, required in zip(self.graph[v].operands, s.operands, strict=True):
            if operand not in member_set:
                if self._readers_disagree(operand, choice, member_set):
                    return True
            elif self.lead[operand] in choice and self._moves(operand, self._chosen(operand, choice).output,
                                                              required):
                return True
        for user in self.graph.users(v):
            if user in member_set and self.lead[user] in choice:
                used = self._chosen(user, choice)
                for position, operand in enumerate(self.graph[user].operands):
                    if operand == v and self._moves(v, s.output, used.operands[position]):
                        return True
        return False

    def _readers_disagree(self, value: int, choice: dict[int, int], member_set: set[int]) -> bool:
        needs = [self._chosen(u, choice).operands[self.graph[u].operands.index(value)]
                 for u in self.graph.users(value) if u in member_set and self.lead[u] in choice]
        return any(self._moves(value, needs[0], need) for need in needs[1:])

    def _moves(self, producer: int, src: ShardingSpec, dst: ShardingSpec) -> bool:
        """Whether turning `src` into `dst` moves data between devices. Beyond the cost model's
        collectives, a split added *major* to an existing one (S1 -> S01) is not a local slice:
        device (i, j) holds piece j of 4 but needs piece 4i + j of 8 (XLA permutes)."""
        return bool(self._reshard(producer, src, dst)) or not is_local_slice(src, dst)

    def _cost(self, nodes: list[int], choice: dict[int, int], member_set: set[int]) -> float:
        total = 0.0
        for v in nodes:
            s = self._chosen(v, choice)
            total += s.compute + s.communication
            for operand, required in zip(self.graph[v].operands, s.operands, strict=True):
                if operand in member_set and self.lead[operand] in choice:
                    total += sum(c.cost for c in self._reshard(operand, self._chosen(operand, choice).output,
                                                               required))
        return total

    def _chosen(self, v: int, choice: dict[int, int]):
        return self.strategies[v].strategies[choice[self.lead[v]]]

    def _reshard(self, producer: int, src, dst):
        if src == dst:
            return ()
        node = self.graph[producer]
        key = (node.shape, node.dtype, src, dst)
        if key not in self._reshards:
            self._reshards[key] = resharding_collectives(node.shape, node.dtype.itemsize, src, dst, self.mesh,
                                                         self.model)
        return self._reshards[key]
