"""`meshplan report PLAN --html FILE`: one self-contained HTML page that opens offline.

Charts are plotly figures with plotly.js inlined once in the page (no network): the pipeline
schedule (forward/backward per stage and micro-batch over time; the bubble shows as gaps),
memory per device per stage against the budget (weights, gradients, optimizer state, activations
of the micro-batches in flight and working memory), compute vs communication per stage, and a
heat map of every parameter's classification per layer; then the plan's tables.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from meshplan.intra.plan import IntraPlan
from meshplan.plan import Plan, Stage
from meshplan.report.breakdown import collective_rows, time_rows
from meshplan.report.layouts import parameter_layouts
from meshplan.report.tables import bytes_text, gb, ms, seconds_text, shape_text
from meshplan.report.text import (
    batch_option,
    distinct_plans,
    header_lines,
    local_name,
    memory_budget,
    parameter_rows,
    prediction_lines,
)
from meshplan.report.timeline import iteration_spans, step_seconds

CHART_IDS = ("schedule-chart", "memory-chart", "time-chart", "strategy-chart")
_COLORS = {"forward": "#4c78a8", "backward": "#f58518", "gradient sync": "#54a24b", "optimizer": "#b279a2"}
# Parameter classes of the heat map, in colour order.
CLASSES = ("replicated", "data parallel", "tensor parallel column", "tensor parallel row", "ZeRO-3", "sharded")
_CLASS_COLORS = ("#bab0ac", "#4c78a8", "#f58518", "#e45756", "#54a24b", "#b279a2")
_PASS_THROUGH = ("transpose", "reshape", "broadcast")


@dataclass(frozen=True, slots=True)
class MemoryParts:
    """Bytes per device of one stage by what they hold."""

    weights: float
    gradients: float
    optimizer: float
    activations: float  # activations of the micro-batches in flight and working memory: the rest


def memory_parts(stage: Stage) -> MemoryParts | None:
    plans = [(p.last_layer - p.first_layer + 1, p.intra_plan) for p in stage.pieces]
    if not plans and stage.intra_plan is not None:
        plans = [(1, stage.intra_plan)]
    if not plans:
        return None
    weights = gradients = optimizer = 0.0
    for count, intra in plans:
        memory = {c.node: c.memory for c in intra.nodes}
        for p, c in zip(parameter_layouts(intra), (c for c in intra.nodes if c.op == "parameter"), strict=True):
            if p.role == "optimizer":
                optimizer += count * memory[c.node]
            elif p.role != "input":
                weights += count * memory[c.node]
        gradients += count * sum(c.memory for c in intra.nodes
                                 if "accumulated" in c.tags and c.op not in _PASS_THROUGH)
    total = stage.memory_bytes if stage.memory_bytes is not None else max(i.peak_memory for _, i in plans)
    return MemoryParts(weights, gradients, optimizer, max(0.0, total - weights - gradients - optimizer))


def classify(text: str) -> int:
    """Index into CLASSES of a parameter's classification text."""
    if "tensor parallel column" in text:
        return 2
    if "tensor parallel row" in text:
        return 3
    if "ZeRO-3" in text:
        return 4
    if "sharded" in text or "split" in text:
        return 5
    return 1 if "data parallel" in text else 0


def _go():
    import plotly.graph_objects as go  # a plotting dependency only the HTML report needs

    return go


def schedule_figure(plan: Plan):
    go = _go()
    fig = go.Figure()
    spans = iteration_spans(plan)
    labels = [f"stage {k}" for k in range(plan.num_stages)]
    for category, color in _COLORS.items():
        chosen = [s for s in spans if s.category == category]
        if not chosen:
            continue
        fig.add_trace(go.Bar(name=category, orientation="h", y=[labels[s.stage] for s in chosen],
                             base=[s.start for s in chosen], x=[s.end - s.start for s in chosen],
                             marker={"color": color, "line": {"width": 0.3, "color": "white"}},
                             text=[s.name for s in chosen] if len(chosen) <= 200 else None, textposition="inside",
                             hovertemplate="%{y} %{text}: %{base:.4g} s + %{x:.4g} s<extra></extra>"
                             if len(chosen) <= 200 else "%{y}: %{base:.4g} s + %{x:.4g} s<extra></extra>"))
    if plan.prediction is not None:
        fig.add_vline(x=plan.prediction.pipeline_time_s, line_dash="dash", line_color="black",
                      annotation_text="predicted pipeline end", annotation_position="top left")
    fig.update_layout(barmode="overlay", title="pipeline schedule (gaps are the bubble)", xaxis_title="seconds",
                      yaxis={"autorange": "reversed"}, height=180 + 40 * plan.num_stages, bargap=0.2,
                      uniformtext={"mode": "hide", "minsize": 8})
    return fig


def memory_figure(plan: Plan):
    go = _go()
    parts = [memory_parts(s) for s in plan.stages]
    labels = [f"stage {k}" for k in range(plan.num_stages)]
    fig = go.Figure()
    for field, name in (("weights", "weights and state"), ("gradients", "gradients"),
                        ("optimizer", "optimizer state"), ("activations", "activations in flight, working")):
        fig.add_trace(go.Bar(name=name, x=labels, y=[getattr(p, field) / 1e9 if p else 0.0 for p in parts]))
    budget = memory_budget(plan)
    if budget:
        fig.add_trace(go.Scatter(name="budget", x=labels, y=[budget / 1e9] * len(labels), mode="lines+markers",
                                 line={"color": "black", "dash": "dash"}))
    fig.update_layout(barmode="stack", title="memory per device", yaxis_title="GB", height=420)
    return fig


def time_figure(plan: Plan):
    go = _go()
    labels = [f"stage {k}" for k in range(plan.num_stages)]
    fig = go.Figure()
    rows = time_rows(plan)
    if rows:
        for field, name in (("compute", "compute"), ("communication", "communication"), ("handoff", "hand-off"),
                            ("bubble", "bubble"), ("sync", "gradient sync"), ("update", "optimizer")):
            fig.add_trace(go.Bar(name=name, x=labels, y=[getattr(r, field) or 0.0 for r in rows]))
        title = "where each stage's iteration goes"
    else:  # no predicted latencies: the intra-op plans' own cost breakdown
        plans = [s.intra_plan for s in plan.stages]
        for name, read in (("compute", lambda i: i.breakdown.compute),
                           ("communication", lambda i: i.breakdown.communication + i.breakdown.resharding)):
            fig.add_trace(go.Bar(name=name, x=labels, y=[read(i) if i else 0.0 for i in plans]))
        title = "compute vs communication per stage (intra-op cost model)"
    fig.update_layout(barmode="stack", title=title, yaxis_title="seconds per iteration", height=420)
    return fig


def strategy_figure(plan: Plan):
    """Heat map: rows are parameters (layer part removed), columns layers (or stages)."""
    go = _go()
    columns: list[str] = []
    cells: dict[tuple[str, str], tuple[int, str]] = {}
    for k, stage in enumerate(plan.stages):
        for first, last, intra in _plans(stage):
            for layer in (range(first, last + 1) if stage.pieces else [None]):
                column = f"layer {layer}" if layer is not None else f"stage {k}"
                if column not in columns:
                    columns.append(column)
                for p in parameter_layouts(intra):
                    if p.role in ("input", "optimizer"):
                        continue
                    hover = f"{p.layout}: {p.classification}"
                    cells[(local_name(p.name), column)] = (classify(p.classification), hover)
    names = list(dict.fromkeys(name for name, _ in cells))
    z = [[cells.get((n, c), (None, ""))[0] for c in columns] for n in names]
    text = [[cells.get((n, c), (None, "-"))[1] for c in columns] for n in names]
    scale = []
    for i, color in enumerate(_CLASS_COLORS):
        scale += [[i / len(CLASSES), color], [(i + 1) / len(CLASSES), color]]
    fig = go.Figure(go.Heatmap(z=z, x=columns, y=names, text=text, zmin=-0.5, zmax=len(CLASSES) - 0.5,
                               colorscale=scale, hovertemplate="%{y} (%{x}): %{text}<extra></extra>",
                               colorbar={"tickvals": list(range(len(CLASSES))), "ticktext": list(CLASSES)}))
    fig.update_layout(title="parameter classification per layer", height=max(320, 28 * len(names) + 160),
                      yaxis={"autorange": "reversed"})
    return fig


def _plans(stage: Stage) -> list[tuple[int, int, IntraPlan]]:
    if stage.pieces:
        return [(p.first_layer, p.last_layer, p.intra_plan) for p in stage.pieces]
    return [(stage.first_layer, stage.last_layer, stage.intra_plan)] if stage.intra_plan is not None else []


def _table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _tables(plan: Plan) -> str:
    budget = memory_budget(plan)
    stages = [[str(k), s.layers, shape_text(s.submesh or ()), shape_text(s.logical_mesh), batch_option(s),
               s.recompute, s.memory_plan, ms(s.latency_s), gb(s.memory_bytes),
               "-" if not budget or s.memory_bytes is None else f"{s.memory_bytes / budget:.0%}"]
              for k, s in enumerate(plan.stages)]
    parts = ["<h2>stages</h2>", _table(["stage", "layers", "sub-mesh", "logical mesh", "batch axis", "recompute",
                                        "intra-op plan", "ms per micro-batch", "GB per device", "% of budget"],
                                       stages)]
    params = []
    for found in distinct_plans(plan):
        for p, state in parameter_rows(found.plan):
            params.append([found.layers, found.piece, local_name(p.name), shape_text(p.shape), str(p.layout),
                           state or "-", p.classification])
    parts += ["<h2>parameters</h2>", _table(["layers", "piece", "parameter", "shape", "layout", "optimizer state",
                                             "classification"], params)]
    comm = [[str(r.stage), r.kind, ",".join(map(str, r.axes)), r.when, f"{r.count:,}", bytes_text(r.nbytes),
             seconds_text(r.seconds)] for r in collective_rows(plan)]
    parts += ["<h2>communication per iteration</h2>",
              _table(["stage", "collective", "mesh axis", "when", "count", "bytes", "time"], comm)]
    return "\n".join(parts)


_STYLE = """body{font-family:sans-serif;margin:24px;max-width:1200px}table{border-collapse:collapse;margin:8px 0}
td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px;text-align:left}th{background:#eee}
.chart{margin:16px 0}"""


def html_report(plan: Plan) -> str:
    """The page as one string (plotly.js inlined)."""
    from plotly.offline import get_plotlyjs

    step_seconds(plan.stages[0])  # a plan without stage times cannot be charted: say so now
    figures = (schedule_figure(plan), memory_figure(plan), time_figure(plan), strategy_figure(plan))
    charts = "\n".join(f'<div class="chart">{fig.to_html(full_html=False, include_plotlyjs=False, div_id=div)}</div>'
                       for fig, div in zip(figures, CHART_IDS, strict=True))
    lines = "".join(f"<p>{html.escape(line)}</p>" for line in header_lines(plan) + prediction_lines(plan))
    title = html.escape(f"meshplan plan: {plan.model}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title><style>{_STYLE}</style>"
            f"<script type=\"text/javascript\">{get_plotlyjs()}</script></head>\n<body><h1>{title}</h1>{lines}\n"
            f"{charts}\n{_tables(plan)}\n</body></html>\n")
