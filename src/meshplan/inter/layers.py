"""Layer clustering: a sequence of operators -> layers balanced by FLOPs, cut where little crosses.

Alpa's automatic layer construction: cut the forward into `num_layers` contiguous layers that
are balanced by FLOPs and cross as few activation bytes as possible between layers. Two
dynamic programs over cut positions, both exact: the first finds the least possible FLOPs of
the heaviest layer (the pipeline's bottleneck); the second, among the cuts whose every layer
stays within `(1 + tolerance)` times that, the one crossing the fewest bytes. Every layer holds
an *anchor*: an operator of a tenth of a layer's mean FLOPs or more (a matmul), or, when there
are fewer such operators than layers, one of the `num_layers` heaviest; so no layer is left with
a few scalar ops at the end of the loss.
Pure Python and NumPy: the runtime supplies each operator's FLOPs and each cut's bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshplan.errors import OptionsError


def cluster_layers(flops: Sequence[float], cut_bytes: Sequence[float], num_layers: int,
                   tolerance: float = 0.1) -> tuple[int, ...]:
    """The first operator of each of `num_layers` layers (the first is 0).

    Args:
        flops: per operator, its FLOPs (>= 0); every layer gets some.
        cut_bytes: per operator i, the bytes crossing a cut just before it (`cut_bytes[0]` unused).
        num_layers: how many layers to make.
        tolerance: each layer's FLOPs stay within `(1 + tolerance)` times the least possible
            FLOPs of the heaviest layer.

    Raises:
        OptionsError: fewer operators with FLOPs than layers.
    """
    work = np.asarray(flops, dtype=float)
    cuts = np.asarray(cut_bytes, dtype=float)
    if len(work) != len(cuts):
        raise OptionsError(f"cluster_layers got {len(work)} operator costs and {len(cuts)} cut sizes; give one "
                           f"of each per operator")
    heavy = int(np.count_nonzero(work > 0))
    if num_layers < 1 or heavy < num_layers:
        raise OptionsError(f"cannot cut {heavy} operators that compute something into {num_layers} layers; "
                           f"ask for at most {heavy} layers (and as many pipeline stages)")
    total = float(work.sum())
    nth_heaviest = float(np.sort(work)[-num_layers])
    anchors = work >= min(total / (10 * num_layers), nth_heaviest)
    if anchors.sum() < num_layers:  # ties at the n-th heaviest FLOPs of zero
        anchors = work > 0
    bottleneck = _least_bottleneck(work, anchors, num_layers)
    starts = _min_cut(work, cuts, anchors, num_layers, (1 + tolerance) * bottleneck)
    assert starts is not None  # the bottleneck's own cuts meet the bound
    return starts


def layer_flops(flops: Sequence[float], starts: Sequence[int]) -> tuple[float, ...]:
    """The FLOPs of each layer that `starts` (from `cluster_layers`) cuts."""
    ends = [*starts[1:], len(flops)]
    return tuple(float(sum(flops[a:b])) for a, b in zip(starts, ends, strict=True))


def _least_bottleneck(work: np.ndarray, anchors: np.ndarray, num_layers: int) -> float:
    """The least possible FLOPs of the heaviest layer, every layer holding an anchor."""
    n = len(work)
    prefix = np.concatenate(([0.0], np.cumsum(work)))
    held = np.concatenate(([0], np.cumsum(anchors)))
    best = np.where(held[1:] > 0, prefix[1:], np.inf)  # best[j - 1]: ops 0..j-1 in k + 1 layers
    best = np.concatenate(([np.inf], best))
    for _ in range(1, num_layers):
        nxt = np.full(n + 1, np.inf)
        for j in range(2, n + 1):
            starts = np.arange(1, j)
            cost = np.maximum(best[starts], prefix[j] - prefix[starts])
            cost = np.where(held[j] > held[starts], cost, np.inf)
            nxt[j] = cost.min()
        best = nxt
    return float(best[n])


def _min_cut(work: np.ndarray, cuts: np.ndarray, anchors: np.ndarray, num_layers: int,
             cap: float) -> tuple[int, ...] | None:
    """Cuts minimising the bytes crossing them, every layer's FLOPs at most `cap` and holding an
    anchor operator; None if there are none."""
    n = len(work)
    prefix = np.concatenate(([0.0], np.cumsum(work)))
    held = np.concatenate(([0], np.cumsum(anchors)))
    cap = cap * (1 + 1e-9)
    # best[k][j]: least bytes crossing the cuts of ops 0..j-1 split into k + 1 layers; choice[k][j]: last start
    best = np.full((num_layers, n + 1), np.inf)
    choice = np.zeros((num_layers, n + 1), dtype=int)
    layer = prefix[1:] - prefix[0]
    best[0, 1:] = np.where((held[1:] > 0) & (layer <= cap), 0.0, np.inf)
    for k in range(1, num_layers):
        for j in range(k + 1, n + 1):
            starts = np.arange(k, j)  # the last layer is ops starts..j-1
            size = prefix[j] - prefix[starts]
            cost = best[k - 1, starts] + cuts[starts]
            cost = np.where((held[j] > held[starts]) & (size <= cap), cost, np.inf)
            i = int(np.argmin(cost))
            best[k, j], choice[k, j] = cost[i], starts[i]
    if not np.isfinite(best[num_layers - 1, n]):
        return None
    result, j = [], n
    for k in range(num_layers - 1, 0, -1):
        j = int(choice[k, j])
        result.append(j)
    return (0, *reversed(result))
