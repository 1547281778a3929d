"""CFP's profile pass: Analysis -> Profiles (per unique segment, every strategy combination
timed on the devices at hand, or priced by the cost model).

The work is cut into `SegmentTask`s, one per unique segment, each holding everything its run
needs as plain picklable data (the segment's standalone graph and, per combination, every
node's strategy), and `run_task` is a module-level function: tasks can go to a process pool or
a Ray cluster unchanged. `profile` runs them here, one after the other, reusing the cache.
Only measured tasks touch JAX, and only inside `run_task`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshplan.cfp.analysis import Analysis
from meshplan.cfp.cache import ProfileCache
from meshplan.cfp.measurement import Measurement
from meshplan.cfp.price import Price, price
from meshplan.cfp.segments import structural_hash
from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.model import CostModel
from meshplan.distributed import Task, TaskRunner, run_tasks
from meshplan.errors import MeshplanError, OptionsError
from meshplan.ir.graph import Graph
from meshplan.sharding.strategy import Strategy

ANALYTIC = "analytic"
MEASURED = "measured"
Progress = Callable[[str, int, int], None]  # (label, done, total)


@dataclass(frozen=True, slots=True)
class ProfileSettings:
    """How combinations are profiled.

    Attributes:
        analytic: price with the cost model instead of running.
        runs, warmup: timed and untimed calls per combination.
        memory_limit: bytes per device a combination may use (None: the device's own limit,
            if it reports one); beyond it the combination is recorded as out of memory.
    """

    analytic: bool = False
    runs: int = 5
    warmup: int = 2
    memory_limit: float | None = None

    def __post_init__(self) -> None:
        if self.runs < 1 or self.warmup < 0:
            raise OptionsError(f"runs must be at least 1 and warmup at least 0, got {self.runs} and {self.warmup}")

    @property
    def mode(self) -> str:
        return ANALYTIC if self.analytic else MEASURED


@dataclass(frozen=True, slots=True)
class Combination:
    """One choice of candidate per block of a segment, and the strategy it gives every node."""

    choice: tuple[int, ...]
    names: tuple[str, ...]
    layouts: tuple[Strategy, ...]


@dataclass(frozen=True, slots=True)
class SegmentTask:
    """Everything needed to profile one unique segment (picklable)."""

    segment: int
    key: str
    structure: str
    graph: Graph
    combinations: tuple[Combination, ...]
    mesh: LogicalMesh
    model: CostModel
    settings: ProfileSettings


@dataclass(frozen=True, slots=True)
class CombinationProfile:
    """What one combination cost.

    Attributes:
        choice, names: the candidate of each block (index and readable name).
        status: "ok", "oom" or "error" (then `message` says why).
        time_s: measured mean seconds (analytic: the cost model's time); None unless ok.
        std_s, median_s, min_s: spread, median and fastest of the timed runs.
        peak_memory: bytes per device (XLA's memory analysis, or the cost model's live sets).
        predicted_s, volume: the cost model's time and bytes sent per device, for comparison.
    """

    choice: tuple[int, ...]
    names: tuple[str, ...]
    status: str
    time_s: float | None
    std_s: float | None
    median_s: float | None
    min_s: float | None
    peak_memory: float | None
    predicted_s: float
    volume: float
    compile_s: float = 0.0
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def time(self, statistic: str = "mean") -> float | None:
        """Seconds by `statistic`: "mean", "median" or "min" of the timed runs."""
        return {"mean": self.time_s, "median": self.median_s, "min": self.min_s}[statistic]


@dataclass(frozen=True, slots=True)
class SegmentProfile:
    """The profiles of one unique segment on one mesh and device kind."""

    key: str
    structure: str
    mesh: tuple[int, ...]
    device: str
    mode: str
    combinations: tuple[CombinationProfile, ...]
    settings: dict[str, Any] = field(default_factory=dict)

    def by_choice(self) -> dict[tuple[int, ...], CombinationProfile]:
        return {c.choice: c for c in self.combinations}

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "structure": self.structure, "mesh": list(self.mesh), "device": self.device,
                "mode": self.mode, "settings": self.settings,
                "combinations": [{"choice": list(c.choice), "names": list(c.names), "status": c.status,
                                  "time_s": c.time_s, "std_s": c.std_s, "median_s": c.median_s, "min_s": c.min_s,
                                  "peak_memory_bytes": c.peak_memory,
                                  "predicted_s": c.predicted_s, "volume_bytes": c.volume, "compile_s": c.compile_s,
                                  "message": c.message} for c in self.combinations]}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> SegmentProfile:
        combos = tuple(CombinationProfile(tuple(c["choice"]), tuple(c["names"]), c["status"], c["time_s"],
                                          c["std_s"], c["median_s"], c["min_s"], c["peak_memory_bytes"],
                                          c["predicted_s"], c["volume_bytes"], c.get("compile_s", 0.0),
                                          c.get("message", ""))
                       for c in data["combinations"])
        return SegmentProfile(data["key"], data["structure"], tuple(data["mesh"]), data["device"], data["mode"],
                              combos, data.get("settings", {}))


@dataclass(frozen=True, slots=True)
class Profiles:
    """Per unique segment (by index), its profile; and which ones came from the cache."""

    segments: tuple[SegmentProfile, ...]
    cached: tuple[int, ...] = ()
    mode: str = MEASURED


def segment_tasks(analysis: Analysis, settings: ProfileSettings) -> tuple[SegmentTask, ...]:
    """One task per unique segment, with every combination of its blocks' candidates."""
    tasks = []
    for segment in analysis.segments:
        blocks = [analysis.blocks[b] for b in segment.blocks]
        combos = []
        for choice in itertools.product(*(range(len(b.strategies)) for b in blocks)):
            layouts = analysis.segment_layouts(segment.extract, segment.blocks, choice)
            names = tuple(b.strategies[k].name for b, k in zip(blocks, choice, strict=True))
            combos.append(Combination(choice, names, layouts))
        tasks.append(SegmentTask(segment.index, segment.key, segment.structure, segment.extract.graph,
                                 tuple(combos), analysis.mesh, analysis.options.cost, settings))
    return tuple(tasks)


def run_task(task: SegmentTask, progress: Progress | None = None) -> SegmentProfile:
    """Profile every combination of one segment (the unit of work a pool or Ray would run)."""
    s = task.settings
    label, total = f"segment {task.segment}", len(task.combinations)
    predicted = [price(task.graph, c.layouts, task.mesh, task.model) for c in task.combinations]
    if s.analytic:
        results = [_analytic(c, p, s.memory_limit) for c, p in zip(task.combinations, predicted, strict=True)]
        device = ANALYTIC
    else:
        from meshplan.cfp.measure import device_kind, measure_many

        done = (lambda n: progress(label, n, total)) if progress else None
        measured = measure_many(task.graph, [c.layouts for c in task.combinations], task.mesh, s.runs, s.warmup,
                                s.memory_limit, done)
        results = [_measured(c, p, m) for c, p, m in zip(task.combinations, predicted, measured, strict=True)]
        device = device_kind()
    if progress:
        progress(label, total, total)
    return SegmentProfile(task.key, task.structure, task.mesh.shape, device, s.mode, tuple(results),
                          {"runs": s.runs, "warmup": s.warmup, "memory_limit": s.memory_limit})


def _analytic(combo: Combination, predicted: Price, memory_limit: float | None) -> CombinationProfile:
    fits = memory_limit is None or predicted.peak_memory <= memory_limit
    time_s = predicted.time if fits else None
    return CombinationProfile(combo.choice, combo.names, "ok" if fits else "oom", time_s, 0.0, time_s, time_s,
                              predicted.peak_memory, predicted.time, predicted.volume)


def _measured(combo: Combination, predicted: Price, m: Measurement) -> CombinationProfile:
    return CombinationProfile(combo.choice, combo.names, m.status, m.mean_s, m.std_s, m.median_s, m.min_s,
                              m.peak_memory, predicted.time, predicted.volume, m.compile_s, m.message)


def profile(analysis: Analysis, settings: ProfileSettings | None = None, cache: ProfileCache | None = None,
            progress: Progress | None = None, runner: TaskRunner | None = None) -> Profiles:
    """Profile every unique segment of `analysis` (see the module docstring).

    Args:
        analysis: from `analyze`.
        settings: measured or analytic, runs, warm-up, memory limit.
        cache: where profiles are kept between runs; segments found there are not re-run.
        progress: called with (label, combinations done, total) as work proceeds; with a
            runner, (label, segments done, segments to profile).
        runner: runs the segment tasks (meshplan.distributed: a process pool or Ray, each worker
            measuring on the devices it sees); None: one after the other in this process.

    Raises:
        PlanValidationError: a cache file is unreadable or of another schema.
        MeshError: a measured profile needs more devices than JAX sees.
        MeshplanError: with a runner, a segment task failed every attempt.
    """
    settings = settings or ProfileSettings()
    device = ANALYTIC if settings.analytic else _device_kind()
    found: list[SegmentProfile | None] = []
    cached, todo = [], []
    for task in segment_tasks(analysis, settings):
        hit = cache.load(task.structure, task.key, task.mesh.shape, device, settings.mode) if cache else None
        if hit is None:
            todo.append((len(found), task))
        else:
            cached.append(task.segment)
            if progress:
                progress(f"segment {task.segment} (cached)", len(task.combinations), len(task.combinations))
        found.append(hit)
    for index, hit in _run_segments([t for _, t in todo], runner, progress):
        found[todo[index][0]] = hit
        if cache:
            cache.store(hit)
    if cache:
        cache.record_run(structural_hash(analysis.graph), analysis.graph.name, analysis.mesh.shape, device,
                         settings.mode)
    return Profiles(tuple(p for p in found if p is not None), tuple(cached), settings.mode)


def _run_segments(tasks: list[SegmentTask], runner: TaskRunner | None, progress: Progress | None):
    """(index, profile) of each task: here one after the other, or through the runner."""
    if runner is None:
        for index, task in enumerate(tasks):
            yield index, run_task(task, progress)
        return
    work = [Task(f"segment {t.segment}", "", t) for t in tasks]
    for index, outcome in enumerate(run_tasks(run_task, work, runner, progress, "profiling segments")):
        if not outcome.ok:
            raise MeshplanError(f"profiling {outcome.name} failed {outcome.attempts} time(s): {outcome.error}; "
                                "run `meshplan cfp` again (finished segments are cached)")
        yield index, outcome.value


def load_profiles(analysis: Analysis, cache: ProfileCache, analytic: bool = False) -> Profiles:
    """The cached profiles of every unique segment (for re-running the search alone).

    Raises:
        PlanValidationError: the cache holds no profiles of this graph for this mesh and device
            (the message says when it holds them for another mesh), or misses a segment.
    """
    mode = ANALYTIC if analytic else MEASURED
    device = ANALYTIC if analytic else _device_kind()
    cache.check_run(structural_hash(analysis.graph), analysis.graph.name, analysis.mesh.shape, device, mode)
    found = tuple(cache.require(s.structure, s.key, analysis.mesh.shape, device, mode, f"segment {s.index}")
                  for s in analysis.segments)
    return Profiles(found, tuple(range(len(found))), mode)


def _device_kind() -> str:
    from meshplan.cfp.measure import device_kind

    return device_kind()
