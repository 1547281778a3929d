"""End to end: models, planning, simulation, baselines, plan JSON and the `simulate` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshplan import InfeasiblePlanError, ModelSpecError
from meshplan.cluster import Cluster, get_device
from meshplan.models.transformer import PRESETS, load_hf_config, model_config
from meshplan.plan import Plan
from meshplan.simulator import PlannerOptions, TrainingJob, simulate
from meshplan.simulator.planner import (
    PlannerStats,
    auto_view_tasks,
    dispatch_order,
    microbatch_candidates,
    plan_training,
)
from meshplan.simulator.pricing import planner_views

SMALL = PRESETS["gpt3-125m"].replace(layers=4)


@pytest.fixture(scope="module")
def small_simulation():
    job = TrainingJob(SMALL, global_batch=16, seq_len=256)
    cluster = Cluster(2, 2, get_device("a100-40gb"))
    return job, cluster, simulate(job, cluster, PlannerOptions(workers=1, microbatch_sizes=(2, 4)))


def test_preset_sizes_match_published_counts():
    assert PRESETS["llama2-7b"].num_params() == pytest.approx(6.74e9, rel=0.01)
    assert PRESETS["llama2-13b"].num_params() == pytest.approx(13.0e9, rel=0.01)
    assert PRESETS["llama2-70b"].num_params() == pytest.approx(69.0e9, rel=0.01)
    assert PRESETS["gpt3-175b"].num_params() == pytest.approx(175e9, rel=0.01)
    assert PRESETS["llama3.1-8b"].num_params() == pytest.approx(8.03e9, rel=0.01)
    assert PRESETS["llama3.1-70b"].num_params() == pytest.approx(70.6e9, rel=0.01)
    assert PRESETS["llama3.1-405b"].num_params() == pytest.approx(405.9e9, rel=0.01)


def test_hugging_face_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
                                "num_hidden_layers": 32, "intermediate_size": 11008, "vocab_size": 32000,
                                "num_key_value_heads": 32, "max_position_embeddings": 4096}))
    config = model_config(str(path))
    assert config.num_params() == PRESETS["llama2-7b"].num_params()
    path.write_text("{ not json")
    with pytest.raises(ModelSpecError, match="not valid JSON"):
        load_hf_config(path)


def test_prediction_is_consistent(small_simulation):
    job, cluster, sim = small_simulation
    plan = sim.plan
    assert sum(s.num_devices for s in plan.stages) == cluster.num_devices
    assert sorted(i for s in plan.stages for i in s.devices) == list(range(cluster.num_devices))
    assert plan.stages[0].first_layer == 0 and plan.stages[-1].last_layer == SMALL.layers - 1
    assert [s.first_layer for s in plan.stages[1:]] == [s.last_layer + 1 for s in plan.stages[:-1]]
    p = plan.prediction
    latencies = [s.latency_s for s in plan.stages]
    pipeline = plan.num_microbatches * max(latencies) + (sum(latencies) - max(latencies)) / plan.chunks
    assert plan.schedule == ("1f1b" if plan.chunks == 1 else "interleaved-1f1b")
    assert p.pipeline_time_s == pytest.approx(pipeline)
    assert p.iteration_time_s == pytest.approx(pipeline + p.sync_time_s)
    assert p.tokens_per_s == pytest.approx(16 * 256 / p.iteration_time_s)
    assert p.mfu == pytest.approx(6 * SMALL.flop_params() * 16 * 256 / p.iteration_time_s / 4 / 312e12, rel=1e-9)
    assert SMALL.flop_params() == SMALL.num_params() - (51200 + 2048) * 768  # no lookup tables
    assert all(s.memory_bytes <= cluster.device.memory_bytes for s in plan.stages)


def test_auto_plan_at_least_as_fast_as_baselines(small_simulation):
    _, _, sim = small_simulation
    names = {b.name for b in sim.baselines}
    assert names == {"megatron", "data-parallel", "zero-2"}
    for b in sim.baselines:
        if b.plan is not None:
            assert sim.plan.prediction.iteration_time_s <= b.plan.prediction.iteration_time_s * (1 + 1e-9)


def test_plan_json_round_trip(small_simulation):
    _, _, sim = small_simulation
    text = sim.plan.to_json()
    assert Plan.from_json(text) == sim.plan
    with pytest.raises(Exception, match="schema version"):
        Plan.from_dict({**json.loads(text), "schema_version": 99})


def test_plan_fingerprint_ignores_wall_times_only(small_simulation):
    """Two processes that plan alike get one fingerprint although their solvers took other times."""
    _, _, sim = small_simulation
    data = json.loads(sim.plan.to_json())
    for plan in data["piece_plans"]:
        plan["solver"]["wall_s"] += 1.0
        plan["problem"]["build_s"] += 1.0
    data["metrics"] = {name: value + 1.0 if name.startswith("planner_s.") else value
                       for name, value in data["metrics"].items()}
    assert Plan.from_dict(data).fingerprint() == sim.plan.fingerprint()
    data["stages"][0]["devices"] = list(reversed(data["stages"][0]["devices"]))
    assert Plan.from_dict(data).fingerprint() != sim.plan.fingerprint()


def test_model_that_cannot_fit_names_the_memory():
    job = TrainingJob(PRESETS["llama2-70b"], global_batch=8, seq_len=512)
    cluster = Cluster(1, 4, get_device("v100-16gb"))
    with pytest.raises(InfeasiblePlanError, match=r"leanest layout \(tp=4,.*\) needs 311\.7 GB per device"):
        simulate(job, cluster, PlannerOptions(workers=1, microbatch_sizes=(2,)), baselines=False)


def test_microbatch_sizes_must_divide_batch():
    job = TrainingJob(SMALL, global_batch=10, seq_len=64)
    with pytest.raises(Exception, match="does not divide the global batch 10"):
        simulate(job, Cluster(1, 2, get_device("a100-40gb")), PlannerOptions(microbatch_sizes=(3,)))
    assert microbatch_candidates(1000, 50, 3) == (8, 25, 100)


def run(*args):
    return subprocess.run([sys.executable, "-m", "meshplan.cli", "simulate", *args], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize(("args", "message"), [
    (("--device", "v200-8gb"), "unknown device"),
    (("--cluster", "0x4"), "0x4"),
    (("--model", "llama-13"), "unknown model"),
    (("--global-batch", "10", "--microbatch-sizes", "3"), "does not divide"),
    (("--model", "llama2-70b", "--cluster", "1x4", "--device", "v100-16gb", "--global-batch", "4",
      "--seq-len", "256", "--microbatch-sizes", "1", "--no-baselines"), "does not fit"),
    (("--layout", "tp=8,pq=2"), "'pq=2' is not KEY=VALUE"),
    (("--mesh-axes", "4"), "write --mesh-axes 2, 3 or refine"),
    (("--layout", "tp=8,pp=8,dp=16"), "needs 1024 devices"),
    (("--layout", "tp=3"), "tp=3 does not divide"),
    (("--layout", "tp=4,pp=2,dp=25", "--efficiency-file", "/nonexistent/eff.json"), "does not exist"),
])
def test_simulate_user_errors(args, message):
    result = run(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_simulate_command_json(tmp_path):
    out = tmp_path / "sim.json"
    result = run("--model", "gpt3-125m", "--cluster", "1x2", "--device", "a100-40gb", "--global-batch", "8",
                 "--seq-len", "128", "--microbatch-sizes", "2,4", "--workers", "1", "--json", "--out", str(out))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data == json.loads(out.read_text())
    assert Plan.from_dict(data).to_dict() == data  # one schema-versioned Plan, baselines inside
    assert data["prediction"]["iteration_time_s"] > 0 and data["source"] == "simulate"
    assert {b["name"] for b in data["baselines"]} == {"megatron", "data-parallel", "zero-2", "layout-search"}
    # One cost model prices the auto plan and every baseline, and the auto plan is never slower.
    auto = data["prediction"]
    priced = [b["prediction"] for b in data["baselines"] if b["prediction"]]
    assert priced and {p["cost_model"] for p in priced} == {auto["cost_model"]} and auto["cost_model"]
    assert all(auto["iteration_time_s"] <= p["iteration_time_s"] * (1 + 1e-9) for p in priced)
    # Its time breakdown beside the fastest recipe's, part by part, each adding up to its time.
    own = {k: v for k, v in data["metrics"].items() if k.startswith("time.")}
    recipe = {k: v for k, v in data["metrics"].items() if k.startswith("recipe_time.")}
    assert len(own) == len(recipe) == 7 and all(v >= -1e-9 for v in own.values())
    assert sum(own.values()) == pytest.approx(auto["iteration_time_s"], rel=1e-6)
    fastest = min(p["iteration_time_s"] for p in priced)
    assert sum(recipe.values()) == pytest.approx(fastest, rel=0.01)


def test_reduce_scatter_widens_the_piece_plans():
    """A data-parallel block whose held bytes are priced (the planner's second memory menu
    entry): with reduce_scatter the plan scatters weight gradients onto the sharded optimizer
    state (ZeRO-2) and is never more expensive, the space being a superset; without it every
    contraction's partial sums are all-reduced."""
    from meshplan.cost.collectives import CollectiveKind
    from meshplan.models.training import block_training_graph
    from meshplan.simulator.pricing import profile_piece

    cluster = Cluster(1, 4, get_device("a100-40gb"))
    mesh = cluster.logical_views((1, 4))[0]
    piece = block_training_graph(SMALL, 0, 8, 256)
    costs, kinds = {}, {}
    for reduce_scatter in (False, True):
        _, plan = profile_piece(piece, mesh, 1e14, 4, memory_price=max(mesh.beta), force_batch_axis=1,
                                reduce_scatter=reduce_scatter)
        costs[reduce_scatter], kinds[reduce_scatter] = plan.objective, {c.kind for c in plan.collectives()}
    assert CollectiveKind.REDUCE_SCATTER not in kinds[False]
    assert CollectiveKind.REDUCE_SCATTER in kinds[True]
    assert costs[True] <= costs[False] * (1 + 1e-4)  # the solver's relative gap


def test_any_global_batch_plans_with_idle_devices_reported():
    """`meshplan simulate --global-batch 1` (LLaMA2-13B on 50 x 4 V100-32GB): the stage DP over
    all 200 devices finds no plan for one sequence (40 layers cannot make 200 one-device
    stages); the fastest fitting layout is the plan, its idle devices named."""
    result = run("--global-batch", "1", "--workers", "1", "--no-baselines", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["label"] == "auto" and data["prediction"]["iteration_time_s"] > 0
    assert data["prediction"]["peak_memory_bytes"] <= 32 * 2**30 * 0.9
    assert any("stay idle" in note for note in data["notes"])
    used = sum(len(s["devices"]) for s in data["stages"])
    assert used < 200 and f"{200 - used} of 200 devices stay idle" in " ".join(data["notes"])


def test_menu_from_one_enumeration_equals_separate_solves():
    """solve_intra_prices re-prices one enumeration: the plans equal separate solve_intra calls."""
    from meshplan.simulator.pricing import MEMORY_PRICES, piece_graphs, profile_menu, profile_piece

    cluster = Cluster(2, 4, get_device("a100-40gb"))
    mesh = cluster.logical_views((2, 4))[1]
    blocks, embed, _ = piece_graphs(SMALL, 4, 256, TrainingJob(SMALL, 16, 256).dtype, "adam")
    for piece in (blocks[False], embed):
        menu = profile_menu(piece, mesh, 1e14, 4, MEMORY_PRICES)
        separate = [profile_piece(piece, mesh, 1e14, 4, memory_price=f * max(mesh.beta))[0] for f in MEMORY_PRICES]
        kept = [separate[0]]
        for cost in separate[1:]:
            if cost.static_bytes < kept[-1].static_bytes * 0.999:
                kept.append(cost)
        assert menu == tuple(kept) and len(menu) >= 2


def test_three_axis_views_let_a_small_micro_batch_use_every_node():
    """Two sequences per micro-batch on 4 nodes of 8: every 2-D view of the 4 nodes has a data axis
    of 4 or more (it spans all nodes), so none is priced; with --mesh-axes 3 the views (2, b, c)
    are, data over node pairs and the other axes for sequence and tensor splits
    (benchmarks/bench_ndmesh.py: the stage DP then plans one 32-device stage on (2, 2, 8))."""
    job = TrainingJob(PRESETS["gpt3-1.3b"], global_batch=2, seq_len=32768)
    cluster = Cluster(4, 8, get_device("a100-80gb"))

    def priced(axes: int) -> list[tuple[tuple[int, int], tuple[int, ...]]]:
        tasks = auto_view_tasks(job, cluster, 2, PlannerOptions(mesh_axes=axes))
        return [(t.key.submesh, planner_views(cluster, t.key.submesh, axes)[t.key.view_index].shape) for t in tasks]

    two, three = priced(2), priced(3)
    assert not [view for submesh, view in two if submesh[0] > 2]
    assert [view for submesh, view in three if submesh == (4, 8)] == [(2, 2, 8), (2, 4, 4), (2, 8, 2)]
    assert set(two) < set(three)


def test_pricing_tasks_go_out_size_by_size_costliest_view_first():
    """The workers get every task once, micro-batch sizes in the planner's order (each size's
    stage DP starts when its views are in), and within a size the views splitting both axes
    before one-axis views, larger meshes first (the seed job's tasks: 37)."""
    job = TrainingJob(PRESETS["llama2-13b"], global_batch=1000, seq_len=4096)
    cluster = job.on(Cluster(50, 4, get_device("v100-32gb")))
    tasks = [t for b in (8, 25, 100) for t in auto_view_tasks(job, cluster, b, PlannerOptions())]
    sent = dispatch_order(tasks)
    assert {t.key for t in sent} == {t.key for t in tasks} and len(sent) == len(tasks) == 37
    sizes = [t.key.microbatch_size for t in sent]
    assert sizes == sorted(sizes)
    shapes = [planner_views(cluster, t.key.submesh)[t.key.view_index].shape for t in sent if t.key.microbatch_size == 8]
    assert shapes[0] == (8, 4) and shapes[-1] == (1, 1)
    split = [min(shape) > 1 for shape in shapes]
    assert split == sorted(split, reverse=True)  # two-axis views, then one-axis views


def test_refine_prices_the_3d_views_of_the_plans_stages_only():
    """mesh_axes="refine": after the 2-D plan (one (2, 4) stage: at micro-batch 2 the other
    2-D views of the 8 devices split the batch 4 or 8 ways), it prices the 3-D views of that
    sub-mesh alone, (2, 2, 2), and the stage DP moves the stage there (sequence and tensor
    splits on the other axes): never slower than the 2-D plan, never faster than pricing every
    3-D view. The three runs share priced views, so (2, 2, 2) is planned once."""
    job = TrainingJob(SMALL, global_batch=2, seq_len=4096)
    cluster = Cluster(2, 4, get_device("a100-40gb"))
    priced = {}

    def plan(axes):
        options = PlannerOptions(workers=1, microbatch_sizes=(2,), mesh_axes=axes)
        return plan_training(job, cluster, options, None, PlannerStats(), priced, None)

    two = plan(2)
    before = set(priced)
    refined = plan("refine")
    added = set(priced) - before
    shapes = {s.submesh for s in two.stages if s.submesh[0] * s.submesh[1] >= 8}
    assert added and {k.submesh for k in added} <= shapes and {k.microbatch_size for k in added} == {2}
    assert all(len(planner_views(cluster, k.submesh, 3)[k.view_index].shape) == 3 for k in added)
    assert refined.iteration_time < two.iteration_time
    assert any(len(s.view) == 3 for s in refined.stages)
    full = plan(3)
    assert full.iteration_time <= refined.iteration_time * (1 + 1e-12)
