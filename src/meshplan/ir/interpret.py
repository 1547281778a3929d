"""A NumPy interpreter of the IR (Graph + input arrays -> the value of every node).

It is the correctness oracle of the house: gradients built by `autodiff` and updates built by
`models.optimizers` are checked by running them here. It favours clarity over speed.

Numerics: each node's value is cast to the node's dtype. NumPy has no bfloat16, so bf16 values
are held as float32 rounded to the nearest bf16 value (ties to even), which keeps the rounding
of mixed-precision graphs visible.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from meshplan.errors import GraphError
from meshplan.ir.dtypes import DType
from meshplan.ir.graph import Graph
from meshplan.ir.node import Node, OpKind
from meshplan.ir.windows import ConvDims, Padding, dilated, window_output_size

_NUMPY_DTYPES = {
    DType.F64: np.float64, DType.F32: np.float32, DType.BF16: np.float32, DType.F16: np.float16,
    DType.I64: np.int64, DType.I32: np.int32, DType.I8: np.int8, DType.U8: np.uint8, DType.PRED: np.bool_,
}

Evaluator = Callable[[Node, list[np.ndarray]], np.ndarray]
_EVALUATORS: dict[OpKind, Evaluator] = {}


def evaluate(graph: Graph, inputs: Mapping[str | int, Any], constants_default: float = 0.0) -> list[np.ndarray]:
    """The value of every node of `graph`, in node order.

    Args:
        graph: the graph to run.
        inputs: a value for every parameter, keyed by the parameter's name or id.
        constants_default: the value of constants built without one (`value=None`).

    Raises:
        GraphError: an input is missing, unknown or mis-shaped, or the graph has an opaque op.
    """
    params = _bind_inputs(graph, inputs)
    values: list[np.ndarray] = []
    with np.errstate(all="ignore"):  # IEEE semantics (inf, nan) as on an accelerator, no warnings
        for node in graph.nodes:
            if node.kind is OpKind.PARAMETER:
                values.append(cast(params[node.id], node.dtype))
            else:
                values.append(evaluate_node(node, [values[i] for i in node.operands], constants_default))
    return values


def evaluate_node(node: Node, operands: list[np.ndarray], constants_default: float = 0.0) -> np.ndarray:
    """The value of one node (not a parameter) from its operands' values, cast to its dtype.

    Raises:
        GraphError: the node is a parameter or an op the interpreter cannot run (opaque).
    """
    if node.kind is OpKind.PARAMETER:
        raise GraphError(f"evaluate_node: {node.label} is a parameter; its value is an input, not computed")
    if node.kind is OpKind.CONSTANT:
        value = np.full(node.shape, constants_default if node.attr("value") is None else node.attr("value"))
    else:
        with np.errstate(all="ignore"):
            value = _evaluator(node)(node, operands)
    return cast(value, node.dtype)


def numpy_dtype(dtype: DType) -> type[np.generic]:
    """The NumPy type that holds values of `dtype` (float32 for bf16)."""
    return _NUMPY_DTYPES[dtype]


def cast(value: Any, dtype: DType) -> np.ndarray:
    """`value` as an array of `dtype`, rounded to bf16 precision when `dtype` is bf16."""
    with np.errstate(all="ignore"):
        array = np.asarray(value).astype(_NUMPY_DTYPES[dtype])
    return _round_bf16(array) if dtype is DType.BF16 else array


def _round_bf16(x: np.ndarray) -> np.ndarray:
    # Round-to-nearest-even on the top 16 bits of the float32 pattern; NaNs are kept as they are.
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, rounded).astype(np.float32)


def _bind_inputs(graph: Graph, inputs: Mapping[str | int, Any]) -> dict[int, np.ndarray]:
    params = graph.parameters()
    keys = {p.name for p in params if p.name} | {p.id for p in params}
    unknown = [k for k in inputs if k not in keys]
    if unknown:
        raise GraphError(f"evaluate: inputs {unknown} name no parameter of graph {graph.name!r}; "
                         f"its parameters are {[p.label for p in params]}")
    bound, missing = {}, []
    for p in params:
        key = p.name if p.name in inputs else p.id
        if key not in inputs:
            missing.append(p.label)
            continue
        value = np.asarray(inputs[key])
        if value.shape != p.shape:
            raise GraphError(f"evaluate: input for parameter {p.label} has shape {value.shape}, "
                             f"but the parameter has shape {p.shape}; pass an array of that shape")
        bound[p.id] = value
    if missing:
        raise GraphError(f"evaluate: no input for parameters {missing} of graph {graph.name!r}; "
                         "pass one array per parameter, keyed by name or id")
    return bound


def _evaluator(node: Node) -> Evaluator:
    rule = _EVALUATORS.get(node.kind)
    if rule is None:
        raise GraphError(f"evaluate: node {node.label} has op kind {node.kind.value} ({node.op!r}), which the "
                         "interpreter cannot run; express it with IR ops to evaluate the graph")
    return rule


def _register(*kinds: OpKind) -> Callable[[Evaluator], Evaluator]:
    def decorate(rule: Evaluator) -> Evaluator:
        for kind in kinds:
            _EVALUATORS[kind] = rule
        return rule

    return decorate


# -- leaves and contraction ----------------------------------------------------------------------


@_register(OpKind.IOTA)
def _iota(node: Node, args: list[np.ndarray]) -> np.ndarray:
    dim = node.attr("dim")
    ramp = np.arange(node.shape[dim]).reshape([-1 if d == dim else 1 for d in range(node.rank)])
    return np.broadcast_to(ramp, node.shape)


@_register(OpKind.DOT)
def _dot(node: Node, args: list[np.ndarray]) -> np.ndarray:
    lhs, rhs = args
    lc, rc = node.attr("lhs_contracting"), node.attr("rhs_contracting")
    lb, rb = node.attr("lhs_batch"), node.attr("rhs_batch")
    letters = iter("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    lhs_sub = [next(letters) for _ in range(lhs.ndim)]
    rhs_sub = [next(letters) for _ in range(rhs.ndim)]
    for ld, rd in zip(lc + lb, rc + rb, strict=True):
        rhs_sub[rd] = lhs_sub[ld]
    out = [lhs_sub[d] for d in lb]
    out += [lhs_sub[d] for d in range(lhs.ndim) if d not in lc + lb]
    out += [rhs_sub[d] for d in range(rhs.ndim) if d not in rc + rb]
    # Accumulate in the widest of the operand and result types (a dot's preferred element type).
    wide = np.result_type(lhs, rhs, _NUMPY_DTYPES[node.dtype])
    return np.einsum(f"{''.join(lhs_sub)},{''.join(rhs_sub)}->{''.join(out)}", lhs.astype(wide), rhs.astype(wide))


# -- elementwise ---------------------------------------------------------------------------------


def _bitwise_or_logical(logical: Callable, bitwise: Callable) -> Callable:
    return lambda *xs: logical(*xs) if xs[0].dtype == np.bool_ else bitwise(*xs)


def _divide(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if np.issubdtype(x.dtype, np.integer):  # integer division truncates toward zero, as in XLA
        return np.sign(x) * np.sign(y) * (np.abs(x) // np.abs(y))
    return x / y


def _erf_inv(x: np.ndarray) -> np.ndarray:
    from scipy.special import erfinv  # SciPy comes with JAX; the rest of the interpreter needs only NumPy

    return erfinv(x)


def _shift_right_logical(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    # Signed stand-ins of unsigned types (uint32 as i32) shift in zeros from the top.
    unsigned = np.dtype(f"u{x.dtype.itemsize}")
    return (x.view(unsigned) >> y.astype(unsigned)).view(x.dtype)


_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "neg": np.negative, "exp": np.exp, "log": np.log, "rsqrt": lambda x: 1 / np.sqrt(x), "sqrt": np.sqrt,
    "tanh": np.tanh, "logistic": lambda x: 0.5 * (1 + np.tanh(0.5 * x)), "abs": np.abs, "sign": np.sign,
    "erf": np.vectorize(math.erf, otypes=[np.float64]), "sin": np.sin, "cos": np.cos, "copy": np.copy,
    "floor": np.floor, "ceil": np.ceil, "not": _bitwise_or_logical(np.logical_not, np.invert),
    "square": np.square, "log1p": np.log1p, "expm1": np.expm1, "is_finite": np.isfinite, "erf_inv": _erf_inv,
    "round": np.round, "tan": np.tan,  # round: half to even, the only rounding capture maps here
}
_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": _divide, "max": np.maximum,
    "min": np.minimum, "pow": np.power, "and": _bitwise_or_logical(np.logical_and, np.bitwise_and),
    "or": _bitwise_or_logical(np.logical_or, np.bitwise_or), "rem": np.fmod,  # fmod: sign of x, as XLA
    "xor": _bitwise_or_logical(np.logical_xor, np.bitwise_xor), "atan2": np.arctan2, "shift_left": np.left_shift,
    "shift_right_logical": _shift_right_logical, "shift_right_arithmetic": np.right_shift,
}
_COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
            "ge": np.greater_equal}


@_register(OpKind.ELEMENTWISE)
def _elementwise(node: Node, args: list[np.ndarray]) -> np.ndarray:
    op = node.op
    if op == "compare":
        return _COMPARE[node.attr("direction")](*args)
    if op == "select":
        return np.where(args[0], args[1], args[2])
    if op == "convert":
        return args[0]  # the cast to the node's dtype follows every op
    if op == "bitcast":
        return args[0].view(_NUMPY_DTYPES[node.dtype])
    table = _UNARY if len(args) == 1 else _BINARY
    if op not in table:
        raise GraphError(f"evaluate: elementwise op {op!r} of node {node.label} is unknown to the interpreter")
    return table[op](*args)


# -- layout --------------------------------------------------------------------------------------


@_register(OpKind.BROADCAST)
def _broadcast(node: Node, args: list[np.ndarray]) -> np.ndarray:
    dims = node.attr("dims")
    expanded = [1] * node.rank
    for i, d in enumerate(dims):
        expanded[d] = args[0].shape[i]
    return np.broadcast_to(args[0].reshape(expanded), node.shape)


@_register(OpKind.RESHAPE)
def _reshape(node: Node, args: list[np.ndarray]) -> np.ndarray:
    return args[0].reshape(node.shape)


@_register(OpKind.TRANSPOSE)
def _transpose(node: Node, args: list[np.ndarray]) -> np.ndarray:
    return np.transpose(args[0], node.attr("perm"))


_REDUCERS = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


@_register(OpKind.REDUCE)
def _reduce(node: Node, args: list[np.ndarray]) -> np.ndarray:
    return _REDUCERS[node.op](args[0], axis=node.attr("dims"))


@_register(OpKind.SLICE)
def _slice(node: Node, args: list[np.ndarray]) -> np.ndarray:
    window = tuple(slice(s, e) for s, e in zip(node.attr("start"), node.attr("limit"), strict=True))
    return args[0][window]


@_register(OpKind.DYNAMIC_SLICE)
def _dynamic_slice(node: Node, args: list[np.ndarray]) -> np.ndarray:
    x, starts = args[0], args[1:]
    # Clamp so the window fits, as XLA does, instead of failing on out-of-range starts.
    first = [min(max(int(s), 0), x.shape[d] - node.shape[d]) for d, s in enumerate(starts)]
    return x[tuple(slice(f, f + n) for f, n in zip(first, node.shape, strict=True))]


@_register(OpKind.CONCATENATE)
def _concatenate(node: Node, args: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(args, axis=node.attr("dim"))


# -- indexing ------------------------------------------------------------------------------------


def _take_index(shape: tuple[int, ...], indices: np.ndarray, axis: int, batch_dims: int) -> tuple[Any, ...]:
    """The NumPy index tuple `t` with x[t] == gather(x, indices, axis, batch_dims), x of `shape`.

    Dims before `axis` get aranges and `axis` gets the indices, all broadcast to the leading
    output dims shape[:axis] + indices.shape[batch_dims:]; the dims after `axis` are sliced whole.
    """
    picked = indices.shape[batch_dims:]
    lead = axis + len(picked)
    index: list[Any] = [np.arange(shape[d]).reshape([-1 if k == d else 1 for k in range(lead)])
                        for d in range(axis)]
    index.append(indices.reshape(indices.shape[:batch_dims] + (1,) * (axis - batch_dims) + picked))
    return (*index, *[slice(None)] * (len(shape) - axis - 1))


def _clipped(node: Node, indices: np.ndarray, size: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The indices clamped into [0, size), and a mask of the in-range ones that broadcasts against
    the gather output (or scatter updates) of rank `rank`."""
    ids = indices.astype(np.int64)
    axis, batch_dims = node.attr("axis"), node.attr("batch_dims")
    shape = ids.shape[:batch_dims] + (1,) * (axis - batch_dims) + ids.shape[batch_dims:]
    inside = ((ids >= 0) & (ids < size)).reshape(shape + (1,) * (rank - len(shape)))
    return np.clip(ids, 0, max(size - 1, 0)), inside


@_register(OpKind.GATHER)
def _gather(node: Node, args: list[np.ndarray]) -> np.ndarray:
    operand, indices = args
    axis, fill = node.attr("axis"), node.attr("fill_value")
    ids, inside = _clipped(node, indices, operand.shape[axis], node.rank)
    picked = operand[_take_index(operand.shape, ids, axis, node.attr("batch_dims"))]
    return picked if fill is None else np.where(inside, picked, fill)  # clamped (XLA) or filled (mode="fill")


@_register(OpKind.SCATTER_ADD)
def _scatter_add(node: Node, args: list[np.ndarray]) -> np.ndarray:
    indices, updates = args
    axis = node.attr("axis")
    out = np.zeros(node.shape, np.result_type(updates, _NUMPY_DTYPES[node.dtype]))
    ids, inside = _clipped(node, indices, node.shape[axis], updates.ndim)
    kept = np.where(inside, updates, np.zeros((), updates.dtype))  # XLA's scatter drops out-of-range updates
    np.add.at(out, _take_index(node.shape, ids, axis, node.attr("batch_dims")), kept)
    return out


# -- windows, scans, sorts -----------------------------------------------------------------------


@_register(OpKind.DYNAMIC_UPDATE_SLICE)
def _dynamic_update_slice(node: Node, args: list[np.ndarray]) -> np.ndarray:
    x, update, starts = args[0], args[1], args[2:]
    first = [min(max(int(s), 0), x.shape[d] - update.shape[d]) for d, s in enumerate(starts)]
    out = np.array(x, copy=True)
    out[tuple(slice(f, f + n) for f, n in zip(first, update.shape, strict=True))] = update
    return out


_ACCUMULATORS = {"sum": np.cumsum, "prod": np.cumprod, "max": np.maximum.accumulate,
                 "min": np.minimum.accumulate, "logsumexp": np.logaddexp.accumulate}


@_register(OpKind.CUMULATIVE)
def _cumulative(node: Node, args: list[np.ndarray]) -> np.ndarray:
    dim, x = node.attr("dim"), args[0]
    if node.attr("reverse"):
        return np.flip(_ACCUMULATORS[node.op](np.flip(x, dim), axis=dim), dim)
    return _ACCUMULATORS[node.op](x, axis=dim)


@_register(OpKind.SORT)
def _sort(node: Node, args: list[np.ndarray]) -> np.ndarray:
    dim = node.attr("dim")
    keys = [np.moveaxis(k, dim, -1) for k in args[:node.attr("num_keys")]]
    order = np.lexsort(keys[::-1], axis=-1)  # lexsort sorts by its last key first; it is stable
    picked = np.take_along_axis(np.moveaxis(args[node.attr("output")], dim, -1), order, axis=-1)
    return np.moveaxis(picked, -1, dim)


@_register(OpKind.TOP_K)
def _top_k(node: Node, args: list[np.ndarray]) -> np.ndarray:
    x, dim = np.moveaxis(args[0], node.attr("dim"), -1), node.attr("dim")
    order = np.argsort(-x.astype(np.float64), axis=-1, kind="stable")[..., :node.attr("k")]
    picked = order if node.attr("output") == 1 else np.take_along_axis(x, order, axis=-1)
    return np.moveaxis(picked, -1, dim)


@_register(OpKind.ARG_REDUCE)
def _arg_reduce(node: Node, args: list[np.ndarray]) -> np.ndarray:
    pick = np.argmax if node.op == "argmax" else np.argmin
    return pick(args[0], axis=node.attr("dim"))


@_register(OpKind.REVERSE)
def _reverse(node: Node, args: list[np.ndarray]) -> np.ndarray:
    return np.flip(args[0], node.attr("dims"))


# -- convolutions and window reductions ----------------------------------------------------------


def _window_entries(x: np.ndarray, window: tuple[int, ...], strides: tuple[int, ...], padding: Padding,
                    base_dilation: tuple[int, ...], window_dilation: tuple[int, ...], fill: float) -> np.ndarray:
    """Every window of `x` at every output position: shape (window entries, *output shape), in
    row-major window order. Padding (negative crops) and dilation holes hold `fill`."""
    if any(d > 1 for d in base_dilation):
        spread = np.full([dilated(n, d) for n, d in zip(x.shape, base_dilation, strict=True)], fill, x.dtype)
        spread[tuple(slice(None, None, d) for d in base_dilation)] = x
        x = spread
    x = x[tuple(slice(max(-lo, 0), n - max(-hi, 0)) for n, (lo, hi) in zip(x.shape, padding, strict=True))]
    x = np.pad(x, [(max(lo, 0), max(hi, 0)) for lo, hi in padding], constant_values=fill)
    out = [window_output_size(n, k, s, (0, 0), 1, r)
           for n, k, s, r in zip(x.shape, window, strides, window_dilation, strict=True)]
    entries = []
    for offset in np.ndindex(*window):
        first = [o * r for o, r in zip(offset, window_dilation, strict=True)]
        entries.append(x[tuple(slice(f, f + (m - 1) * s + 1, s) if m else slice(0, 0)
                               for f, m, s in zip(first, out, strides, strict=True))])
    return np.stack(entries)


@_register(OpKind.CONV)
def _conv(node: Node, args: list[np.ndarray]) -> np.ndarray:
    """Windows of the (canonical NC...) input contracted with the (canonical OI...) kernel, per group."""
    dims = ConvDims.of(node)
    wide = np.result_type(args[0], args[1], _NUMPY_DTYPES[node.dtype])
    lhs, rhs = args[0].astype(wide).transpose(dims.lhs), args[1].astype(wide).transpose(dims.rhs)
    spatial = dims.spatial_rank
    kernel = rhs.shape[2:]
    windows = _window_entries(lhs, (1, 1, *kernel), (1, 1, *node.attr("window_strides")),
                              ((0, 0), (0, 0), *node.attr("padding")), (1, 1, *node.attr("lhs_dilation")),
                              (1, 1, *node.attr("rhs_dilation")), 0.0)
    taps, n, c = windows.shape[0], windows.shape[1], windows.shape[2]
    out_spatial = windows.shape[3:3 + spatial]
    fg, bg = node.attr("feature_group_count"), node.attr("batch_group_count")
    o = rhs.shape[0]
    windows = windows.reshape(taps, bg, n // bg, fg, c // fg, -1)
    kernel_taps = rhs.reshape(bg, fg, o // (bg * fg), rhs.shape[1], taps)
    out = np.einsum("tbngcp,bgoct->nbgop", windows, kernel_taps)
    out = out.reshape(n // bg, o, *out_spatial)
    return out.transpose(np.argsort(dims.out))


_WINDOW_IDENTITY = {"sum": 0.0, "max": -np.inf, "min": np.inf}
_WINDOW_REDUCERS = {"sum": np.sum, "max": np.max, "min": np.min}


@_register(OpKind.REDUCE_WINDOW)
def _reduce_window(node: Node, args: list[np.ndarray]) -> np.ndarray:
    x = args[0]
    fill = _WINDOW_IDENTITY[node.op]
    if np.issubdtype(x.dtype, np.integer) and fill:
        fill = np.iinfo(x.dtype).min if node.op == "max" else np.iinfo(x.dtype).max
    entries = _window_entries(x, node.attr("window_dimensions"), node.attr("window_strides"), node.attr("padding"),
                              node.attr("base_dilation"), node.attr("window_dilation"), fill)
    return _WINDOW_REDUCERS[node.op](entries, axis=0)


@_register(OpKind.SELECT_AND_SCATTER_ADD)
def _select_and_scatter_add(node: Node, args: list[np.ndarray]) -> np.ndarray:
    """Each source entry added at the first extreme entry of its window (XLA keeps the selected
    entry while select(kept, next) holds: with >=, the first maximum)."""
    source, operand = args
    window, strides, padding = (node.attr(k) for k in ("window_dimensions", "window_strides", "padding"))
    ones = (1,) * operand.ndim
    fill = -np.inf if node.attr("select") == "ge" else np.inf
    entries = _window_entries(operand.astype(np.float64), window, strides, padding, ones, ones, fill)
    picked = (np.argmax if node.attr("select") == "ge" else np.argmin)(entries, axis=0)
    padded = np.zeros([n + lo + hi for n, (lo, hi) in zip(operand.shape, padding, strict=True)],
                      np.result_type(source, _NUMPY_DTYPES[node.dtype]))
    for t, offset in enumerate(np.ndindex(*window)):
        region = tuple(slice(o, o + (m - 1) * s + 1, s) for o, m, s in zip(offset, source.shape, strides, strict=True))
        padded[region] += np.where(picked == t, source, 0)
    return padded[tuple(slice(lo, lo + n) for n, (lo, _) in zip(operand.shape, padding, strict=True))]
