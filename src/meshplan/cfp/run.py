"""`meshplan cfp`: the three passes (and the comparison) on a model, with files in a folder.

Modes: "analysis" (blocks and segments), "profile" (analysis + profiles into the cache),
"search" (analysis + cached profiles + search + a measured run of the plan), "all" (every pass
and the comparison with meshplan's ILP plan). Files written to `out` (atomically):
analysis.json, profiles.json, plan.json (every operator's sharding), comparison.json.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshplan.cfp.analysis import Analysis, CfpOptions, analyze
from meshplan.cfp.cache import ProfileCache
from meshplan.cfp.export import house_plan
from meshplan.cfp.measurement import Measurement
from meshplan.cfp.models import ModelSpec, model_graph, model_spec
from meshplan.cfp.profile import Profiles, ProfileSettings, load_profiles, profile
from meshplan.cfp.report import analysis_text, comparison_text, plan_text, profiles_text
from meshplan.cfp.search import STATISTICS, CfpPlan, search
from meshplan.cluster.costs import DeviceCosts
from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.model import CostModel
from meshplan.distributed import TaskRunner, make_executor
from meshplan.errors import OptionsError
from meshplan.files import write_json_atomic
from meshplan.ir.counting import graph_flops

MODES = ("analysis", "profile", "search", "all")
Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class CfpRun:
    """What `meshplan cfp` was asked (see the command's help for each field)."""

    model: str = "gpt3-125m"
    train: bool = False
    layers: int = 2
    batch: int = 8
    seq_len: int = 0
    mesh: tuple[int, ...] = (2, 4)
    mode: str = "all"
    analytic: bool = False
    out: str = "cfp-out"
    cache: str = ""
    runs: int = 5
    warmup: int = 2
    memory: float | None = None
    max_combinations: int = 64
    statistic: str = "min"
    reduced: bool = True
    dtype: str = "f32"
    cluster_file: str = ""
    hidden: int = 0
    heads: int = 0
    ffn: int = 0
    experts: int = 0
    executor: str = "inprocess"
    ray_address: str = "local"

    def check(self) -> None:
        if self.mode not in MODES:
            raise OptionsError(f"unknown mode {self.mode!r}; use one of {', '.join(MODES)}")
        if self.statistic not in STATISTICS:
            raise OptionsError(f"unknown statistic {self.statistic!r}; use one of {', '.join(STATISTICS)}")
        ProfileSettings(self.analytic, self.runs, self.warmup, self.memory)  # checks runs and warm-up

    @property
    def cache_folder(self) -> Path:
        return Path(self.cache) if self.cache else Path(self.out) / "cache"


def run_cfp(run: CfpRun, say: Say, progress: Callable[[str, int, int], None] | None = None) -> dict[str, str]:
    """Run the passes `run.mode` asks for; print with `say`; return the files written."""
    run.check()
    spec, analysis = _analyze(run, say)
    written = {"analysis": _write(run, "analysis.json", analysis.to_dict())}
    if run.mode == "analysis":
        return written
    profiles = _profiles(run, analysis, say, progress)
    written["profiles"] = _write(run, "profiles.json", {"mode": profiles.mode, "segments": [
        p.to_dict() for p in profiles.segments]})
    if run.mode != "profile":
        written |= _search_and_run(run, spec, analysis, profiles, say)
    return written


def _analyze(run: CfpRun, say: Say) -> tuple[ModelSpec, Analysis]:
    spec = model_spec(run.model, run.layers, run.batch, run.seq_len, run.reduced, run.dtype, run.train,
                      hidden=run.hidden, heads=run.heads, ffn=run.ffn, experts=run.experts)
    say(f"model {spec.describe()}")
    if run.mode != "analysis":
        _devices_for(run.mesh)
    mesh, cost = _mesh_and_cost(run)
    analysis = analyze(model_graph(spec), mesh, CfpOptions(cost, run.max_combinations))
    for line in analysis_text(analysis):
        say(line)
    return spec, analysis


def _search_and_run(run: CfpRun, spec: ModelSpec, analysis: Analysis, profiles: Profiles, say: Say
                    ) -> dict[str, str]:
    """Search, run the plan (in mode all next to the ILP's plan, measured alike), print, write."""
    plan = search(analysis, profiles, run.memory, run.statistic)
    comparison = _compare(run, analysis, profiles, plan) if run.mode == "all" else None
    if comparison is not None:
        measured = comparison.plans[0].measured
    else:
        from meshplan.cfp.measure import measure

        measured = measure(analysis.graph, analysis.node_strategies(plan.block_choice), analysis.mesh, run.runs,
                           run.warmup)
    flops = graph_flops(analysis.graph)
    for line in plan_text(analysis, plan, measured, flops):
        say(line)
    house = house_plan(analysis, plan, spec, profiles.segments[0].device, _measured_figures(measured, flops))
    written = {"plan": _write(run, "plan.json", house.to_dict())}
    if comparison is not None:
        for line in comparison_text(comparison):
            say(line)
        written["comparison"] = _write(run, "comparison.json", comparison.to_dict())
    return written


def _profiles(run: CfpRun, analysis: Analysis, say: Say, progress) -> Profiles:
    cache = ProfileCache(run.cache_folder)
    if run.mode == "search":
        profiles = load_profiles(analysis, cache, run.analytic)
    else:
        settings = ProfileSettings(run.analytic, run.runs, run.warmup, run.memory)
        start = time.perf_counter()
        runner = None if run.executor == "inprocess" else TaskRunner(make_executor(run.executor, 2, run.ray_address))
        try:
            profiles = profile(analysis, settings, cache, progress, runner)
        finally:
            if runner is not None:
                runner.close()
        say(f"profiled {len(profiles.segments) - len(profiles.cached)} segment(s) in "
            f"{time.perf_counter() - start:.1f} s ({len(profiles.cached)} from the cache {cache.folder})")
    for line in profiles_text(analysis, profiles, run.statistic):
        say(line)
    return profiles


def _compare(run: CfpRun, analysis: Analysis, profiles: Profiles, plan: CfpPlan):
    from meshplan.cfp.compare import Comparison, combination_rows, compare_plans, ilp_plan

    table = combination_rows(analysis, profiles, run.statistic)
    rows = compare_plans(analysis, plan, ilp_plan(analysis, run.memory), run.runs, run.warmup)
    return Comparison(table.rows, table.rank_correlation, rows, table.statistic)


def _mesh_and_cost(run: CfpRun) -> tuple[LogicalMesh, CostModel]:
    """The logical mesh priced with the runtime's device costs (placeholders, or a cluster file)."""
    costs = DeviceCosts.from_cluster(run.cluster_file) if run.cluster_file else DeviceCosts()
    mesh = costs.mesh(tuple(run.mesh))
    return mesh.with_memory(run.memory), CostModel(flops_per_second=costs.flops_per_second)


def _devices_for(shape: tuple[int, ...]) -> None:
    """On CPU, ask XLA for as many host devices as the mesh has (before JAX starts; GPUs ignore it)."""
    count = 1
    for size in shape:
        count *= size
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _write(run: CfpRun, name: str, data: Any) -> str:
    path = Path(run.out) / name
    write_json_atomic(path, data)
    return str(path)


def _measured_figures(m: Measurement, flops: float) -> dict[str, float]:
    """The measured run's figures (none when it did not run)."""
    if m.status != "ok":
        return {}
    return {"mean_s": m.mean_s, "std_s": m.std_s, "median_s": m.median_s, "min_s": m.min_s, "runs": m.runs,
            "tflops": flops / m.mean_s / 1e12, "xla_peak_memory_bytes": m.peak_memory or 0.0}
