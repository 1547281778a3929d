"""The house rules of docs/design.md's map, read off the source: which folder may import what."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "meshplan"
# Folders (and root modules) that plan or read plans: they see graphs and numbers, never JAX.
NO_JAX = ("ir", "sharding", "cost", "intra", "inter", "simulator", "cluster", "models", "report", "plan.py",
          "errors.py", "files.py", "distributed")
JAX = ("jax", "jaxlib", "flax", "optax")
# What the runtime may use of the planners: their public passes and data types.
RUNTIME_PUBLIC = {"meshplan.intra", "meshplan.intra.options", "meshplan.intra.plan", "meshplan.intra.solve",
                  "meshplan.inter", "meshplan.inter.schedules", "meshplan.sharding.spec"}
RUNTIME_OWN = ("meshplan.runtime", "meshplan.capture", "meshplan.ir", "meshplan.cluster", "meshplan.errors",
               "meshplan.files")


def modules(part: str) -> list[Path]:
    path = SRC / part
    return [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Absolute module names a file imports (all of them, or only those run at import time)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def offending(parts, forbidden, top_level_only=False) -> list[str]:
    bad = []
    for part in parts:
        for path in modules(part):
            hits = sorted(m for m in imports(path, top_level_only) if any(m == f or m.startswith(f + ".")
                                                                        for f in forbidden))
            bad += [f"{path.relative_to(SRC)} imports {m}" for m in hits]
    return bad


def test_planning_folders_and_reports_never_import_jax():
    assert offending(NO_JAX, JAX) == []
    assert offending(["cli.py", "__init__.py"], JAX, top_level_only=True) == []  # only commands that run JAX


def test_inter_imports_neither_models_nor_runtime():
    assert offending(["inter"], ("meshplan.models", "meshplan.runtime", "meshplan.simulator", "meshplan.parallel",
                                 "meshplan.capture")) == []


def test_report_reads_plans_and_never_plans():
    assert offending(["report"], ("meshplan.intra.solve", "meshplan.inter.search", "meshplan.simulator",
                                  "meshplan.parallel", "meshplan.runtime")) == []


def test_runtime_uses_only_the_public_planning_passes():
    bad = []
    for path in modules("runtime"):
        for name in imports(path):
            if name.startswith("meshplan") and not name.startswith(RUNTIME_OWN):
                module = name if name in RUNTIME_PUBLIC else name.rpartition(".")[0]
                if module not in RUNTIME_PUBLIC:
                    bad.append(f"{path.relative_to(SRC)} imports {name}")
    assert bad == []


@pytest.mark.parametrize("package", ["meshplan", "meshplan.simulator", "meshplan.inter", "meshplan.report"])
def test_planning_faces_load_without_jax(package):
    """Importing the planner's and simulator's faces does not start JAX (the runtime loads lazily)."""
    import subprocess
    import sys

    code = f"import sys, {package}; print('jax' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# CFP: its analysis and search see graphs and numbers; only its profiler (lower, measure) runs JAX,
# and the modules that measure load it inside the functions that do.
CFP_PURE = ("cfp/analysis.py", "cfp/blocks.py", "cfp/derive.py", "cfp/strategies.py", "cfp/segments.py",
            "cfp/price.py", "cfp/search.py", "cfp/cache.py", "cfp/models.py", "cfp/report.py", "cfp/export.py",
            "cfp/measurement.py")
CFP_MEASURING = ("cfp/profile.py", "cfp/compare.py", "cfp/run.py", "cfp/__init__.py")
RUNS_JAX = (*JAX, "meshplan.runtime", "meshplan.capture", "meshplan.parallel", "meshplan.cfp.lower",
            "meshplan.cfp.measure")


def test_cfp_analysis_and_search_never_import_jax():
    assert offending(CFP_PURE, RUNS_JAX) == []
    assert offending(CFP_MEASURING, RUNS_JAX, top_level_only=True) == []


def test_no_planner_imports_cfp():
    """CFP is a stage of its own: only the `meshplan cfp` command reaches it, when it runs."""
    parts = [p.name for p in SRC.iterdir() if p.name not in ("cfp", "cli.py", "__pycache__")]
    assert offending(parts, ("meshplan.cfp",)) == []
    assert offending(["cli.py"], ("meshplan.cfp",), top_level_only=True) == []


def test_distributed_knows_nothing_of_what_its_tasks_compute():
    """The executors run any module-level function: they import no planning pass."""
    parts = [p.name for p in SRC.iterdir() if p.name not in ("distributed", "errors.py", "files.py", "__pycache__")]
    assert offending(["distributed"], tuple(f"meshplan.{p.removesuffix('.py')}" for p in parts)) == []


def test_launch_knows_nothing_of_planning_and_starts_jax_only_in_the_worker():
    """`meshplan launch` starts and watches processes: no planning or runtime pass, JAX only inside the
    worker's `initialize()` (the launcher itself never starts JAX)."""
    allowed = ("meshplan.launch", "meshplan.errors", "meshplan.distributed.ray_session")
    bad = [f"{path.relative_to(SRC)} imports {name}" for path in modules("launch") for name in imports(path)
           if name.startswith("meshplan") and not name.startswith(allowed)]
    assert bad == []
    assert offending(["launch"], JAX, top_level_only=True) == []
    assert offending(["launch"], JAX) == ["launch/worker.py imports jax"]
