"""Stage-mesh dynamic program (Alpa §5): cut layers into stages and give each a sub-mesh.

Input: per candidate stage (first layer k, last layer i, sub-mesh m, stages left s) its
latency per micro-batch (inf when it does not fit in memory with s micro-batches in flight).
Output: the stages minimising the pipeline latency T = sum_s t_s + (B - 1) * max_s t_s, with
every device used. For each bound t_max on the slowest stage (ascending over the distinct
latencies, stopping once B * t_max >= the best T) it solves

    F(s, k, d) = min over i >= k, m with size(m) <= d and t(k..i, m, s) <= t_max of
                 t(k..i, m, s) + F(s - 1, i + 1, d - size(m)),

vectorised over (k, i, d) with NumPy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshplan.inter.schedules import pipeline_latency

INF = math.inf


@dataclass(frozen=True, slots=True)
class StageSlot:
    """One stage of a solution: layers first..last (inclusive) on sub-mesh `submesh`."""

    first: int
    last: int
    submesh: int
    latency: float


@dataclass(frozen=True, slots=True)
class StageCuts:
    """The DP's answer: stages in pipeline order and the pipeline latency they give."""

    stages: tuple[StageSlot, ...]
    total: float
    t_max_tried: int = 0  # bounds on the slowest stage the DP solved for (0 for brute force)


def plan_stages(latency: np.ndarray, sizes: Sequence[int], num_devices: int, num_microbatches: int,
                relative_bucket: float = 0.0) -> StageCuts | None:
    """Best stage plan, or None when no plan uses every device within the latencies given.

    Args:
        latency: array [K, K, num_submeshes, S + 1]; latency[k, i, m, s] is the per-micro-batch
            latency of layers k..i on sub-mesh m when it is the s-th stage from the end
            (s = 1 is the last stage); inf marks infeasible candidates and i < k.
        sizes: devices of each sub-mesh.
        num_devices: devices that must all be used.
        num_microbatches: B.
        relative_bucket: merge t_max candidates closer than this ratio (0 = exact); the plan
            found is then within that ratio of the optimum on the max term.
    """
    lat = np.asarray(latency, dtype=float)
    num_layers = lat.shape[0]
    sizes = np.asarray(sizes, dtype=int)
    candidates = np.unique(lat[np.isfinite(lat)])
    if relative_bucket > 0:
        candidates = _bucket(candidates, relative_bucket)
    best: StageCuts | None = None
    tried = 0
    for t_max in candidates:
        if best is not None and num_microbatches * t_max >= best.total:
            break
        tried += 1
        found = _solve_for_bound(lat, sizes, num_devices, t_max, num_layers)
        if found is None:
            continue
        stages = found
        total = pipeline_latency([s.latency for s in stages], num_microbatches)
        if best is None or total < best.total - 1e-15 * abs(total):
            best = StageCuts(tuple(stages), total)
    return None if best is None else StageCuts(best.stages, best.total, tried)


def _bucket(values: np.ndarray, ratio: float) -> np.ndarray:
    kept = []
    for v in values:
        if kept and v <= kept[-1] * (1 + ratio):
            kept[-1] = v  # keep the bucket's largest value so no candidate is lost
        else:
            kept.append(v)
    return np.array(kept)


def _solve_for_bound(lat: np.ndarray, sizes: np.ndarray, num_devices: int, t_max: float,
                     num_layers: int) -> list[StageSlot] | None:
    masked = np.where(lat <= t_max, lat, INF)
    # Per (sub-mesh, stages left): the longest layer range that can still meet t_max.
    finite = np.isfinite(masked)
    spans = np.arange(num_layers)[None, :] - np.arange(num_layers)[:, None] + 1  # [k, i] -> layers
    longest = np.where(finite, spans[:, :, None, None], 0).max(axis=(0, 1))  # [m, s]
    max_stages = min(lat.shape[3] - 1, num_layers, num_devices)
    # f[k, d]: best sum of latencies for layers k.. with the stages so far and d devices.
    f_prev = np.full((num_layers + 1, num_devices + 1), INF)
    f_prev[num_layers, 0] = 0.0
    history = []
    best_s, best_value = None, INF
    for s in range(1, max_stages + 1):
        f_cur = np.full_like(f_prev, INF)
        arg = np.full((num_layers, num_devices + 1, 2), -1, dtype=int)
        for m, size in enumerate(sizes):
            if size > num_devices or longest[m, s] == 0:
                continue
            shifted = np.full((num_layers + 1, num_devices + 1), INF)  # [j, d] -> F(s-1, j, d - size)
            shifted[:, size:] = f_prev[:, : num_devices + 1 - size]
            for n in range(1, int(longest[m, s]) + 1):
                k = np.arange(num_layers - n + 1)
                value = masked[k, k + n - 1, m, s][:, None] + shifted[n:, :]  # [k, d]
                better = value < f_cur[: num_layers - n + 1]
                f_cur[: num_layers - n + 1][better] = value[better]
                arg[: num_layers - n + 1][better] = (np.broadcast_to(k[:, None] + n - 1, better.shape)[better][:, None]
                                                     * np.array([1, 0]) + np.array([0, m]))
        history.append(arg)
        if f_cur[0, num_devices] < best_value:
            best_s, best_value = s, f_cur[0, num_devices]
        f_prev = f_cur
    if best_s is None:
        return None
    return _backtrack(history, lat, sizes, best_s, num_devices)


def _backtrack(history, lat, sizes, num_stages, num_devices) -> list[StageSlot]:
    stages, k, d = [], 0, num_devices
    for s in range(num_stages, 0, -1):
        i, m = history[s - 1][k, d]
        stages.append(StageSlot(int(k), int(i), int(m), float(lat[k, i, m, s])))
        k, d = i + 1, d - int(sizes[m])
    return stages


def brute_force_stages(latency: np.ndarray, sizes: Sequence[int], num_devices: int,
                       num_microbatches: int) -> StageCuts | None:
    """Exhaustive twin of `plan_stages` for tests: every cut, every sub-mesh per stage."""
    lat = np.asarray(latency, dtype=float)
    num_layers = lat.shape[0]
    best: StageCuts | None = None
    for cuts in _compositions(num_layers):
        num_stages = len(cuts)
        if num_stages > lat.shape[3] - 1:
            continue
        for meshes in itertools.product(range(len(sizes)), repeat=num_stages):
            if sum(sizes[m] for m in meshes) != num_devices:
                continue
            slots = [StageSlot(a, b, m, float(lat[a, b, m, num_stages - j]))
                     for j, ((a, b), m) in enumerate(zip(cuts, meshes, strict=True))]
            if any(math.isinf(s.latency) for s in slots):
                continue
            total = pipeline_latency([s.latency for s in slots], num_microbatches)
            if best is None or total < best.total:
                best = StageCuts(tuple(slots), total)
    return best


def _compositions(n: int):
    """All ways to cut layers 0..n-1 into contiguous (first, last) ranges."""
    for mask in range(1 << (n - 1)):
        ranges, start = [], 0
        for k in range(n - 1):
            if mask >> k & 1:
                ranges.append((start, k))
                start = k + 1
        ranges.append((start, n - 1))
        yield ranges
