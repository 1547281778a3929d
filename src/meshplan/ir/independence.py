"""Do positions along a dim stay apart through a program? The proof behind the batch dim.

Input: a Graph and source dims (node, dim), e.g. the rows of the inputs x and y. Output: the
first operation that mixes positions along them, or None, which proves that every value the
dims reach is computed at position i from position i of the sources only, until sums over
the dim end them (a loss's mean, a weight's gradient). A batch of independent examples has
this property; the sequence dim of a transformer does not (attention mixes it).

The dims are followed forward in topological order (one pass), each value keeping every dim
that carries the sources. Mixing is:

- one value carrying the dims twice (x @ x.T, attention scores, a [seq, seq] mask input);
- an op that moves, selects or orders positions along a carried dim: a slice, a
  concatenation, a window write, a cumulative op, a sort, top_k, a gather that indexes
  along it, a reshape that splits it or merges it as a minor part, an opaque or random op;
- a reduction along it other than a sum (max, min, prod, argmax), or a sum whose result
  still carries the dims elsewhere (positions summed into positions);
- a value computed from a sum over the dims meeting the dims again (softmax over the batch,
  batch norm, a second pass with weights updated from this batch's gradient). One form is
  allowed: a scalar so computed scaling them (multiply or divide), which is what a loss
  normalised by a count of tokens (`sum(l * w) / sum(w)`) and its gradient do.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from meshplan.ir.dimflow import reshape_groups
from meshplan.ir.graph import Graph
from meshplan.ir.node import Node, OpKind
from meshplan.ir.windows import SUMMED, ConvDims, conv_output_dim, windowed_dims


@dataclass(frozen=True, slots=True)
class Mixing:
    """Where positions along the dims mix: the node and how (e.g. "carries it on dims 2 and 3")."""

    node: int
    why: str

    def describe(self, graph: Graph) -> str:
        """E.g. "a dot f32[8, 4, 16, 16] (%412) carries it on dims 2 and 3"."""
        return f"{_op_text(graph[self.node])} {self.why}"


class _Taint(enum.Enum):
    """A value that does not carry the dims but was computed from a sum over them."""

    SCALE = "scale"  # a scalar, or a scalar broadcast or multiplied by values free of the dims
    FULL = "full"


_SUM = "sum"  # _follow's answer for a dim summed away
_OPAQUE = "reads it, and meshplan cannot see inside"
_MOVES_ALONG = {OpKind.CUMULATIVE: "runs a cumulative op along it", OpKind.SORT: "sorts along it",
                OpKind.CONCATENATE: "concatenates along it"}
_SCALING_OPS = frozenset({"mul", "div"})
_SCALE_KEEPING = frozenset({"mul", "div", "neg", "convert"})


def find_mixing(graph: Graph, sources: Iterable[tuple[int, int]]) -> Mixing | None:
    """The first op that mixes positions along the source dims, or None (they stay independent)."""
    carried: dict[int, dict[int, int]] = {}  # node -> {dim carrying the sources: their extent}
    for n, d in sources:
        if 0 <= d < graph[n].rank:
            carried.setdefault(n, {})[d] = graph[n].shape[d]
    for n, dims in carried.items():
        if len(dims) > 1:
            return Mixing(n, f"holds it on dims {' and '.join(map(str, sorted(dims)))}")
    tainted: dict[int, _Taint] = {}
    for node in graph.nodes:
        if node.id in carried:
            continue
        fed = [(k, o) for k, o in enumerate(node.operands) if o in carried]
        marked = [o for o in node.operands if o in tainted]
        if not fed:
            if marked:
                tainted[node.id] = _taint(node, [tainted[o] for o in marked])
            continue
        dims, mixing = _carry(graph, node, fed, carried)
        if mixing is None and marked and not _scales(node, [tainted[o] for o in marked]):
            source = graph[marked[0]]
            mixing = Mixing(node.id, f"combines it with {_op_text(source)}, computed from a sum over it")
        if mixing is not None:
            return mixing
        if dims:
            carried[node.id] = dims
        else:
            tainted[node.id] = _Taint.SCALE if node.size == 1 else _Taint.FULL
    return None


def _carry(graph: Graph, node: Node, fed: list[tuple[int, int]],
           carried: dict[int, dict[int, int]]) -> tuple[dict[int, int], Mixing | None]:
    """The dims of `node` carrying the sources (with their extents), or the mixing it does."""
    out: dict[int, int] = {}
    summed = False
    for k, o in fed:
        for d, extent in carried[o].items():
            result = _follow(graph, node, k, d, extent)
            if result == _SUM:
                summed = True
            elif isinstance(result, str):
                return out, Mixing(node.id, result)
            else:
                out[result] = extent
    if len(out) > 1:
        return out, Mixing(node.id, f"holds it on dims {' and '.join(map(str, sorted(out)))}")
    if summed and out:
        return out, Mixing(node.id, f"sums positions along it into dim {next(iter(out))}, which holds it too")
    return out, None


def _follow(graph: Graph, node: Node, position: int, dim: int, extent: int) -> int | str:
    """Where dim `dim` of operand `position` goes in `node`: an output dim, _SUM, or why it mixes."""
    rule = _RULES.get(node.kind)
    return _OPAQUE if rule is None else rule(graph, node, position, dim, extent)


def _elementwise(graph: Graph, node: Node, position: int, dim: int, extent: int) -> int | str:
    return dim


def _transposed(graph: Graph, node: Node, position: int, dim: int, extent: int) -> int | str:
    return node.attr("perm").index(dim)


def _broadcast(graph: Graph, node: Node, position: int, dim: int, extent: int) -> int | str:
    return node.attr("dims")[dim]


def _reduced(graph: Graph, node: Node, position: int, dim: int, extent: int) -> int | str:
    dims = node.attr("dims")
    if dim in dims:
        return _SUM if node.op == "sum" else f"takes the {node.op} over it"
    return dim - sum(d < dim for d in dims)


def _same_positions(graph: Graph, node: Node, position: int, dim: int, extent: int) -> int | str:
    """Slices, window reads and writes, concatenations, cumulative ops and sorts along other dims:
    the dim keeps its positions when the op leaves its extent whole."""
    operand = graph[node.operands[position]]
    if node.kind in _MOVES_ALONG and node.attr("dim") == dim:
        return _MOVES_ALONG[node.kind]
    if operand.rank != node.rank:
        return _OPAQUE
    if operand.shape[dim] != node.shape[dim]:
        return "writes a window along it" if node.kind is OpKind.DYNAMIC_UPDATE_SLICE else "keeps part of it"
    return dim


def _dot(graph: Graph, node: Node, position: int, dim: int, extent: int) -> int | str:
    """Contracted dims are summed; output dims are batch dims, then lhs free dims, then rhs free dims."""
    side = "lhs" if position == 0 else "rhs"
    batch, contracting = node.attr(f"{side}_batch"), node.attr(f"{side}_contracting")
    if dim in contracting:
        return _SUM
    if dim in batch:
        return batch.index(dim)
    free = [d for d in range(graph[node.operands[position]].rank) if d not in batch + contracting]
    offset = len(batch)
    if position == 1:
        lhs = graph[node.operands[0]]
        offset += lhs.rank - len(node.attr("lhs_batch")) - len(node.attr("lhs_contracting"))
    return offset + free.index(dim)


def _reshaped(graph: Graph, node: Node, position: int, dim: int, extent: int) -> int | str:
    """A reshape keeps the positions when the dim is the major part of its group and the group's
    first output dim holds all of them (its size a multiple of `extent`)."""
    in_shape, out_shape = graph[node.operands[position]].shape, node.shape
    for in_dims, out_dims in reshape_groups(in_shape, out_shape):
        if dim not in in_dims:
            continue
        major_in = next(d for d in in_dims if in_shape[d] > 1)
        major_out = next((d for d in out_dims if out_shape[d] > 1), None)
        if major_in != dim:
            return "merges it into a dim as its minor part (a reshape)"
        if major_out is None or out_shape[major_out] % extent:
            return "splits it over several dims (a reshape)"
        return major_out
    return _OPAQUE


def _gathered(graph: Graph, node: Node, position: int, dim: int, extent: int) -> int | str:
    """gather's output is operand[:axis] + indices[batch_dims:] + operand[axis + 1:]."""
    axis, batch_dims = node.attr("axis"), node.attr("batch_dims")
    if position == 1:
        return dim if dim < batch_dims else axis + dim - batch_dims
    if dim == axis:
        return "indexes along it (a gather)"
    picked = graph[node.operands[1]].rank - batch_dims
    return dim if dim < axis else dim + picked - 1


def _scattered(graph: Graph, node: Node, position: int, dim: int, extent: int) -> int | str:
    """scatter_add(indices, updates): updates along picked index dims are summed into rows."""
    axis, batch_dims = node.attr("axis"), node.attr("batch_dims")
    picked = graph[node.operands[0]].rank - batch_dims
    if position == 0:
        return dim if dim < batch_dims else _SUM
    if dim < axis:
        return dim
    return _SUM if dim < axis + picked else dim - picked + 1


def _ordered(graph: Graph, node: Node, position: int, dim: int, extent: int) -> int | str:
    """argmax/argmin drop their dim, top_k shortens its (the last unless given); others stay."""
    along = node.attr("dim")
    along = graph[node.operands[position]].rank - 1 if along is None else along
    if along == dim:
        return f"takes the {node.op} along it"
    return dim - (along < dim) if node.kind is OpKind.ARG_REDUCE else dim


def _convolved(graph: Graph, node: Node, position: int, dim: int, extent: int) -> int | str:
    out = conv_output_dim(node, position, dim, graph[node.operands[1]].shape)
    if out is None:
        return "slides a convolution window along it" if dim in ConvDims.of(node).lhs[2:] else "groups it"
    return _SUM if out == SUMMED else out


def _pooled(graph: Graph, node: Node, position: int, dim: int, extent: int) -> int | str:
    return f"slides a window ({node.op}) along it" if dim in windowed_dims(node) else dim


def _reversed(graph: Graph, node: Node, position: int, dim: int, extent: int) -> int | str:
    return "reverses it" if dim in node.attr("dims") else dim


# Per op kind: where a carried dim goes (kinds without a rule, opaque and random ops, mix it).
_RULES: dict[OpKind, Callable[[Graph, Node, int, int, int], int | str]] = {
    OpKind.ELEMENTWISE: _elementwise, OpKind.TRANSPOSE: _transposed, OpKind.BROADCAST: _broadcast,
    OpKind.REDUCE: _reduced, OpKind.DOT: _dot, OpKind.RESHAPE: _reshaped, OpKind.GATHER: _gathered,
    OpKind.SCATTER_ADD: _scattered, OpKind.ARG_REDUCE: _ordered, OpKind.TOP_K: _ordered,
    OpKind.CONV: _convolved, OpKind.REDUCE_WINDOW: _pooled, OpKind.SELECT_AND_SCATTER_ADD: _pooled,
    OpKind.REVERSE: _reversed,
    **dict.fromkeys((OpKind.SLICE, OpKind.DYNAMIC_SLICE, OpKind.DYNAMIC_UPDATE_SLICE, OpKind.CONCATENATE,
                     OpKind.CUMULATIVE, OpKind.SORT), _same_positions),
}


def _taint(node: Node, marks: list[_Taint]) -> _Taint:
    """The taint of a value free of the dims computed from tainted ones."""
    if node.size == 1:
        return _Taint.SCALE
    keeps = node.kind in (OpKind.BROADCAST, OpKind.RESHAPE, OpKind.TRANSPOSE) or (
        node.kind is OpKind.ELEMENTWISE and node.op in _SCALE_KEEPING)
    return _Taint.SCALE if keeps and all(m is _Taint.SCALE for m in marks) else _Taint.FULL


def _scales(node: Node, marks: list[_Taint]) -> bool:
    """Whether `node` only scales values along the dims by scalars computed from sums over them."""
    return node.kind is OpKind.ELEMENTWISE and node.op in _SCALING_OPS and all(m is _Taint.SCALE for m in marks)


def _op_text(node: Node) -> str:
    shape = ", ".join(map(str, node.shape))
    op = node.kind.value if node.op == node.kind.value else f"{node.kind.value} {node.op}"
    return f"{op} {node.dtype}[{shape}] ({node.label})"
