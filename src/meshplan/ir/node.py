"""One operator of the IR: its kind, operands, output shape and dtype, and attributes."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from meshplan.ir.dtypes import DType


class OpKind(enum.Enum):
    """Operator families; the sharding rules are registered per kind."""

    PARAMETER = "parameter"
    CONSTANT = "constant"
    IOTA = "iota"
    DOT = "dot"
    CONV = "conv"  # convolution, any rank (attrs: lhs/rhs/out_spec dims, strides, padding, dilations, groups)
    ELEMENTWISE = "elementwise"  # unary, binary, ternary, compare, select, convert (attr "op")
    BROADCAST = "broadcast"
    RESHAPE = "reshape"
    TRANSPOSE = "transpose"
    REDUCE = "reduce"
    SLICE = "slice"
    CONCATENATE = "concatenate"
    GATHER = "gather"  # entries along one dim picked by indices, with batch dims (embedding, label pick)
    DYNAMIC_SLICE = "dynamic_slice"
    SCATTER_ADD = "scatter_add"  # gather's transpose: updates added into zeros at indices
    DYNAMIC_UPDATE_SLICE = "dynamic_update_slice"  # a window overwritten at run-time starts (KV caches)
    CUMULATIVE = "cumulative"  # running sum/prod/max/min/logsumexp along one dim (attr "op")
    SORT = "sort"  # one result of a (multi-operand) sort along one dim (attr "output")
    TOP_K = "top_k"  # the k largest entries of the last dim: values (output 0) or indices (1)
    REDUCE_WINDOW = "reduce_window"  # sum/max/min over sliding windows (pooling; attr "op")
    SELECT_AND_SCATTER_ADD = "select_and_scatter_add"  # max pooling's gradient: each window's value added at its max
    REVERSE = "reverse"  # entries of some dims in reverse order (a kernel flipped for a conv's input gradient)
    ARG_REDUCE = "arg_reduce"  # argmax/argmin along one dim (attr "op")
    RANDOM = "random"  # random bits and key handling (attr "op": random_bits, rng_bit_generator, ...)
    OPAQUE = "opaque"


@dataclass(frozen=True, slots=True)
class Node:
    """An operator producing one tensor.

    Attributes:
        id: position in the graph's topological order.
        kind: operator family.
        operands: ids of the producing nodes, in operand order.
        shape: output shape.
        dtype: output element type.
        attrs: kind-specific attributes as sorted (name, value) pairs, values hashable.
        name: a readable name ("w1", "layer3.attn.q"), unique in the graph.
        source: where it came from (layer name, jaxpr equation, source line) for reports.
        layer: index of the repeated layer the node belongs to, or None.
    """

    id: int
    kind: OpKind
    operands: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: DType
    attrs: tuple[tuple[str, Any], ...] = ()
    name: str = ""
    source: str = ""
    layer: int | None = None
    _attr_map: dict[str, Any] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_attr_map", dict(self.attrs))

    def attr(self, key: str, default: Any = None) -> Any:
        """The attribute `key`, or `default` when the node has none."""
        return self._attr_map.get(key, default)

    @property
    def op(self) -> str:
        """The sub-operation: "add", "exp", "sum" …; the kind's name when there is none."""
        return self._attr_map.get("op", self.kind.value)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def label(self) -> str:
        return self.name or f"%{self.id}"


def freeze_attrs(attrs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Sorted, hashable attribute pairs (lists become tuples)."""
    frozen = []
    for key, value in sorted(attrs.items()):
        if isinstance(value, list):
            value = tuple(value)
        frozen.append((key, value))
    return tuple(frozen)
