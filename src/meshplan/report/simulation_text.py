"""Text report of a simulated Plan: its stages, its prediction, the baselines, planner time."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from meshplan.plan import Plan


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def stage_table(plan: Plan) -> Table:
    table = Table(title=f"{plan.label} plan: {len(plan.stages)} stages, {plan.num_microbatches} micro-batches "
                        f"of {plan.microbatch_size} sequences, {plan.schedule}")
    for column in ("stage", "layers", "sub-mesh", "logical mesh", "intra-op plan", "recompute",
                   "time/micro-batch", "memory/device"):
        table.add_column(column, justify="right" if column.startswith(("time", "memory")) else "left")
    for j, s in enumerate(plan.stages):
        table.add_row(str(j), s.layers, "x".join(map(str, s.submesh)), "x".join(map(str, s.logical_mesh)),
                      s.memory_plan, s.recompute, f"{s.latency_s * 1e3:.1f} ms", _gb(s.memory_bytes))
    return table


def prediction_lines(plan: Plan) -> list[str]:
    p = plan.prediction
    metrics = dict(plan.metrics)
    spread = ""
    if "time_range.low_s" in metrics:
        spread = f" ({metrics['time_range.low_s']:.2f}-{metrics['time_range.high_s']:.2f} s)"
    lines = [f"iteration time  {p.iteration_time_s:.3f} s{spread}  (pipeline {p.pipeline_time_s:.3f} s + gradient sync "
             f"and optimizer {p.sync_time_s:.3f} s)",
             f"throughput      {p.tokens_per_s:,.0f} tokens/s, {p.tflops_per_device:.1f} TFLOP/s per device, "
             f"MFU {p.mfu:.1%}",
             f"peak memory     {_gb(p.peak_memory_bytes)} per device"]
    parts = plan.metrics_under("memory.")
    if parts:
        lines.append("                " + ", ".join(f"{name} {_gb(v)}" for name, v in parts.items()))
    return lines


def baseline_table(plan: Plan) -> Table:
    table = Table(title="baselines (the ILP cost model; layout-search: the closed-form model)")
    for column in ("plan", "configuration", "iteration time", "tokens/s", "MFU", "vs auto"):
        table.add_column(column)
    auto = plan.prediction
    table.add_row("auto", f"{len(plan.stages)} stages, micro-batch {plan.microbatch_size}",
                  f"{auto.iteration_time_s:.3f} s", f"{auto.tokens_per_s:,.0f}", f"{auto.mfu:.1%}", "1.00x")
    for b in plan.baselines:
        if b.prediction is None:
            table.add_row(b.name, b.config, "does not fit", "-", "-", b.reason)
            continue
        p = b.prediction
        table.add_row(b.name, b.config, f"{p.iteration_time_s:.3f} s", f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}",
                      f"{auto.tokens_per_s / p.tokens_per_s:.2f}x")
    return table


def print_simulation(plan: Plan, console: Console | None = None) -> None:
    console = console or Console()
    console.print(f"[bold]{plan.model}[/bold] ({plan.num_params / 1e9:.2f}B parameters) on "
                  f"{plan.cluster[0]}x{plan.cluster[1]} {plan.device}: global batch {plan.global_batch} x "
                  f"{plan.seq_len} tokens")
    console.print(stage_table(plan))
    for line in prediction_lines(plan):
        console.print(line)
    if plan.baselines:
        console.print(baseline_table(plan))
    phases = plan.metrics_under("planner_s.")
    text = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items())
    console.print(f"planner time: {text} (total {sum(phases.values()):.1f} s)")
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)


def print_layout(plan: Plan, console: Console | None = None) -> None:
    """A priced layout: its time with the range, the time and memory breakdowns, and how it
    compares with the fastest layout found."""
    console = console or Console()
    p = plan.prediction
    metrics = dict(plan.metrics)
    console.print(f"[bold]{plan.model}[/bold] ({plan.num_params / 1e9:.2f}B parameters) on "
                  f"{plan.cluster[0]}x{plan.cluster[1]} {plan.device}: global batch {plan.global_batch} x "
                  f"{plan.seq_len} tokens, layout {plan.option('layout')}", highlight=False)
    low, high = metrics["time_range.low_s"], metrics["time_range.high_s"]
    console.print(f"iteration time  {p.iteration_time_s:.2f} s ({low:.2f}-{high:.2f} s)  "
                  f"{plan.num_microbatches} micro-batches of {plan.microbatch_size}, {plan.schedule}", highlight=False)
    console.print(f"throughput      {p.tokens_per_s:,.0f} tokens/s, {p.tflops_per_device:.1f} TFLOP/s per device, "
                  f"MFU {p.mfu:.1%}", highlight=False)
    table = Table(title="time per iteration (critical stage)")
    table.add_column("part")
    table.add_column("seconds", justify="right")
    for name, seconds in plan.metrics_under("time.").items():
        table.add_row(name, f"{seconds:.3f}")
    console.print(table)
    table = Table(title="peak memory per device (most loaded stage)")
    table.add_column("part")
    table.add_column("memory", justify="right")
    for name, nbytes in plan.metrics_under("memory.").items():
        table.add_row(name, _gb(nbytes))
    table.add_row("total", _gb(p.peak_memory_bytes))
    console.print(table)
    for b in plan.baselines:
        if b.prediction is not None:
            console.print(f"{b.name}: {b.config}: {b.prediction.iteration_time_s:.2f} s, MFU {b.prediction.mfu:.1%} "
                          f"(this layout takes {p.iteration_time_s / b.prediction.iteration_time_s:.2f}x as long)",
                          highlight=False)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)
