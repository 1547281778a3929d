"""Text report of an IntraPlan: objective, breakdown, per-layer strategies, solver figures."""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console
from rich.table import Table

from meshplan.intra.plan import ChosenStrategy, IntraPlan

_SHOWN_OPS = ("dot", "parameter", "reduce")


def layer_rows(plan: IntraPlan) -> list[tuple[str, str, str, str]]:
    """(layers, node, strategy, collectives) rows; consecutive identical layers are merged."""
    by_layer: dict[int | None, list[ChosenStrategy]] = {}
    for chosen in plan.nodes:
        if chosen.op in _SHOWN_OPS and (chosen.op != "reduce" or chosen.collectives):
            by_layer.setdefault(chosen.layer, []).append(chosen)
    rows = []
    for chosen in by_layer.pop(None, []):
        rows.append(("-", chosen.name, chosen.strategy, _collectives(chosen)))
    runs: list[tuple[list[int], list[ChosenStrategy]]] = []
    for layer in sorted(by_layer):
        key = [(_local(c.name), c.strategy) for c in by_layer[layer]]
        if runs and [(_local(c.name), c.strategy) for c in runs[-1][1]] == key:
            runs[-1][0].append(layer)
        else:
            runs.append(([layer], by_layer[layer]))
    for layers, nodes in runs:
        span = str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
        for chosen in nodes:
            rows.append((span, _local(chosen.name), chosen.strategy, _collectives(chosen)))
    return rows


def _local(name: str) -> str:
    """Name without its layer prefix ("layer3.wq" -> "wq")."""
    head, _, tail = name.partition(".")
    return tail if head.startswith("layer") and tail else name


def _collectives(chosen: ChosenStrategy) -> str:
    return ", ".join(str(c) for c in chosen.collectives) or "-"


def print_intra_plan(plan: IntraPlan, console: Console | None = None, extra: Iterable[str] = ()) -> None:
    console = console or Console()
    b, s = plan.breakdown, plan.solve
    console.print(f"[bold]{plan.graph_name}[/bold] on mesh {plan.mesh.name} "
                  f"(alpha {plan.mesh.alpha}, beta {plan.mesh.beta})")
    console.print(f"objective      {plan.objective:,.4f}")
    console.print(f"  compute      {b.compute:,.4f}\n  communication {b.communication:,.4f}\n"
                  f"  resharding   {b.resharding:,.4f}")
    budget = "unlimited" if plan.memory_budget is None else f"{plan.memory_budget / 1e9:.2f} GB"
    console.print(f"peak memory    {plan.peak_memory / 1e9:.3f} GB per device (budget {budget})")
    gap = "n/a" if s.gap is None else f"{s.gap:.2%}"
    console.print(f"solver         {s.backend}: {s.status.value}, gap {gap}, solve {s.wall_s:.2f} s, "
                  f"build {plan.build_s:.2f} s; {plan.num_groups} decisions, {plan.num_variables} variables, "
                  f"{plan.num_constraints} constraints" + (", layers shared" if plan.shared_layers else ""))
    for line in extra:
        console.print(line)
    table = Table(title="strategies (dots, parameters, reductions that communicate)")
    for column in ("layers", "node", "strategy", "collectives"):
        table.add_column(column)
    for row in layer_rows(plan):
        table.add_row(*row)
    console.print(table)
    if plan.reshardings:
        console.print(f"{len(plan.reshardings)} reshardings cost "
                      f"{sum(c.cost for r in plan.reshardings for c in r.collectives):,.4f}")
    if plan.unsupported_ops:
        console.print(f"[yellow]planned replicated (no rule): {', '.join(plan.unsupported_ops)}[/yellow]")
