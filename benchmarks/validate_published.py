"""Predict published, measured training runs with their own model, cluster and layout; writes
benchmarks/results/validation.json and prints the table of docs/validation.md.

Every run is priced by `meshplan simulate --layout` (meshplan.simulator.analytic) with one
fixed set of kernel efficiencies (meshplan.cost.kernels.DEFAULT_EFFICIENCY); the runs and
their sources are in benchmarks/published_runs.py. Takes a few seconds.
Run: python benchmarks/validate_published.py
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict

from published_runs import MEMORY_RUNS, RUNS, price_memory_run, price_run

from meshplan.cost.kernels import DEFAULT_EFFICIENCY
from meshplan.simulator.analytic import UNCERTAINTY
from meshplan.simulator.layout import parse_layout

from common import save

SIZES = ((0, 10), (10, 50), (50, 200), (200, 2000))  # billions of parameters


def main(only: set[str]) -> None:
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
                      "memory_gb": found.memory.total / 1e9 if found else None, "note": run.note})
    errors = [c["relative_error"] for c in cases if c["relative_error"] is not None]
    summary = {"runs": len(cases), "priced": len(errors), "mae": statistics.mean(abs(e) for e in errors),
               "mean_signed": statistics.mean(errors), "efficiency": asdict(DEFAULT_EFFICIENCY),
               "by_size": by_size(cases), "spread": spread(cases), "uncertainty_in_code": UNCERTAINTY}
    memory = memory_cases()
    cases.append({"name": "summary", **summary, "memory": memory})
    print(table(cases[:-1]))
    print()
    print(memory_table(memory))
    print(f"\nmean absolute error {summary['mae']:.1%} over {summary['priced']} runs, mean signed "
          f"{summary['mean_signed']:+.1%}; spread (10th, 90th percentile of published/predicted - 1) "
          f"{summary['spread'][0]:+.1%}, {summary['spread'][1]:+.1%}")
    for (low, high), (count, signed, absolute) in zip(SIZES, summary["by_size"], strict=True):
        print(f"{low}-{high}B: {count} runs, mean signed {signed:+.1%}, mean absolute {absolute:.1%}")
    print("wrote", save("validation", cases))


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
    main(set(sys.argv[1:]))
