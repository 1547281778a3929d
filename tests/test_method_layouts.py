"""Alpa-style plan assertions: each method on Alpa's test models (an MLP, two BERT layers with and
without remat, an MoE layer; Adam, TrainState) runs exactly the collectives it planned, and the
layout it promises (after alpa-projects/alpa tests/shard_parallel/test_mlp.py, test_bert.py,
test_moe.py: collective kinds and counts per method and mesh, parameters replicated or sharded).

Each step is trained 3 Adam steps and equals plain jax.jit on one device; under the data-parallel
methods the whole state is donated and comes back laid out as promised (tests/method_runs.py,
shared with tests/test_zero.py).

Counts are of the compiled executable after the normalisation of `runtime.collective_check`
(combined collectives count once per operand; the CPU backend emits a reduce-scatter as an
all-reduce). Alpa counts instructions on GPU, where XLA also combines all-gathers and
reduce-scatters: its "one all-reduce" under data parallelism is our one all-reduce instruction.
"""

from __future__ import annotations

import jax
import pytest

from method_runs import (
    DATA_PARALLEL,
    METHODS,
    assert_same_training,
    one_device,
    split_eight_ways,
    trained,
    whole_everywhere,
)

# Every method on each model and every mesh shape on some (the BERT cases take seconds each).
CASES = [("mlp", m) for m in METHODS] + [
    ("bert", m) for m in METHODS if m not in ("shard8", "shard4x2", "shard2x2x2")] + [
    ("bert_remat", m) for m in ("dp", "zero2", "zero3", "tp", "shard2x4")] + [
    ("moe", m) for m in ("dp", "zero2", "zero3", "tp", "shard4x2")]


def specs(parallel, prefix: str) -> dict[str, str]:
    """Planned layout of the input leaves whose name starts with `prefix`."""
    return {c.name: str(c.output) for c in parallel.get_plan().nodes if c.op == "parameter" and
            c.name.startswith(prefix)}


def replicated(spec: str) -> bool:
    return set(spec.replace("(scalar)", "")) <= {"R"}


@pytest.mark.parametrize(("program", "method"), CASES, ids=[f"{p}-{m}" for p, m in CASES])
def test_compiled_collectives_are_the_planned_ones_and_training_equals_one_device(program, method):
    parallel, got = trained(program, method)
    state, _, want = one_device(program)
    assert_same_training(got, want)
    check = parallel.get_collectives()
    assert check.agrees, (check.missing, check.unplanned)
    weights = len(jax.tree_util.tree_leaves(state.params))
    counts = check.counts()
    params, moments = specs(parallel, "args[0].params"), specs(parallel, "args[0].opt_state[0].mu")
    new_state = got[0]
    new_weights = jax.tree_util.tree_leaves(new_state.params)
    new_moments = [x for x in jax.tree_util.tree_leaves(new_state.opt_state) if x.ndim]
    if method in DATA_PARALLEL:  # the whole state donated and kept, every step
        assert len(parallel._last.donation.pairs) == len(jax.tree_util.tree_leaves(state))
    if method == "dp":  # Alpa: n_all_reduce == 1 == n_total, every weight replicated
        assert counts == {"all-reduce": weights + 1}  # each weight's gradient and the loss, in one instruction
        assert [r.instructions for r in check.rows] == [1]
        assert all(map(replicated, (*params.values(), *moments.values())))
        assert all(map(whole_everywhere, new_weights + new_moments))
        assert all(s.startswith("S0") for s in specs(parallel, "args[1]").values())  # the batch
    elif method == "zero2":  # Alpa: reduce-scatter the gradients, gather the new weights
        assert counts == {"all-reduce": weights + 1, "all-gather": weights}
        assert check.counts("planned")["reduce-scatter"] >= 2  # the weight matrices' gradients
        assert all(map(replicated, params.values())) and not any(map(replicated, moments.values()))
        assert all(map(whole_everywhere, new_weights)) and all(map(split_eight_ways, new_moments))
    elif method == "zero3":  # Alpa: assert_sharding_zero_stage_3, each weight gathered for use
        assert set(counts) == {"all-reduce", "all-gather"} and counts["all-gather"] >= weights
        assert not any(map(replicated, (*params.values(), *moments.values())))
        assert all(map(split_eight_ways, new_weights + new_moments))
    elif method == "tp" and program != "moe":  # Alpa: (layers - 1) or (4 layers - 1) all-reduces, no other
        expected = {"mlp": 4 - 1, "bert": 4 * 2 - 1, "bert_remat": 4 * 2 - 1 + 2 * 2}[program]  # remat: forward again
        assert counts == {"all-reduce": expected}
        assert all(map(replicated, specs(parallel, "args[1]").values()))


def test_tensor_parallel_alternates_column_and_row_splits():
    """Alpa's assert_column_partitioned / assert_row_partitioned on the MLP and both BERT layers."""
    mlp, _ = trained("mlp", "tp")
    kernels = specs(mlp, "args[0].params['params']['Dense_")
    assert [kernels[f"args[0].params['params']['Dense_{k}']['kernel']"] for k in range(4)] == ["RS0", "S0R"] * 2
    bert, _ = trained("bert", "tp")
    for layer in ("0", "1"):
        params = specs(bert, f"args[0].params['params']['{layer}']")
        names = ("['attention']['qkv_combined']", "['attention']['output']", "['intermediate']", "['output']")
        got = [params[f"args[0].params['params']['{layer}']{n}['kernel']"] for n in names]
        assert got == ["RS0", "S0R", "RS0", "S0R"]


def test_three_axis_mesh_runs_as_planned():
    """ShardParallel on a 2x2x2 logical mesh of the 8 devices: the JAX mesh has three named Auto
    axes, the plan splits values over all three (some over two at once), and the compiled
    collectives are the planned ones (the training equals one device: the test above)."""
    from jax.sharding import AxisType

    parallel, _ = trained("mlp", "shard2x2x2")
    plan = parallel.get_plan()
    assert plan.mesh.shape == (2, 2, 2)
    mesh = jax.tree_util.tree_leaves(parallel.get_input_shardings())[0].mesh
    assert mesh.axis_names == ("x", "y", "z") and tuple(mesh.axis_types) == (AxisType.Auto,) * 3
    used = {a for c in plan.nodes for a in c.output.axes()}
    assert used == {0, 1, 2}
    assert any(len(axes) > 1 for c in plan.nodes for axes in c.output.dims)
    check = parallel.get_collectives()
    assert check.agrees, (check.missing, check.unplanned)
    assert {axis for row in check.rows for axis in row.axes or ()} == {0, 1, 2}
