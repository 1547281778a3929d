"""Reverse-mode autodiff on the IR (forward graph in a builder -> gradient nodes appended to it).

`append_backward` walks the nodes between `wrt` and a scalar loss in reverse order and asks a
per-op VJP rule for each operand's cotangent. Rules live in two registries: one keyed by op
kind, one keyed by elementwise sub-op. A rule maps (builder, forward node, output cotangent,
operand position) to the cotangent of that operand; the driver calls it only for operands
whose gradient is needed, so the appended graph holds no dead nodes a planner would cost.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from meshplan.errors import GraphError
from meshplan.ir.builder import GraphBuilder
from meshplan.ir.dtypes import DType
from meshplan.ir.node import Node, OpKind
from meshplan.ir.windows import ConvDims, kernel_padding, transposed_padding

FLOAT_DTYPES = frozenset({DType.F64, DType.F32, DType.BF16, DType.F16})

# (builder, forward node, cotangent of the node's output, operand position) -> operand cotangent
Cotangent = Callable[[GraphBuilder, Node, int, int], int]


@dataclass(frozen=True, slots=True)
class VjpRule:
    """How one op family passes cotangents to its operands.

    Attributes:
        cotangent: builds the cotangent of one operand.
        no_grad: operand positions that never get a gradient (indices, predicates).
    """

    cotangent: Cotangent
    no_grad: frozenset[int] = frozenset()


_KIND_RULES: dict[OpKind, VjpRule] = {}
_ELEMENTWISE_RULES: dict[str, VjpRule] = {}
# Piecewise-constant or boolean ops: their derivative is zero wherever it exists.
_ZERO_GRAD_OPS = frozenset({"compare", "sign", "floor", "ceil", "round", "and", "or", "not", "xor", "is_finite",
                            "shift_left", "shift_right_logical", "shift_right_arithmetic"})
_LEAVES = frozenset({OpKind.PARAMETER, OpKind.CONSTANT, OpKind.IOTA})


def register_vjp(key: OpKind | str, no_grad: Sequence[int] = ()) -> Callable[[Cotangent], Cotangent]:
    """Decorator: `cotangent` is the VJP of op kind `key`, or of elementwise sub-op `key` (a str)."""

    def decorate(cotangent: Cotangent) -> Cotangent:
        rule = VjpRule(cotangent, frozenset(no_grad))
        if isinstance(key, OpKind):
            _KIND_RULES[key] = rule
        else:
            _ELEMENTWISE_RULES[key] = rule
        return cotangent

    return decorate


def vjp_rule(node: Node) -> VjpRule | None:
    """The VJP rule of `node`'s op, or None when there is none."""
    if node.kind is OpKind.ELEMENTWISE:
        return _ELEMENTWISE_RULES.get(node.op)
    return _KIND_RULES.get(node.kind)


def append_backward(builder: GraphBuilder, loss: int, wrt: Sequence[int]) -> dict[int, int]:
    """Append the nodes computing d(loss)/d(x) for every x in `wrt`.

    Gradient nodes copy the layer tag and the fused-kernel tag (`GraphBuilder.kernel`) of the
    forward node they differentiate; the final
    gradient of a named node is named `grad.<name>` when it is a node of its own.

    Args:
        builder: holds the forward graph; the backward nodes are appended to it.
        loss: id of a floating-point scalar.
        wrt: ids of floating-point nodes (usually parameters).

    Returns:
        {x: id of the gradient node} for every x in `wrt`; a broadcast zero when x does not
        affect the loss.

    Raises:
        GraphError: the loss is not a float scalar, a `wrt` node is not floating-point, or an
            op between `wrt` and the loss has no VJP rule.
    """
    _check_request(builder, loss, wrt)
    return append_vjp(builder, {loss: None}, wrt).grads


@dataclass(frozen=True, slots=True)
class Vjp:
    """The backward nodes `append_vjp` appended, by what they differentiate.

    Attributes:
        grads: {wrt node: id of its gradient}.
        cotangents: {forward node: id of its cotangent}, the sum of what its users send back, for
            every node on a differentiable path from `wrt` to the outputs.
        contributions: {(forward node, operand position): id of the cotangent that node sends
            back to that operand} (what its VJP rule built).
    """

    grads: dict[int, int]
    cotangents: dict[int, int]
    contributions: dict[tuple[int, int], int]


def append_vjp(builder: GraphBuilder, seeds: dict[int, int | None], wrt: Sequence[int]) -> Vjp:
    """Append the vector-Jacobian product of the outputs `seeds` at their cotangents, saying
    which node differentiates what (a runtime that runs JAX's own VJP pins these to the plan's
    layouts).

    Args:
        builder: as `append_backward`.
        seeds: {output node: the node holding its cotangent (of its shape and dtype), or None
            for a scalar loss seeded with 1}.
        wrt: as `append_backward`.
    """
    roots = list(seeds)
    forward = [builder.node(i) for i in range(max(roots) + 1)]
    relevant = _relevant_nodes(forward, roots, set(wrt))
    _check_rules(forward, relevant)  # before appending anything, so a failure leaves the builder as it was
    taken = {builder.node(i).name for i in range(len(builder))} | {""}
    contributions: dict[int, list[int]] = {
        r: [_seed(builder, forward[r]) if c is None else c] for r, c in seeds.items() if r in relevant}
    grads: dict[int, int] = {}
    sent: dict[tuple[int, int], int] = {}
    for node in reversed(forward):
        if node.id not in relevant:
            continue
        grads[node.id] = _accumulate(builder, node, contributions.pop(node.id), taken)
        for position, operand in enumerate(node.operands):
            if operand in relevant and _is_differentiable(node, position):
                cot = _operand_cotangent(builder, node, grads[node.id], position)
                contributions.setdefault(operand, []).append(cot)
                sent[(node.id, position)] = cot
    wrt_grads = {x: grads[x] if x in grads else _zero_grad(builder, builder.node(x), taken) for x in wrt}
    return Vjp(wrt_grads, grads, sent)


# -- driver internals ----------------------------------------------------------------------------


def _check_request(builder: GraphBuilder, loss: int, wrt: Sequence[int]) -> None:
    node = builder.node(loss)
    if node.shape != () or node.dtype not in FLOAT_DTYPES:
        raise GraphError(f"append_backward: the loss {node.label} is {node.dtype}{list(node.shape)}; it must "
                         "be a floating-point scalar (reduce it, e.g. b.reduce(x, all dims, 'sum'))")
    for x in wrt:
        if builder.node(x).dtype not in FLOAT_DTYPES:
            raise GraphError(f"append_backward: wrt node {builder.node(x).label} is {builder.node(x).dtype}; "
                             "only floating-point values have gradients")


def _is_differentiable(node: Node, position: int) -> bool:
    if node.kind in _LEAVES or (node.kind is OpKind.ELEMENTWISE and node.op in _ZERO_GRAD_OPS):
        return False
    rule = vjp_rule(node)
    # An op without a rule counts as differentiable so that reaching it raises, not zeroes.
    return rule is None or position not in rule.no_grad


def _relevant_nodes(forward: list[Node], roots: Sequence[int], wrt: set[int]) -> set[int]:
    """Nodes on a differentiable path from some `wrt` node to one of the `roots` (the loss)."""
    reached: set[int] = set()
    for node in forward:
        if node.dtype in FLOAT_DTYPES and (node.id in wrt or any(
                o in reached and _is_differentiable(node, p) for p, o in enumerate(node.operands))):
            reached.add(node.id)
    needed = {r for r in roots if r in reached}
    for node in reversed(forward):
        if node.id in needed:
            needed.update(o for p, o in enumerate(node.operands) if o in reached and _is_differentiable(node, p))
    return needed


def _check_rules(forward: list[Node], relevant: set[int]) -> None:
    for node in forward:
        if node.id in relevant and node.kind not in _LEAVES and vjp_rule(node) is None and any(
                o in relevant for o in node.operands):
            raise GraphError(f"append_backward: no VJP rule for {node.kind.value} op {node.op!r} at node "
                             f"{node.label}, which lies between wrt and the loss; build it from "
                             "differentiable IR ops or leave its inputs out of wrt")


@contextlib.contextmanager
def _tagged(builder: GraphBuilder, node: Node) -> Iterator[None]:
    """Nodes built inside carry `node`'s layer tag and fused-kernel tag."""
    with builder.layer(node.layer, node.source), builder.kernel(node.attr("kernel")):
        yield


def _seed(builder: GraphBuilder, loss: Node) -> int:
    with _tagged(builder, loss):
        return builder.full((), 1.0, loss.dtype)


def _accumulate(builder: GraphBuilder, node: Node, parts: list[int], taken: set[str]) -> int:
    """Sum the cotangents from every user of `node`; name the result after the node if free."""
    with _tagged(builder, node):
        total = parts[0]
        for part in parts[1:]:
            total = builder.add(total, part)
    name = f"grad.{node.name}"
    if node.name and not builder.node(total).name and name not in taken:
        builder.rename(total, name)
        taken.add(name)
    return total


def _operand_cotangent(builder: GraphBuilder, node: Node, g: int, position: int) -> int:
    operand = builder.node(node.operands[position])
    with _tagged(builder, node):
        cot = vjp_rule(node).cotangent(builder, node, g, position)
        if builder.node(cot).dtype != operand.dtype:  # mixed-dtype binaries, dots with a result type
            cot = builder.convert(cot, operand.dtype)
    if builder.shape(cot) != operand.shape:
        raise GraphError(f"append_backward: internal error: the {node.op} rule gave operand {position} of "
                         f"{node.label} a cotangent of shape {builder.shape(cot)}, expected {operand.shape}")
    return cot


def _zero_grad(builder: GraphBuilder, x: Node, taken: set[str]) -> int:
    name = f"grad.{x.name}" if x.name and f"grad.{x.name}" not in taken else ""
    taken.add(name)
    with _tagged(builder, x):
        return builder.zeros(x.shape, x.dtype, name=name)


def _full_like(b: GraphBuilder, x: int, value: float) -> int:
    return b.full(b.shape(x), value, b.node(x).dtype)


# -- contraction ---------------------------------------------------------------------------------


@register_vjp(OpKind.DOT)
def _dot_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    """d(operand i): contract g with the other operand over the other's free dims, then permute.

    g's dims are [batch, lhs free, rhs free]. Contracting g's dims of the *other* operand's free
    dims with those dims, and batching over batch dims, leaves the batch dims, this operand's
    free dims (in g's order) and the other's contracting dims (ascending); each of the latter
    pairs with one of this operand's contracting dims. Of dot(g, other) and dot(other, g), the
    one already in the operand's dim order is built, so plain matmuls need no transpose.
    """
    own, other = (b.node(o) for o in (node.operands if i == 0 else node.operands[::-1]))
    keys = ("lhs_contracting", "lhs_batch", "rhs_contracting", "rhs_batch")
    own_c, own_b, other_c, other_b = (node.attr(k) for k in (keys if i == 0 else keys[2:] + keys[:2]))
    own_free = [d for d in range(own.rank) if d not in own_c + own_b]
    other_free = [d for d in range(other.rank) if d not in other_c + other_b]
    nb = len(own_b)
    first = nb + (len(own_free) if i == 0 else 0)  # where the other operand's free dims start in g
    g_dims, batch = list(range(first, first + len(other_free))), list(range(nb))
    paired = [own_c[other_c.index(d)] for d in sorted(other_c)]  # own dims of the other's leftover dims
    g_first = list(own_b) + own_free + paired  # the operand dim each dim of dot(g, other) holds
    identity = list(range(own.rank))
    if g_first != identity and list(own_b) + paired + own_free == identity:
        return b.dot(other.id, g, other_free, g_dims, other_b, batch, dtype=own.dtype)
    product = b.dot(g, other.id, g_dims, other_free, batch, other_b, dtype=own.dtype)
    perm = [g_first.index(d) for d in identity]
    return product if perm == identity else b.transpose(product, perm)


# -- elementwise ---------------------------------------------------------------------------------


@register_vjp("add")
def _add_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    return g


@register_vjp("sub")
def _sub_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    return g if i == 0 else b.neg(g)


@register_vjp("mul")
def _mul_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    return b.mul(g, node.operands[1 - i])


@register_vjp("div")
def _div_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    x, y = node.operands
    if i == 0:
        return b.div(g, y)
    return b.neg(b.div(b.mul(g, node.id), y))  # d(x/y)/dy = -(x/y)/y


@register_vjp("pow")
def _pow_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    x, e = node.operands
    if i == 0:  # e * x^(e-1), written without dividing by x so x = 0 stays finite
        return b.mul(g, b.mul(e, b.binary("pow", x, b.sub(e, _full_like(b, e, 1.0)))))
    return b.mul(g, b.mul(node.id, b.unary("log", x)))


@register_vjp("rem")
def _rem_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    x, y = node.operands
    if i == 0:
        return g
    return b.neg(b.mul(g, b.div(b.sub(x, node.id), y)))  # rem = x - y*trunc(x/y); trunc(x/y) = (x-rem)/y


def _extremum_vjp(direction: str) -> Cotangent:
    def cotangent(b: GraphBuilder, node: Node, g: int, i: int) -> int:
        x, y = node.operands
        x_wins = b.compare(x, y, direction)  # ties go to x
        zero = _full_like(b, g, 0.0)
        return b.select(x_wins, g, zero) if i == 0 else b.select(x_wins, zero, g)

    return cotangent


register_vjp("max")(_extremum_vjp("ge"))
register_vjp("min")(_extremum_vjp("le"))


@register_vjp("select", no_grad=(0,))
def _select_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    zero = _full_like(b, g, 0.0)
    return b.select(node.operands[0], g, zero) if i == 1 else b.select(node.operands[0], zero, g)


@register_vjp("convert")
def _convert_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    return b.convert(g, b.node(node.operands[0]).dtype)


# Unary ops: the derivative as f(builder, x, y=f(x), g) -> g * f'(x).
_UNARY_DERIVATIVES: dict[str, Callable[[GraphBuilder, int, int, int], int]] = {
    "neg": lambda b, x, y, g: b.neg(g),
    "copy": lambda b, x, y, g: g,
    "exp": lambda b, x, y, g: b.mul(g, y),
    "log": lambda b, x, y, g: b.div(g, x),
    "log1p": lambda b, x, y, g: b.div(g, b.add(x, _full_like(b, x, 1.0))),
    "expm1": lambda b, x, y, g: b.mul(g, b.add(y, _full_like(b, y, 1.0))),
    "sqrt": lambda b, x, y, g: b.div(b.mul(g, _full_like(b, g, 0.5)), y),
    "rsqrt": lambda b, x, y, g: b.mul(b.div(b.mul(g, y), x), _full_like(b, g, -0.5)),  # -y/(2x)
    "tanh": lambda b, x, y, g: b.mul(g, b.sub(_full_like(b, y, 1.0), b.mul(y, y))),
    "logistic": lambda b, x, y, g: b.mul(g, b.mul(y, b.sub(_full_like(b, y, 1.0), y))),
    "square": lambda b, x, y, g: b.mul(g, b.mul(x, _full_like(b, x, 2.0))),
    "abs": lambda b, x, y, g: b.mul(g, b.unary("sign", x)),
    "sin": lambda b, x, y, g: b.mul(g, b.unary("cos", x)),
    "cos": lambda b, x, y, g: b.neg(b.mul(g, b.unary("sin", x))),
    "erf": lambda b, x, y, g: b.mul(g, b.mul(_full_like(b, x, 2 / math.sqrt(math.pi)),
                                             b.exp(b.neg(b.unary("square", x))))),
}


def _unary_vjp(derivative: Callable[[GraphBuilder, int, int, int], int]) -> Cotangent:
    return lambda b, node, g, i: derivative(b, node.operands[0], node.id, g)


for _op, _derivative in _UNARY_DERIVATIVES.items():
    register_vjp(_op)(_unary_vjp(_derivative))


# -- layout --------------------------------------------------------------------------------------


@register_vjp(OpKind.BROADCAST)
def _broadcast_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    """Sum over the new dims and over size-1 dims that were stretched, then restore the 1s."""
    x, dims = b.node(node.operands[0]), node.attr("dims")
    stretched = [d for k, d in enumerate(dims) if x.shape[k] == 1 and node.shape[d] != 1]
    summed = sorted(set(range(node.rank)) - set(dims) | set(stretched))
    total = b.reduce(g, summed) if summed else g
    return total if b.shape(total) == x.shape else b.reshape(total, x.shape)


@register_vjp(OpKind.RESHAPE)
def _reshape_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    return b.reshape(g, b.shape(node.operands[0]))


@register_vjp(OpKind.TRANSPOSE)
def _transpose_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    perm = node.attr("perm")
    return b.transpose(g, [perm.index(d) for d in range(len(perm))])


@register_vjp(OpKind.REDUCE)
def _reduce_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    x, dims = b.node(node.operands[0]), node.attr("dims")
    kept = [d for d in range(x.rank) if d not in dims]
    spread = lambda v: b.broadcast(v, x.shape, kept)  # back to the operand's shape
    if node.op == "sum":
        return spread(g)
    if node.op == "prod":  # d(prod)/dx = prod/x: assumes no zero entries
        return b.div(spread(b.mul(g, node.id)), x.id)
    # max/min: the extreme entries share the cotangent equally (JAX's convention on ties).
    hits = b.compare(x.id, spread(node.id), "eq")
    count = b.reduce(b.convert(hits, x.dtype), dims)
    return b.select(hits, spread(b.div(g, count)), b.zeros(x.shape, x.dtype))


@register_vjp(OpKind.SLICE)
def _slice_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    """Pad the cotangent with zeros back to the operand's shape, one dim at a time."""
    x = b.node(node.operands[0])
    padded = g
    for d, (start, limit) in enumerate(zip(node.attr("start"), node.attr("limit"), strict=True)):
        before, after = start, x.shape[d] - limit
        if before or after:
            shape = list(b.shape(padded))
            parts = [b.zeros(shape[:d] + [before] + shape[d + 1:], x.dtype)] if before else []
            parts.append(padded)
            parts += [b.zeros(shape[:d] + [after] + shape[d + 1:], x.dtype)] if after else []
            padded = b.concatenate(parts, d)
    return padded


@register_vjp(OpKind.CONCATENATE)
def _concatenate_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    dim = node.attr("dim")
    offset = sum(b.shape(o)[dim] for o in node.operands[:i])
    start = [0] * node.rank
    start[dim] = offset
    limit = list(node.shape)
    limit[dim] = offset + b.shape(node.operands[i])[dim]
    return b.slice(g, start, limit)


# -- indexing ------------------------------------------------------------------------------------


@register_vjp(OpKind.GATHER, no_grad=(1,))
def _gather_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    """Scatter the cotangent back to where each entry was read. Filled (out-of-range) entries
    read nothing and are dropped; clamped ones would belong to the edge entry but are dropped too."""
    operand, indices = node.operands
    return b.scatter_add(b.shape(operand), indices, g, node.attr("axis"), node.attr("batch_dims"),
                         dtype=b.node(operand).dtype)


@register_vjp(OpKind.SCATTER_ADD, no_grad=(0,))
def _scatter_add_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    """Read the cotangent where each update was added; dropped (out-of-range) updates get zero."""
    return b.gather(g, node.operands[0], node.attr("axis"), node.attr("batch_dims"), fill_value=0.0)


# -- convolutions and windows --------------------------------------------------------------------


def _spatial(b: GraphBuilder, x: int, dims: tuple[int, ...]) -> list[int]:
    return [b.shape(x)[d] for d in dims[2:]]


def _swap_roles(spec: tuple[int, ...]) -> tuple[int, ...]:
    return (spec[1], spec[0], *spec[2:])


@register_vjp(OpKind.CONV)
def _conv_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    """The input's cotangent is a convolution of g (dilated by the strides) with the flipped kernel,
    input and output features swapped; the kernel's is a convolution of the input with g, the
    batch being contracted (input and output swap the batch and feature roles)."""
    dims = ConvDims.of(node)
    lhs, rhs = node.operands
    strides, padding = node.attr("window_strides"), node.attr("padding")
    lhs_dil, rhs_dil = node.attr("lhs_dilation"), node.attr("rhs_dilation")
    sizes, windows, out_sizes = _spatial(b, lhs, dims.lhs), _spatial(b, rhs, dims.rhs), _spatial(b, g, dims.out)
    groups, batch_groups = node.attr("feature_group_count"), node.attr("batch_group_count")
    if i == 1:
        pads = kernel_padding(sizes, windows, strides, out_sizes, padding, lhs_dil, rhs_dil)
        return b.conv(lhs, g, rhs_dil, pads, lhs_dil, strides,
                      (_swap_roles(dims.lhs), _swap_roles(dims.out), _swap_roles(dims.rhs)),
                      feature_group_count=batch_groups, batch_group_count=groups, dtype=b.node(rhs).dtype)
    if batch_groups > 1:
        raise GraphError(f"append_backward: the input gradient of conv {node.label} with batch_group_count="
                         f"{batch_groups} (a kernel gradient differentiated again) has no IR form")
    kernel, kernel_spec = b.reverse(rhs, dims.rhs[2:]), _swap_roles(dims.rhs)
    if groups > 1:  # per group: the group's output features become its input features
        kernel, kernel_spec = _regroup_kernel(b, kernel, dims.rhs, groups), _swap_roles(tuple(range(len(dims.rhs))))
    pads = transposed_padding(sizes, windows, strides, out_sizes, padding, lhs_dil, rhs_dil)
    return b.conv(g, kernel, lhs_dil, pads, strides, rhs_dil, (dims.out, kernel_spec, dims.lhs),
                  feature_group_count=groups, dtype=b.node(lhs).dtype)


def _regroup_kernel(b: GraphBuilder, kernel: int, spec: tuple[int, ...], groups: int) -> int:
    """A grouped kernel [O = groups·Og, I, taps...] (in role order) as [Og, groups·I, taps...]."""
    canonical = b.transpose(kernel, spec)
    o, i, *taps = b.shape(canonical)
    split = b.reshape(canonical, (groups, o // groups, i, *taps))
    moved = b.transpose(split, (1, 0, *range(2, len(taps) + 3)))
    return b.reshape(moved, (o // groups, groups * i, *taps))


@register_vjp(OpKind.REDUCE_WINDOW)
def _reduce_window_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    """A window sum's cotangent: every input entry sums g over the windows holding it (a window sum
    of g dilated by the strides); a window max's (min's) goes to each window's first extreme entry."""
    x = node.operands[0]
    window, strides, padding = (node.attr(k) for k in ("window_dimensions", "window_strides", "padding"))
    base, wdil = node.attr("base_dilation"), node.attr("window_dilation")
    if node.op == "sum":
        pads = transposed_padding(b.shape(x), window, strides, node.shape, padding, base, wdil)
        return b.reduce_window(g, "sum", window, base, pads, strides, wdil)
    if any(d > 1 for d in base + wdil) or any(lo < 0 or hi < 0 for lo, hi in padding):
        raise GraphError(f"append_backward: window {node.op} {node.label} with dilations or negative padding "
                         "has no IR gradient; pool without them")
    return b.select_and_scatter_add(g, x, window, strides, padding, "ge" if node.op == "max" else "le")


@register_vjp(OpKind.REVERSE)
def _reverse_vjp(b: GraphBuilder, node: Node, g: int, i: int) -> int:
    return b.reverse(g, node.attr("dims"))
