"""Text report of a simulated Plan as `meshplan simulate` prints it: its stages, its prediction,
the baselines, planner time (`meshplan report` shows the rest)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from meshplan.plan import Plan
from meshplan.report.tables import gb, table
from meshplan.report.text import (
    baselines_table,
    header_lines,
    prediction_lines,
    stages_table,
    time_range,
    unpriced_baseline_lines,
)


def print_simulation(plan: Plan, console: Console | None = None) -> None:
    console = console or Console()
    for line in header_lines(plan):
        console.print(line, highlight=False)
    console.print(stages_table(plan))
    for line in prediction_lines(plan):
        console.print(line, highlight=False)
    if plan.baselines:
        console.print(baselines_table(plan))
        for line in unpriced_baseline_lines(plan):
            console.print(line, highlight=False)
    beside = recipe_table(plan)
    if beside is not None:
        console.print(beside)
        console.print(f"fastest recipe: {plan.option('best_recipe')}", highlight=False)
    phases = plan.metrics_under("planner_s.")
    text = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items())
    # The layout search and the stage DP run while the workers price: the phases overlap.
    console.print(f"planner time (phases overlap): {text}", highlight=False)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)
    console.print("details: meshplan report PLAN.json (write the plan with --out)", highlight=False)


def recipe_table(plan: Plan) -> Table | None:
    """The auto plan's time per iteration beside the fastest recipe's, part by part (None when
    the plan carries no recipe breakdown)."""
    own, recipe = plan.metrics_under("time."), plan.metrics_under("recipe_time.")
    if not own or not recipe:
        return None
    t = table("seconds per iteration: auto beside the fastest recipe (critical stage)", ["part", "auto", "recipe"],
              numeric=("auto", "recipe"))
    for part in own:
        t.add_row(part, f"{own[part]:.3f}", f"{recipe.get(part, 0.0):.3f}")
    t.add_row("iteration", f"{sum(own.values()):.3f}", f"{sum(recipe.values()):.3f}")
    return t


def print_layout(plan: Plan, console: Console | None = None) -> None:
    """A priced layout: its time with the range, the time and memory breakdowns, and how it
    compares with the fastest layout found."""
    console = console or Console()
    p = plan.prediction
    for line in header_lines(plan):
        console.print(line, highlight=False)
    console.print(f"layout          {plan.option('layout')}", highlight=False)
    if p.cost_model:
        console.print(f"priced by       {p.cost_model}", highlight=False)
    console.print(f"iteration time  {p.iteration_time_s:.4g} s{time_range(plan)}", highlight=False)
    console.print(f"throughput      {p.tokens_per_s:,.0f} {plan.sample_unit}/s, {p.tflops_per_device:.1f} TFLOP/s "
                  "per device, "
                  f"MFU {p.mfu:.1%}", highlight=False)
    times = table("time per iteration (critical stage)", ["part", "seconds"], numeric=("seconds",))
    for name, seconds in plan.metrics_under("time.").items():
        times.add_row(name, f"{seconds:.3f}")
    console.print(times)
    memory = table("peak memory per device (most loaded stage)", ["part", "GB"], numeric=("GB",))
    for name, nbytes in plan.metrics_under("memory.").items():
        memory.add_row(name, gb(nbytes))
    memory.add_row("total", gb(p.peak_memory_bytes))
    console.print(memory)
    for b in plan.baselines:
        if b.prediction is not None:
            console.print(f"{b.name}: {b.config}: {b.prediction.iteration_time_s:.4g} s, MFU {b.prediction.mfu:.1%} "
                          f"(this layout takes {p.iteration_time_s / b.prediction.iteration_time_s:.2f}x as long)",
                          highlight=False)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)
