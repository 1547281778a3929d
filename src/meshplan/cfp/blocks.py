"""ParallelBlocks: a graph's operators grouped around contractions (Graph + strategies -> blocks).

A block starts at a contraction (dot). It takes in:
- the operators meshplan's rules make follow it (elementwise, reshape, transpose, broadcast,
  reduce, ...): their sharding is a function of the dot's;
- dots that read an operand another dot of the block reads (the sibling projections q, k, v
  of one input, or the backward dots of a training graph, which read the forward dot's weight
  or activation): they must read it in the same layout, which fixes their strategy;
- the chain of operators that feeds only this block and is entered by one value of another
  block (the normalisation before a projection, a softmax before its context product): its
  layout is the one this block reads, so the value crossing is the chain's input, not output;
- parameters and constants it reads first, laid out as it reads them.

A block's candidates are its leading dot's CFP candidates (`strategies.py`). Under each
candidate, every other member's strategy is derived (a strategy map, `derive.py`); a candidate
is kept only when the whole block then runs without communication, apart from the partial-sum
all-reduces of its own contractions. Communication happens between blocks.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from meshplan.cfp.derive import BlockStrategy, StrategyMaps
from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.model import CostModel
from meshplan.errors import GraphError
from meshplan.ir.graph import Graph
from meshplan.ir.node import OpKind
from meshplan.sharding.strategy import NodeStrategies

_LEAVES = (OpKind.PARAMETER, OpKind.CONSTANT, OpKind.IOTA)


@dataclass(frozen=True, slots=True)
class ParallelBlock:
    """Operators that share one sharding decision.

    Attributes:
        index: position in the block sequence (ordered by leading dot).
        lead: the leading dot's node id.
        dots: every dot of the block (lead first).
        members: every node of the block, ascending.
        strategies: the kept candidates.
        dropped: candidates dropped, each with the member that would communicate.
    """

    index: int
    lead: int
    dots: tuple[int, ...]
    members: tuple[int, ...]
    strategies: tuple[BlockStrategy, ...]
    dropped: tuple[tuple[str, str], ...] = ()

    @property
    def communication_free(self) -> bool:
        return all(s.communication_free for s in self.strategies)


def leaders(graph: Graph, strategies: Sequence[NodeStrategies]) -> tuple[int, ...]:
    """Per node, the node whose strategy index it shares (itself when it chooses freely)."""
    lead: list[int] = []
    for ns in strategies:
        lead.append(ns.node if ns.follows is None else lead[graph[ns.node].operands[ns.follows]])
    return tuple(lead)


def find_blocks(graph: Graph, mesh: LogicalMesh, model: CostModel,
                strategies: Sequence[NodeStrategies]) -> tuple[tuple[ParallelBlock, ...], tuple[int, ...]]:
    """The ParallelBlocks of `graph` and the block of every node.

    Raises:
        GraphError: the graph has no contraction.
    """
    dots = [n.id for n in graph.nodes if n.kind is OpKind.DOT]
    if not dots:
        raise GraphError(f"graph {graph.name!r} has no contraction (dot): CFP's ParallelBlocks start at "
                         "contractions, so there is nothing to plan; use a model with matrix products, or "
                         "plan this graph with the ILP (meshplan intra)")
    lead = leaders(graph, strategies)
    split: set[int] = set()
    while True:
        block_dots = group_dots(graph, dots, split)
        owner = assign_owners(graph, lead, block_dots)
        maps = StrategyMaps(graph, mesh, model, strategies, lead)
        blocks, unmatched = [], None
        for index, group in enumerate(block_dots):
            members = tuple(v for v in range(len(graph)) if owner[v] == index)
            derived = maps.derive(index, group, members)
            unmatched = derived.unmatched
            if unmatched is not None:
                break
            blocks.append(ParallelBlock(index, group[0], group, members, derived.kept, derived.dropped))
        if unmatched is None:
            return tuple(blocks), owner
        split.add(unmatched)  # a joined dot no candidate can derive: it leads a block of its own


def group_dots(graph: Graph, dots: Sequence[int], split: Collection[int] = ()) -> list[tuple[int, ...]]:
    """Dots grouped into blocks: a dot joins the first block whose dots read one of its
    (non-constant) operands; `split` dots always lead their own block."""
    blocks: list[list[int]] = []
    reader: dict[int, int] = {}  # operand node -> block of the first dot that reads it
    for dot in dots:
        shared = [reader[o] for o in graph[dot].operands if o in reader and graph[o].kind is not OpKind.CONSTANT]
        if shared and dot not in split:
            index = min(shared)
            blocks[index].append(dot)
        else:
            index = len(blocks)
            blocks.append([dot])
        for o in graph[dot].operands:
            reader.setdefault(o, index)
    return [tuple(b) for b in blocks]


def assign_owners(graph: Graph, lead: Sequence[int], block_dots: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The block of every node (see the module docstring for the rules)."""
    block_of_dot = {d: b for b, ds in enumerate(block_dots) for d in ds}
    owner: list[int | None] = [block_of_dot.get(lead[v]) for v in range(len(graph))]
    _move_feeding_chains(graph, owner, block_of_dot)
    for v in reversed(range(len(graph))):  # leaf-led nodes (and leaves): the block of their first user
        if owner[v] is None:
            owner[v] = _first_user_block(graph, v, owner)
    for v in range(len(graph)):  # leaves no block reads (a graph output only): the last block
        if owner[v] is None:
            owner[v] = max((o for o in owner if o is not None), default=0)
    return tuple(owner)


def _first_user_block(graph: Graph, v: int, owner: list[int | None]) -> int | None:
    for user in graph.users(v):
        if owner[user] is not None:
            return owner[user]
    return None


def _move_feeding_chains(graph: Graph, owner: list[int | None], block_of_dot: dict[int, int]) -> None:
    """Move to block C every chain of non-dot nodes of a block P whose results feed only C and
    which is entered by a single value of P (that value stays in P)."""
    outputs = set(graph.outputs)
    movable = lambda v: (owner[v] is not None and v not in block_of_dot and v not in outputs
                         and graph[v].kind not in _LEAVES)
    target: dict[int, int] = {}  # node -> block its chain feeds
    for v in reversed(range(len(graph))):
        if not movable(v) or not graph.users(v):
            continue
        feeds = {target.get(u, owner[u]) for u in graph.users(v)}
        if len(feeds) == 1 and None not in feeds and feeds != {owner[v]}:
            target[v] = feeds.pop()
    for chain in _components(graph, target, owner):
        p, c = owner[chain[0]], target[chain[0]]
        inside = set(chain)
        entries = {o for v in chain for o in graph[v].operands
                   if o not in inside and owner[o] == p and graph[o].kind not in _LEAVES}
        if len(entries) == 1:
            for v in chain:
                owner[v] = c


def _components(graph: Graph, target: dict[int, int], owner: list[int | None]) -> list[list[int]]:
    """The connected pieces of the nodes in `target` that share a source and a target block."""
    seen: set[int] = set()
    pieces = []
    for start in sorted(target):
        if start in seen:
            continue
        piece, stack = [], [start]
        seen.add(start)
        while stack:
            v = stack.pop()
            piece.append(v)
            for w in (*graph[v].operands, *graph.users(v)):
                if w in target and w not in seen and (target[w], owner[w]) == (target[v], owner[v]):
                    seen.add(w)
                    stack.append(w)
        pieces.append(sorted(piece))
    return pieces


