"""A loss jaxpr -> layer functions for the pipeline: cut at its marks, or clustered by FLOPs.

The loss is a closed jaxpr of flat inputs, some of them weights (the differentiated inputs).
Its top-level equations are cut into contiguous layers: after each `mark_pipeline_boundary`
when the loss has marks, else where `meshplan.inter.cluster_layers` puts the cuts (each layer
within ~10 % of the mean FLOPs, fewest activation bytes crossing). Layer k runs
`layer_k(weights_k, act_k)`: `weights_k` are the weight inputs its equations read (a weight
read by several layers goes to each of them; their gradients are summed by the caller),
`act_k` every other value defined before the cut and read at or after it (the non-weight
inputs for layer 0; batch inputs, masks and residuals ride along as long as they are needed).
The last layer returns the loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.extend.core import ClosedJaxpr, Literal

from meshplan.inter import cluster_layers
from meshplan.runtime.boundary import is_boundary
from meshplan.runtime.replay import read, replay, subjaxprs


@dataclass(frozen=True, slots=True)
class LossLayers:
    """The loss cut into layers.

    Attributes:
        fns: `fns[k](weights, act)` -> the next layer's act (a tuple), or for the last the loss
            (with aux values: `(loss, aux_tuple)`); the last also takes an (empty) targets
            argument, as pipeline stages do.
        weights: per layer, the loss input positions of the weights it reads, in input order.
        starts: per layer, the index of its first top-level equation.
        flops: per layer, its estimated FLOPs.
        marked: whether the cuts came from `mark_pipeline_boundary` calls.
        num_aux: how many aux values the loss returns besides the loss (`has_aux=True`).
    """

    fns: tuple[Callable[..., Any], ...]
    weights: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]
    flops: tuple[float, ...]
    marked: bool

    num_aux: int = 0

    @property
    def num_layers(self) -> int:
        """How many layers the loss was cut into."""
        return len(self.fns)


def count_marks(loss: ClosedJaxpr) -> int:
    """How many top-level `mark_pipeline_boundary` calls the loss makes."""
    return sum(is_boundary(eqn.primitive) for eqn in loss.jaxpr.eqns)


def split_loss(loss: ClosedJaxpr, weights: Sequence[int], num_layers: int | None) -> LossLayers:
    """Cut `loss` into layers: at its marks when `num_layers` is None, else into `num_layers` by FLOPs.

    Args:
        loss: the loss, a closed jaxpr of flat inputs returning the scalar loss (then any aux values).
        weights: positions of the inputs that are weights (differentiated).
        num_layers: how many layers to cluster into; None: one more than the marks.

    Raises:
        OptionsError: fewer operators that compute something than layers.
    """
    jaxpr = loss.jaxpr
    flops = [eqn_flops(eqn) for eqn in jaxpr.eqns]
    if num_layers is None:
        starts = (0, *(i + 1 for i, eqn in enumerate(jaxpr.eqns) if is_boundary(eqn.primitive)))
    else:
        starts = cluster_layers(flops, _live_bytes(jaxpr, set(weights)), num_layers)
    ends = (*starts[1:], len(jaxpr.eqns))
    weight_vars = {jaxpr.invars[i]: i for i in weights}
    acts = _activations(jaxpr, starts, set(weight_vars))
    consts = {v: _host(c) for v, c in zip(jaxpr.constvars, loss.consts, strict=True)}
    fns, reads = [], []
    for k, (a, b) in enumerate(zip(starts, ends, strict=True)):
        eqns = jaxpr.eqns[a:b]
        results = jaxpr.outvars if k == len(starts) - 1 else []  # a weight returned as it is: the last layer's
        read_weights = sorted({weight_vars[v] for v in [*(v for eqn in eqns for v in eqn.invars), *results]
                               if not isinstance(v, Literal) and v in weight_vars})
        reads.append(tuple(read_weights))
        outs = jaxpr.outvars if k == len(starts) - 1 else acts[k + 1]
        fns.append(_layer_fn(consts, [jaxpr.invars[i] for i in read_weights], acts[k], eqns, outs,
                             k == len(starts) - 1))
    per_layer = tuple(float(sum(flops[a:b])) for a, b in zip(starts, ends, strict=True))
    return LossLayers(tuple(fns), tuple(reads), tuple(starts), per_layer, num_layers is None, len(jaxpr.outvars) - 1)


def _activations(jaxpr: Any, starts: Sequence[int], weights: set[Any]) -> list[list[Any]]:
    """Per layer, the non-weight values it receives: defined before its start, read at or after."""
    last_use: dict[Any, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal):
                last_use[v] = i
    end = len(jaxpr.eqns)
    for v in jaxpr.outvars:
        if not isinstance(v, Literal):
            last_use[v] = end
    inputs = [v for v in jaxpr.invars if v not in weights]
    result = [inputs]
    defined = [v for v in inputs]
    for k in range(1, len(starts)):
        defined += [v for eqn in jaxpr.eqns[starts[k - 1]:starts[k]] for v in eqn.outvars]
        result.append([v for v in defined if last_use.get(v, -1) >= starts[k]])
    return result


def _live_bytes(jaxpr: Any, weights: set[int]) -> list[float]:
    """Per equation i, the bytes of non-weight values defined before i and read at or after i."""
    skip = {v for n, v in enumerate(jaxpr.invars) if n in weights} | set(jaxpr.constvars)
    born, last_use = {}, {}
    for v in jaxpr.invars:
        born[v] = 0
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal):
                last_use[v] = i
        for v in eqn.outvars:
            born[v] = i + 1
    for v in jaxpr.outvars:
        if not isinstance(v, Literal):
            last_use[v] = len(jaxpr.eqns)
    delta = np.zeros(len(jaxpr.eqns) + 2)
    for v, start in born.items():
        if v in skip or v not in last_use or last_use[v] < start:
            continue
        size = _bytes(v.aval)  # live at cuts start..last_use
        delta[start] += size
        delta[last_use[v] + 1] -= size
    return list(np.cumsum(delta)[:len(jaxpr.eqns)])


def _layer_fn(consts: dict[Any, Any], weight_vars: list[Any], act_vars: list[Any], eqns: Sequence[Any],
              out_vars: Sequence[Any], last: bool) -> Callable[..., Any]:
    def layer(weights: Sequence[Any], act: Sequence[Any], *targets: Any) -> Any:
        env = {**consts, **dict(zip(weight_vars, weights, strict=True)), **dict(zip(act_vars, act, strict=True))}
        env = replay(eqns, env)
        outs = tuple(read(env, v) for v in out_vars)
        if not last:
            return outs
        return outs[0] if len(outs) == 1 else (outs[0], outs[1:])  # the loss, and its aux values if any

    return layer


def _host(value: Any) -> Any:
    """A constant as a host array, so that jitting a stage on any sub-mesh embeds it."""
    try:
        return np.asarray(value)
    except TypeError:  # e.g. PRNG key arrays
        return value


def _bytes(aval: Any) -> float:
    try:
        return float(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)
    except TypeError:
        return 0.0


def eqn_flops(eqn: Any) -> float:
    """Estimated FLOPs of one jaxpr equation: 2 per multiply-add of a contraction, one per output
    element otherwise; nested jaxprs (jit, custom_jvp, remat, scan bodies) counted inside."""
    name = eqn.primitive.name
    out = sum(_size(v.aval) for v in eqn.outvars)
    if name == "dot_general":
        (contracting, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * out * math.prod(lhs[d] for d in contracting)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2.0 * out * math.prod(rhs) / max(out_features, 1)
    inner = subjaxprs(eqn.params)
    if inner:
        repeat = eqn.params.get("length", 1) if name == "scan" else 1
        return float(repeat * sum(eqn_flops(e) for sub in inner[:1] for e in sub.eqns))
    return float(out)


def _size(aval: Any) -> int:
    return math.prod(getattr(aval, "shape", ()))
