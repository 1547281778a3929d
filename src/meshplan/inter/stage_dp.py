"""Stage-mesh dynamic program (Alpa §5): cut layers into stages and give each a sub-mesh.

Input: per candidate stage (first layer k, last layer i, sub-mesh m, stages left s) its
latency per micro-batch (inf when it does not fit in memory with s micro-batches in flight).
Output: the stages minimising the pipeline latency T = sum_s t_s + (B - 1) * max_s t_s, with
every device used. For a bound t_max on the slowest stage it solves

    F(s, k, d) = min over i >= k, m with size(m) <= d and t(k..i, m, s) <= t_max of
                 t(k..i, m, s) + F(s - 1, i + 1, d - size(m)),

vectorised over (k, d) with NumPy, and S(t_max) = min_s F(s, 0, D) is the least latency sum of
a plan whose stages all take at most t_max. The optimum is T* = min over t_max of
S(t_max) + (B - 1) * t_max, taken over the distinct stage latencies. Rather than solving for
every one (Alpa's loop), a branch and bound visits them: S never grows with t_max, so on a run
of candidates c_lo..c_hi whose upper end is solved, S(c_hi) + (B - 1) * c_lo bounds them all
from below and the run is dropped once that bound reaches the best plan; a plan solved at c_hi
whose slowest stage takes t* < c_hi settles every candidate in [t*, c_hi] at once. No solve
starts it: every sum is at least the cheapest cut of the layers with devices ignored
(`least_sum`), so the first probe is the middle candidate, and the top candidates, whose solves
use every sub-mesh and device column, are solved only when that bound cannot drop them. The
answer is exactly Alpa's (tests compare it with exhaustive search).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshplan.inter.schedules import pipeline_latency

INF = math.inf
# Cells of the stage DP's temporary per relaxation step (8 bytes each).
CHUNK_CELLS = 1 << 21


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
                relative_bucket: float = 0.0, chunks: int = 1) -> StageCuts | None:
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
        chunks: v model chunks per device (interleaved 1F1B): `num_microbatches` is then v·B and
            the price v times the interleaved latency (`_cuts`).
    """
    lat = np.asarray(latency, dtype=float)
    sizes = np.asarray(sizes, dtype=int)
    used = [m for m in range(len(sizes)) if 0 < sizes[m] <= num_devices and np.isfinite(lat[:, :, m, 1:]).any()]
    if not used:
        return None
    # Count devices in units of the sizes' common divisor (whole nodes, often): same plans, fewer columns.
    unit = math.gcd(*(int(size) for size in sizes[used]))
    if num_devices % unit:
        return None
    table = _BandTable(lat[:, :, used, :], sizes[used] // unit, num_devices // unit)
    candidates = table.candidates()
    if relative_bucket > 0:
        candidates = _bucket(candidates, relative_bucket)
    found = _branch_and_bound(table, candidates, num_microbatches, chunks)
    if found is None:
        return None
    cuts, tried = found
    stages = tuple(StageSlot(s.first, s.last, used[s.submesh], s.latency) for s in cuts.stages)
    return StageCuts(stages, cuts.total, tried)


def _bucket(values: np.ndarray, ratio: float) -> np.ndarray:
    kept: list[float] = []
    for v in values:
        if kept and v <= kept[-1] * (1 + ratio):
            kept[-1] = v  # keep the bucket's largest value so no candidate is lost
        else:
            kept.append(v)
    return np.array(kept)


def _branch_and_bound(table: _BandTable, candidates: np.ndarray, num_microbatches: int, chunks: int = 1
                      ) -> tuple[StageCuts, int] | None:
    """min over t_max in `candidates` of S(t_max) + (B - 1) t_max, solving few of them (see the
    module docstring); returns the best plan and how many bounds were solved."""
    tail = num_microbatches - 1
    best: StageCuts | None = None
    tried = 0
    # Runs [lo, hi) of candidates not yet settled, with S(c) >= upper_sum on all of them.
    runs: list[tuple[float, int, int, float]] = []

    def push(lo: int, hi: int, upper_sum: float) -> None:
        if lo < hi:
            heapq.heappush(runs, (upper_sum + tail * candidates[lo], lo, hi, upper_sum))

    # No solve starts the search: the first run's sums are bounded by the least sum of any cut
    # (`least_sum`), so the slowest bounds, whose solves use every sub-mesh and device column
    # and cost the most, are dropped by their max term alone once a plan below them is found.
    push(0, len(candidates), table.least_sum())
    while runs:
        bound, lo, hi, upper_sum = heapq.heappop(runs)
        if best is not None and bound >= best.total:
            break  # the heap is ordered by bound: nothing left can do better
        mid = (lo + hi) // 2 if hi - lo > 2 else hi - 1  # probe the top of short runs: it settles most
        if tried and hi == len(candidates):
            mid = hi - 1  # the top run, bounded by least_sum alone, survived a first plan: its sum tightens it
        solved = table.solve(candidates[mid])
        tried += 1
        if solved is None:  # nothing fits under candidates[mid], so nothing under the smaller ones
            push(mid + 1, hi, upper_sum)
            continue
        cuts = _cuts(solved, num_microbatches, chunks)
        if best is None or cuts.total < best.total - 1e-15 * abs(cuts.total):
            best = cuts
        solved_sum = sum(s.latency for s in solved)
        push(lo, _below(candidates, solved, mid), solved_sum)
        push(mid + 1, hi, upper_sum)
    if best is None:
        return None
    return best, tried


def _below(candidates: np.ndarray, stages: list[StageSlot], index: int) -> int:
    """Candidates from the plan's slowest stage up to `index` share its sum: they are settled."""
    slowest = max(s.latency for s in stages)
    return min(index, int(np.searchsorted(candidates, slowest, side="left")))


def _cuts(stages: list[StageSlot], num_microbatches: int, chunks: int = 1) -> StageCuts:
    """The stages priced in the DP's unit: with v chunks, v times the interleaved latency of
    num_microbatches / v micro-batches, i.e. the closed form sum + (v B - 1) t_max the bounds use,
    or more when there are fewer micro-batches than stages (`schedules.pipeline_latency`). The
    price never falls below that closed form and grows with the sum and t_max alike, so the
    bounds and the DP's argument stay exact."""
    latencies = [s.latency for s in stages]
    return StageCuts(tuple(stages), chunks * pipeline_latency(latencies, num_microbatches // chunks, chunks))


class _BandTable:
    """The latency table by span: spans[s, m, n - 1, k] = latency of layers k..k+n-1 on sub-mesh
    m as the s-th stage from the end (inf past the last layer), so the DP's inner step gathers
    the spans it relaxes of one (s, m) in one indexing."""

    def __init__(self, lat: np.ndarray, sizes: np.ndarray, num_devices: int) -> None:
        self.num_layers = k_all = lat.shape[0]
        self.sizes = sizes
        self.num_devices = num_devices
        self.max_stages = min(lat.shape[3] - 1, self.num_layers, num_devices // int(sizes.min()))
        stage_counts = self.max_stages + 1
        self.spans = np.full((stage_counts, lat.shape[2], k_all, k_all), INF)
        for n in range(1, k_all + 1):
            diagonal = np.diagonal(lat, offset=n - 1, axis1=0, axis2=1)  # [m, s, k]
            self.spans[:, :, n - 1, :k_all - n + 1] = diagonal[:, :stage_counts].transpose(1, 0, 2)
        # Fastest candidate per (span, s, m): spans whose fastest exceeds t_max are skipped.
        self.fastest = self.spans.min(axis=3).transpose(2, 0, 1)  # [n - 1, s, m]

    def candidates(self) -> np.ndarray:
        values = self.spans[1:].ravel()
        return np.unique(values[np.isfinite(values)])

    def least_sum(self) -> float:
        """A lower bound on the latency sum of any plan: the cheapest path through the layers
        with each span at its fastest over sub-meshes and stage counts, ignoring devices."""
        k_all = self.num_layers
        fastest = self.spans[1:].min(axis=(0, 1))  # [n - 1, k]
        cheapest = np.full(k_all + 1, INF)
        cheapest[k_all] = 0.0
        for k in range(k_all - 1, -1, -1):
            cheapest[k] = (fastest[:k_all - k, k] + cheapest[k + 1:]).min()
        return float(cheapest[0]) if np.isfinite(cheapest[0]) else 0.0

    def solve(self, t_max: float) -> list[StageSlot] | None:
        """The least-sum plan whose stages all take at most t_max (None: none uses every device)."""
        usable = self.fastest <= t_max  # [span - 1, s, m]
        live = np.flatnonzero(usable.any(axis=(0, 1)))
        if not live.size:
            return None
        # Devices in units of the common divisor of the sub-meshes some stage may use under t_max
        # (whole nodes, often, once small sub-meshes are too slow): other columns are never
        # reached, the reached ones get the same sums.
        unit = math.gcd(*(int(self.sizes[m]) for m in live))
        if self.num_devices % unit:
            return None
        sizes, k_all, d_all = self.sizes // unit, self.num_layers, self.num_devices // unit
        f_prev = np.full((k_all + 1, d_all + 1), INF)
        f_prev[k_all, 0] = 0.0
        history = [f_prev]
        best_s, best_value = 0, INF
        largest, smallest = int(sizes[live].max()), int(sizes[live].min())
        longest = int(np.flatnonzero(usable.any(axis=(1, 2))).max(initial=-1)) + 1
        padded = np.full((2 * k_all + 1, d_all + 1), INF)  # F(s - 1, ., .) with inf rows past K
        for s in range(1, self.max_stages + 1):
            f_cur = np.full_like(f_prev, INF)
            padded[:k_all + 1] = f_prev
            # s stages hold layers k.. only if s <= K - k <= s * longest, and use s * smallest
            # to s * largest devices: the rest of F(s, ., .) stays inf without being computed.
            k_lo, k_hi = max(0, k_all - s * longest), k_all - s
            d_lo, d_hi = s * smallest, min(d_all, s * largest)
            # Only sums onto a finite F(s - 1, k + n, d - size) can be finite: the rows and
            # columns of F(s, ., .) no stage reaches from one stay inf without being computed.
            reached = np.isfinite(f_prev)
            rows, cols = np.flatnonzero(reached.any(axis=1)), np.flatnonzero(reached.any(axis=0))
            if k_hi < 0 or d_lo > d_all or not rows.size:
                break
            for m in live:
                size = int(sizes[m])
                c0, c1 = max(size, d_lo, int(cols[0]) + size), min(d_hi, int(cols[-1]) + size) + 1
                spans = np.flatnonzero(usable[:, s, m]) + 1
                spans = spans[spans <= k_all - k_lo]
                if c0 >= c1 or not spans.size:
                    continue
                first, last = max(k_lo, int(rows[0]) - int(spans[-1])), min(k_hi, int(rows[-1]) - int(spans[0]))
                if first <= last:
                    self._relax(f_cur[first:last + 1, c0:c1], padded[:, c0 - size:c1 - size], spans, s, m, first,
                                t_max)
            history.append(f_cur)
            if f_cur[0, d_all] < best_value:
                best_s, best_value = s, f_cur[0, d_all]
            f_prev = f_cur
        if best_s == 0:
            return None
        return self._backtrack(history, best_s, t_max, sizes, live)

    def _relax(self, target: np.ndarray, previous: np.ndarray, spans: np.ndarray, s: int, m: int, k_lo: int,
               t_max: float) -> None:
        """target[k - k_lo, d] = min(target, t(k..k+n-1) + previous[k + n, d]) over the spans n,
        all spans at once (in chunks that bound the temporary): the same sums as one by one."""
        rows = target.shape[0]
        chunk = max(1, CHUNK_CELLS // max(1, rows * target.shape[1]))
        for start in range(0, spans.size, chunk):
            part = spans[start:start + chunk]
            bands = self.spans[s, m][part - 1, k_lo:k_lo + rows]  # a copy: masked below
            bands[bands > t_max] = INF
            firsts = np.arange(k_lo, k_lo + rows)
            sums = previous[firsts[None, :] + part[:, None]]  # a copy, summed in place
            sums += bands[:, :, None]
            np.minimum(target, sums.min(axis=0), out=target)

    def _backtrack(self, history: list[np.ndarray], num_stages: int, t_max: float, sizes: np.ndarray,
                   live: np.ndarray) -> list[StageSlot]:
        """The stages of F(num_stages, 0, D), sub-mesh sizes and D in the units `solve` used."""
        stages, k, d = [], 0, history[0].shape[1] - 1
        for s in range(num_stages, 0, -1):
            target, before = history[s][k, d], history[s - 1]
            stages.append(self._step(before, s, k, d, target, t_max, sizes, live))
            k, d = stages[-1].last + 1, d - int(sizes[stages[-1].submesh])
        return stages

    def _step(self, before: np.ndarray, s: int, k: int, d: int, target: float, t_max: float, sizes: np.ndarray,
              live: np.ndarray) -> StageSlot:
        """The stage (k..i on m) that gives F(s, k, d) = target: the same sums as the forward pass."""
        for m in map(int, live):
            size = int(sizes[m])
            if size > d:
                continue
            for n in range(1, self.num_layers - k + 1):
                t = self.spans[s, m, n - 1, k]
                if t <= t_max and t + before[k + n, d - size] == target:
                    return StageSlot(k, k + n - 1, m, float(t))
        raise AssertionError("stage DP backtracking lost its path")  # pragma: no cover


def brute_force_stages(latency: np.ndarray, sizes: Sequence[int], num_devices: int,
                       num_microbatches: int, chunks: int = 1) -> StageCuts | None:
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
            priced = _cuts(slots, num_microbatches, chunks)
            if best is None or priced.total < best.total:
                best = priced
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
