"""Simulate training a model on a cluster: the auto plan, its prediction, and the baselines.

Input: a TrainingJob and a Cluster. Output: a Simulation: the auto plan as a `Plan` (with each
stage's piece plans, the baselines' predictions and the planner's seconds per phase inside it,
so one file tells the whole story), and each baseline's own `Plan`.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from meshplan.cluster.cluster import Cluster
from meshplan.cost.kernels import WORKSPACE_BYTES
from meshplan.distributed import TaskRunner
from meshplan.errors import InfeasiblePlanError
from meshplan.inter.placement import place_submeshes
from meshplan.plan import NOT_APPLICABLE, BaselineSummary, Plan, Prediction, Stage
from meshplan.simulator.analytic import LayoutPrediction, LayoutSearch, search_layouts
from meshplan.simulator.baselines import Baseline, evaluate_data_parallel, evaluate_megatron
from meshplan.simulator.graph_pricing import GraphPricer
from meshplan.simulator.job import PlannerOptions, TrainingJob
from meshplan.simulator.layout import parse_layout
from meshplan.simulator.planner import (
    PipelinePlan,
    PlannerStats,
    Progress,
    capacity,
    default_runner,
    no_fit_message_without_layouts,
    plan_training,
    planned_microbatch_sizes,
)
from meshplan.simulator.pricing import GRAPH, cost_model_name, layer_overhead, task_name
from meshplan.simulator.stage_plans import PlannedPiece, block_runs, replayed, with_pieces, with_stage_plans


@dataclass(frozen=True, slots=True)
class BaselineResult:
    """A baseline: its name and configuration, its plan or why none fits."""

    name: str
    config: str
    plan: Plan | None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Simulation:
    """The auto plan (baseline predictions and planner seconds included) and the baselines' plans."""

    plan: Plan
    baselines: tuple[BaselineResult, ...]

    @property
    def phases(self) -> dict[str, float]:
        """Planner seconds per phase."""
        return self.plan.metrics_under("planner_s.")

    def to_dict(self) -> dict:
        return self.plan.to_dict()


def to_plan(pipeline: PipelinePlan, job: TrainingJob, cluster: Cluster, cost_model: str = GRAPH) -> Plan:
    """A simulated pipeline as a Plan, its stages placed on the cluster (each stage's memory
    with the runtime's workspace); `cost_model` names the pricer."""
    stages = _placed(pipeline, cluster)
    inter = pipeline.inter
    seconds = inter.iteration_time
    tflops = job.model_flops / seconds / cluster.num_devices / 1e12
    prediction = Prediction(seconds, inter.pipeline_time, inter.sync_time, job.tokens / seconds, tflops,
                            tflops * 1e12 / cluster.device.peak_flops, max(s.memory_bytes for s in stages),
                            cost_model)
    return Plan("simulate", job.model.name, stages, inter.schedule, inter.num_microbatches, inter.chunks,
                pipeline.microbatch_size, job.global_batch, plan_seq_len(job), job.model.num_params(),
                (cluster.nodes, cluster.devices_per_node), cluster.device.name, prediction, pipeline.label,
                options=(("dtype", job.dtype.short_name), ("optimizer", job.optimizer), *unit_option(job)))


def plan_seq_len(job: TrainingJob) -> int:
    """The plan's tokens per sequence: 0 for image models (a sample is an image)."""
    return job.seq_len if job.model.sample_unit == "tokens" else 0


def unit_option(job: TrainingJob) -> tuple[tuple[str, str], ...]:
    """The plan option naming what its throughput counts, when not tokens (reports read it)."""
    unit = job.model.sample_unit
    return () if unit == "tokens" else (("unit", unit),)


def _placed(pipeline: PipelinePlan, cluster: Cluster) -> tuple[Stage, ...]:
    estimates = pipeline.stages
    devices = [s.devices for s in estimates]
    if not all(devices):  # baselines are priced unplaced; the DP's plans come placed
        origins = place_submeshes([s.submesh for s in estimates], cluster.nodes, cluster.devices_per_node)
        origins = origins or [(0, 0)] * len(estimates)  # tiling was checked before; keep the plan readable
        devices = [cluster.submesh_ids(s.submesh, o) for s, o in zip(estimates, origins, strict=True)]
    return tuple(Stage(s.first, s.last, ids, s.view, s.submesh, None, "fastest" if s.menu == 0 else f"lean-{s.menu}",
                       s.recompute, s.latency, s.memory + WORKSPACE_BYTES, s.inflight, s.sync_time, s.update_time)
                 for s, ids in zip(estimates, devices, strict=True))


def layout_plan(found: LayoutPrediction, job: TrainingJob, cluster: Cluster, label: str = "layout") -> Plan:
    """A priced layout as a Plan: one stage per pipeline stage on Megatron's rank order
    (tensor-parallel fastest, then context-, data-parallel, then stages), the memory breakdown
    and the time range in its metrics, idle devices in its notes."""
    lay = found.layout
    per_stage = lay.stage_devices
    bounds = [round(j * job.model.layers / lay.pp) for j in range(lay.pp + 1)]
    per_node = cluster.devices_per_node
    submesh = (math.ceil(per_stage / per_node), per_node) if per_stage >= per_node else (1, per_stage)
    # Every stage waits for the slowest stage's gradient sync and optimizer step, as the
    # closed form charges them to the iteration.
    parts = dict(found.breakdown)
    sync, update = parts["exposed data-parallel communication"], parts["optimizer step"]
    stages = tuple(Stage(bounds[j], bounds[j + 1] - 1, tuple(range(j * per_stage, (j + 1) * per_stage)),
                         (lay.dp * lay.cp, lay.tp), submesh, None, "layout", lay.recompute, found.stage_times[j],
                         found.memory.total, None, sync, update) for j in range(lay.pp))
    seconds = found.iteration_time
    tflops = found.model_flops / seconds / cluster.num_devices / 1e12
    prediction = Prediction(seconds, found.pipeline_time, found.sync_time, job.tokens / seconds, tflops, found.mfu,
                            found.memory.total, found.cost_model)
    low, high = found.time_range
    metrics = (("time_range.low_s", low), ("time_range.high_s", high),
               *((f"memory.{name}", value) for name, value in found.memory.items()),
               *((f"time.{name}", value) for name, value in found.breakdown))
    notes = ()
    if found.idle_devices:
        notes = (f"{found.idle_devices} of {cluster.num_devices} devices stay idle: {lay.devices} devices "
                 f"(tp x pp x dp x cp) run the layout",)
    if not found.fits:
        notes += (f"does not fit: needs {found.memory.total / 1e9:.1f} GB per device, {found.capacity / 1e9:.1f} GB "
                  "usable",)
    return Plan("simulate", job.model.name, stages, "interleaved-1f1b" if lay.vp > 1 else "1f1b",
                found.num_microbatches, lay.vp, lay.mb, job.global_batch, job.seq_len, job.model.num_params(),
                (cluster.nodes, cluster.devices_per_node), cluster.device.name, prediction, label,
                options=(("layout", lay.text()), ("dtype", job.dtype.short_name), ("optimizer", job.optimizer)),
                metrics=metrics, notes=notes)


def _recipe_plan(found: LayoutPrediction, job: TrainingJob, cluster: Cluster, options: PlannerOptions) -> Plan:
    """The closed-form layout search's best layout priced on the operator graph (the auto plan's
    cost model), with its pieces' plans, and its closed-form time in the metrics."""
    pricer = GraphPricer(job, cluster, found.layout, options.kernels)
    plan = layout_plan(pricer.predict(options.memory_fraction), job, cluster, "layout-search")
    stages = tuple(_layout_stage(stage, pricer, job, options) for stage in plan.stages)
    # The schedule replayed on the stages' own forward and backward seconds, as the auto plan's
    # (the closed form's bubble is an upper bound); the difference leaves the bubble.
    closed_form = plan.prediction.pipeline_time_s
    plan = replayed(replace(plan, stages=stages))
    shorter = closed_form - plan.prediction.pipeline_time_s
    metrics = tuple((name, value - shorter if name == "time.pipeline bubble" else value)
                    for name, value in plan.metrics)
    return replace(plan, metrics=metrics + (("formula_s", found.iteration_time),))


def _layout_stage(stage: Stage, pricer: GraphPricer, job: TrainingJob, options: PlannerOptions) -> Stage:
    """A stage of a graph-priced layout with its pieces' plans and times, as the auto plan's."""
    def planned(name: str) -> PlannedPiece:
        priced = pricer.pieces[name]
        return PlannedPiece(name, priced.piece, priced.plan, priced.cost.attention_forward_time)

    blocks = {moe: pricer.pieces["moe-block" if moe else "block"].piece for moe in (False, True)
              if ("moe-block" if moe else "block") in pricer.pieces}
    ranges = [(planned("embedding"), 0, 0)] if stage.first_layer == 0 else []
    ranges += [(planned(name), first, last) for name, _, first, last in
               block_runs(job, blocks, stage.first_layer, stage.last_layer)]
    if stage.last_layer == job.model.layers - 1:
        ranges.append((planned("head"), stage.last_layer, stage.last_layer))
    return with_pieces(stage, ranges, layer_overhead(options))[0]


def _recipe_note(recipe: Plan, dp_plan: Plan, job: TrainingJob, cluster: Cluster, options: PlannerOptions) -> str:
    """Why the layout search's recipe is the auto plan: its time against the stage DP's, and the
    techniques of the recipe the stage DP does not search."""
    layout = parse_layout(recipe.option("layout"))
    lacks = []
    if layout.cp > 1:
        lacks.append(f"context parallelism (cp={layout.cp})")
    if layout.ep > 1:
        lacks.append(f"expert parallelism (ep={layout.ep})")
    global_microbatch = layout.dp * layout.mb
    sizes = planned_microbatch_sizes(job, cluster, options)
    if global_microbatch not in sizes:
        priced = ", ".join(map(str, sizes))
        lacks.append(f"micro-batches of {global_microbatch} sequences (the stage DP priced {priced})")
    if layout.vp > 1 and layout.vp not in options.chunks:
        lacks.append(f"{layout.vp} model chunks per device")
    why = "; the stage DP does not search " + ", ".join(lacks) if lacks else \
        " (its per-stage costs and memory rule are the stage DP's approximations of the same plan)"
    ratio = dp_plan.prediction.iteration_time_s / recipe.prediction.iteration_time_s
    return (f"taken from the layout search ({recipe.option('layout')}), priced on the operator graph: "
            f"{recipe.prediction.iteration_time_s:.4g} s against {dp_plan.prediction.iteration_time_s:.4g} s "
            f"for the stage DP's own plan ({ratio:.3f}x){why}")


def _fastest_exact_baseline(found: list[Baseline]) -> Baseline | None:
    """The fastest baseline whose plan is one of the stage DP's candidates as priced (the
    Megatron grid and its PP-DP part, plain data parallelism; ZeRO-2's memory is the formula's, not a plan's)."""
    exact = [b for b in found if b.plan is not None and b.name in ("megatron", "pp-dp", "data-parallel")]
    return min(exact, key=lambda b: b.plan.iteration_time, default=None)


def _beside_best_recipe(auto: Plan, name: str, recipe: Plan, job: TrainingJob, cluster: Cluster,
                        options: PlannerOptions, runner: TaskRunner) -> Plan:
    """`auto` with the fastest recipe's name and time breakdown (metrics `recipe_time.*`, the
    same parts as its own `time.*`), to show side by side."""
    if not recipe.metrics_under("time."):  # a pipeline baseline: its breakdown from its stage plans
        recipe = with_stage_plans(recipe, job, cluster, options, runner)
    breakdown = tuple((f"recipe_time.{part}", seconds) for part, seconds in recipe.metrics_under("time.").items())
    return replace(auto, metrics=auto.metrics + breakdown, options=auto.options + (("best_recipe", name),))


NO_MEGATRON = ("Megatron-LM's tensor parallelism splits transformer blocks (attention heads, MLP columns) and "
               "has no convolution layers: no Megatron recipe applies to {model}; pp-dp is its pipeline and "
               "data-parallel part")


def no_fit_message(job: TrainingJob, cluster: Cluster, search: LayoutSearch) -> str:
    """Why nothing fits, with the memory per device the leanest layout would need."""
    lean = search.leanest
    if lean is None:
        return f"{job.model.name}: no layout can run on {cluster.name} (too few devices or layers for any split)"
    return (f"{job.model.name} does not fit on {cluster.name} at global batch {job.global_batch} x {job.seq_len} "
            f"tokens: the leanest layout ({lean.layout.text()}) needs {lean.memory.total / 1e9:.1f} GB per device, "
            f"devices offer {lean.capacity / 1e9:.1f} GB usable. Use devices with at least "
            f"{lean.memory.total / 0.9 / 1e9:.0f} GB, more devices, or a shorter sequence.")


def simulate(job: TrainingJob, cluster: Cluster, options: PlannerOptions | None = None,
             progress: Progress | None = None, baselines: bool = True, runner: TaskRunner | None = None) -> Simulation:
    """Plan `job` on `cluster` and price the baselines; raises InfeasiblePlanError when no
    plan fits.

    The auto plan comes from the intra-op ILP and the stage DP over every device. When they
    find none (a global batch that does not split over the stages' nodes, or memory), the
    fastest Megatron-style layout that fits is the plan, idle devices reported; only when no
    layout fits either is the error raised, naming the memory the leanest one needs. `runner`
    runs the pricing tasks (default: a process pool of `options.workers`); a task that fails
    every attempt is named in the plan's notes and its view left out.

    Models the closed form does not describe (ResNets: `closed_form` False) are planned by the
    stage DP alone, with the baselines that apply to them (no Megatron tensor parallelism)."""
    options = options or PlannerOptions()
    cluster = job.on(cluster)
    with default_runner(runner, options) as tasks_runner:
        return _simulate(job, cluster, options, progress, baselines, tasks_runner)


def _timed_layout_search(job: TrainingJob, cluster: Cluster, options: PlannerOptions):
    start = time.perf_counter()
    if not job.model.closed_form:  # Megatron-style layouts of transformer blocks only
        return LayoutSearch(None, None, 0), 0.0
    return search_layouts(job, cluster, memory_fraction=options.memory_fraction), time.perf_counter() - start


def _simulate(job: TrainingJob, cluster: Cluster, options: PlannerOptions, progress: Progress | None,
              baselines: bool, runner: TaskRunner) -> Simulation:
    stats = PlannerStats()
    priced: dict = {}
    with ThreadPoolExecutor(max_workers=1) as background:
        # The closed-form layout search needs no pricing: it runs while the workers price
        # (this process mostly waits for them then).
        searching = background.submit(_timed_layout_search, job, cluster, options)
        try:
            best = plan_training(job, cluster, options, progress, stats, priced, runner)
            failed_dp = False
        except InfeasiblePlanError:
            failed_dp = True
        search, seconds = searching.result()
    if job.model.closed_form:
        stats.phases["layout search"] = seconds
    if failed_dp:
        if not job.model.closed_form:
            raise InfeasiblePlanError(no_fit_message_without_layouts(job, cluster, options)) from None
        if search.best is None:
            raise InfeasiblePlanError(no_fit_message(job, cluster, search),
                                      search.leanest.memory.total if search.leanest else None) from None
        plan = layout_plan(search.best, job, cluster, "auto")
        note = (f"the stage DP over all {cluster.num_devices} devices found no plan for a global batch of "
                f"{job.global_batch}; the plan is the fastest Megatron-style layout that fits (closed-form "
                f"pricing, {search.candidates} layouts priced)")
        return Simulation(replace(plan, notes=(note, *plan.notes),
                                  metrics=plan.metrics + tuple((f"planner_s.{k}", v) for k, v in stats.phases.items())),
                          ())
    found: list[Baseline] = []
    if baselines:
        start = time.perf_counter()
        sizes = planned_microbatch_sizes(job, cluster, options)
        if job.model.closed_form:
            found.append(evaluate_megatron(job, cluster, sizes, options, priced, progress, runner))
        else:
            found.append(Baseline("megatron", None, NO_MEGATRON.format(model=job.model.name), NOT_APPLICABLE))
            found.append(evaluate_megatron(job, cluster, sizes, options, priced, progress, runner,
                                           tensor_parallel=False))
        found.extend(evaluate_data_parallel(job, cluster, options, priced, runner))
        stats.timed("baselines", start)
    model = cost_model_name(options)
    results = tuple(BaselineResult(b.name, b.config, to_plan(b.plan, job, cluster, model) if b.plan else None,
                                   b.reason)
                    for b in found)
    auto = to_plan(best, job, cluster, model)
    taken = _fastest_exact_baseline(found)
    if taken is not None and taken.plan.iteration_time < best.iteration_time:
        # Megatron grid points (PP-DP) and plain data parallelism are plans of the auto search
        # space too; the stage DP prices sync per stage approximately and can miss them by a little.
        auto = replace(to_plan(replace(taken.plan, label="auto"), job, cluster, model),
                       notes=(f"taken from the {taken.name} baseline ({taken.config}): "
                              f"{best.iteration_time:.4f} s from the stage DP",))
    start = time.perf_counter()
    auto = with_stage_plans(auto, job, cluster, options, runner)  # on the pool's idle workers
    stats.timed("stage plans", start)
    summaries = tuple(BaselineSummary(r.name, r.config, r.plan.prediction if r.plan else None, r.reason)
                      for r in results)
    recipes = [(f"{r.name} {r.config}", r.plan) for r in results if r.plan is not None]
    if search.best is not None:
        start = time.perf_counter()
        recipe = _recipe_plan(search.best, job, cluster, options)
        stats.timed("layout search on the graph", start)
        summaries += (BaselineSummary("layout-search", recipe.option("layout"), recipe.prediction),)
        fits = recipe.prediction.peak_memory_bytes <= capacity(cluster, options) + WORKSPACE_BYTES
        if fits:
            recipes.append((f"layout-search {recipe.option('layout')}", recipe))
        if fits and recipe.prediction.iteration_time_s < auto.prediction.iteration_time_s:
            auto = replace(recipe, label="auto", notes=(_recipe_note(recipe, auto, job, cluster, options),
                                                        *recipe.notes))
    if recipes:
        start = time.perf_counter()
        name, fastest = min(recipes, key=lambda r: r[1].prediction.iteration_time_s)
        auto = _beside_best_recipe(auto, name, fastest, job, cluster, options, runner)
        stats.timed("stage plans", start)
    metrics = tuple((f"planner_s.{phase}", seconds) for phase, seconds in stats.phases.items())
    failed = tuple(f"pricing task {task_name(r.key)!r} failed ({r.error}); not a candidate"
                   for r in priced.values() if r.costs is None)
    budget = (("memory_budget_bytes", repr(capacity(cluster, options))),)
    return Simulation(replace(auto, baselines=summaries, metrics=auto.metrics + metrics, notes=auto.notes + failed,
                              options=auto.options + budget), results)
