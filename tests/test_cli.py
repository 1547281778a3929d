"""The `meshplan` command: plans print, JSON parses, user errors exit 2 without a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshplan.plan import Plan


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshplan.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_intra_prints_plan():
    result = run("intra", "--layers", "2", "--batch", "8", "--seq-len", "128", "--mesh", "2x4")
    assert result.returncode == 0, result.stderr
    assert "objective" in result.stdout and "scores" in result.stdout and "solver" in result.stdout


def test_intra_json_and_out_file(tmp_path):
    out = tmp_path / "plan.json"
    result = run("intra", "--layers", "2", "--batch", "8", "--seq-len", "128", "--mesh", "2x4", "--json",
                 "--out", str(out), "--compare-sharing")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["source"] == "intra" and len(data["stages"]) == 1
    assert data["stages"][0]["intra_plan"]["solver"]["status"] == "optimal"
    assert data["metrics"]["sharing.difference"] >= -1e-9  # sharing can only constrain
    assert json.loads(out.read_text()) == data
    assert Plan.from_dict(data).to_dict() == data


def test_intra_on_a_three_axis_mesh(tmp_path):
    """`--mesh 2x2x2` without per-axis costs: axis 0 slow, the others fast; the plan names all three."""
    out = tmp_path / "plan.json"
    result = run("intra", "--layers", "1", "--batch", "2", "--seq-len", "8", "--mesh", "2x2x2", "--memory", "none",
                 "--out", str(out))
    assert result.returncode == 0, result.stderr
    plan = Plan.from_dict(json.loads(out.read_text()))
    assert plan.stages[0].logical_mesh == (2, 2, 2)
    intra = plan.stages[0].intra_plan
    assert (intra.mesh.alpha, intra.mesh.beta) == ((1.0, 1.0, 1.0), (1.0, 0.01, 0.01))
    assert {a for c in intra.nodes for a in c.output.axes()} == {0, 1, 2}


def test_dump_lp(tmp_path):
    lp = tmp_path / "m.lp"
    result = run("intra", "--layers", "1", "--batch", "8", "--seq-len", "64", "--mesh", "2x2", "--dump-lp", str(lp))
    assert result.returncode == 0, result.stderr
    text = lp.read_text()
    assert text.startswith("\\ meshplan") and "Subject To" in text and "Binaries" in text


@pytest.mark.parametrize(("args", "message"), [
    (("--model", "llama9-1b"), "unknown model 'llama9-1b'"),
    (("--mesh", "4xq"), "is not a shape"),
    (("--mesh", "2x2", "--mesh-alpha", "1"), "1 alpha values for 2 axes"),
    (("--mesh", "2x2x2", "--mesh-beta", "1,0.01"), "2 beta values for 3 axes"),
    (("--mesh", "2x2x2x2x2x2x2x2x2x2x2"), "at most 10"),
    (("--memory", "lots"), "memory size 'lots'"),
    (("--mesh", "100000x1", "--batch", "8", "--seq-len", "64", "--layers", "1"), "nothing can be split"),
    (("--batch", "0"), "must be at least 1"),
    (("--solver", "gurobi"), "unknown solver"),
    (("--layers", "1", "--batch", "8", "--seq-len", "64", "--mesh", "2x2", "--memory", "1MB"), "needs at least"),
])
def test_user_errors_are_one_message(args, message):
    result = run("intra", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.data
def test_solve_problem_writes_solution(tmp_path):
    from iopddl_score import load, score

    from data_files import IOPDDL

    example = IOPDDL / "example.json"
    out = tmp_path / "solution.json"
    result = run("solve-problem", str(example), "--time-limit", "20", "--out", str(out))
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["status"] == "optimal" and "optimal" in result.stdout
    assert score(load(str(example)), data["solution"]) == (data["cost"], True)


@pytest.mark.parametrize(("content", "message"), [
    (None, "no problem file"),
    ("{not json", "not an IOPDDL problem"),
    ('{"problem": {"nodes": {}}}', "missing field"),
])
def test_solve_problem_bad_input_is_one_message(tmp_path, content, message):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    result = run("solve-problem", str(path), "--out", str(tmp_path / "s.json"))
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "s.json").exists()


def test_user_error_is_one_unwrapped_line():
    result = run("simulate", "--cluster", "50")  # the message runs past 80 columns
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) > 80
    assert "write e.g. 50x4 (50 nodes of 4 devices)" in lines[0]


def test_simulate_help_shows_layout_keys_and_a_whole_example():
    import os

    result = subprocess.run([sys.executable, "-m", "meshplan.cli", "simulate", "--help"], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    assert any(line.strip() == "--layout tp=8,pp=8,dp=1,vp=3,mb=1,sp=on,recompute=selective" for line in lines)
    keys = " ".join(lines[lines.index("  --layout keys:"):])
    from meshplan.simulator.layout import _KEYS

    for key in set(_KEYS) - {"distopt"}:  # every key the parser takes but the alias of zero
        assert f" {key} " in f" {keys} ", key
