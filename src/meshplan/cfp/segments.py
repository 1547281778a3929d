"""Segments: repeated block sequences found by structural hashing (blocks -> unique segments).

A block sequence is cut out of the graph as a standalone program: every value it reads from
outside (another block's result or a parameter) becomes an input, placed right before its
first use, so a layer reading the model input and a layer reading the previous layer's output
are the same program. Its structural hash covers op kinds, attributes, shapes, dtypes, edges
and outputs, never names, plus the blocks' candidate strategies.

The block sequence is cut into windows at the lag where block hashes repeat most (a layer),
and each window into pieces whose strategy combinations stay within a limit (what profiling
enumerates). Equal pieces are one unique segment, profiled once.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.cfp.blocks import ParallelBlock
from meshplan.ir.graph import Graph, check_graph
from meshplan.ir.node import Node, OpKind


@dataclass(frozen=True, slots=True)
class Extract:
    """A node set of a graph as a standalone graph.

    Attributes:
        graph: inputs are parameters; results read outside (or graph outputs) are outputs.
        origin: per standalone node, the original node whose value it holds.
        inputs: standalone ids of the inputs whose value comes from outside the node set.
    """

    graph: Graph
    origin: tuple[int, ...]
    inputs: tuple[int, ...]

    @property
    def key(self) -> str:
        return structural_hash(self.graph)


@dataclass(frozen=True, slots=True)
class Segment:
    """A unique block sequence.

    Attributes:
        index: position among the unique segments.
        key: structural hash (graph and candidates).
        structure: hash of the graph alone (the profile cache key, with the mesh and device).
        blocks: the blocks of its first occurrence (the representative).
        space: candidates per block, e.g. (3, 3, 3, 4): the sub-search space.
        extract: the representative as a standalone graph.
    """

    index: int
    key: str
    structure: str
    blocks: tuple[int, ...]
    space: tuple[int, ...]
    extract: Extract

    @property
    def combinations(self) -> int:
        return math.prod(self.space)

    @property
    def span(self) -> tuple[int, int]:
        return self.blocks[0], self.blocks[-1] + 1


@dataclass(frozen=True, slots=True)
class Occurrence:
    """Blocks [start, stop) of the sequence, an instance of unique segment `segment`."""

    start: int
    stop: int
    segment: int
    extract: Extract

    @property
    def blocks(self) -> range:
        return range(self.start, self.stop)


def extract(graph: Graph, members: Sequence[int], name: str = "segment") -> Extract:
    """Cut `members` out of `graph` as a standalone graph (see the module docstring)."""
    member_set = set(members)
    nodes: list[Node] = []
    origin: list[int] = []
    new_id: dict[int, int] = {}
    inputs: list[int] = []

    def add(v: int, node: Node) -> None:
        new_id[v] = len(nodes)
        origin.append(v)
        nodes.append(node)

    def add_input(v: int) -> None:
        old = graph[v]
        if v not in member_set:
            inputs.append(len(nodes))
        add(v, Node(len(nodes), OpKind.PARAMETER, (), old.shape, old.dtype, name=old.label))

    for v in sorted(member_set):
        old = graph[v]
        if old.kind is OpKind.PARAMETER:
            continue  # an input: placed before its first use
        for o in old.operands:
            if o not in new_id:
                add_input(o)
        add(v, Node(len(nodes), old.kind, tuple(new_id[o] for o in old.operands), old.shape, old.dtype,
                    old.attrs, old.label))
    for v in sorted(member_set):
        if v not in new_id:
            add_input(v)
    outs = set(graph.outputs)
    # Inputs are never results: a parameter read by other blocks too is just their input as well.
    outputs = tuple(new_id[v] for v in sorted(member_set) if graph[v].kind is not OpKind.PARAMETER
                    and (v in outs or any(u not in member_set for u in graph.users(v))))
    standalone = Graph(tuple(nodes), outputs or (len(nodes) - 1,), name=name)
    check_graph(standalone)
    return Extract(standalone, tuple(origin), tuple(inputs))


def structural_hash(graph: Graph, extra: object = ()) -> str:
    """A hash of kinds, attributes, shapes, dtypes, edges and outputs (not names)."""
    signature = (tuple((n.kind.value, n.attrs, n.shape, n.dtype.short_name, n.operands) for n in graph.nodes),
                 graph.outputs, extra)
    return hashlib.sha256(repr(signature).encode()).hexdigest()[:16]


def block_signature(graph: Graph, block: ParallelBlock) -> str:
    return structural_hash(extract(graph, block.members).graph, _candidates(block))


def find_segments(graph: Graph, blocks: Sequence[ParallelBlock], max_combinations: int
                  ) -> tuple[tuple[Segment, ...], tuple[Occurrence, ...]]:
    """Unique segments and every occurrence, in block order."""
    hashes = [block_signature(graph, b) for b in blocks]
    segments: dict[str, Segment] = {}
    occurrences = []
    for start, stop in pieces(windows(hashes), [len(b.strategies) for b in blocks], max_combinations):
        chosen = blocks[start:stop]
        cut = extract(graph, sorted(v for b in chosen for v in b.members), f"segment{len(segments)}")
        structure = cut.key
        key = structural_hash(cut.graph, tuple(_candidates(b) for b in chosen))
        if key not in segments:
            segments[key] = Segment(len(segments), key, structure, tuple(range(start, stop)),
                                    tuple(len(b.strategies) for b in chosen), cut)
        occurrences.append(Occurrence(start, stop, segments[key].index, cut))
    return tuple(segments.values()), tuple(occurrences)


def windows(hashes: Sequence[str]) -> list[tuple[int, int]]:
    """Cut the sequence at the lag where most blocks equal the block one lag earlier (ties:
    the shortest lag), starting where the repetition starts; no repetition: one window."""
    n = len(hashes)
    best_matches, lag = 0, n
    for candidate in range(1, n // 2 + 1):
        matches = sum(hashes[i] == hashes[i - candidate] for i in range(candidate, n))
        if matches > best_matches:
            best_matches, lag = matches, candidate
    if best_matches == 0:
        return [(0, n)]
    start = next(i for i in range(n - lag) if hashes[i] == hashes[i + lag])
    cuts = [0] if start else []
    cuts += list(range(start, n, lag))
    return [(a, b) for a, b in zip(cuts, [*cuts[1:], n], strict=True) if a < b]


def pieces(spans: Sequence[tuple[int, int]], sizes: Sequence[int], max_combinations: int) -> list[tuple[int, int]]:
    """Each window cut greedily into runs of blocks whose candidate counts multiply to at most
    `max_combinations` (a block larger than that is a piece of its own)."""
    out = []
    for first, stop in spans:
        start, product = first, 1
        for b in range(first, stop):
            if b > start and product * sizes[b] > max_combinations:
                out.append((start, b))
                start, product = b, 1
            product *= sizes[b]
        out.append((start, stop))
    return out


def _candidates(block: ParallelBlock) -> tuple[str, ...]:
    return tuple(f"{s.label}|{s.name}" for s in block.strategies)
