"""`meshplan cfp`: the analysis prints blocks and segment mappings, a full run writes its files,
bad input gives one message and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshplan.plan import Plan

TINY = ("--layers", "1", "--batch", "8", "--seq-len", "16", "--hidden", "64")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshplan.cli", "cfp", *args], capture_output=True, text=True,
                          timeout=600)


def test_analysis_prints_blocks_and_maps_repeats(tmp_path):
    result = run("--model", "llama2-7b", "--layers", "2", "--mode", "analysis", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "reduced for CPU devices: hidden 4096 -> 128" in out
    assert "12 ParallelBlocks, 6 unique segments" in out
    assert "SRSRR = SRR x RSRR @ {0,1}" in out and "(allreduce @ 1)" in out
    assert "(6, 7) -> (0, 1)" in out and "(11, 12) -> (5, 6)" in out
    data = json.loads((tmp_path / "analysis.json").read_text())
    assert [o["representative"] for o in data["occurrences"]][6:] == [[b, b + 1] for b in range(6)]


def test_all_mode_writes_plan_and_comparison(tmp_path):
    result = run(*TINY, "--mode", "all", "--analytic", "--runs", "1", "--warmup", "0", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "CFP plan from analytic profiles" in result.stdout and "TFLOP/s" in result.stdout
    plan = Plan.from_json((tmp_path / "plan.json").read_text())
    assert plan.source == "cfp" and len(plan.notes) == 6 and dict(plan.metrics)["measured.mean_s"] > 0
    nodes = plan.stages[0].intra_plan.nodes  # every operator's sharding
    assert len(nodes) == json.loads((tmp_path / "analysis.json").read_text())["nodes"]
    assert any(node.output.axes() for node in nodes)
    comparison = json.loads((tmp_path / "comparison.json").read_text())
    assert [p["name"] for p in comparison["plans"]] == ["CFP", "ILP"]
    assert all(p["status"] == "ok" for p in comparison["plans"])


@pytest.mark.parametrize(("args", "message"), [
    (("--mode", "bogus"), "unknown mode 'bogus'; use one of analysis, profile, search, all"),
    (("--layers", "0", "--mode", "analysis"), "has no contraction (dot)"),
    (("--mesh", "4xq"), "is not a shape"),
    (("--model", "gpt9"), "unknown model 'gpt9'"),
])
def test_bad_input_exits_2_with_one_message(args, message, tmp_path):
    result = run(*args, "--out", str(tmp_path))
    assert result.returncode == 2
    assert message in " ".join(result.stderr.split()) and "Traceback" not in result.stderr
    assert result.stderr.count("error:") == 1


def test_search_with_a_cache_from_another_mesh_exits_2(tmp_path):
    made = run(*TINY, "--mode", "profile", "--analytic", "--mesh", "2x4", "--out", str(tmp_path))
    assert made.returncode == 0, made.stderr
    result = run(*TINY, "--mode", "search", "--analytic", "--mesh", "1x8", "--out", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "made for another mesh" in " ".join(result.stderr.split())
