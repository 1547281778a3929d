"""The `meshplan` command: thin entry points over the library; user errors exit non-zero."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from meshplan.cluster.mesh import LogicalMesh, parse_bytes, parse_floats, parse_mesh_shape
from meshplan.cost.model import CostModel
from meshplan.errors import MeshplanError
from meshplan.files import write_json_atomic, write_text_atomic
from meshplan.intra.options import IntraOptions
from meshplan.intra.solve import build_intra_problem, solve_intra
from meshplan.models.registry import forward_graph
from meshplan.plan import single_stage_plan
from meshplan.report.intra_text import print_intra_plan
from meshplan.sharding.strategy import StrategySpace

if TYPE_CHECKING:
    from meshplan.cluster.cluster import Cluster
    from meshplan.models.training import ModelConfig
    from meshplan.plan import Plan
    from meshplan.simulator import TrainingJob

# Plain (click) help: rich's option tables squeeze the help column and cut long examples.
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Plan data, tensor and pipeline parallelism for deep-learning training.")
err = Console(stderr=True)


@app.callback()
def root() -> None:
    """Plan data, tensor and pipeline parallelism for deep-learning training."""


def user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Print a MeshplanError as one message and exit 2, never a traceback."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except MeshplanError as exc:
            # soft_wrap: a terminal wraps the line at its real width; a pipe or a log gets it whole
            err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return run


@app.command(short_help="Shard one model over one logical mesh (intra-op ILP).")
@user_errors
def intra(
    model: Annotated[str, typer.Option(help="Model preset, e.g. llama2-13b.")] = "llama2-13b",
    mesh: Annotated[str, typer.Option(help="Logical mesh shape, e.g. 50x4 or 2x2x2.")] = "50x4",
    mesh_alpha: Annotated[str, typer.Option(help="Latency per mesh axis, comma separated (default: 1 "
                                                 "each).")] = "",
    mesh_beta: Annotated[str, typer.Option(help="Cost per byte per mesh axis, comma separated (default: 1 "
                                                "on axis 0, 0.01 on the others).")] = "",
    memory: Annotated[str, typer.Option(help="Memory per device, e.g. 32GB; 'none' for unlimited.")] = "32GB",
    batch: Annotated[int, typer.Option(help="Batch size.")] = 200,
    seq_len: Annotated[int, typer.Option(help="Sequence length.")] = 4096,
    layers: Annotated[int, typer.Option(help="Number of layers (0: the preset's).")] = 0,
    solver: Annotated[str, typer.Option(help="ILP backend: highs or cbc.")] = "highs",
    time_limit: Annotated[float, typer.Option(help="Solver time limit in seconds.")] = 60.0,
    share_layers: Annotated[bool, typer.Option(help="Repeated layers share one choice.")] = True,
    compare_sharing: Annotated[bool, typer.Option(help="Also solve unshared and report the difference.")] = False,
    space: Annotated[str, typer.Option(help="Strategy space: full, or alpa (Alpa's lists and liveness).")] = "full",
    flops: Annotated[float, typer.Option(help="Device FLOP/s in the cost unit; 0 switches compute off.")] = 0.0,
    force_replicated_output: Annotated[bool, typer.Option(help="The output must be replicated.")] = False,
    reduce_scatter: Annotated[bool, typer.Option(help="Contractions may reduce-scatter partial sums.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    out: Annotated[str, typer.Option(help="Also write the JSON plan to this file.")] = "",
    dump_lp: Annotated[str, typer.Option(help="Write the ILP in LP format to this file.")] = "",
) -> None:
    """Solve the intra-operator (sharding) ILP of a model's forward graph on one logical mesh."""
    logical = _mesh(mesh, mesh_alpha, mesh_beta, memory)
    graph = forward_graph(model, batch, seq_len, layers or None, force_replicated_output)
    strategy_space = _space(space)
    alpa = strategy_space is StrategySpace.ALPA
    # Alpa's space comes with Alpa's liveness (parameters freed after their last use) and, in
    # its unit setting (compute off), its 2 units per replicated parameter.
    cost = CostModel(flops_per_second=flops or None, parameters_held=not alpa,
                     replicated_parameter_cost=2.0 if alpa and not flops else 0.0)
    options = IntraOptions(cost=cost, space=strategy_space, solver=solver, time_limit=time_limit,
                           share_layers=share_layers, reduce_scatter=reduce_scatter)
    if dump_lp:
        write_text_atomic(dump_lp, build_intra_problem(graph, logical, options)[1].to_lp_text())
    plan = solve_intra(graph, logical, options)
    metrics, extra = {}, []
    if compare_sharing:
        other = solve_intra(graph, logical, options.replace(share_layers=not share_layers))
        shared, unshared = (plan, other) if share_layers else (other, plan)
        metrics = {"sharing.shared_objective": shared.objective, "sharing.unshared_objective": unshared.objective,
                   "sharing.difference": shared.objective - unshared.objective,
                   "sharing.shared_solve_s": shared.solve.wall_s, "sharing.unshared_solve_s": unshared.solve.wall_s}
        extra.append(f"layer sharing: shared {shared.objective:,.4f} vs unshared {unshared.objective:,.4f} "
                     f"(difference {shared.objective - unshared.objective:,.4f})")
    data = single_stage_plan(plan, "intra", model, global_batch=batch, seq_len=seq_len,
                             options=(("strategy_space", space),
                                      ("liveness", "held parameters" if cost.parameters_held else "alpa")),
                             metrics=tuple(metrics.items())).to_dict()
    if out:
        write_json_atomic(out, data)
    if json_out:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        print_intra_plan(plan, Console(), extra)


@app.command("solve-problem", short_help="Solve an IOPDDL-format sharding problem.")
@user_errors
def solve_problem_file(
    path: Annotated[str, typer.Argument(help="Problem file in the IOPDDL format (.json or .json.gz).")],
    time_limit: Annotated[float, typer.Option(help="Wall seconds for reading, solving and writing.")] = 60.0,
    out: Annotated[str, typer.Option(help="Solution file to write (JSON).")] = "solution.json",
    solver: Annotated[str, typer.Option(help="MIP backend: highs or cbc.")] = "highs",
    seed: Annotated[int, typer.Option(help="Seed of the randomized search.")] = 0,
    workers: Annotated[int, typer.Option(help="Processes: 2 runs memory prices and the MIP side at once.")] = 2,
    lockstep: Annotated[bool, typer.Option(help="Trade plans between workers at fixed epochs (repeatable).")] = False,
) -> None:
    """Solve an intra-op sharding problem given as arrays (IOPDDL format) and write the chosen strategies.

    The best plan so far is kept in --out while the search runs, so an interrupted run (SIGTERM,
    Ctrl-C) leaves its last good plan there."""
    import os
    import signal
    import time

    from meshplan.intra.problem.iopddl import SolutionWriter, read_iopddl, solution_to_json
    from meshplan.intra.search.problem_solver import ProblemOptions, solve_problem

    start = time.perf_counter() - _seconds_since_process_start()  # the limit counts Python's start too
    too_slow = MeshplanError(f"reading {path!r} took the whole --time-limit of {time_limit:g} s; raise it")

    def reading_too_long(signum: int, frame: Any) -> None:
        raise too_slow

    _hard_stop(time_limit - (time.perf_counter() - start) - HARD_STOP_MARGIN)
    before = signal.signal(signal.SIGALRM, reading_too_long)
    signal.setitimer(signal.ITIMER_REAL, max(time_limit - (time.perf_counter() - start) - 0.5, 0.01))
    try:
        problem = read_iopddl(path)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    left = time_limit - (time.perf_counter() - start) - _writing_margin(problem)
    if left <= 0:
        raise too_slow
    writer = SolutionWriter(out, problem)

    def interrupted(signum: int, frame: Any) -> None:
        timed_out = signum == signal.SIGALRM
        wrote = writer.flush("feasible" if timed_out else "interrupted")
        err.print(f"{problem.name}: " + ("time limit reached" if timed_out else "interrupted") + "; "
                  + (f"wrote the best plan so far to {out}" if wrote else "no plan found yet, nothing written"))
        sys.stdout.flush()
        os._exit(0 if wrote else 1)  # leave now: the search's child processes die with this one

    previous = {s: signal.signal(s, interrupted) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)}
    # the watchdog: a step that cannot stop half-way (a bulk presolve step, on a machine loaded
    # 10 times over) must not carry the run past its limit; the plan held so far is written
    signal.setitimer(signal.ITIMER_REAL, left + 0.5 * _writing_margin(problem))
    try:
        solution = solve_problem(problem, ProblemOptions(time_limit=left, backend=solver, seed=seed, workers=workers,
                                                         lockstep=lockstep), on_plan=writer.plan)
        signal.setitimer(signal.ITIMER_REAL, 0)
        write_json_atomic(out, solution_to_json(problem, solution))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, handler in previous.items():
            signal.signal(s, handler)
    cost = "no solution" if solution.cost is None else f"cost {solution.cost:,.0f}"
    bound = "" if solution.bound is None else f", bound {solution.bound:,.0f}"
    Console().print(f"{problem.name}: {solution.status.value}, {cost}{bound} in {time.perf_counter() - start:.1f} s; "
                    f"wrote {out}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the answer is written: skip tearing down the problem's arrays (1.4 s on D, loaded)


HARD_STOP_MARGIN = 0.3  # seconds before the limit at which a run that is still going is ended


def _hard_stop(seconds: float) -> None:
    """End the process after `seconds` even where no Python code runs (a signal handler waits
    for the running C call: parsing D's JSON took 15 s at load 20): faulthandler's watchdog is
    a C thread that needs no interpreter lock. The plans found were written as they came."""
    import faulthandler
    import os

    faulthandler.dump_traceback_later(max(seconds, 0.01), exit=True, file=open(os.devnull, "w"))  # noqa: SIM115


def _seconds_since_process_start() -> float:
    """Wall seconds since this process started (Linux's /proc; elsewhere 0): starting Python
    and importing the planner took 1 s on an idle machine and 5 s on a loaded one."""
    import os

    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started = int(stat.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
            return max(0.0, float(uptime.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


def _writing_margin(problem: Any) -> float:
    """Seconds kept back from the solver for ending (stopping the child process, the last plan's
    cost, the file): proportional to the problem's size, 1.6 s for D's 41,000 nodes and 69,000
    edges."""
    return 0.5 + 1e-5 * (problem.num_nodes + problem.num_edges)


# "\b" keeps click from re-flowing the paragraph that follows it (the example line stays whole).
_LAYOUT_HELP = """\b
--layout keys:
  tp pp dp cp ep   tensor, pipeline, data, context, expert parallel sizes
  vp mb            virtual stages per device, sequences per micro-batch
  recompute        none, selective or full
  sp zero fsdp     sequence parallel, distributed optimizer, fully sharded
  overlap tpo      overlapped data-parallel and tensor-parallel communication
  flash fp8 fp32grads
                   fused attention, fp8 GEMMs, fp32 gradient reduction
  (the on/off keys take on or off)

\b
Example (Megatron's GPT-3 175B recipe on 64 A100s):
  meshplan simulate --model gpt3-175b --cluster 8x8 --device a100-80gb \\
    --global-batch 64 --seq-len 2048 \\
    --layout tp=8,pp=8,dp=1,vp=3,mb=1,sp=on,recompute=selective
"""


@app.command(epilog=_LAYOUT_HELP, short_help="Plan training on a cluster; predict time and memory.")
@user_errors
def simulate(
    model: Annotated[str, typer.Option(help="Model preset (e.g. llama2-13b, wresnet-2b) or a config.json "
                                            "path.")] = "llama2-13b",
    cluster: Annotated[str, typer.Option(help="Nodes x devices per node, e.g. 50x4.")] = "50x4",
    device: Annotated[str, typer.Option(help="Device type, e.g. v100-32gb, a100-80gb, h100-80gb.")] = "v100-32gb",
    memory: Annotated[str, typer.Option(help="Override memory per device, e.g. 32GB.")] = "",
    global_batch: Annotated[int, typer.Option(help="Sequences (images) per iteration.")] = 1000,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per sequence [default: 4096; image models take "
                                                        "none]", show_default=False)] = None,
    microbatch_sizes: Annotated[str, typer.Option(help="Sequences (images) per micro-batch to try, e.g. "
                                                       "4,8,16.")] = "",
    chunks: Annotated[str, typer.Option(help="Model chunks per device to plan for: 1 is 1F1B, more is "
                                             "interleaved 1F1B.")] = "1,2,4",
    efficiency: Annotated[float, typer.Option(help="Fraction of peak FLOP/s non-GEMM kernels sustain.")] = 0.5,
    gemm_curve: Annotated[bool, typer.Option(help="Price GEMMs from their (m, n, k), not at --efficiency.")] = True,
    dtype: Annotated[str, typer.Option(help="Weight/activation type: bf16, f16 (fp32 master copy) or f32 "
                                            "[default: bf16; f32 for image models, as Alpa ran them]",
                                       show_default=False)] = "",
    optimizer: Annotated[str, typer.Option(help="adam (mixed precision), momentum (SGD, Nesterov) or sgd "
                                                "[default: adam; momentum for image models]", show_default=False)] = "",
    workers: Annotated[int, typer.Option(help="Processes pricing candidates in parallel.")] = 2,
    executor: Annotated[str, typer.Option(help="Where pricing tasks run: auto, inprocess, pool or ray.")] = "auto",
    ray_address: Annotated[str, typer.Option(help="With --executor ray: local (start one here), auto or "
                                                  "ray://HOST:PORT (join a cluster).")] = "local",
    cache: Annotated[str, typer.Option(help="Folder caching finished tasks; a rerun resumes from it.")] = "",
    task_retries: Annotated[int, typer.Option(help="Retries of a task whose attempt failed.")] = 2,
    task_time_limit: Annotated[float, typer.Option(help="Seconds per task attempt (0: none; pool and Ray).")] = 0.0,
    baselines: Annotated[bool, typer.Option(help="Also price data parallel, ZeRO-2, Megatron.")] = True,
    reduce_scatter: Annotated[bool, typer.Option(help="Contractions may reduce-scatter partial sums.")] = True,
    mesh_axes: Annotated[str, typer.Option(help="Logical views per stage: 2 (Alpa's 2-D views), 3 (also 3-D "
                                                "views of stages of 8+ devices) or refine (2-D, then the 3-D "
                                                "views of the 2-D plan's stages).")] = "2",
    cluster_file: Annotated[str, typer.Option(help="A cluster measured by `meshplan profile-cluster`.")] = "",
    layout: Annotated[str, typer.Option(
        help="Price this layout instead of planning: KEY=VALUE pairs separated by commas (keys and an "
             "example below).")] = "",
    efficiency_file: Annotated[str, typer.Option(help="Kernel efficiencies (JSON) for --layout pricing.")] = "",
    pricer: Annotated[str, typer.Option(help="How --layout is priced: formula (closed form; transformers "
                                             "only) or graph (fixed per-op strategies on the operator graph: the "
                                             "auto planner's pricer) [default: formula]",
                                        show_default=False)] = "",
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    out: Annotated[str, typer.Option(help="Also write the JSON result to this file.")] = "",
    html: Annotated[str, typer.Option(help="Also write the HTML report (charts, tables) to this file.")] = "",
) -> None:
    """Plan a model's training on a cluster and predict its time, throughput, MFU and memory."""
    from meshplan.cluster.cluster import Cluster, load_cluster_file, parse_cluster
    from meshplan.cluster.devices import device_from_overrides, get_device
    from meshplan.distributed import TaskRunner, make_executor
    from meshplan.ir import as_dtype
    from meshplan.models.registry import simulation_model
    from meshplan.report.simulation_text import print_simulation
    from meshplan.simulator import PlannerOptions, TrainingJob
    from meshplan.simulator import simulate as run_simulation

    spec = get_device(device)
    if memory:
        spec = device_from_overrides(spec, memory_bytes=parse_bytes(memory))
    nodes, per_node = parse_cluster(cluster)
    machines = load_cluster_file(cluster_file) if cluster_file else Cluster(nodes, per_node, spec)
    options = PlannerOptions(efficiency=efficiency, gemm_curve=gemm_curve, workers=workers,
                             microbatch_sizes=_ints(microbatch_sizes), reduce_scatter=reduce_scatter,
                             chunks=_ints(chunks, "--chunks", "1,2,4") or (1,),
                             mesh_axes=_mesh_axes(mesh_axes))
    model_spec = simulation_model(model)
    _check_image_options(model_spec, seq_len, layout, pricer)
    job = TrainingJob(model_spec, global_batch, seq_len or (4096 if model_spec.sample_unit == "tokens" else 1),
                      as_dtype(dtype) if dtype else model_spec.default_dtype,
                      optimizer or model_spec.default_optimizer)
    if layout:
        from meshplan.report.simulation_text import print_layout

        plan = _price_layout(job, machines, layout, efficiency_file, pricer or "formula")
        data, show = plan.to_dict(), print_layout
    else:
        runner = TaskRunner(make_executor(executor, workers, ray_address), task_retries, task_time_limit or None,
                            cache or None)
        with runner, _progress(enabled=not json_out) as progress:
            sim = run_simulation(job, machines, options, progress, baselines, runner)
        plan, data, show = sim.plan, sim.to_dict(), print_simulation
    if out:
        write_json_atomic(out, data)
    if html:
        from meshplan.report.html import html_report

        write_text_atomic(html, html_report(plan))
    if json_out:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        show(plan, Console())


@app.command(short_help="Show a plan; export HTML, PartitionSpecs, trace.")
@user_errors
def report(
    plan: Annotated[str, typer.Argument(help="A plan file (simulate/intra --out) or a dump_debug_info folder.")],
    ops: Annotated[bool, typer.Option(help="Also list the operators' strategies.")] = False,
    layer: Annotated[int, typer.Option(help="With --ops: only this layer's operators (-1: all).")] = -1,
    name: Annotated[str, typer.Option(help="With --ops: only operators whose name contains this.")] = "",
    html: Annotated[str, typer.Option(help="Write the HTML report (charts, tables) to this file.")] = "",
    partition_specs: Annotated[str, typer.Option(help="Write the parameter layouts as JAX PartitionSpecs "
                                                      "(a Python file) and print them.")] = "",
    chrome_trace: Annotated[str, typer.Option(help="Write the simulated schedule as Chrome trace JSON.")] = "",
    width: Annotated[int, typer.Option(help="Columns of the terminal report (0: the terminal's).")] = 0,
) -> None:
    """Show what a plan decided: stages, layouts, communication, time; or export it (HTML,
    PartitionSpecs, Chrome trace)."""
    from meshplan.report.collectives_text import print_collectives
    from meshplan.report.load import load_collectives, load_plan
    from meshplan.report.text import OpFilter, print_report

    loaded = load_plan(plan)
    collectives = load_collectives(plan) if Path(plan).is_dir() else None
    console = Console(width=width or None)
    written = []
    if partition_specs:
        from meshplan.report.partition_specs import python_source

        source = python_source(loaded)
        write_text_atomic(partition_specs, source)
        console.print(source, markup=False, highlight=False, soft_wrap=True)
        written.append(partition_specs)
    if chrome_trace:
        from meshplan.report.timeline import chrome_trace_text

        write_text_atomic(chrome_trace, chrome_trace_text(loaded))
        written.append(chrome_trace)
    if html:
        from meshplan.report.html import html_report

        write_text_atomic(html, html_report(loaded))
        written.append(html)
    if not written:
        print_report(loaded, console, OpFilter(None if layer < 0 else layer, name) if ops or name or layer >= 0
                     else None)
        if collectives is not None:
            print_collectives(collectives, console)
    else:
        err.print("wrote " + ", ".join(written), highlight=False)


@app.command(short_help="What changed between two plans, largest first.")
@user_errors
def diff(
    first: Annotated[str, typer.Argument(help="Plan A (file or dump_debug_info folder).")],
    second: Annotated[str, typer.Argument(help="Plan B.")],
    limit: Annotated[int, typer.Option(help="Show at most this many differences (0: all).")] = 40,
) -> None:
    """What changed from plan A to plan B (stages, meshes, layouts, predicted time and memory),
    largest differences first."""
    from meshplan.report.diff import check_comparable, diff_plans
    from meshplan.report.load import load_plan
    from meshplan.report.tables import table

    a, b = load_plan(first), load_plan(second)
    check_comparable(a, b, first, second)
    changes = diff_plans(a, b)
    console = Console()
    if not changes:
        console.print(f"{first} and {second} plan {a.model} identically", highlight=False)
        return
    shown = changes if limit <= 0 else changes[:limit]
    t = table(f"{len(changes)} difference(s) from A = {first} to B = {second}, largest first",
              ["what", "A", "B", "size"], numeric=("size",))
    for d in shown:
        t.add_row(d.what, d.before, d.after, "new" if d.size == float("inf") else f"{d.size:.3g}")
    console.print(t)
    if len(shown) < len(changes):
        console.print(f"... {len(changes) - len(shown)} more (--limit 0 shows all)", highlight=False)


PRICERS = ("formula", "graph")


def _check_image_options(spec: ModelConfig, seq_len: int | None, layout: str, pricer: str) -> None:
    """Options that describe transformers only, refused for image models with what to do instead."""
    if spec.closed_form:
        return
    name = spec.name
    if pricer == "formula":
        raise MeshplanError(f"--pricer formula is the closed form of Megatron-style transformer layouts; {name} is "
                            "a convolutional network, priced on its operator graph by the auto planner (the graph "
                            "pricer). Drop --pricer formula (or pass --pricer graph).")
    if layout:
        raise MeshplanError(f"--layout prices Megatron-style transformer layouts (tp, pp, dp, cp, ...); {name} is "
                            "planned by the auto planner, which reports the data-parallel, ZeRO-2 and pipeline + "
                            "data-parallel baselines beside its plan. Drop --layout.")
    if seq_len not in (None, 1):
        raise MeshplanError(f"{name} takes {spec.image_size}x{spec.image_size} images, not sequences: drop --seq-len "
                            "(--global-batch counts images).")


def _price_layout(job: TrainingJob, machines: Cluster, text: str, efficiency_file: str, pricer: str) -> Plan:
    """`simulate --layout`: the given layout priced in closed form or on the operator graph, next
    to the fastest layout the search finds for the same job (priced by the same pricer)."""
    from meshplan.cost.kernels import DEFAULT_EFFICIENCY, KernelEfficiency
    from meshplan.simulator.analytic import check_layout, price_layout, search_layouts
    from meshplan.simulator.graph_pricing import price_layout_graph
    from meshplan.simulator.layout import parse_layout
    from meshplan.simulator.simulate import layout_plan

    if pricer not in PRICERS:
        raise MeshplanError(f"--pricer {pricer!r} is not a pricer; use one of {', '.join(PRICERS)}")
    chosen = parse_layout(text)
    why = check_layout(job, machines, chosen)
    if why:
        raise MeshplanError(f"{why}; change --layout")
    efficiency = KernelEfficiency.from_file(efficiency_file) if efficiency_file else DEFAULT_EFFICIENCY
    price = price_layout_graph if pricer == "graph" else price_layout
    priced = price(job, machines, chosen, efficiency)
    search = search_layouts(job, machines, efficiency, fp8=chosen.fp8)
    plan = layout_plan(priced, job, machines)
    if search.best is not None:
        from dataclasses import replace

        from meshplan.plan import BaselineSummary

        best = search.best if pricer == "formula" else price(job, machines, search.best.layout, efficiency)
        auto = layout_plan(best, job, machines, "layout-search")
        plan = replace(plan, baselines=(BaselineSummary("layout-search", best.layout.text(), auto.prediction),))
    return plan


@app.command("profile-cluster", short_help="Measure these devices; write a cluster file.")
@user_errors
def profile_cluster(
    out: Annotated[str, typer.Option(help="Cluster file to write.")] = "cluster.json",
    nodes: Annotated[int, typer.Option(help="Nodes to view the devices as (0: 1).")] = 0,
    devices_per_node: Annotated[int, typer.Option(help="Devices per node (0: all devices JAX sees).")] = 0,
    memory: Annotated[str, typer.Option(help="Memory per device to record, e.g. 16GB.")] = "16GB",
    repeats: Annotated[int, typer.Option(help="Timed runs per measurement.")] = 5,
) -> None:
    """Measure collective latency/bandwidth per mesh axis and matmul throughput on the devices JAX
    sees, fit the GEMM efficiency curve to measured matmuls, and write a cluster file for
    `meshplan simulate --cluster-file` (with --efficiency 1; for --layout pricing, pass the same
    file as --efficiency-file to use the measured curve)."""
    import jax

    from meshplan.runtime.calibrate import profile_cluster as measure

    count = len(jax.devices())
    nodes = nodes or 1
    per_node = devices_per_node or max(1, count // nodes)
    data = measure(nodes, per_node, parse_bytes(memory), repeats=repeats)
    write_json_atomic(out, data)
    d = data["device"]
    Console().print(f"wrote {out}: {nodes}x{per_node} {jax.devices()[0].platform} devices, matmul "
                    f"{d['peak_flops'] / 1e9:.1f} GFLOP/s, intra-node {d['intra_bandwidth'] / 1e9:.2f} GB/s "
                    f"(latency {d['intra_latency'] * 1e6:.1f} us), inter-node {d['inter_bandwidth'] / 1e9:.2f} GB/s")


_LAUNCH_HELP = """\b
Examples:
  meshplan launch --nprocs 2 --devices-per-process 4 -- python train.py
  meshplan launch --ray-address auto -- python train.py

The script calls meshplan.launch.initialize() before anything uses JAX. Exit status: 0 when every
process exits 0; 1 when one fails or hangs (all are stopped, one line names the rank); 2 for a bad
setup. See docs/multihost.md."""


@app.command(epilog=_LAUNCH_HELP, context_settings={"allow_interspersed_args": False},
             short_help="Start a JAX job's processes here or on Ray; watch them.")
@user_errors
def launch(
    command: Annotated[list[str] | None, typer.Argument(help="What every process runs, after --.",
                                                        show_default=False)] = None,
    nprocs: Annotated[int | None, typer.Option(help="Processes to start (on Ray: workers, default one per "
                                                    "node).", show_default=False)] = None,
    devices_per_process: Annotated[int | None, typer.Option(help="CPU devices per process (default 1); on Ray "
                                                                 "GPU nodes, GPUs per worker (default: the "
                                                                 "node's).", show_default=False)] = None,
    coordinator: Annotated[str, typer.Option(help="HOST:PORT of JAX's coordination service (default: "
                                                  "127.0.0.1, or rank 0's Ray node, and a free port).")] = "",
    ray_address: Annotated[str, typer.Option(help="Run on Ray: local (start one here), auto (the cluster this "
                                                  "node is in) or ray://HOST:PORT.")] = "",
    hang_timeout: Annotated[float, typer.Option(help="Seconds a process behind the others may stay silent "
                                                     "before it counts as hung; 0: off.")] = 30.0,
    ray_temp_dir: Annotated[str, typer.Option(help="Folder for a local Ray's files (with --ray-address "
                                                   "local).")] = "",
) -> None:
    """Start the processes of one JAX job with jax.distributed set up for them (coordinator, process
    count and ids, devices, gloo collectives on CPU), show rank 0's output and the others' errors, and
    stop them all with one message naming the rank when one fails or hangs."""
    from meshplan.launch import LaunchSpec, run

    status = run(LaunchSpec(tuple(command or ()), nprocs, devices_per_process, coordinator, ray_address,
                            hang_timeout, ray_temp_dir))
    if status:
        raise typer.Exit(status)


@app.command(short_help="CFP: ParallelBlocks planned with profiled costs.")
@user_errors
def cfp(
    model: Annotated[str, typer.Option(help="gpt3-125m, llama2-7b, moe-1.3b, ... or a config.json.")] = "gpt3-125m",
    train: Annotated[bool, typer.Option(help="Plan the training step (forward and backward).")] = False,
    layers: Annotated[int, typer.Option(help="Transformer blocks in the stack.")] = 2,
    batch: Annotated[int, typer.Option(help="Sequences per step.")] = 8,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence (0: the model's context).")] = 0,
    mesh: Annotated[str, typer.Option(help="Logical mesh shape, e.g. 2x4.")] = "2x4",
    mode: Annotated[str, typer.Option(help="analysis, profile, search or all.")] = "all",
    analytic: Annotated[bool, typer.Option(help="Price combinations with the cost model instead of running.")] = False,
    out: Annotated[str, typer.Option(help="Folder for analysis/profiles/plan/comparison JSON.")] = "cfp-out",
    cache: Annotated[str, typer.Option(help="Profile cache folder (default: <out>/cache).")] = "",
    runs: Annotated[int, typer.Option(help="Timed runs per program.")] = 5,
    warmup: Annotated[int, typer.Option(help="Untimed runs first.")] = 2,
    memory: Annotated[str, typer.Option(help="Memory per device, e.g. 16GB; 'none' for unlimited.")] = "none",
    max_combinations: Annotated[int, typer.Option(help="Most strategy combinations per segment.")] = 64,
    statistic: Annotated[str, typer.Option(help="Profiled time the search uses: min, median or mean.")] = "min",
    full_size: Annotated[bool, typer.Option(help="Keep the preset's sizes (default: reduced for CPUs).")] = False,
    dtype: Annotated[str, typer.Option(help="Element type: f32, bf16, f16.")] = "f32",
    cluster_file: Annotated[str, typer.Option(help="Costs measured by `meshplan profile-cluster`.")] = "",
    hidden: Annotated[int, typer.Option(help="Override the hidden size (0: the preset's).")] = 0,
    heads: Annotated[int, typer.Option(help="Override the attention heads.")] = 0,
    ffn: Annotated[int, typer.Option(help="Override the MLP width.")] = 0,
    experts: Annotated[int, typer.Option(help="Override the MoE experts.")] = 0,
    executor: Annotated[str, typer.Option(help="Where segments are profiled: inprocess, pool or ray.")] = "inprocess",
    ray_address: Annotated[str, typer.Option(help="With --executor ray: local, auto or ray://HOST:PORT.")] = "local",
) -> None:
    """CFP: group operators into ParallelBlocks, profile each unique segment's strategy
    combinations, and search one strategy per block (see docs/cfp.md)."""
    from meshplan.cfp.run import CfpRun, run_cfp

    budget = None if memory.strip().lower() in ("none", "0", "unlimited") else parse_bytes(memory)
    request = CfpRun(model=model, train=train, layers=layers, batch=batch, seq_len=seq_len,
                     mesh=parse_mesh_shape(mesh), mode=mode.lower(), analytic=analytic, out=out, cache=cache, runs=runs,
                     warmup=warmup, memory=budget, max_combinations=max_combinations, statistic=statistic,
                     reduced=not full_size, dtype=dtype, cluster_file=cluster_file, hidden=hidden, heads=heads, ffn=ffn,
                     experts=experts, executor=executor, ray_address=ray_address)
    console = Console(highlight=False)
    with _progress(enabled=True) as progress:
        written = run_cfp(request, lambda line: console.print(line, markup=False, soft_wrap=True), progress)
    console.print("wrote " + ", ".join(written.values()), markup=False, soft_wrap=True)


def _ints(text: str, option: str = "--microbatch-sizes", example: str = "4,8,16") -> tuple[int, ...]:
    if not text.strip():
        return ()
    try:
        return tuple(int(p) for p in text.split(","))
    except ValueError:
        raise MeshplanError(f"{option} {text!r} is not a list of integers; write e.g. {example}") from None


def _mesh_axes(text: str) -> int | str:
    """--mesh-axes as PlannerOptions.mesh_axes: 2, 3 or "refine" (checked there)."""
    value = text.strip().lower()
    return int(value) if value.isdigit() else value


class _progress:
    """A rich progress bar on stderr fed by the planner's (label, done, total) callback."""

    def __init__(self, enabled: bool) -> None:
        from rich.progress import Progress

        self.bar = Progress(console=err, transient=True, disable=not enabled)
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def __call__(self, label: str, done: int, total: int) -> None:
        if label not in self.tasks:
            self.tasks[label] = self.bar.add_task(label, total=total)
        self.bar.update(self.tasks[label], completed=done)


def _mesh(shape: str, alpha: str, beta: str, memory: str) -> LogicalMesh:
    """The logical mesh of `meshplan intra`: without --mesh-alpha/--mesh-beta, axis 0 is the slow
    (inter-node) one at 1 per byte and every other axis is fast (0.01), whatever the axis count."""
    budget = None if memory.strip().lower() in ("none", "0", "unlimited") else parse_bytes(memory)
    sizes = parse_mesh_shape(shape)
    alphas = parse_floats(alpha, "--mesh-alpha") if alpha.strip() else (1.0,) * len(sizes)
    betas = parse_floats(beta, "--mesh-beta") if beta.strip() else (1.0,) + (0.01,) * (len(sizes) - 1)
    return LogicalMesh(sizes, alphas, betas, budget)


def _space(name: str) -> StrategySpace:
    try:
        return StrategySpace(name.lower())
    except ValueError:
        raise MeshplanError(f"unknown strategy space {name!r}; use full or alpa") from None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
