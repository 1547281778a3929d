"""The validation set (benchmarks/published_runs.py) against docs/validation.md: each run's
published layout reproduces the doc's predicted figure, the mean absolute error stays within
10 % with one set of efficiencies, there is no trend with model size, and layouts of the same
model and cluster keep their published order."""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from published_runs import RUNS, price_run  # noqa: E402

from meshplan.simulator.analytic import UNCERTAINTY  # noqa: E402
from meshplan.simulator.layout import parse_layout  # noqa: E402

ROW = re.compile(r"^\| (\S+) \| [\d.]+B \| .*? \| `([^`]+)` \| ([\d.]+) \| ([\d.]+) \| ([+-][\d.]+)% \|$")


def doc_rows() -> dict[str, tuple[str, float, float]]:
    rows = {}
    for line in (ROOT / "docs" / "validation.md").read_text().splitlines():
        match = ROW.match(line)
        if match:
            rows[match.group(1)] = (match.group(2), float(match.group(3)), float(match.group(4)))
    return rows


@pytest.fixture(scope="module")
def priced():
    return {run.name: price_run(run) for run in RUNS}


def test_at_least_twenty_runs_each_in_the_doc(priced):
    rows = doc_rows()
    assert len(RUNS) >= 20 and set(rows) == {run.name for run in RUNS}
    assert all(found is not None for found in priced.values())


def test_each_layout_reproduces_the_doc_figure(priced):
    rows = doc_rows()
    for run in RUNS:
        layout, published, predicted = rows[run.name]
        found = priced[run.name]
        assert found.layout.text() == layout
        assert published == pytest.approx(run.published_s, abs=0.006)
        assert round(found.iteration_time, 2) == pytest.approx(predicted, abs=1e-9), run.name


def test_mean_absolute_error_and_no_size_trend(priced):
    errors = {run.name: priced[run.name].iteration_time / run.published_s - 1 for run in RUNS}
    assert statistics.mean(abs(e) for e in errors.values()) <= 0.10
    sizes = [run.size for run in RUNS]
    signed = [errors[run.name] for run in RUNS]
    # No trend: the error is uncorrelated with log model size (|r| small) and every size
    # bucket's mean signed error stays within 10 %.
    logs = [math.log(s) for s in sizes]
    assert abs(statistics.correlation(logs, signed)) < 0.5
    for low, high in ((0, 10), (10, 50), (50, 200), (200, 2000)):
        bucket = [e for s, e in zip(sizes, signed, strict=True) if low <= s < high]
        assert bucket and abs(statistics.mean(bucket)) <= 0.10


def test_layout_order_is_preserved(priced):
    """Same model and cluster, two published layouts: the faster one is predicted faster."""
    for key in ("22b", "175b", "530b", "1t"):
        full, present = (priced[f"korthikanti-{key}-{kind}"] for kind in ("full", "sp-selective"))
        assert present.iteration_time < full.iteration_time


def test_uncertainty_is_the_validation_spread(priced):
    ratios = sorted(run.published_s / priced[run.name].iteration_time - 1 for run in RUNS)
    low, high = statistics.quantiles(ratios, n=10, method="inclusive")[0::8]
    assert pytest.approx((low, high), abs=0.0015) == UNCERTAINTY


def test_command_line_layout_reproduces_a_validated_run(tmp_path):
    run = next(r for r in RUNS if r.name == "korthikanti-175b-sp-selective")
    result = subprocess.run([sys.executable, "-m", "meshplan.cli", "simulate", "--model", "gpt3-175b", "--cluster",
                             "8x8", "--device", "a100-80gb", "--global-batch", "64", "--seq-len", "2048", "--layout",
                             run.layout, "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout[result.stdout.index("{"):])
    # The preset differs from the paper's GPT only by its 2048-position table.
    assert data["prediction"]["iteration_time_s"] == pytest.approx(doc_rows()[run.name][2], abs=0.01)
    assert parse_layout(data["options"]["layout"]) == parse_layout(run.layout)


MEMORY_ROW = re.compile(r"^\| (torchtitan\S+) \| \d+ \| \d+ \| `([^`]+)` \| ([\d.]+) \| ([\d.]+) \| ([+-][\d.]+)% \|")


def test_memory_rows_reproduce_the_doc():
    """The torchtitan memory rows of docs/validation.md are what the code predicts today, and
    every predicted peak is the sum of its parts."""
    from published_runs import MEMORY_RUNS, price_memory_run

    rows = {}
    for line in (ROOT / "docs" / "validation.md").read_text().splitlines():
        match = MEMORY_ROW.match(line)
        if match:
            rows[match.group(1)] = (match.group(2), float(match.group(3)), float(match.group(4)))
    assert set(rows) == {run.name for run in MEMORY_RUNS}
    for run in MEMORY_RUNS:
        layout, published, predicted = rows[run.name]
        found = price_memory_run(run)
        assert parse_layout(layout) == parse_layout(run.layout) and published == run.published_gib
        assert round(found.memory.total / 2**30, 1) == pytest.approx(predicted, abs=1e-9)
        assert found.memory.total == pytest.approx(sum(v for _, v in found.memory.items()))
