"""The planned-vs-compiled collectives of a `dump_debug_info` folder (its collectives.json) as a
terminal section: per collective kind and mesh axes, what the plan implies and what the compiled
executable runs, after the normalisation the file lists, with every difference named."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from meshplan.report.tables import bytes_text, table

SHOWN = 12  # differences listed one by one; the rest are counted
LARGEST = 5  # planned collectives listed with the operator or conversion that implies them


def collectives_table(data: dict[str, Any]) -> Table:
    """Counts and bytes per device of both sides, one row per (kind, mesh axes)."""
    numeric = ("planned", "planned\nbytes", "compiled", "compiled\nbytes", "instr-\nuctions")
    t = table(f"collectives: planned vs compiled ({data['backend']}, per device)",
              ["collective", "mesh\naxes", *numeric, ""], numeric=numeric)
    for r in data["rows"]:
        t.add_row(r["kind"], _axes(r["axes"]), str(r["planned"]), bytes_text(r["planned_bytes"]), str(r["compiled"]),
                  bytes_text(r["compiled_bytes"]), str(r["instructions"]), "ok" if r["agrees"] else "DIFFERS")
    return t


def collectives_lines(data: dict[str, Any]) -> list[str]:
    """The verdict, the method's layout rule, the differences and the normalisation applied."""
    lines = [_verdict(data)]
    if data.get("layout"):
        lines.append(f"layout: {data['layout']}")
    renamed = [p for p in data["planned"] if p["kind"] != p["compiled_kind"]]
    if renamed:
        lines.append(f"{len(renamed)} planned {renamed[0]['kind']}(s) counted as {renamed[0]['compiled_kind']}: "
                     f"the {data['backend']} backend emits them so")
    largest = sorted(data["planned"], key=lambda p: -p["bytes"])[:LARGEST]
    if largest:
        lines.append("largest planned collectives, where the plan puts them:")
        lines += [f"  {p['kind']} on axes {_axes(p['axes'])}, {bytes_text(p['bytes'])}: {p['origin']}" for p in largest]
    for p in data["missing"][:SHOWN]:
        lines.append(f"  planned, not compiled: {p['kind']} on axes {_axes(p['axes'])}, {bytes_text(p['bytes'])} "
                     f"({p['origin']})")
    lines += _more(data["missing"], "planned collectives not compiled")
    for u in data["unplanned"][:SHOWN]:
        lines.append(f"  compiled, not planned: {u['kind']} on axes {_axes(u['axes'])}, {bytes_text(u['bytes'])}"
                     + (f" (from {u['op_name']})" if u["op_name"] else ""))
    lines += _more(data["unplanned"], "compiled collectives not planned")
    lines.append("normalised: " + "; ".join(data["normalisation"]))
    return lines


def print_collectives(data: dict[str, Any], console: Console) -> None:
    console.print(collectives_table(data))
    for line in collectives_lines(data):
        console.print(line, highlight=False, markup=False)


def _verdict(data: dict[str, Any]) -> str:
    planned = sum(r["planned"] for r in data["rows"])
    compiled = sum(r["compiled"] for r in data["rows"])
    if data["agrees"]:
        return f"the executable runs exactly the {planned} planned collective(s)"
    return (f"the executable differs from the plan: {len(data['missing'])} of {planned} planned collective(s) "
            f"not compiled, {len(data['unplanned'])} of {compiled} compiled collective(s) not planned")


def _more(items: list[Any], what: str) -> list[str]:
    return [f"  ... and {len(items) - SHOWN} more {what} (collectives.json lists all)"] if len(items) > SHOWN else []


def _axes(axes: list[int] | None) -> str:
    if axes is None:
        return "other"
    return ",".join(map(str, axes)) or "-"
