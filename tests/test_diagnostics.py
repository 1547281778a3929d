"""runtime.diagnostics: XLA's involuntary full rematerializations counted while compiling.

The incoherent program: a (8, 8, 16) array split 8 ways on dim 0 (devices=[8,1,1]) must become
split 2 ways on dim 2 and replicated over the other 4 devices (devices=[1,1,2,4]
last_tile_dim_replicate). Measured on JAX 0.10.2 (Shardy, 8 CPU devices): XLA's SPMD
partitioner finds no collective path for that pair and replicates the value first — one
"Involuntary full rematerialization" per compile. The reverse direction, or going to a
split over both axes, it reshards with all-to-all / collective-permute instead.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jax_models import mlp_args, mlp_step
from meshplan import CostModel, IntraOptions, LogicalMesh, ShardingSpec, solve_intra
from meshplan.capture import capture
from meshplan.parallel import ShardParallel, parallelize
from meshplan.parallel import spmd as api_module
from meshplan.runtime import diagnostics
from meshplan.runtime.diagnostics import (
    REMAT_MARKER,
    CompileDiagnostics,
    RematerializationWarning,
    compile_lowered,
    split_log,
    warn_if_rematerialized,
)
from meshplan.runtime.sharded import execute_sharded, make_jax_mesh

SPLIT_8_WAYS_ON_DIM_0 = PartitionSpec(("x", "y"), None, None)
SPLIT_2_WAYS_ON_DIM_2 = PartitionSpec(None, None, "x")


def jax_mesh():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)


def incoherent(mesh):
    constrain = lambda v, spec: jax.lax.with_sharding_constraint(v, NamedSharding(mesh, spec))  # noqa: E731
    return lambda a: constrain(jnp.sin(constrain(a, SPLIT_8_WAYS_ON_DIM_0)), SPLIT_2_WAYS_ON_DIM_2)


def test_incoherent_constraint_chain_counts_one_rematerialization(capfd):
    a = jnp.arange(8 * 8 * 16, dtype=jnp.float32).reshape(8, 8, 16) / 100
    compiled, report = compile_lowered(jax.jit(incoherent(jax_mesh())).lower(a))
    assert report.num_rematerializations == 1
    (message,) = report.rematerializations
    assert REMAT_MARKER in message
    assert "{devices=[8,1,1]<=[8]} to {devices=[1,1,2,4]<=[8] last_tile_dim_replicate}" in message
    assert REMAT_MARKER not in capfd.readouterr().err  # counted, not passed on to stderr
    np.testing.assert_allclose(compiled(a), jnp.sin(a), rtol=1e-6)


def test_coherent_megatron_plan_has_no_rematerialization():
    args = mlp_args(batch=8, d_in=1024, hidden=1024, d_out=1024)
    captured = capture(mlp_step, *args)
    options = IntraOptions(cost=CostModel(flops_per_second=1e12), memory_budget=6e6)
    plan = solve_intra(captured.graph, LogicalMesh((1, 8), (1e-5, 1e-5), (1e-9, 1e-9)), options)
    sharded, report = execute_sharded(captured, plan, make_jax_mesh(plan.mesh)).compile(*args)
    assert report.rematerializations == ()
    assert report.compile_s > 0
    for value, expected in zip(sharded(*args), jax.jit(mlp_step)(*args), strict=True):
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)


def test_log_threshold_is_lowered_for_the_compile_only(monkeypatch):
    """conftest sets TF_CPP_MIN_LOG_LEVEL=2, which hides XLA's warnings: lower it to 1, then restore."""
    calls = []
    monkeypatch.setattr(diagnostics, "_absl_setter", lambda: calls.append)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    compile_lowered(jax.jit(lambda x: x + 1).lower(jnp.ones(3)))
    assert calls == [1, 2]


def test_split_log_counts_remats_and_passes_on_what_the_user_would_see():
    remat = ("W1122 02:22:55.416714   16187 spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization. "
             "The compiler cannot go from sharding {devices=[8,1,1]<=[8]} to ...\n")
    info = "I1122 02:22:55.000001   16187 pjrt_client.cc:579] PjRt-IFRT device count: total=8\n"
    warning = "W1122 02:22:55.000002   16187 cpu_compiler.cc:10] something\n"
    error = "E1122 02:22:55.000003   16187 rendezvous.cc:116] stuck\n"
    python = "/x.py:3: UserWarning: from Python\n  warnings.warn(...)\n"
    text = info + remat + warning + error + python
    assert split_log(text, 2) == ((remat.strip(),), error + python)
    assert split_log(text, 1) == ((remat.strip(),), warning + error + python)


def test_warning_names_count_and_incoherence():
    report = CompileDiagnostics(("W1 x.cc:1] [SPMD] Involuntary full rematerialization. a", "b"), 0.1)
    with pytest.warns(RematerializationWarning, match=r"step on mesh 2x4: XLA fully rematerialized 2 value\(s\) "
                                                       r"while compiling the plan: the plan is incoherent .* First: "
                                                       r"\[SPMD\] Involuntary"):
        warn_if_rematerialized(report, "step on mesh 2x4")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_rematerialized(CompileDiagnostics((), 0.1), "step")  # no rematerialization: silent


def incoherent_solve(graph, mesh, options):
    """The planner's plan of `sin(a)` with the layouts of the incoherent program forced in."""
    plan = solve_intra(graph, mesh, options)
    forced = {"parameter": ShardingSpec.of((0, 1), None, None), "sin": ShardingSpec.of(None, None, 0)}
    return dataclasses.replace(plan, nodes=tuple(dataclasses.replace(c, output=forced[c.op]) for c in plan.nodes))


def test_parallelize_warns_on_an_incoherent_plan_and_dumps_the_count(monkeypatch, tmp_path):
    monkeypatch.setattr(api_module, "solve_intra", incoherent_solve)
    parallel = parallelize(jnp.sin, method=ShardParallel(mesh_shape=(2, 4)))
    a = jnp.linspace(0, 1, 8 * 8 * 16).reshape(8, 8, 16)
    with pytest.warns(RematerializationWarning, match=r"sin on mesh 2x4: XLA fully rematerialized 1 value\(s\)"):
        out = parallel(a)
    np.testing.assert_allclose(out, jnp.sin(a), rtol=1e-6)
    parallel.dump_debug_info(tmp_path)
    report = json.loads((tmp_path / "diagnostics.json").read_text())
    assert report["involuntary_rematerializations"] == 1
    assert REMAT_MARKER in report["rematerialization_messages"][0]
