"""Optimizer updates appended to a training graph (parameters + gradients -> aliased new values).

Every update aliases its parameter (and optimizer state) to the new value, so a planner sees
the in-place weight update that ZeRO-like weight-update sharding acts on. Update nodes carry
the layer tag of the parameter they update.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshplan.errors import GraphError
from meshplan.ir import DType, GraphBuilder, Node, as_dtype

Grads = Mapping[int, int] | Sequence[int]
_LOW_PRECISION = frozenset({DType.BF16, DType.F16})


@dataclass(frozen=True, slots=True)
class _Adam:
    """Adam hyper-parameters; `step` (1-based) fixes the bias-correction constants."""

    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    step: int = 1


def append_sgd(builder: GraphBuilder, params: Sequence[int], grads: Grads, lr: float = 1e-3) -> dict[int, int]:
    """Append `p - lr * g` for every parameter and alias each parameter to its new value `<param>.new`.

    Args:
        builder: holds the forward and backward graph.
        params: parameter ids.
        grads: {param: gradient id} (as `append_backward` returns) or gradient ids aligned with `params`.
        lr: learning rate.

    Returns:
        {param: id of the updated parameter}.
    """
    grad_of = _grads_by_param(builder, params, grads)
    updated = {}
    for p in params:
        param = builder.node(p)
        with builder.layer(param.layer, param.source):
            g = _as_dtype(builder, grad_of[p], param.dtype)
            delta = builder.mul(g, builder.full(param.shape, lr, param.dtype))
            updated[p] = builder.sub(p, delta, name=_suffixed(param, "new"))
        builder.alias(p, updated[p])
    return updated


def append_momentum(builder: GraphBuilder, params: Sequence[int], grads: Grads, lr: float = 0.1,
                    momentum: float = 0.9, nesterov: bool = True) -> dict[int, int]:
    """Append SGD with momentum (optax.sgd's trace, Nesterov by default, as Alpa's Wide-ResNet
    benchmark and Flax's ImageNet example train) for every parameter, aliased in place.

    Per parameter: a state parameter `<param>.momentum` in the parameter's dtype, updated as
    v' = momentum v + g, and the weight p' = p - lr (g + momentum v') (Nesterov) or
    p' = p - lr v'.

    Returns:
        {param: id of the updated parameter}.
    """
    grad_of = _grads_by_param(builder, params, grads)
    updated = {}
    for p in params:
        param = builder.node(p)
        with builder.layer(param.layer, param.source):
            const = lambda value, shape=param.shape, dtype=param.dtype: builder.full(shape, value, dtype)  # noqa: E731
            g = _as_dtype(builder, grad_of[p], param.dtype)
            trace = builder.parameter(param.shape, param.dtype, name=_suffixed(param, "momentum"))
            new_trace = builder.add(builder.mul(const(momentum), trace), g, name=_suffixed(param, "momentum.new"))
            builder.alias(trace, new_trace)
            step = builder.add(g, builder.mul(const(momentum), new_trace)) if nesterov else new_trace
            updated[p] = builder.sub(p, builder.mul(const(lr), step), name=_suffixed(param, "new"))
        builder.alias(p, updated[p])
    return updated


def append_adam(builder: GraphBuilder, params: Sequence[int], grads: Grads, lr: float = 1e-3, b1: float = 0.9,
                b2: float = 0.999, eps: float = 1e-8, master_dtype: DType | str | None = None,
                step: int = 1, relayout: bool = False) -> dict[int, int]:
    """Append an Adam update for every parameter, with its state, and alias all of it in place.

    Per parameter: state parameters `<param>.adam_m` and `<param>.adam_v` (fp32, or f64 for f64
    parameters) updated as m' = b1 m + (1-b1) g, v' = b2 v + (1-b2) g^2, and the weight
    p' = p - lr_t m' / (sqrt(v') + eps_t), with the bias corrections of step `step` folded into
    the constants lr_t = lr sqrt(1-b2^t)/(1-b1^t) and eps_t = eps sqrt(1-b2^t) (exactly Adam's
    m_hat / (sqrt(v_hat) + eps)). New values are named `<name>.new` (`<param>.adam_m.new`, ...).

    With `master_dtype` ("f32") and a bf16/f16 parameter, the update runs on an fp32 master
    copy `<param>.master` (aliased to its update) and the new low-precision weight is its
    conversion. Without a master copy, low-precision weights are updated in fp32 and rounded.

    With `relayout`, each new weight passes through a `copy` marked `relayout`: the planner
    may lay it out apart from the optimizer state it comes from (weights whole, state sharded:
    ZeRO-1), paying one gather per step.

    Returns:
        {param: id of the updated parameter, in the parameter's dtype}.
    """
    if step < 1:
        raise GraphError(f"append_adam: step must be at least 1 (1-based, for bias correction), got {step}")
    config = _Adam(lr, b1, b2, eps, step)
    master = as_dtype(master_dtype) if master_dtype is not None else None
    grad_of = _grads_by_param(builder, params, grads)
    updated = {}
    for p in params:
        param = builder.node(p)
        with builder.layer(param.layer, param.source):
            updated[p] = _adam_one(builder, param, grad_of[p], config, master)
            if relayout:
                updated[p] = builder.unary("copy", updated[p])
                builder.tag(updated[p], relayout=True)
        builder.alias(p, updated[p])
    return updated


def _adam_one(b: GraphBuilder, param: Node, grad: int, config: _Adam, master: DType | None) -> int:
    """The new weight of one parameter; state and master copies are aliased here."""
    if master is not None and param.dtype in _LOW_PRECISION:
        weights = b.parameter(param.shape, master, name=_suffixed(param, "master"))
        new_master = _adam_weight(b, b.node(weights), grad, config, param.name)
        b.alias(weights, new_master)
        return b.convert(new_master, param.dtype, name=_suffixed(param, "new"))
    return _adam_weight(b, param, grad, config, param.name)


def _adam_weight(b: GraphBuilder, weights: Node, grad: int, config: _Adam, prefix: str) -> int:
    """Adam on `weights`, computed in the state dtype; returns the new weights in their dtype."""
    state = DType.F64 if weights.dtype is DType.F64 else DType.F32
    const = lambda value: b.full(weights.shape, value, state)  # scalars broadcast to the update's shape
    named = lambda suffix: f"{prefix}.{suffix}" if prefix else ""
    g = _as_dtype(b, grad, state)
    m, v = (b.parameter(weights.shape, state, name=named(f"adam_{s}")) for s in "mv")
    new_m = b.add(b.mul(const(config.b1), m), b.mul(const(1 - config.b1), g), name=named("adam_m.new"))
    new_v = b.add(b.mul(const(config.b2), v), b.mul(const(1 - config.b2), b.mul(g, g)), name=named("adam_v.new"))
    b.alias(m, new_m)
    b.alias(v, new_v)
    correction = math.sqrt(1 - config.b2 ** config.step)
    denom = b.add(b.unary("sqrt", new_v), const(config.eps * correction))
    delta = b.mul(const(config.lr * correction / (1 - config.b1 ** config.step)), b.div(new_m, denom))
    name = weights.name and f"{weights.name}.new"
    if weights.dtype is state:
        return b.sub(weights.id, delta, name=name)
    return b.convert(b.sub(b.convert(weights.id, state), delta), weights.dtype, name=name)


def _grads_by_param(builder: GraphBuilder, params: Sequence[int], grads: Grads) -> dict[int, int]:
    if not isinstance(grads, Mapping):
        if len(grads) != len(params):
            raise GraphError(f"optimizer: {len(params)} parameters but {len(grads)} gradients; pass one "
                             "gradient per parameter, or the dict append_backward returns")
        grads = dict(zip(params, grads, strict=True))
    for p in params:
        param = builder.node(p)
        if p not in grads:
            raise GraphError(f"optimizer: no gradient for parameter {param.label}; include it in "
                             "append_backward's wrt")
        if builder.shape(grads[p]) != param.shape:
            raise GraphError(f"optimizer: gradient {builder.node(grads[p]).label} has shape "
                             f"{builder.shape(grads[p])}, but parameter {param.label} has shape {param.shape}")
    return dict(grads)


def _as_dtype(b: GraphBuilder, x: int, dtype: DType) -> int:
    return x if b.node(x).dtype is dtype else b.convert(x, dtype)


def _suffixed(param: Node, suffix: str) -> str:
    return f"{param.name}.{suffix}" if param.name else ""
