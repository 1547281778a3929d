"""GraphBuilder: build graphs by hand, with shapes inferred and checked at every call."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

from meshplan.errors import GraphError
from meshplan.ir.dtypes import DType, as_dtype
from meshplan.ir.graph import Graph, check_graph
from meshplan.ir.node import Node, OpKind, freeze_attrs
from meshplan.ir.windows import conv_dims, dilated, positive, window_output_size, window_padding

UNARY_OPS = frozenset({
    "neg", "exp", "log", "rsqrt", "sqrt", "tanh", "logistic", "abs", "sign", "erf", "sin",
    "cos", "copy", "floor", "ceil", "not", "square", "log1p", "expm1", "is_finite", "erf_inv",
    "round", "tan", "bitcast",
})
BINARY_OPS = frozenset({"add", "sub", "mul", "div", "max", "min", "pow", "and", "or", "rem", "xor", "atan2",
                        "shift_left", "shift_right_logical", "shift_right_arithmetic"})
CUMULATIVE_OPS = frozenset({"sum", "prod", "max", "min", "logsumexp"})
COMPARE_DIRECTIONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
REDUCE_KINDS = frozenset({"sum", "max", "min", "prod"})
WINDOW_REDUCE_KINDS = frozenset({"sum", "max", "min"})
_INTEGER_DTYPES = frozenset({DType.I64, DType.I32, DType.I8, DType.U8})


class GraphBuilder:
    """Builds a Graph one operator at a time; every method returns the new node's id.

    Example:
        b = GraphBuilder("mlp")
        x = b.parameter((1024, 128), name="x")
        w = b.parameter((128, 128), name="w")
        y = b.dot(x, w, (1,), (0,))
        b.outputs(y)
        graph = b.build()
    """

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self._nodes: list[Node] = []
        self._outputs: list[int] = []
        self._aliases: list[tuple[int, int]] = []
        self._force_replicated: list[int] = []
        self._layer: int | None = None
        self._source = ""
        self._kernel: str | None = None

    # -- context ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def layer(self, index: int | None, source: str = "") -> Iterator[None]:
        """Tag the nodes built inside the block as belonging to repeated layer `index`.

        `index=None` builds untagged nodes (used to copy a forward node's tag, which may be none).
        """
        saved = self._layer, self._source
        default = f"layer{index}" if index is not None else ""
        self._layer, self._source = index, source or default
        try:
            yield
        finally:
            self._layer, self._source = saved

    @contextlib.contextmanager
    def kernel(self, name: str | None) -> Iterator[None]:
        """Tag the nodes built inside as parts of one fused kernel `name` (attribute "kernel",
        e.g. "attention": the score product, softmax and context product that fused attention
        runs as one kernel); cost models price such a group as that kernel. None: no tag."""
        saved = self._kernel
        self._kernel = name
        try:
            yield
        finally:
            self._kernel = saved

    # -- leaves ------------------------------------------------------------------------------

    def parameter(self, shape: Sequence[int], dtype: DType | str = DType.F32, name: str = "") -> int:
        return self._add(OpKind.PARAMETER, (), shape, dtype, {}, name)

    def constant(self, shape: Sequence[int] = (), dtype: DType | str = DType.F32,
                 value: float | None = None, name: str = "") -> int:
        return self._add(OpKind.CONSTANT, (), shape, dtype, {"value": value}, name)

    def full(self, shape: Sequence[int], value: float, dtype: DType | str = DType.F32, name: str = "") -> int:
        """`value` everywhere: a scalar constant broadcast to `shape` (broadcasts take no memory)."""
        if not tuple(shape):
            return self.constant((), dtype, value, name)
        return self.broadcast(self.constant((), dtype, value), shape, (), name)

    def zeros(self, shape: Sequence[int], dtype: DType | str = DType.F32, name: str = "") -> int:
        """Zeros of `shape`: a broadcast scalar constant."""
        return self.full(shape, 0.0, dtype, name)

    def iota(self, shape: Sequence[int], dim: int, dtype: DType | str = DType.I32, name: str = "") -> int:
        self._check_dims("iota", (dim,), len(shape))
        return self._add(OpKind.IOTA, (), shape, dtype, {"dim": dim}, name)

    # -- contraction -------------------------------------------------------------------------

    def dot(self, lhs: int, rhs: int, lhs_contracting: Sequence[int], rhs_contracting: Sequence[int],
            lhs_batch: Sequence[int] = (), rhs_batch: Sequence[int] = (), name: str = "",
            dtype: DType | str | None = None) -> int:
        """A dot_general; output dims are batch dims, then lhs free dims, then rhs free dims."""
        a, b = self._node(lhs), self._node(rhs)
        lc, rc, lb, rb = map(tuple, (lhs_contracting, rhs_contracting, lhs_batch, rhs_batch))
        self._check_dims("dot lhs", lc + lb, a.rank)
        self._check_dims("dot rhs", rc + rb, b.rank)
        if len(lc) != len(rc) or len(lb) != len(rb):
            raise GraphError(
                f"dot {name or ''}: {len(lc)} lhs vs {len(rc)} rhs contracting dims and "
                f"{len(lb)} vs {len(rb)} batch dims; pass the same number on both sides"
            )
        for what, ldims, rdims in (("contracting", lc, rc), ("batch", lb, rb)):
            for ld, rd in zip(ldims, rdims, strict=True):
                if a.shape[ld] != b.shape[rd]:
                    raise GraphError(
                        f"dot {name or ''}: {what} dim {ld} of {a.label} {a.shape} has size "
                        f"{a.shape[ld]} but dim {rd} of {b.label} {b.shape} has size {b.shape[rd]}"
                    )
        lfree = [d for d in range(a.rank) if d not in lc + lb]
        rfree = [d for d in range(b.rank) if d not in rc + rb]
        shape = [a.shape[d] for d in lb] + [a.shape[d] for d in lfree] + [b.shape[d] for d in rfree]
        attrs = {"lhs_contracting": lc, "rhs_contracting": rc, "lhs_batch": lb, "rhs_batch": rb}
        return self._add(OpKind.DOT, (lhs, rhs), shape, dtype or a.dtype, attrs, name)

    def matmul(self, lhs: int, rhs: int, name: str = "") -> int:
        """lhs[..., k] @ rhs[k, n]: contract the last lhs dim with the first rhs dim."""
        return self.dot(lhs, rhs, (self._node(lhs).rank - 1,), (0,), name=name)

    def conv(self, lhs: int, rhs: int, window_strides: Sequence[int] | None = None,
             padding: str | Sequence[Sequence[int]] | None = None, lhs_dilation: Sequence[int] | None = None,
             rhs_dilation: Sequence[int] | None = None, dimension_numbers: Sequence | None = None,
             feature_group_count: int = 1, batch_group_count: int = 1, name: str = "",
             dtype: DType | str | None = None) -> int:
        """A convolution with XLA's semantics (`jax.lax.conv_general_dilated`), any spatial rank.

        Args:
            lhs: the input, e.g. images [batch, height, width, channels].
            rhs: the kernel, e.g. [height, width, in channels, out channels].
            window_strides: per spatial dim (default 1).
            padding: (lo, hi) per spatial dim (negative crops), or "SAME" / "VALID" (default: none).
            lhs_dilation: holes between input entries (a transposed convolution); default 1.
            rhs_dilation: holes between kernel taps (an atrous convolution); default 1.
            dimension_numbers: which dim is which: None (NCHW, OIHW, NCHW), strings such as
                ("NHWC", "HWIO", "NHWC") (Flax's layout), or three index tuples in role order:
                lhs (batch, feature, spatial...), rhs (out feature, in feature, spatial...),
                out (batch, feature, spatial...), as JAX's ConvDimensionNumbers.
            feature_group_count: input features split into groups, each convolved with its share
                of the output features (depthwise when it equals the input features).
            batch_group_count: the batch split into groups, each with its share of the output
                features (how a grouped convolution's kernel gradient is formed).
            dtype: the result type (default: the input's).

        The node's attrs hold the normalized form: lhs_spec, rhs_spec, out_spec (dim indices in
        role order), window_strides, padding, lhs_dilation, rhs_dilation, feature_group_count,
        batch_group_count; `meshplan.ir.windows.ConvDims.of(node)` reads the dims back.
        """
        a, k = self._node(lhs), self._node(rhs)
        where = f"conv {name!r}" if name else "conv"
        if a.rank != k.rank or a.rank < 2:
            raise GraphError(f"{where}: input {a.label} {a.shape} and kernel {k.label} {k.shape} need the same "
                             "rank, at least 2 (batch and feature dims)")
        dims = conv_dims(dimension_numbers, a.rank)
        n = dims.spatial_rank
        strides = positive(window_strides, n, f"{where}: window_strides")
        lhs_dil = positive(lhs_dilation, n, f"{where}: lhs_dilation")
        rhs_dil = positive(rhs_dilation, n, f"{where}: rhs_dilation")
        sizes = [a.shape[d] for d in dims.lhs[2:]]
        windows = [k.shape[d] for d in dims.rhs[2:]]
        if isinstance(padding, str) and any(d > 1 for d in lhs_dil):
            raise GraphError(f"{where}: padding {padding!r} is undefined with lhs_dilation {lhs_dil} (as in "
                             "jax.lax); give (lo, hi) per spatial dim")
        pads = window_padding(padding, sizes, [dilated(w, r) for w, r in zip(windows, rhs_dil, strict=True)], strides)
        self._check_groups(where, a.shape[dims.lhs[0]], a.shape[dims.lhs[1]], k.shape[dims.rhs[0]],
                           k.shape[dims.rhs[1]], feature_group_count, batch_group_count)
        shape = [0] * a.rank
        shape[dims.out[0]] = a.shape[dims.lhs[0]] // batch_group_count
        shape[dims.out[1]] = k.shape[dims.rhs[0]]
        for i in range(n):
            shape[dims.out[2 + i]] = window_output_size(sizes[i], windows[i], strides[i], pads[i], lhs_dil[i],
                                                        rhs_dil[i])
        attrs = {"lhs_spec": dims.lhs, "rhs_spec": dims.rhs, "out_spec": dims.out, "window_strides": strides,
                 "padding": pads, "lhs_dilation": lhs_dil, "rhs_dilation": rhs_dil,
                 "feature_group_count": int(feature_group_count), "batch_group_count": int(batch_group_count)}
        return self._add(OpKind.CONV, (lhs, rhs), shape, dtype or a.dtype, attrs, name)

    @staticmethod
    def _check_groups(where: str, batch: int, features: int, out_features: int, in_features: int,
                      feature_groups: int, batch_groups: int) -> None:
        if feature_groups < 1 or batch_groups < 1 or (feature_groups > 1 and batch_groups > 1):
            raise GraphError(f"{where}: feature_group_count={feature_groups} and batch_group_count={batch_groups} "
                             "must be positive, and at most one of them above 1")
        if features != in_features * feature_groups or out_features % feature_groups:
            raise GraphError(f"{where}: the input has {features} features but the kernel takes {in_features} in "
                             f"{feature_groups} group(s) and makes {out_features}; input features must equal kernel "
                             "input features x feature_group_count, which must divide the output features")
        if batch % batch_groups or out_features % batch_groups:
            raise GraphError(f"{where}: batch_group_count={batch_groups} must divide the batch ({batch}) and the "
                             f"output features ({out_features})")

    # -- windows -----------------------------------------------------------------------------

    def reduce_window(self, x: int, op: str, window_dimensions: Sequence[int],
                      window_strides: Sequence[int] | None = None,
                      padding: str | Sequence[Sequence[int]] | None = None, base_dilation: Sequence[int] | None = None,
                      window_dilation: Sequence[int] | None = None, name: str = "") -> int:
        """`op` ("sum", "max", "min") over windows sliding along every dim (XLA's ReduceWindow).

        One window size, stride, (lo, hi) padding, base and window dilation per dim of `x`
        (defaults 1 and no padding; "SAME"/"VALID" padding as in `conv`); padding and the holes
        of a base dilation hold the op's identity (0, -inf, +inf). A dim with window 1 and
        stride 1 is left as it is (the batch and channel dims of a pooling).
        """
        node = self._node(x)
        where = f"reduce_window {name!r}" if name else "reduce_window"
        if op not in WINDOW_REDUCE_KINDS:
            raise GraphError(f"{where}: unknown op {op!r}; use one of {sorted(WINDOW_REDUCE_KINDS)}")
        window = positive(window_dimensions, node.rank, f"{where}: window_dimensions")
        strides = positive(window_strides, node.rank, f"{where}: window_strides")
        base = positive(base_dilation, node.rank, f"{where}: base_dilation")
        wdil = positive(window_dilation, node.rank, f"{where}: window_dilation")
        pads = window_padding(padding, node.shape, [dilated(w, r) for w, r in zip(window, wdil, strict=True)], strides)
        shape = [window_output_size(*args) for args in zip(node.shape, window, strides, pads, base, wdil, strict=True)]
        attrs = {"op": op, "window_dimensions": window, "window_strides": strides, "padding": pads,
                 "base_dilation": base, "window_dilation": wdil}
        return self._add(OpKind.REDUCE_WINDOW, (x,), shape, node.dtype, attrs, name)

    def max_pool(self, x: int, window_shape: Sequence[int], strides: Sequence[int] | None = None,
                 padding: str | Sequence[Sequence[int]] = "VALID", name: str = "") -> int:
        """Flax's `nn.max_pool` on [batch, spatial..., features]: a window max over the spatial dims."""
        return self.reduce_window(x, "max", *self._pool_window(x, window_shape, strides, padding), name=name)

    def avg_pool(self, x: int, window_shape: Sequence[int], strides: Sequence[int] | None = None,
                 padding: str | Sequence[Sequence[int]] = "VALID", name: str = "") -> int:
        """Flax's `nn.avg_pool` (padding counted): a window sum over the spatial dims over the window size."""
        total = self.reduce_window(x, "sum", *self._pool_window(x, window_shape, strides, padding))
        return self.div(total, self.full(self.shape(total), float(math.prod(window_shape)), self._node(x).dtype),
                        name=name)

    def _pool_window(self, x: int, window_shape: Sequence[int], strides: Sequence[int] | None,
                     padding: str | Sequence[Sequence[int]]) -> tuple:
        rank, n = self._node(x).rank, len(window_shape)
        if n != rank - 2:
            raise GraphError(f"pooling of {self._node(x).label} {self.shape(x)}: window {tuple(window_shape)} needs "
                             f"{rank - 2} entries (one per spatial dim of [batch, spatial..., features])")
        strides = tuple(strides) if strides is not None else (1,) * n
        if not isinstance(padding, str):
            padding = ((0, 0), *padding, (0, 0))
        return (1, *window_shape, 1), (1, *strides, 1), padding

    def select_and_scatter_add(self, source: int, operand: int, window_dimensions: Sequence[int],
                               window_strides: Sequence[int] | None = None,
                               padding: Sequence[Sequence[int]] | None = None, select: str = "ge",
                               name: str = "") -> int:
        """Zeros shaped like `operand` with each entry of `source` added where its window of
        `operand` holds its largest (`select="ge"`, the first on ties) or smallest ("le") value:
        the gradient of a window max (min) pooling, `source` being the pooled output's cotangent."""
        src, node = self._node(source), self._node(operand)
        where = f"select_and_scatter_add {name!r}" if name else "select_and_scatter_add"
        if select not in ("ge", "le"):
            raise GraphError(f"{where}: select {select!r} must be 'ge' (max) or 'le' (min)")
        window = positive(window_dimensions, node.rank, f"{where}: window_dimensions")
        strides = positive(window_strides, node.rank, f"{where}: window_strides")
        pads = window_padding(padding, node.shape, window, strides)
        if any(lo < 0 or hi < 0 for lo, hi in pads):
            raise GraphError(f"{where}: padding {pads} must not be negative")
        pooled = tuple(window_output_size(*args) for args in zip(node.shape, window, strides, pads, strict=True))
        if src.shape != pooled:
            raise GraphError(f"{where}: source {src.label} {src.shape} must have the pooled shape {pooled} of "
                             f"{node.label} {node.shape}")
        attrs = {"select": select, "window_dimensions": window, "window_strides": strides, "padding": pads}
        return self._add(OpKind.SELECT_AND_SCATTER_ADD, (source, operand), node.shape, src.dtype, attrs, name)

    def reverse(self, x: int, dims: Sequence[int], name: str = "") -> int:
        """`x` with the entries of `dims` in reverse order (`jax.lax.rev`)."""
        node, dims = self._node(x), tuple(sorted(int(d) for d in dims))
        self._check_dims("reverse", dims, node.rank)
        return self._add(OpKind.REVERSE, (x,), node.shape, node.dtype, {"dims": dims}, name)

    # -- elementwise -------------------------------------------------------------------------

    def unary(self, op: str, x: int, name: str = "", dtype: DType | str | None = None) -> int:
        """An elementwise op of one operand; `dtype` for ops whose result type differs (is_finite's
        pred, a bitcast to another type of the same width)."""
        if op not in UNARY_OPS:
            raise GraphError(f"unknown unary op {op!r}; use one of {sorted(UNARY_OPS)}")
        node = self._node(x)
        return self._add(OpKind.ELEMENTWISE, (x,), node.shape, dtype or node.dtype, {"op": op}, name)

    def binary(self, op: str, x: int, y: int, name: str = "") -> int:
        if op not in BINARY_OPS:
            raise GraphError(f"unknown binary op {op!r}; use one of {sorted(BINARY_OPS)}")
        shape = self._same_shape(op, (x, y))
        return self._add(OpKind.ELEMENTWISE, (x, y), shape, self._node(x).dtype, {"op": op}, name)

    def compare(self, x: int, y: int, direction: str = "lt", name: str = "") -> int:
        if direction not in COMPARE_DIRECTIONS:
            raise GraphError(f"unknown compare direction {direction!r}; use one of {sorted(COMPARE_DIRECTIONS)}")
        shape = self._same_shape("compare", (x, y))
        return self._add(OpKind.ELEMENTWISE, (x, y), shape, DType.PRED,
                         {"op": "compare", "direction": direction}, name)

    def select(self, pred: int, on_true: int, on_false: int, name: str = "") -> int:
        shape = self._same_shape("select", (pred, on_true, on_false))
        return self._add(OpKind.ELEMENTWISE, (pred, on_true, on_false), shape,
                         self._node(on_true).dtype, {"op": "select"}, name)

    def convert(self, x: int, dtype: DType | str, name: str = "") -> int:
        node = self._node(x)
        return self._add(OpKind.ELEMENTWISE, (x,), node.shape, dtype, {"op": "convert"}, name)

    def add(self, x: int, y: int, name: str = "") -> int:
        return self.binary("add", x, y, name)

    def sub(self, x: int, y: int, name: str = "") -> int:
        return self.binary("sub", x, y, name)

    def mul(self, x: int, y: int, name: str = "") -> int:
        return self.binary("mul", x, y, name)

    def div(self, x: int, y: int, name: str = "") -> int:
        return self.binary("div", x, y, name)

    def max(self, x: int, y: int, name: str = "") -> int:
        return self.binary("max", x, y, name)

    def exp(self, x: int, name: str = "") -> int:
        return self.unary("exp", x, name)

    def neg(self, x: int, name: str = "") -> int:
        return self.unary("neg", x, name)

    def rsqrt(self, x: int, name: str = "") -> int:
        return self.unary("rsqrt", x, name)

    def tanh(self, x: int, name: str = "") -> int:
        return self.unary("tanh", x, name)

    def logistic(self, x: int, name: str = "") -> int:
        return self.unary("logistic", x, name)

    # -- layout ------------------------------------------------------------------------------

    def broadcast(self, x: int, shape: Sequence[int], dims: Sequence[int], name: str = "") -> int:
        """Broadcast in dim: operand dim i becomes output dim dims[i]; other dims are new."""
        node, shape, dims = self._node(x), tuple(shape), tuple(dims)
        if len(dims) != node.rank:
            raise GraphError(f"broadcast of {node.label} {node.shape}: {len(dims)} dims given for rank {node.rank}")
        self._check_dims("broadcast", dims, len(shape))
        if list(dims) != sorted(dims):
            raise GraphError(f"broadcast of {node.label}: dims {dims} must be increasing")
        for i, d in enumerate(dims):
            if node.shape[i] not in (1, shape[d]):
                raise GraphError(
                    f"broadcast of {node.label} {node.shape} to {shape}: operand dim {i} "
                    f"(size {node.shape[i]}) cannot become output dim {d} (size {shape[d]})"
                )
        return self._add(OpKind.BROADCAST, (x,), shape, node.dtype, {"dims": dims}, name)

    def reshape(self, x: int, shape: Sequence[int], name: str = "") -> int:
        node = self._node(x)
        if math.prod(shape) != node.size:
            raise GraphError(
                f"reshape of {node.label} {node.shape} ({node.size} elements) to {tuple(shape)} "
                f"({math.prod(shape)} elements): element counts must match"
            )
        return self._add(OpKind.RESHAPE, (x,), shape, node.dtype, {}, name)

    def transpose(self, x: int, perm: Sequence[int], name: str = "") -> int:
        node, perm = self._node(x), tuple(perm)
        if sorted(perm) != list(range(node.rank)):
            raise GraphError(f"transpose of {node.label} {node.shape}: {perm} is not a permutation of its dims")
        shape = tuple(node.shape[p] for p in perm)
        return self._add(OpKind.TRANSPOSE, (x,), shape, node.dtype, {"perm": perm}, name)

    def reduce(self, x: int, dims: Sequence[int], kind: str = "sum", name: str = "") -> int:
        node, dims = self._node(x), tuple(sorted(dims))
        if kind not in REDUCE_KINDS:
            raise GraphError(f"unknown reduce kind {kind!r}; use one of {sorted(REDUCE_KINDS)}")
        self._check_dims("reduce", dims, node.rank)
        shape = tuple(s for d, s in enumerate(node.shape) if d not in dims)
        return self._add(OpKind.REDUCE, (x,), shape, node.dtype, {"dims": dims, "op": kind}, name)

    def slice(self, x: int, start: Sequence[int], limit: Sequence[int], name: str = "") -> int:
        node = self._node(x)
        if len(start) != node.rank or len(limit) != node.rank:
            raise GraphError(f"slice of {node.label} {node.shape}: start/limit need {node.rank} entries")
        for d, (s, e) in enumerate(zip(start, limit, strict=True)):
            if not 0 <= s <= e <= node.shape[d]:
                raise GraphError(f"slice of {node.label} {node.shape}: dim {d} range [{s}, {e}) is out of bounds")
        shape = tuple(e - s for s, e in zip(start, limit, strict=True))
        return self._add(OpKind.SLICE, (x,), shape, node.dtype, {"start": tuple(start), "limit": tuple(limit)}, name)

    def concatenate(self, xs: Sequence[int], dim: int, name: str = "") -> int:
        nodes = [self._node(x) for x in xs]
        if not nodes:
            raise GraphError("concatenate needs at least one operand")
        self._check_dims("concatenate", (dim,), nodes[0].rank)
        for n in nodes[1:]:
            if n.rank != nodes[0].rank or any(
                a != b for d, (a, b) in enumerate(zip(n.shape, nodes[0].shape, strict=True)) if d != dim
            ):
                raise GraphError(f"concatenate on dim {dim}: {n.label} {n.shape} does not match {nodes[0].shape}")
        shape = list(nodes[0].shape)
        shape[dim] = sum(n.shape[dim] for n in nodes)
        return self._add(OpKind.CONCATENATE, tuple(xs), shape, nodes[0].dtype, {"dim": dim}, name)

    def gather(self, operand: int, indices: int, axis: int = 0, batch_dims: int = 0,
               fill_value: float | None = None, name: str = "") -> int:
        """Entries of `operand` along dim `axis` picked by integer `indices` (tf.gather's semantics).

        The first `batch_dims` dims of `indices` and of `operand` are matched one to one (they
        must have equal sizes and come before `axis`); every other index dim picks independently.
        The output has shape operand[:axis] + indices[batch_dims:] + operand[axis + 1:], and
        out[b, p, i, q] = operand[b, p, indices[b, i], q]. An embedding lookup is axis=0,
        batch_dims=0; the per-row pick of cross-entropy, logp[b, labels[b]], is axis=1, batch_dims=1.

        Out-of-range indices are clamped (XLA's gather) when `fill_value` is None, else their
        entries are `fill_value` (JAX's mode="fill").
        """
        o, i = self._node(operand), self._node(indices)
        where = f"gather {name!r}" if name else "gather"
        self._check_take(where, o.shape, i, axis, batch_dims)
        shape = o.shape[:axis] + i.shape[batch_dims:] + o.shape[axis + 1:]
        if fill_value is not None:
            # One NaN object: NaN != NaN, so equal attrs (and layer signatures) need the same object.
            fill_value = math.nan if math.isnan(fill_value) else float(fill_value)
        attrs = {"axis": axis, "batch_dims": batch_dims, "fill_value": fill_value}
        return self._add(OpKind.GATHER, (operand, indices), shape, o.dtype, attrs, name)

    def scatter_add(self, shape: Sequence[int], indices: int, updates: int, axis: int = 0, batch_dims: int = 0,
                    dtype: DType | str | None = None, name: str = "") -> int:
        """The transpose of `gather`: zeros of `shape` with each entry of `updates` added at its index.

        `updates` has the shape gather(zeros(shape), indices, axis, batch_dims) would have:
        shape[:axis] + indices.shape[batch_dims:] + shape[axis + 1:]. With axis=0, batch_dims=0
        this is an embedding gradient (rows of updates added into a zero table). Duplicate
        indices accumulate; out-of-range indices are dropped (as XLA's scatter does).
        """
        shape = tuple(int(s) for s in shape)
        i, u = self._node(indices), self._node(updates)
        where = f"scatter_add {name!r}" if name else "scatter_add"
        self._check_take(where, shape, i, axis, batch_dims)
        expected = shape[:axis] + i.shape[batch_dims:] + shape[axis + 1:]
        if u.shape != expected:
            raise GraphError(
                f"{where}: updates {u.label} have shape {u.shape}, but indices {i.shape} into {shape} along "
                f"axis {axis} with {batch_dims} batch dims need updates of shape {expected} "
                f"(shape[:axis] + indices.shape[batch_dims:] + shape[axis + 1:])"
            )
        attrs = {"axis": axis, "batch_dims": batch_dims}
        return self._add(OpKind.SCATTER_ADD, (indices, updates), shape, dtype or u.dtype, attrs, name)

    def dynamic_slice(self, x: int, starts: Sequence[int], sizes: Sequence[int], name: str = "") -> int:
        """A `sizes` window of `x` at run-time start indices (one integer scalar node per dim).

        Starts are clamped so the window stays inside `x`, as in XLA.
        """
        node, starts, sizes = self._node(x), tuple(starts), tuple(int(s) for s in sizes)
        if len(sizes) != node.rank:
            raise GraphError(f"dynamic_slice of {node.label} {node.shape}: sizes need {node.rank} entries")
        self._check_starts("dynamic_slice", node, starts)
        for d, size in enumerate(sizes):
            if not 0 <= size <= node.shape[d]:
                raise GraphError(f"dynamic_slice of {node.label} {node.shape}: size {size} of dim {d} "
                                 f"does not fit in [0, {node.shape[d]}]")
        return self._add(OpKind.DYNAMIC_SLICE, (x, *starts), sizes, node.dtype, {}, name)

    def dynamic_update_slice(self, x: int, update: int, starts: Sequence[int], name: str = "") -> int:
        """`x` with the window at run-time `starts` (one integer scalar node per dim) overwritten by
        `update`. Starts are clamped so the window stays inside `x`, as in XLA."""
        node, u, starts = self._node(x), self._node(update), tuple(starts)
        if u.rank != node.rank or any(a > b for a, b in zip(u.shape, node.shape, strict=True)):
            raise GraphError(f"dynamic_update_slice of {node.label} {node.shape}: update {u.label} {u.shape} "
                             "must have the same rank and fit inside it")
        self._check_starts("dynamic_update_slice", node, starts)
        return self._add(OpKind.DYNAMIC_UPDATE_SLICE, (x, update, *starts), node.shape, node.dtype, {}, name)

    def cumulative(self, x: int, dim: int, op: str = "sum", reverse: bool = False, name: str = "") -> int:
        """Running `op` ("sum", "prod", "max", "min", "logsumexp") along `dim` (from the end if `reverse`)."""
        node = self._node(x)
        if op not in CUMULATIVE_OPS:
            raise GraphError(f"unknown cumulative op {op!r}; use one of {sorted(CUMULATIVE_OPS)}")
        self._check_dims("cumulative", (dim,), node.rank)
        return self._add(OpKind.CUMULATIVE, (x,), node.shape, node.dtype, {"op": op, "dim": dim,
                                                                          "reverse": bool(reverse)}, name)

    def sort(self, xs: Sequence[int], dim: int, num_keys: int = 1, output: int = 0, name: str = "") -> int:
        """Result `output` of sorting the equal-shaped `xs` together along `dim` (ascending,
        stable), ordered by the first `num_keys` of them (lexicographically)."""
        nodes = [self._node(x) for x in xs]
        self._same_shape("sort", xs)
        self._check_dims("sort", (dim,), nodes[0].rank)
        if not 1 <= num_keys <= len(nodes) or not 0 <= output < len(nodes):
            raise GraphError(f"sort of {len(nodes)} operand(s): num_keys={num_keys} and output={output} "
                             "must index the operands")
        attrs = {"dim": dim, "num_keys": num_keys, "output": output}
        return self._add(OpKind.SORT, tuple(xs), nodes[output].shape, nodes[output].dtype, attrs, name)

    def top_k(self, x: int, k: int, output: int = 0, dim: int | None = None, index_dtype: DType | str = DType.I32,
              name: str = "") -> int:
        """The `k` largest entries along `dim` (default: the last), largest first (lower index first
        on ties): their values (`output=0`) or their indices (`output=1`)."""
        node = self._node(x)
        dim = node.rank - 1 if dim is None else dim
        self._check_dims("top_k", (dim,), node.rank)
        if not 0 < k <= node.shape[dim] or output not in (0, 1):
            raise GraphError(f"top_k of {node.label} {node.shape}: k={k} must lie in [1, {node.shape[dim]}] and "
                             "output must be 0 (values) or 1 (indices)")
        shape = node.shape[:dim] + (k,) + node.shape[dim + 1:]
        dtype = node.dtype if output == 0 else index_dtype
        return self._add(OpKind.TOP_K, (x,), shape, dtype, {"k": k, "output": output, "dim": dim}, name)

    def arg_reduce(self, x: int, dim: int, op: str = "argmax", dtype: DType | str = DType.I32, name: str = "") -> int:
        """The index of the largest (argmax) or smallest (argmin) entry along `dim` (the first on ties)."""
        node = self._node(x)
        if op not in ("argmax", "argmin"):
            raise GraphError(f"unknown arg_reduce op {op!r}; use argmax or argmin")
        self._check_dims(op, (dim,), node.rank)
        shape = node.shape[:dim] + node.shape[dim + 1:]
        return self._add(OpKind.ARG_REDUCE, (x,), shape, dtype, {"op": op, "dim": dim}, name)

    def random(self, operands: Sequence[int], shape: Sequence[int], dtype: DType | str, op: str,
               partitionable: bool = False, output: int = 0, name: str = "") -> int:
        """Result `output` of random bits or PRNG key handling (`op` names the JAX primitive).
        `partitionable`: the values do not depend on how the result is split (threefry with
        partitionable counters), so any split of it is free."""
        for x in operands:
            self._node(x)
        attrs = {"op": op, "partitionable": bool(partitionable), "output": output}
        return self._add(OpKind.RANDOM, tuple(operands), shape, dtype, attrs, name)

    def opaque(self, operands: Sequence[int], shape: Sequence[int], dtype: DType | str,
               op: str, name: str = "") -> int:
        """An operator meshplan has no rule for; it is planned replicated."""
        for x in operands:
            self._node(x)
        return self._add(OpKind.OPAQUE, tuple(operands), shape, dtype, {"op": op}, name)

    # -- graph-level -------------------------------------------------------------------------

    def outputs(self, *ids: int, force_replicated: bool = False) -> None:
        """Mark results; `force_replicated` pins them replicated (Alpa's ForceReplicated)."""
        for x in ids:
            self._node(x)
            self._outputs.append(x)
            if force_replicated:
                self._force_replicated.append(x)

    def force_replicated(self, *ids: int) -> None:
        for x in ids:
            self._node(x)
            self._force_replicated.append(x)

    def alias(self, param: int, updated: int) -> None:
        """`updated` overwrites parameter `param` in place (a training step's new weight)."""
        p, u = self._node(param), self._node(updated)
        if p.kind is not OpKind.PARAMETER:
            raise GraphError(f"alias: {p.label} is a {p.kind.value}; only parameters can be aliased")
        if p.shape != u.shape:
            raise GraphError(f"alias {p.label} {p.shape} -> {u.label} {u.shape}: shapes must be equal")
        self._aliases.append((param, updated))

    def shape(self, x: int) -> tuple[int, ...]:
        return self._node(x).shape

    def __len__(self) -> int:
        """Number of nodes built so far."""
        return len(self._nodes)

    def __bool__(self) -> bool:
        return True  # an empty builder is still a builder (`builder or default` must not replace it)

    def node(self, x: int) -> Node:
        """The node with id `x` built so far."""
        return self._node(x)

    def tag(self, x: int, **attrs: Any) -> None:
        """Add attributes to node `x` (e.g. accumulated=True on a parameter gradient)."""
        node = self._node(x)
        merged = dict(node.attrs) | attrs
        self._nodes[x] = dataclasses.replace(node, attrs=freeze_attrs(merged))

    def rename(self, x: int, name: str) -> None:
        """Give node `x` a new name (e.g. `grad.w` once a gradient is known to be final)."""
        self._nodes[x] = dataclasses.replace(self._node(x), name=name)

    @classmethod
    def from_graph(cls, graph: Graph) -> GraphBuilder:
        """A builder holding `graph`'s nodes (same ids) but no outputs, to append more nodes to it."""
        builder = cls(graph.name)
        builder._nodes = list(graph.nodes)
        return builder

    def build(self) -> Graph:
        graph = Graph(tuple(self._nodes), tuple(self._outputs), tuple(self._aliases),
                      tuple(dict.fromkeys(self._force_replicated)), self.name)
        check_graph(graph)
        return graph

    # -- internals ---------------------------------------------------------------------------

    def _node(self, x: int) -> Node:
        if not isinstance(x, int) or not 0 <= x < len(self._nodes):
            raise GraphError(f"{x!r} is not a node id of graph {self.name!r}; pass ids returned by the builder")
        return self._nodes[x]

    def _same_shape(self, op: str, ids: Sequence[int]) -> tuple[int, ...]:
        nodes = [self._node(i) for i in ids]
        for n in nodes[1:]:
            if n.shape != nodes[0].shape:
                raise GraphError(
                    f"{op}: operand shapes differ ({nodes[0].label} {nodes[0].shape} vs {n.label} "
                    f"{n.shape}); broadcast explicitly first"
                )
        return nodes[0].shape

    @staticmethod
    def _check_take(where: str, shape: tuple[int, ...], indices: Node, axis: int, batch_dims: int) -> None:
        """Checks shared by gather and scatter_add (`shape` is the indexed tensor's)."""
        if not 0 <= axis < len(shape):
            raise GraphError(f"{where}: axis {axis} is out of range for shape {shape}; it needs a dim to index")
        if indices.dtype not in _INTEGER_DTYPES:
            raise GraphError(f"{where}: indices {indices.label} are {indices.dtype}; convert them to an integer dtype")
        if not 0 <= batch_dims <= min(axis, indices.rank):
            raise GraphError(f"{where}: batch_dims={batch_dims} must lie in [0, min(axis={axis}, rank of indices "
                             f"{indices.label} = {indices.rank})]")
        if indices.shape[:batch_dims] != shape[:batch_dims]:
            raise GraphError(f"{where}: the {batch_dims} batch dims of indices {indices.label} {indices.shape} "
                             f"and of {shape} differ; batch dims must have equal sizes")

    def _check_starts(self, what: str, node: Node, starts: tuple[int, ...]) -> None:
        """One integer scalar start node per dim of `node`."""
        if len(starts) != node.rank:
            raise GraphError(f"{what} of {node.label} {node.shape}: starts need {node.rank} entries")
        for d, start in enumerate(starts):
            s = self._node(start)
            if s.shape != () or s.dtype not in _INTEGER_DTYPES:
                raise GraphError(f"{what} of {node.label}: start of dim {d} ({s.label}) must be an "
                                 f"integer scalar, got {s.dtype}{list(s.shape)}")

    @staticmethod
    def _check_dims(what: str, dims: Sequence[int], rank: int) -> None:
        for d in dims:
            if not 0 <= d < rank:
                raise GraphError(f"{what}: dim {d} is out of range for rank {rank}")
        if len(set(dims)) != len(dims):
            raise GraphError(f"{what}: dims {tuple(dims)} repeat")

    def _add(self, kind: OpKind, operands: tuple[int, ...], shape: Sequence[int],
             dtype: DType | str, attrs: dict[str, Any], name: str) -> int:
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise GraphError(f"{kind.value} {name}: negative dimension in {shape}")
        node_id = len(self._nodes)
        if self._kernel is not None:
            attrs = {**attrs, "kernel": self._kernel}
        self._nodes.append(Node(node_id, kind, operands, shape, as_dtype(dtype), freeze_attrs(attrs),
                                name, self._source, self._layer))
        return node_id
