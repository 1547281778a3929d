"""Kernel fusion: which values of a training graph reach device memory, and what each kernel reads.

Input: a Graph whose backward nodes are tagged `backward`, optimizer nodes `per_iteration`,
fused-kernel nodes `kernel` (GraphBuilder.kernel) and residual-stream values `stored`. Output:
a `Fusion`: the materialized values, the operands each node reads from device memory, the
nodes of fused attention kernels, and the forward values a backward pass keeps.

The rules are those of the kernels training frameworks run (Megatron-LM's fused kernels, XLA's
loop and input fusion):

- contractions, gathers, reductions and parameters are kernels of their own: their outputs
  are written to device memory;
- element-wise and layout ops fuse with their neighbours: a value is written only when a
  kernel of its own reads it (a GEMM's input), when it is a result, an update, an accumulated
  gradient, a `stored` value (a kernel boundary the model marks: the residual stream, the
  unfused softmax's output) or a `saved` one (written for the backward pass while its kernel
  goes on using it: a dropout mask); a slice, reshape or transpose of a value in
  memory is a view of it, read in place (q, k and v of a fused QKV projection);
- a fused region (element-wise ops joined through values that are not written, further
  outputs of the same kernel, and row reductions with the ops that use them) reads each value
  in memory it needs once;
- a backward kernel that needs a forward value that was never written recomputes it from the
  written values it came from (the frontier), which the forward pass therefore keeps; a fused
  softmax keeps its output instead (its backward needs only the probabilities);
- with fused (flash) attention, the score product, softmax and context product are one kernel:
  nothing inside is written but its result and its row statistics, and its backward
  recomputes the scores from the kept queries, keys and values.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from meshplan.ir.graph import Graph
from meshplan.ir.node import Node, OpKind

FUSIBLE = frozenset({OpKind.ELEMENTWISE, OpKind.BROADCAST, OpKind.TRANSPOSE, OpKind.RESHAPE, OpKind.SLICE,
                     OpKind.CONCATENATE, OpKind.DYNAMIC_SLICE})
VIEWS = frozenset({OpKind.TRANSPOSE, OpKind.RESHAPE, OpKind.SLICE})
# Kernels of their own that take their operands straight from the kernel making them (input
# fusion: a reduction, or a scatter of tokens back into their sequences).
INPUT_FUSED = frozenset({OpKind.REDUCE, OpKind.SCATTER_ADD})  # read in place when over a value in memory
# Computed inside the kernel that reads them (random bits: in-kernel Philox, as fused dropout does).
GENERATED = frozenset({OpKind.CONSTANT, OpKind.IOTA, OpKind.RANDOM})
# Fused-kernel tags (GraphBuilder.kernel) of attention cores -> whether the kernel is causal.
ATTENTION_KERNELS = {"attention": False, "causal_attention": True}
BOUNDARY = "stage_boundary"  # the product with the arriving gradient that ends a stage's graph

FORWARD, BACKWARD, UPDATE = 0, 1, 2


def is_attention(node: Node) -> bool:
    """Part of an attention core (the score product, softmax and context product)."""
    return node.attr("kernel") in ATTENTION_KERNELS


def training_pass(node: Node) -> int:
    """FORWARD, BACKWARD or UPDATE, from the node's tags."""
    if node.attr("per_iteration"):
        return UPDATE
    return BACKWARD if node.attr("backward") else FORWARD


@dataclass(frozen=True, slots=True)
class Fusion:
    """How a graph runs as fused kernels.

    Attributes:
        materialized: ids of values written to device memory (the others live in registers, or
            are views of written values).
        reads: per node, (operand position, share of the operand's bytes) it reads from device
            memory (each fused region reads a value once: the first node of the region that needs
            it; a recomputed forward value is read as the values it comes from).
        attention: ids of the nodes of fused attention kernels (empty without flash).
        free: ids of nodes that run no kernel (a stage's boundary: the product with the arriving
            gradient that stands for the rest of the model).
        kept: forward values the backward pass reads from device memory (saved activations).
        kept_by_attention: the part of `kept` only the attention kernels read (dropped when the
            attention is recomputed: selective recomputation).
    """

    materialized: frozenset[int]
    reads: tuple[tuple[tuple[int, float], ...], ...]
    attention: frozenset[int]
    free: frozenset[int]
    kept: frozenset[int]
    kept_by_attention: frozenset[int]

    def is_fused_attention(self, node_id: int) -> bool:
        return node_id in self.attention


# The last few graphs' fused views, by graph identity (a Graph hashes all its nodes): a piece
# is fused by its enumeration, its re-priced menu entries and its cost read-out, and a worker
# prices one piece graph on many views.
_FUSED: dict[tuple[int, bool], tuple[Graph, Fusion]] = {}
_FUSED_KEPT = 16
_FUSED_LOCK = threading.Lock()


def fused(graph: Graph, flash: bool) -> Fusion:
    """`fuse(graph, flash)`, remembered for the last few graphs of this process."""
    key = (id(graph), flash)
    found = _FUSED.get(key)
    if found is not None and found[0] is graph:
        return found[1]
    fusion = fuse(graph, flash)
    with _FUSED_LOCK:  # the planner's threads fuse too
        if len(_FUSED) >= _FUSED_KEPT:
            del _FUSED[next(iter(_FUSED))]
        _FUSED[key] = (graph, fusion)
    return fusion


def fuse(graph: Graph, flash: bool) -> Fusion:
    """The fused-kernel view of `graph`; `flash`: attention kernels are fused (flash attention)."""
    passes = [training_pass(n) for n in graph.nodes]
    attention = frozenset(n.id for n in graph.nodes if flash and is_attention(n))
    written, views = _written(graph, passes, attention)
    memory = written | views
    region = _regions(graph, passes, written, memory, attention)
    reads = _reads(graph, passes, memory, views, attention, region)
    kept, by_attention = _kept(graph, passes, memory, attention)
    free = frozenset(n.id for n in graph.nodes if n.attr("kernel") == BOUNDARY)
    return Fusion(frozenset(written), reads, attention, free, frozenset(kept), frozenset(by_attention))


def _written(graph: Graph, passes: list[int], attention: frozenset[int]) -> tuple[set[int], set[int]]:
    """(values written to memory, views: layout ops over values in memory, which read them in place)."""
    outputs = set(graph.outputs) | {u for _, u in graph.aliases}
    written: set[int] = set()
    views: set[int] = set()
    for node in graph.nodes:
        if node.kind in GENERATED:
            continue
        if node.id in attention:
            if _leaves_attention(graph, node, attention, passes):
                written.add(node.id)
        elif (node.kind in VIEWS and node.id not in outputs and node.operands[0] in written | views
              and passes[node.operands[0]] == passes[node.id]):
            views.add(node.id)
        elif node.kind not in FUSIBLE or (node.id in outputs or node.attr("accumulated") or node.attr("stored")
              or node.attr("saved")
              or any(_reads_as_kernel(graph[u], attention) or passes[u] > max(passes[node.id], BACKWARD)
                     for u in graph.users(node.id))):
            written.add(node.id)
    return written, views


def _reads_as_kernel(user: Node, attention: frozenset[int]) -> bool:
    """A kernel that reads its operands from memory: not a fused element-wise op or reduction."""
    return user.id in attention or user.kind not in FUSIBLE | GENERATED | INPUT_FUSED


def _leaves_attention(graph: Graph, node: Node, attention: frozenset[int], passes: list[int]) -> bool:
    """An attention-kernel value that is written: its result (read outside the kernel) or, in
    the forward pass, a row statistic (a reduction) its backward reads."""
    users = graph.users(node.id)
    if any(u not in attention for u in users) or node.id in graph.outputs:
        return True
    if node.kind is not OpKind.REDUCE or passes[node.id] != FORWARD:
        return False
    spread = [w for u in users if graph[u].kind is OpKind.BROADCAST for w in graph.users(u)]
    return any(passes[u] == BACKWARD for u in (*users, *spread))


def _reads(graph: Graph, passes: list[int], memory: set[int], views: set[int], attention: frozenset[int],
           region: list[int]) -> tuple[tuple[tuple[int, float], ...], ...]:
    """Per node, (operand position, share of its bytes) read from memory, once per fused region
    (a view reads nothing: its readers read it in place)."""
    seen: set[tuple[int, object]] = set()
    reads: list[tuple[tuple[int, float], ...]] = []
    for node in graph.nodes:
        positions = []
        if node.id not in attention | views and (node.kind in FUSIBLE or node.kind in INPUT_FUSED):
            for position, operand in enumerate(node.operands):
                if graph[operand].kind in GENERATED:
                    continue
                in_region = passes[operand] == passes[node.id] and region[operand] == region[node.id]
                if in_region or (operand not in memory and passes[operand] == passes[node.id]):
                    continue
                if operand in memory:
                    source, share = frozenset((operand,)), 1.0
                else:  # a forward value the backward recomputes: read as the values it comes from,
                    # once for every value recomputed from them in the region
                    frontier = frozenset(_kept_for(graph, operand, memory, attention))
                    source, share = frontier, sum(graph[v].nbytes for v in frontier) / max(graph[operand].nbytes, 1)
                if share > 0 and (region[node.id], source) not in seen:
                    seen.add((region[node.id], source))
                    positions.append((position, share))
        reads.append(tuple(positions))
    return tuple(reads)


def _regions(graph: Graph, passes: list[int], written: set[int], memory: set[int],
             attention: frozenset[int]) -> list[int]:
    """Union-find over fusible nodes joined through values that are not in memory, through
    further outputs of one kernel (multi-output fusion) and through row reductions (a norm or a
    softmax reduces a row and uses the result in one pass over it)."""
    parent = list(range(len(graph)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for node in graph.nodes:
        if node.id in attention or not (node.kind in FUSIBLE or node.kind in INPUT_FUSED):
            continue
        for operand in node.operands:
            producer = graph[operand]
            if operand in attention or passes[operand] != passes[node.id]:
                continue
            fused = producer.kind in FUSIBLE and operand not in memory - written and _fuses_on(graph, operand, written)
            # A reduction is also a further output of the kernel making its operand (a bias
            # gradient summed as the gradient is written).
            side_output = node.kind in INPUT_FUSED and producer.kind in FUSIBLE and operand not in memory - written
            if fused or side_output or producer.kind is OpKind.REDUCE:
                parent[find(operand)] = find(node.id)
    return [find(n) for n in range(len(graph))]


def _fuses_on(graph: Graph, value: int, written: set[int]) -> bool:
    """Whether consumers of `value` in its pass take it from the kernel that makes it: a value
    that is not written, or one written as a further output of that kernel (multi-output fusion:
    an optimizer's new moments feed its weight update); a kernel boundary (a value a GEMM reads,
    a `stored` residual-stream value) is read back from memory."""
    if value not in written:
        return True
    node = graph[value]
    return not node.attr("stored") and not any(_reads_as_kernel(graph[u], frozenset()) for u in graph.users(value))


def _kept(graph: Graph, passes: list[int], memory: set[int], attention: frozenset[int]) -> tuple[set[int], set[int]]:
    """Forward values the backward pass reads from memory, and those only attention kernels read."""
    kept: dict[int, set[int]] = {}  # value -> the backward readers it is kept for
    for node in graph.nodes:
        if passes[node.id] != BACKWARD:
            continue
        for operand in node.operands:
            if passes[operand] != FORWARD or graph[operand].kind in GENERATED:
                continue
            for value in _kept_for(graph, operand, memory, attention):
                kept.setdefault(value, set()).add(node.id)
    marked = {n.id for n in graph.nodes if is_attention(n)}
    only_attention = {v for v, readers in kept.items() if readers <= marked and v in marked}
    return set(kept), only_attention


def _kept_for(graph: Graph, value: int, memory: set[int], attention: frozenset[int]) -> set[int]:
    """The forward values in memory a backward read of `value` needs: the value itself when it is
    in memory, a fused softmax's output for a value inside it, else the frontier it is
    recomputed from."""
    if value in memory:
        return {value}
    found: set[int] = set()
    stack = [value]
    while stack:
        current = graph[stack.pop()]
        for operand in current.operands:
            producer = graph[operand]
            if producer.kind in GENERATED or training_pass(producer) != training_pass(current):
                continue
            if operand in memory:
                found.add(operand)
            else:
                stack.append(operand)
    if any(graph[v].kind is not OpKind.REDUCE for v in found) and is_attention(graph[value]) and value not in attention:
        return _softmax_output(graph, value, memory)
    # Empty for a value made of constants alone (recomputed for free); row statistics for one
    # made of reductions alone.
    return found


def _softmax_output(graph: Graph, value: int, memory: set[int]) -> set[int]:
    """The values in memory of the attention kernel `value` belongs to that a later product
    reads: the probabilities (an unfused attention's softmax keeps only its output)."""
    found: set[int] = set()
    stack, seen = [value], {value}
    while stack:
        current = stack.pop()
        for user in graph.users(current):
            node = graph[user]
            if user in seen or training_pass(node) != training_pass(graph[value]) or not is_attention(node):
                continue
            seen.add(user)
            if user in memory and node.kind is not OpKind.REDUCE:
                found.add(user)
            elif user not in memory:
                stack.append(user)
    return found
