"""`meshplan report`: a Plan in the terminal: stages, Alpa's DP result, parameter layouts,
operator strategies on request, communication and where the iteration's time goes."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from meshplan.intra.plan import ChosenStrategy, IntraPlan
from meshplan.plan import NOT_APPLICABLE, Plan, Stage
from meshplan.report.breakdown import collective_rows, stage_plans, time_rows
from meshplan.report.layouts import ParameterLayout, parameter_layouts, stage_parallelism
from meshplan.report.tables import bytes_text, gb, ms, seconds_text, shape_text, table
from meshplan.report.timeline import replayed_pipeline_time


@dataclass(frozen=True, slots=True)
class OpFilter:
    """Which operators `--ops` lists: all dots, parameters and communicating ops, or those of one
    layer, or those whose name contains a text (then any op kind)."""

    layer: int | None = None
    name: str = ""

    def keeps(self, chosen: ChosenStrategy, first: int, last: int) -> bool:
        if self.layer is not None and not first <= self.layer <= last:
            return False
        if self.name:
            return self.name in chosen.name
        return chosen.op in ("dot", "parameter") or bool(chosen.collectives)


@dataclass(frozen=True, slots=True)
class DistinctPlan:
    """A piece plan and every (stage, layer range) it covers (identical plans are listed once)."""

    piece: str
    plan: IntraPlan
    stages: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]

    @property
    def layers(self) -> str:
        merged: list[list[int]] = []
        for first, last in sorted(self.ranges):
            if merged and first <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], last)
            else:
                merged.append([first, last])
        return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in merged)


def distinct_plans(plan: Plan) -> tuple[DistinctPlan, ...]:
    """The plan's intra-op plans, each once, with where it is used."""
    found: dict[int, DistinctPlan] = {}
    for k, stage in enumerate(plan.stages):
        for name, first, last, intra in _pieces(stage):
            known = found.get(id(intra))
            if known is None:
                found[id(intra)] = DistinctPlan(name, intra, (k,), ((first, last),))
            else:
                found[id(intra)] = DistinctPlan(name, intra, (*known.stages, k), (*known.ranges, (first, last)))
    return tuple(found.values())


def _pieces(stage: Stage) -> Iterator[tuple[str, int, int, IntraPlan]]:
    for piece in stage.pieces:
        yield piece.name, piece.first_layer, piece.last_layer, piece.intra_plan
    if not stage.pieces and stage.intra_plan is not None:
        yield "stage", stage.first_layer, stage.last_layer, stage.intra_plan


def memory_budget(plan: Plan) -> float | None:
    """Bytes per device the plan was held to, when it says."""
    text = plan.option("memory_budget_bytes")
    if text:
        return float(text)
    budgets = [i.memory_budget for s in plan.stages for _, _, i in stage_plans(s) if i.memory_budget]
    return min(budgets) if budgets else None


def batch_option(stage: Stage) -> str:
    """Alpa's force_batch_dim_to_mesh_dim for the stage, read off its plans ("-" without one)."""
    options = {stage_parallelism(intra).batch_option for _, _, intra in stage_plans(stage)}
    return ",".join(sorted(options)) if options else "-"


def print_report(plan: Plan, console: Console | None = None, ops: OpFilter | None = None) -> None:
    """The whole terminal report; `ops` adds the per-operator strategies."""
    console = console or Console()
    for line in header_lines(plan):
        console.print(line, highlight=False)
    console.print(stages_table(plan))
    for line in alpa_lines(plan):
        console.print(line, highlight=False)
    for line in prediction_lines(plan):
        console.print(line, highlight=False)
    if time_rows(plan):
        console.print(time_table(plan))
        line = replay_line(plan)
        if line:
            console.print(line, highlight=False)
    if collective_rows(plan):
        console.print(communication_table(plan))
    else:
        console.print("communication: none (the plan implies no collectives)")
    console.print(parameters_table(plan))
    if ops is not None:
        console.print(operators_table(plan, ops))
    if plan.baselines:
        console.print(baselines_table(plan))
        for line in unpriced_baseline_lines(plan):
            console.print(line, highlight=False)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)


def header_lines(plan: Plan) -> list[str]:
    lines = [f"{plan.model}: {plan.source} plan ({plan.label}), {plan.num_stages} stage(s) on "
             f"{plan.num_devices} device(s)"]
    facts = []
    if plan.num_params:
        facts.append(f"{plan.num_params / 1e9:.2f}B parameters")
    if plan.cluster:
        facts.append(f"cluster {plan.cluster[0]}x{plan.cluster[1]} {plan.device}".rstrip())
    if plan.global_batch:
        unit = f" x {plan.seq_len} tokens" if plan.seq_len else \
            f" {plan.sample_unit}" if plan.sample_unit != "tokens" else ""
        facts.append(f"global batch {plan.global_batch}{unit}")
    facts.append(f"schedule {plan.schedule}, {plan.num_microbatches} micro-batch(es)"
                 + (f" of {plan.microbatch_size}" if plan.microbatch_size else ""))
    lines.append(", ".join(facts))
    budget = memory_budget(plan)
    if budget:
        lines.append(f"memory budget {gb(budget)} GB per device")
    if plan.option("batch"):  # what a runtime plan splits (or cuts into micro-batches) as the batch, and why
        lines.append(f"batch {plan.option('batch')}")
    return lines


def stages_table(plan: Plan) -> Table:
    budget = memory_budget(plan)
    t = table("stages", ["stage", "layers", "sub-\nmesh", "logical\nmesh", "batch\naxis", "recompute", "plan",
                         "ms per\nu-batch", "GB per\ndevice", "% of\nbudget"],
              numeric=("ms per\nu-batch", "GB per\ndevice", "% of\nbudget"))
    for k, s in enumerate(plan.stages):
        memory = s.memory_bytes
        share = "-" if memory is None or not budget else f"{memory / budget:.0%}"
        t.add_row(str(k), s.layers, shape_text(s.submesh or ()), shape_text(s.logical_mesh), batch_option(s),
                  s.recompute, s.memory_plan, ms(s.latency_s), gb(memory), share)
    return t


def alpa_lines(plan: Plan) -> list[str]:
    """The fields of Alpa's get_last_dp_result(), as Alpa prints them."""
    options = []
    for s in plan.stages:
        option = batch_option(s)
        options.append({} if option in ("-", "none") else {"force_batch_dim_to_mesh_dim": int(option.split(",")[0])})
    return ["as Alpa's get_last_dp_result():",
            f"  forward_stage_layer_ids = {[list(range(s.first_layer, s.last_layer + 1)) for s in plan.stages]}",
            f"  submesh_shapes = {[tuple(s.submesh) if s.submesh else None for s in plan.stages]}",
            f"  logical_mesh_shapes = {[tuple(s.logical_mesh) for s in plan.stages]}",
            f"  autosharding_option_dicts = {options}"]


def prediction_lines(plan: Plan) -> list[str]:
    p = plan.prediction
    if p is None:
        return ["no prediction in this plan"]
    lines = [f"iteration time  {p.iteration_time_s:.4g} s{time_range(plan)} (pipeline {p.pipeline_time_s:.4g} s "
             f"+ gradient sync and optimizer {p.sync_time_s:.4g} s)"]
    if p.tokens_per_s is not None:
        lines.append(f"throughput      {p.tokens_per_s:,.0f} {plan.sample_unit}/s, {p.tflops_per_device:.1f} "
                     f"TFLOP/s per device, MFU {p.mfu:.1%}")
    if p.peak_memory_bytes is not None:
        lines.append(f"peak memory     {gb(p.peak_memory_bytes)} GB per device")
    parts = plan.metrics_under("memory.")
    if parts:
        lines.append("                " + ", ".join(f"{name} {gb(v)} GB" for name, v in parts.items()))
    return lines


def time_range(plan: Plan) -> str:
    """" (low-high s)": the prediction's range from the calibration's spread, when the plan has one."""
    metrics = dict(plan.metrics)
    if "time_range.low_s" not in metrics:
        return ""
    return f" ({metrics['time_range.low_s']:.4g}-{metrics['time_range.high_s']:.4g} s)"


def time_table(plan: Plan) -> Table:
    t = table("where an iteration's time goes, per stage",
              ["stage", "compute", "communi-\ncation", "hand-off", "bubble", "gradient\nsync", "optimizer"],
              numeric=("compute", "communi-\ncation", "hand-off", "bubble", "gradient\nsync", "optimizer"))
    for r in time_rows(plan):
        t.add_row(str(r.stage), *(_secs(v) for v in (r.compute, r.communication, r.handoff, r.bubble, r.sync,
                                                     r.update)))
    return t


def replay_line(plan: Plan) -> str:
    """A note when replaying the schedule step by step ends earlier than the predicted pipeline time."""
    if plan.prediction is None:
        return ""
    replayed, predicted = replayed_pipeline_time(plan), plan.prediction.pipeline_time_s
    if replayed >= predicted * (1 - 1e-9):
        return ""
    return (f"replaying the {plan.schedule} schedule step by step takes {replayed:.4g} s for the pipeline, "
            f"{1 - replayed / predicted:.2%} less than predicted ({predicted:.4g} s, the stage DP's closed form, "
            "an upper bound here); the Chrome trace and the HTML chart show the replay")


def _secs(value: float | None) -> str:
    return "-" if value is None else seconds_text(0.0 if abs(value) < 1e-12 else value)


def communication_table(plan: Plan) -> Table:
    unit = "cost" if plan.source == "intra" else "time"
    t = table("communication per iteration (per device)", ["stage", "collective", "mesh\naxis", "when", "count",
                                                             "bytes", unit],
              numeric=("count", "bytes", unit))
    rows = collective_rows(plan)
    for r in rows:
        cost = f"{r.seconds:,.4g}" if plan.source == "intra" else seconds_text(r.seconds)
        t.add_row(str(r.stage), r.kind, ",".join(map(str, r.axes)), r.when, f"{r.count:,}", bytes_text(r.nbytes), cost)
    if rows:
        total = sum(r.seconds for r in rows)
        cost = f"{total:,.4g}" if plan.source == "intra" else seconds_text(total)
        t.add_row("all", "", "", "", f"{sum(r.count for r in rows):,}", bytes_text(sum(r.nbytes for r in rows)),
                  cost)
    return t


def parameter_rows(intra: IntraPlan) -> Iterator[tuple[ParameterLayout, str]]:
    """Each parameter but optimizer state, with the spec of its optimizer state ("" if none)."""
    layouts = parameter_layouts(intra)
    states: dict[str, set[str]] = {}
    for p in layouts:
        if p.role == "optimizer":
            states.setdefault(p.of_weight, set()).add(str(p.layout))
    for p in layouts:
        if p.role != "optimizer":
            yield p, "/".join(sorted(states.get(p.name, ())))


def parameters_table(plan: Plan) -> Table:
    t = table("parameters: layout (R whole, Sk split over mesh axis k) and what it means",
              ["layers", "parameter", "shape", "layout", "optim.\nstate", "classification"])
    for found in distinct_plans(plan):
        summary = stage_parallelism(found.plan).summary
        t.add_row(f"[bold]{found.layers}[/bold]", f"[bold]{found.piece}[/bold]", "", "", "",
                  f"[bold]{summary}[/bold]")
        for p, state in parameter_rows(found.plan):
            name = p.name if found.piece == "stage" else local_name(p.name)  # a piece plan stands for its layers
            t.add_row("", name, shape_text(p.shape), str(p.layout), state or "-", p.classification)
    return t


def operators_table(plan: Plan, ops: OpFilter) -> Table:
    t = table("operator strategies", ["stage", "layer", "operator", "op", "strategy", "collectives"])
    for k, stage in enumerate(plan.stages):
        for _, first, last, intra in _pieces(stage):
            for chosen in intra.nodes:
                if ops.keeps(chosen, first, last):
                    layer = f"{first}-{last}" if chosen.layer is not None and last > first else str(first)
                    t.add_row(str(k), layer if chosen.layer is not None else "-", local_name(chosen.name), chosen.op,
                              chosen.strategy, ", ".join(str(c) for c in chosen.collectives) or "-")
    return t


def unpriced_baseline_lines(plan: Plan) -> list[str]:
    """Why each baseline without a prediction has none: it does not fit, or does not apply."""
    return [f"{b.name} {'does not apply' if b.config == NOT_APPLICABLE else 'does not fit'}: {b.reason}"
            for b in plan.baselines if b.prediction is None]


def baselines_table(plan: Plan) -> Table:
    model = plan.prediction.cost_model or "the same cost model"
    rate = f"{plan.sample_unit}/s"
    t = table(f"baselines priced by the auto plan's cost model ({model})",
              ["plan", "configuration", "s per\niteration", rate, "MFU", "auto is\nfaster by"],
              numeric=("s per\niteration", rate, "MFU", "auto is\nfaster by"))
    auto = plan.prediction
    t.add_row("auto", f"{plan.num_stages} stages, micro-batch {plan.microbatch_size}",
              f"{auto.iteration_time_s:.3f}", f"{auto.tokens_per_s:,.0f}", f"{auto.mfu:.1%}", "1.00x")
    for b in plan.baselines:
        p = b.prediction
        config = b.config.replace(",", ", ")  # a layout wraps between its keys (parse_layout takes either)
        if p is None:
            t.add_row(b.name, config, "-" if b.config == NOT_APPLICABLE else "no fit", "-", "-", "-")
        else:
            t.add_row(b.name, config, f"{p.iteration_time_s:.3f}", f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}",
                      f"{auto.tokens_per_s / p.tokens_per_s:.2f}x")
    return t


def local_name(name: str) -> str:
    """Name without its layer part ("layer3.attn.wq" -> "attn.wq", "grad.layer3.wq" -> "grad.wq"): a
    piece plan stands for every layer of its range."""
    return re.sub(r"(^|\.)layer\d+\.", r"\1", name)


def render(plan: Plan, ops: OpFilter | None = None, width: int = 80) -> str:
    """The report as text `width` columns wide (for files and tests)."""
    console = Console(width=width, record=True, file=_Null(), color_system=None)
    print_report(plan, console, ops)
    return console.export_text()


class _Null:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def lines_wider_than(text: str, width: int = 80) -> Iterable[str]:
    return [line for line in text.splitlines() if len(line) > width]
