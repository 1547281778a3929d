"""Text report of a simulated Plan as `meshplan simulate` prints it: its stages, its prediction,
the baselines, planner time (`meshplan report` shows the rest)."""

from __future__ import annotations

from rich.console import Console

from meshplan.plan import Plan
from meshplan.report.text import baselines_table, header_lines, prediction_lines, stages_table


def print_simulation(plan: Plan, console: Console | None = None) -> None:
    console = console or Console()
    for line in header_lines(plan):
        console.print(line, highlight=False)
    console.print(stages_table(plan))
    for line in prediction_lines(plan):
        console.print(line, highlight=False)
    if plan.baselines:
        console.print(baselines_table(plan))
        for b in plan.baselines:
            if b.prediction is None:
                console.print(f"{b.name} does not fit: {b.reason}", highlight=False)
    phases = plan.metrics_under("planner_s.")
    text = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items())
    console.print(f"planner time: {text} (total {sum(phases.values()):.1f} s)", highlight=False)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)
    console.print("details: meshplan report PLAN.json (write the plan with --out)", highlight=False)
