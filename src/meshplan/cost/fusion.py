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
  gradient or a `stored` residual-stream value;
- a fused region (element-wise ops joined through values that are not written) reads each
  written value it needs once;
- a backward kernel that needs a forward value that was never written recomputes it from the
  written values it came from (the frontier), which the forward pass therefore keeps; a fused
  softmax keeps its output instead (its backward needs only the probabilities);
- with fused (flash) attention, the score product, softmax and context product are one kernel:
  nothing inside is written but its result and its row statistics, and its backward
  recomputes the scores from the kept queries, keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.ir.graph import Graph
from meshplan.ir.node import Node, OpKind

FUSIBLE = frozenset({OpKind.ELEMENTWISE, OpKind.BROADCAST, OpKind.TRANSPOSE, OpKind.RESHAPE, OpKind.SLICE,
                     OpKind.CONCATENATE, OpKind.DYNAMIC_SLICE})
GENERATED = frozenset({OpKind.CONSTANT, OpKind.IOTA})  # computed inside the kernel that reads them
# Fused-kernel tags (GraphBuilder.kernel) of attention cores -> whether the kernel is causal.
ATTENTION_KERNELS = {"attention": False, "causal_attention": True}

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
        materialized: ids of values written to device memory (the others live in registers).
        reads: per node, the operand positions it reads from device memory (each fused region
            reads a value once: the first node of the region that needs it).
        attention: ids of the nodes of fused attention kernels (empty without flash).
        kept: forward values the backward pass reads from device memory (saved activations).
        kept_by_attention: the part of `kept` only the attention kernels read (dropped when the
            attention is recomputed: selective recomputation).
    """

    materialized: frozenset[int]
    reads: tuple[tuple[int, ...], ...]
    attention: frozenset[int]
    kept: frozenset[int]
    kept_by_attention: frozenset[int]

    def is_fused_attention(self, node_id: int) -> bool:
        return node_id in self.attention


def fuse(graph: Graph, flash: bool) -> Fusion:
    """The fused-kernel view of `graph`; `flash`: attention kernels are fused (flash attention)."""
    passes = [training_pass(n) for n in graph.nodes]
    attention = frozenset(n.id for n in graph.nodes if flash and is_attention(n))
    materialized = _materialized(graph, passes, attention)
    reads = _reads(graph, passes, materialized, attention)
    kept, by_attention = _kept(graph, passes, materialized, attention)
    return Fusion(frozenset(materialized), reads, attention, frozenset(kept), frozenset(by_attention))


def _materialized(graph: Graph, passes: list[int], attention: frozenset[int]) -> set[int]:
    outputs = set(graph.outputs) | {u for _, u in graph.aliases}
    written = set()
    for node in graph.nodes:
        if node.kind in GENERATED:
            continue
        if node.id in attention:
            if _leaves_attention(graph, node, attention, passes):
                written.add(node.id)
        elif node.kind not in FUSIBLE or (node.id in outputs or node.attr("accumulated") or node.attr("stored")
              or any(_reads_as_kernel(graph[u], attention) or passes[u] > max(passes[node.id], BACKWARD)
                     for u in graph.users(node.id))):
            written.add(node.id)
    return written


def _reads_as_kernel(user: Node, attention: frozenset[int]) -> bool:
    """A kernel that reads its operands from memory: not a fused element-wise op or reduction."""
    return user.id in attention or user.kind not in FUSIBLE | GENERATED | {OpKind.REDUCE}


def _leaves_attention(graph: Graph, node: Node, attention: frozenset[int], passes: list[int]) -> bool:
    """An attention-kernel value that is written: its result (read outside the kernel) or, in
    the forward pass, a row statistic (a reduction) its backward reads."""
    users = graph.users(node.id)
    if any(u not in attention for u in users) or node.id in graph.outputs:
        return True
    return node.kind is OpKind.REDUCE and passes[node.id] == FORWARD and any(passes[u] == BACKWARD for u in users)


def _reads(graph: Graph, passes: list[int], written: set[int],
           attention: frozenset[int]) -> tuple[tuple[int, ...], ...]:
    """Per node, operand positions read from memory, once per fused region."""
    region = _regions(graph, passes, written, attention)
    seen: set[tuple[int, int]] = set()
    reads: list[tuple[int, ...]] = []
    for node in graph.nodes:
        positions = []
        if node.id not in attention and (node.kind in FUSIBLE or node.kind is OpKind.REDUCE):
            for position, operand in enumerate(node.operands):
                producer = graph[operand]
                if producer.kind in GENERATED:
                    continue
                recomputed = operand not in written and passes[operand] != passes[node.id]
                in_region = passes[operand] == passes[node.id] and region[operand] == region[node.id]
                if (operand in written or recomputed) and not in_region and (region[node.id], operand) not in seen:
                    seen.add((region[node.id], operand))
                    positions.append(position)
        reads.append(tuple(positions))
    return tuple(reads)


def _regions(graph: Graph, passes: list[int], written: set[int], attention: frozenset[int]) -> list[int]:
    """Union-find over fusible nodes joined through values that are not written."""
    parent = list(range(len(graph)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for node in graph.nodes:
        if node.id in attention or not (node.kind in FUSIBLE or node.kind is OpKind.REDUCE):
            continue
        for operand in node.operands:
            producer = graph[operand]
            if (producer.kind in FUSIBLE and _fuses_on(graph, operand, written) and operand not in attention
                    and passes[operand] == passes[node.id]):
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


def _kept(graph: Graph, passes: list[int], written: set[int], attention: frozenset[int]) -> tuple[set[int], set[int]]:
    """Forward values the backward pass reads from memory, and those only attention kernels read."""
    kept: dict[int, set[int]] = {}  # value -> the backward readers it is kept for
    for node in graph.nodes:
        if passes[node.id] != BACKWARD:
            continue
        for operand in node.operands:
            if passes[operand] != FORWARD or graph[operand].kind in GENERATED:
                continue
            for value in _kept_for(graph, operand, written, attention):
                kept.setdefault(value, set()).add(node.id)
    marked = {n.id for n in graph.nodes if is_attention(n)}
    only_attention = {v for v, readers in kept.items() if readers <= marked and v in marked}
    return set(kept), only_attention


def _kept_for(graph: Graph, value: int, written: set[int], attention: frozenset[int]) -> set[int]:
    """The written forward values a backward read of `value` needs: the value itself when it is
    written, a fused softmax's output for a value inside it, else the frontier it is recomputed
    from."""
    if value in written:
        return {value}
    node = graph[value]
    if is_attention(node) and value not in attention:
        return _softmax_output(graph, value, written)
    found: set[int] = set()
    stack = [value]
    while stack:
        current = graph[stack.pop()]
        for operand in current.operands:
            producer = graph[operand]
            if producer.kind in GENERATED or passes_differ(producer, current):
                continue
            if operand in written:
                found.add(operand)
            else:
                stack.append(operand)
    return found


def passes_differ(a: Node, b: Node) -> bool:
    return training_pass(a) != training_pass(b)


def _softmax_output(graph: Graph, value: int, written: set[int]) -> set[int]:
    """The written values of the attention kernel `value` belongs to that a later product reads:
    the probabilities (an unfused attention's softmax keeps only its output)."""
    found: set[int] = set()
    stack, seen = [value], {value}
    while stack:
        current = stack.pop()
        for user in graph.users(current):
            node = graph[user]
            if user in seen or training_pass(node) != training_pass(graph[value]) or not is_attention(node):
                continue
            seen.add(user)
            if user in written and node.kind is not OpKind.REDUCE:
                found.add(user)
            elif user not in written:
                stack.append(user)
    return found
