"""Predict published, measured training runs with their own model, cluster and layout; writes
benchmarks/results/validation.json and prints the tables of docs/validation.md.

Every run is priced by `meshplan simulate --layout` with one fixed set of kernel efficiencies
(meshplan.cost.kernels.DEFAULT_EFFICIENCY) and both pricers: the closed form
(meshplan.simulator.analytic, `--pricer formula`) and the operator graph
(meshplan.simulator.graph_pricing, `--pricer graph`, the auto planner's cost model). The errors
are summed up by technique family, and the two pricers' agreement is checked on every run and
on the best layout-search layout of each job of docs/simulator.md (3 % in time, 5 % in peak
memory). The runs and their sources are in benchmarks/published_runs.py. Takes about a minute
(--formula-only: a few seconds).
Run: python benchmarks/validate_published.py [--formula-only] [RUN ...]
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict

from published_runs import MEMORY_RUNS, RUNS, price_memory_run, price_run

from meshplan.cluster import Cluster, get_device
from meshplan.cost.kernels import DEFAULT_EFFICIENCY
from meshplan.models.transformer import PRESETS
from meshplan.simulator import TrainingJob
from meshplan.simulator.analytic import UNCERTAINTY, search_layouts
from meshplan.simulator.graph_pricing import price_layout_graph
from meshplan.simulator.layout import parse_layout

from common import save

SIZES = ((0, 10), (10, 50), (50, 200), (200, 2000))  # billions of parameters
TIME_AGREEMENT, MEMORY_AGREEMENT = 0.03, 0.05  # graph against formula, the bound
# The jobs of docs/simulator.md: (name, model, nodes, GPUs per node, device, global batch, sequence).
JOBS = (("llama2-13b-50x4-v100", "llama2-13b", 50, 4, "v100-32gb", 1000, 4096),
        ("llama2-70b-128x8-a100", "llama2-70b", 128, 8, "a100-80gb", 1024, 4096),
        ("llama3.1-405b-288x8-h100", "llama3.1-405b", 288, 8, "h100-80gb", 2304, 8192),
        ("mixtral-8x7b-4x8-h100", "mixtral-8x7b", 4, 8, "h100-80gb", 256, 4096))
# Technique families the errors are summed up by: (name, does a run's layout and model belong).
FAMILIES = (
    ("tensor parallel across nodes (tp > 8)", lambda lay, model: lay.tp > 8),
    ("deep pipelines (pp >= 8)", lambda lay, model: lay.pp >= 8),
    ("interleaved stages (vp > 1)", lambda lay, model: lay.vp > 1),
    ("fp8", lambda lay, model: lay.fp8),
    ("MoE", lambda lay, model: model.experts > 0),
    ("context parallel", lambda lay, model: lay.cp > 1),
    ("sequence parallel, selective recompute", lambda lay, model: lay.sp and lay.recompute == "selective"),
    ("full recompute", lambda lay, model: lay.recompute == "full"),
    ("distributed optimizer", lambda lay, model: lay.distributed_optimizer),
    ("data parallel only", lambda lay, model: lay.tp == lay.pp == lay.cp == 1),
)


def main(only: set[str], graph: bool) -> None:
    cases = []
    for run in RUNS:
        if only and run.name not in only:
            continue
        found = price_run(run)
        predicted = found.iteration_time if found else None
        error = None if found is None else predicted / run.published_s - 1
        cases.append({"name": run.name, "source": run.source, "model": run.model.name, "params_b": run.size,
                      "gpus": run.cluster.num_devices, "device": run.device, "global_batch": run.global_batch,
                      "seq_len": run.seq_len, "layout": found.layout.text() if found else run.layout,
                      "published_s": run.published_s, "predicted_s": predicted, "relative_error": error,
                      "memory_gb": found.memory.total / 1e9 if found else None, "note": run.note,
                      "families": [name for name, member in FAMILIES
                                   if found and member(found.layout, run.model)],
                      **(graph_case(run.job, run.cluster, found, run.published_s) if graph and found else {})})
    errors = [c["relative_error"] for c in cases if c["relative_error"] is not None]
    summary = {"runs": len(cases), "priced": len(errors), "mae": statistics.mean(abs(e) for e in errors),
               "mean_signed": statistics.mean(errors), "efficiency": asdict(DEFAULT_EFFICIENCY),
               "by_size": by_size(cases), "spread": spread(cases), "uncertainty_in_code": UNCERTAINTY,
               "by_family": by_family(cases)}
    memory = memory_cases()
    jobs = [job_case(*job) for job in JOBS] if graph and not only else []
    cases.append({"name": "summary", **summary, "memory": memory, "jobs": jobs})
    print(table(cases[:-1]))
    print()
    print(memory_table(memory))
    print()
    print(family_table(summary["by_family"]))
    if graph:
        print()
        print(pricer_table(cases[:-1], jobs))
    print(f"\nmean absolute error {summary['mae']:.1%} over {summary['priced']} runs, mean signed "
          f"{summary['mean_signed']:+.1%}; spread (10th, 90th percentile of published/predicted - 1) "
          f"{summary['spread'][0]:+.1%}, {summary['spread'][1]:+.1%}")
    for (low, high), (count, signed, absolute) in zip(SIZES, summary["by_size"], strict=True):
        print(f"{low}-{high}B: {count} runs, mean signed {signed:+.1%}, mean absolute {absolute:.1%}")
    if graph:
        worst = max([*cases[:-1], *jobs], key=lambda c: abs(c.get("time_agreement", 0.0)))
        print(f"pricers agree within {TIME_AGREEMENT:.0%} / {MEMORY_AGREEMENT:.0%}: "
              f"{all(agrees(c) for c in [*cases[:-1], *jobs])}; largest time difference "
              f"{worst['time_agreement']:+.2%} ({worst['name']})")
    print("wrote", save("validation", cases))


def graph_case(job: TrainingJob, cluster: Cluster, found, published_s: float | None) -> dict:
    """The layout `found` was priced at, priced on the operator graph: its time, memory, error and
    its agreement with the closed form (graph / formula - 1)."""
    start = time.perf_counter()
    graph = price_layout_graph(job, cluster, found.layout)
    case = {"graph_s": graph.iteration_time, "graph_memory_gb": graph.memory.total / 1e9,
            "time_agreement": graph.iteration_time / found.iteration_time - 1,
            "memory_agreement": graph.memory.total / found.memory.total - 1,
            "graph_pricing_s": time.perf_counter() - start}
    if published_s:
        case["graph_error"] = graph.iteration_time / published_s - 1
    return case


def agrees(case: dict) -> bool:
    return abs(case["time_agreement"]) <= TIME_AGREEMENT and abs(case["memory_agreement"]) <= MEMORY_AGREEMENT


def job_case(name: str, model: str, nodes: int, per_node: int, device: str, batch: int, seq: int) -> dict:
    """The best layout the closed-form layout search finds for a job, priced by both pricers."""
    job, cluster = TrainingJob(PRESETS[model], batch, seq), Cluster(nodes, per_node, get_device(device))
    best = search_layouts(job, cluster).best
    return {"name": name, "layout": best.layout.text(), "formula_s": best.iteration_time,
            "formula_memory_gb": best.memory.total / 1e9, **graph_case(job, cluster, best, None)}


def by_family(cases: list[dict]) -> dict[str, dict]:
    """Per technique family: runs, and the mean absolute and signed error of each pricer."""
    rows = {}
    for name, _ in FAMILIES:
        members = [c for c in cases if name in c.get("families", ())]
        row = {"runs": len(members)}
        for pricer, key in (("formula", "relative_error"), ("graph", "graph_error")):
            errors = [c[key] for c in members if c.get(key) is not None]
            if errors:
                row[pricer] = {"mae": statistics.mean(abs(e) for e in errors), "mean_signed": statistics.mean(errors)}
        rows[name] = row
    return rows


def family_table(families: dict[str, dict]) -> str:
    lines = ["| technique | runs | formula MAE | formula signed | graph MAE | graph signed |",
             "|---|---|---|---|---|---|"]
    for name, row in families.items():
        cells = [f"{row[p]['mae']:.1%} | {row[p]['mean_signed']:+.1%}" if p in row else "- | -"
                 for p in ("formula", "graph")]
        lines.append(f"| {name} | {row['runs']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def pricer_table(cases: list[dict], jobs: list[dict]) -> str:
    lines = ["| run or job | formula s | graph s | time (graph / formula - 1) | memory (graph / formula - 1) |",
             "|---|---|---|---|---|"]
    for c in [*cases, *jobs]:
        if "graph_s" in c:
            formula = c.get("predicted_s", c.get("formula_s"))
            lines.append(f"| {c['name']} | {formula:.2f} | {c['graph_s']:.2f} | {c['time_agreement']:+.2%} | "
                         f"{c['memory_agreement']:+.2%} |")
    return "\n".join(lines)


def memory_cases() -> list[dict]:
    rows = []
    for run in MEMORY_RUNS:
        found = price_memory_run(run)
        gib = found.memory.total / 2**30
        rows.append({"name": run.name, "layout": parse_layout(run.layout).text(), "seq_len": run.seq_len,
                     "gpus": run.cluster.num_devices, "published_gib": run.published_gib, "predicted_gib": gib,
                     "memory_error": gib / run.published_gib - 1, "published_s": run.published_s,
                     "predicted_s": found.iteration_time, "time_error": found.iteration_time / run.published_s - 1,
                     "parts_gib": {name: value / 2**30 for name, value in found.memory.items()}})
    return rows


def memory_table(rows: list[dict]) -> str:
    lines = ["| run | GPUs | sequence | layout | published GiB | predicted GiB | memory error | published s | "
             "predicted s | time error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['gpus']} | {r['seq_len']} | `{r['layout']}` | {r['published_gib']:.1f} | "
                     f"{r['predicted_gib']:.1f} | {r['memory_error']:+.1%} | {r['published_s']:.2f} | "
                     f"{r['predicted_s']:.2f} | {r['time_error']:+.1%} |")
    return "\n".join(lines)


def by_size(cases: list[dict]) -> list[tuple[int, float, float]]:
    """(runs, mean signed error, mean absolute error) per model-size bucket of SIZES."""
    rows = []
    for low, high in SIZES:
        errors = [c["relative_error"] for c in cases if c["relative_error"] is not None and low <= c["params_b"] < high]
        rows.append((len(errors), statistics.mean(errors) if errors else 0.0,
                     statistics.mean(abs(e) for e in errors) if errors else 0.0))
    return rows


def spread(cases: list[dict]) -> tuple[float, float]:
    """10th and 90th percentile of published / predicted - 1: where the true time falls around a
    prediction (meshplan.simulator.analytic.UNCERTAINTY)."""
    ratios = sorted(c["published_s"] / c["predicted_s"] - 1 for c in cases if c["predicted_s"])
    deciles = statistics.quantiles(ratios, n=10, method="inclusive")
    return deciles[0], deciles[-1]


def table(cases: list[dict]) -> str:
    lines = ["| run | params | GPUs | global batch | layout | published s | predicted s | error |",
             "|---|---|---|---|---|---|---|---|"]
    for c in cases:
        predicted = "does not fit" if c["predicted_s"] is None else f"{c['predicted_s']:.2f}"
        error = "-" if c["relative_error"] is None else f"{c['relative_error']:+.1%}"
        lines.append(f"| {c['name']} | {c['params_b']:.1f}B | {c['gpus']} {c['device']} | {c['global_batch']} x "
                     f"{c['seq_len']} | `{c['layout']}` | {c['published_s']:.2f} | {predicted} | {error} |")
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    main({a for a in args if not a.startswith("--")}, "--formula-only" not in args)
