"""Reports of plans: `meshplan report` (text, --html, --partition-specs, --chrome-trace), `meshplan
diff`, parameter classification, and plan files (validation, permissions).

Every command runs on the default `meshplan simulate --out plan.json` (planned once per module),
on a smaller simulated plan, and on runtime `dump_debug_info` folders (ShardParallel, DataParallel,
Zero3Parallel, PipeshardParallel on 8 CPU devices).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jax_models import pipe_data, pipe_layers, pipe_mlp_params
from meshplan import IntraOptions, LogicalMesh, solve_intra
from meshplan.cluster import Cluster
from meshplan.cluster.devices import get_device
from meshplan.files import write_json_atomic, write_text_atomic
from meshplan.inter.schedules import pipeline_latency, timeline
from meshplan.models.transformer import PRESETS
from meshplan.parallel import DataParallel, PipeshardParallel, ShardParallel, Zero3Parallel, parallelize
from meshplan.plan import SCHEMA_VERSION, Plan, single_stage_plan
from meshplan.report.diff import diff_plans, parameter_specs
from meshplan.report.layouts import parameter_layouts, stage_parallelism
from meshplan.report.load import load_plan
from meshplan.report.partition_specs import is_spec, partition_spec_tree, python_source
from meshplan.report.text import OpFilter, render
from meshplan.report.timeline import chrome_trace, iteration_spans
from meshplan.runtime import make_jax_mesh, mark_pipeline_boundary
from meshplan.runtime.sharded import axis_names, partition_spec
from meshplan.simulator import PlannerOptions, TrainingJob, simulate

from alpa_graphs import mlp_2_layer

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def meshplan(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "meshplan.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=900)


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "error:" in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


# ---------------------------------------------------------------------------------------------
# Plans to report on


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """`meshplan simulate` with its defaults (LLaMA2-13B on 50x4 V100), plan and HTML written."""
    folder = tmp_path_factory.mktemp("default")
    result = meshplan("simulate", "--out", "plan.json", "--html", "simulate.html", cwd=folder)
    assert result.returncode == 0, result.stderr
    return folder, result


@pytest.fixture(scope="module")
def default_plan(default_run):
    return default_run[0] / "plan.json"


def small_job(layers=4, cluster=(2, 2), sizes=(2, 4)):
    job = TrainingJob(PRESETS["gpt3-125m"].replace(layers=layers), global_batch=16, seq_len=256)
    return simulate(job, Cluster(*cluster, get_device("a100-40gb")),
                    PlannerOptions(workers=1, microbatch_sizes=sizes)).plan


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("small") / "plan.json"
    write_json_atomic(path, small_job().to_dict())
    return path


def adam_mlp(d_in=64, hidden=256, d_out=32, batch=32):
    """An MLP trained by hand-written Adam: step(state, batch) with state = (params, m, v)."""
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (d_in, hidden)) / 8, "b1": jnp.zeros((hidden,)),
              "w2": jax.random.normal(k[1], (hidden, d_out)) / 16}
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    data = (jax.random.normal(k[2], (batch, d_in)), jax.random.normal(k[3], (batch, d_out)))

    def loss_fn(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    def step(state, batch):
        p, m, v = state
        loss, g = jax.value_and_grad(loss_fn)(p, *batch)
        m = jax.tree_util.tree_map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
        v = jax.tree_util.tree_map(lambda a, b: 0.99 * a + 0.01 * b * b, v, g)
        p = jax.tree_util.tree_map(lambda w, a, b: w - 1e-2 * a / (jnp.sqrt(b) + 1e-8), p, m, v)
        return (p, m, v), loss

    return step, (params, zeros, zeros), data


@pytest.fixture(scope="module")
def runtime_dumps(tmp_path_factory):
    """dump_debug_info folders of ShardParallel, DataParallel, Zero3Parallel and PipeshardParallel steps."""
    root = tmp_path_factory.mktemp("dumps")
    folders = {}
    step, state, data = adam_mlp()
    for name, method in (("shard", ShardParallel(mesh_shape=(2, 2, 2))), ("dp", DataParallel()),
                         ("zero3", Zero3Parallel())):
        f = parallelize(step, method=method)
        f(state, data)
        f.dump_debug_info(root / name)
        folders[name] = root / name

    def staged_loss(params, x, y):
        for stage in params[:-1]:
            x = mark_pipeline_boundary(pipe_layers(stage, x))
        return jnp.mean((pipe_layers(params[-1], x) - y) ** 2)

    layers = pipe_mlp_params()
    half = len(layers) // 2
    f = parallelize(staged_loss, method=PipeshardParallel(2, stages="auto"))
    f([layers[:half], layers[half:]], *pipe_data())
    f.dump_debug_info(root / "pipeshard")
    folders["pipeshard"] = root / "pipeshard"
    return folders


# ---------------------------------------------------------------------------------------------
# The terminal report


def test_simulate_tables_fit_80_columns_without_cut_headers(default_run):
    _, result = default_run
    text = result.stdout
    assert "…" not in text and "sub-me" not in text.replace("sub-\n", "")
    assert max(len(line) for line in text.splitlines()) <= 80
    for header in ("recompute", "logical", "stages", "baselines"):
        assert header in text


def test_report_on_the_default_plan(default_plan):
    plan = load_plan(default_plan)
    result = meshplan("report", str(default_plan))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    assert "get_last_dp_result" in text and "forward_stage_layer_ids" in text and "force_batch_dim_to_mesh_dim" in text
    layer_ids = str([list(range(s.first_layer, s.last_layer + 1)) for s in plan.stages])
    assert layer_ids.replace(" ", "") in text.replace(" ", "").replace("\n", "")
    for section in ("stages", "where an iteration's time goes", "communication per iteration", "parameters"):
        assert section in text
    for stage in plan.stages:  # every stage's pieces were planned and kept
        assert stage.pieces and stage.compute_s > 0 and stage.communication_s >= 0 and stage.forward_s > 0
        assert stage.compute_s + stage.communication_s <= stage.latency_s * (1 + 1e-9)
    assert {p.name for s in plan.stages for p in s.pieces} == {"embedding", "block", "head"}
    assert "attn.wq" in text and "all-reduce" in text and "gradient sync" in text


def test_report_ops_filter(small_plan):
    plan = load_plan(small_plan)
    everything = render(plan, OpFilter())
    only = render(plan, OpFilter(name="mlp.up"))
    section = only.split("operator strategies")[1].split("baselines")[0]
    rows = [line for line in section.splitlines() if "mlp.up" in line]
    assert len(rows) >= sum(1 for s in plan.stages for p in s.pieces if p.name == "block")
    assert "attn.q" not in section and "attn.q" in everything.split("operator strategies")[1]
    result = meshplan("report", str(small_plan), "--ops", "--layer", "1")
    assert result.returncode == 0 and "operator strategies" in result.stdout


def test_time_breakdown_adds_up(small_plan):
    from meshplan.report.breakdown import time_rows

    plan = load_plan(small_plan)
    for row, stage in zip(time_rows(plan), plan.stages, strict=True):
        busy = row.compute + row.communication + row.handoff
        assert busy == pytest.approx(plan.num_microbatches * stage.latency_s, rel=1e-9)
        assert busy + row.bubble == pytest.approx(plan.prediction.pipeline_time_s, rel=1e-9)


# ---------------------------------------------------------------------------------------------
# Parameter classification


@pytest.mark.parametrize("shape", [(4, 1), (1, 4)])
def test_megatron_mlp_is_column_then_row_tensor_parallel(shape):
    plan = solve_intra(mlp_2_layer(128, 1024), LogicalMesh(shape, (1, 1), (1, 1)), IntraOptions.alpa_unit())
    axis = 0 if shape == (4, 1) else 1
    layouts = {p.name: p for p in parameter_layouts(plan)}
    assert layouts["w1"].classification == f"tensor parallel column on axis {axis}"
    assert layouts["w2"].classification == f"tensor parallel row on axis {axis}"
    assert layouts["x"].role == layouts["y"].role == "input"
    assert stage_parallelism(plan).tensor_axes == (axis,) and stage_parallelism(plan).data_axes == ()


def test_mixed_2d_plan_is_data_plus_tensor_parallel():
    """Alpa's 2-layer MLP on a (4, 8) mesh with a slow axis 0: batch over axis 0, Megatron on axis 1."""
    plan = solve_intra(mlp_2_layer(1024, 128), LogicalMesh((4, 8), (1, 1), (1, 0.01)), IntraOptions.alpa_unit())
    layouts = {p.name: p.classification for p in parameter_layouts(plan)}
    assert layouts["w1"] == "tensor parallel column on axis 1, data parallel on axis 0"
    assert layouts["w2"] == "tensor parallel row on axis 1, data parallel on axis 0"
    assert stage_parallelism(plan).summary == "data parallel on axis 0, tensor parallel on axis 1"


@pytest.mark.parametrize("shape", [(4, 1), (1, 4)])
def test_data_parallel_mlp_is_data_parallel(shape):
    plan = solve_intra(mlp_2_layer(1024, 128), LogicalMesh(shape, (1, 1), (1, 1)), IntraOptions.alpa_unit())
    axis = 0 if shape == (4, 1) else 1
    layouts = {p.name: p for p in parameter_layouts(plan)}
    assert layouts["w1"].classification == layouts["w2"].classification == f"data parallel on axis {axis}"
    assert layouts["x"].classification.startswith(f"batch input, split over axis {axis}")
    parallelism = stage_parallelism(plan)
    assert parallelism.data_axes == (axis,) and parallelism.tensor_axes == () and parallelism.zero == 0
    text = render(single_stage_plan(plan, "intra", "mlp2"))
    assert f"data parallel on axis {axis}" in text and "all-reduce" in text


def test_runtime_data_parallel_and_zero3_plans_are_classified(runtime_dumps):
    dp, zero3 = load_plan(runtime_dumps["dp"]), load_plan(runtime_dumps["zero3"])
    layouts = {p.name: p for p in parameter_layouts(dp.stages[0].intra_plan)}
    for w in ("['w1']", "['w2']"):
        assert layouts[f"args[0][0]{w}"].classification == "data parallel on axis 0"
    assert layouts["args[1][0]"].role == "input" and layouts["args[1][0]"].layout.dims[0] == (0,)
    assert stage_parallelism(dp.stages[0].intra_plan).summary == "data parallel on axis 0"
    layouts = {p.name: p for p in parameter_layouts(zero3.stages[0].intra_plan)}
    assert layouts["args[0][0]['w1']"].classification.startswith("ZeRO-3 on axis 0")
    assert "sharded ZeRO-style on axis 0" in layouts["args[0][1]['w1']"].classification  # Adam m
    assert stage_parallelism(zero3.stages[0].intra_plan).zero == 3


def test_report_of_a_dump_sets_planned_and_compiled_collectives_side_by_side(runtime_dumps, tmp_path):
    result = meshplan("report", str(runtime_dumps["dp"]))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    data = json.loads((runtime_dumps["dp"] / "collectives.json").read_text())
    n = sum(r["planned"] for r in data["rows"])
    assert data["agrees"] and n == 4  # the w1, b1 and w2 gradients and the loss: all-reduces, fused
    assert "collectives: planned vs compiled (cpu, per device)" in text
    assert f"the executable runs exactly the {n} planned collective(s)" in text
    assert "DataParallel: batch values split along the batch dim" in " ".join(text.split())
    broken = tmp_path / "broken"
    shutil.copytree(runtime_dumps["dp"], broken)
    (broken / "collectives.json").write_text('{"backend": "cpu"')
    assert_user_error(meshplan("report", str(broken)), "not a collectives file written by dump_debug_info")


def test_simulated_pieces_show_zero_style_optimizer_state(default_plan):
    plan = load_plan(default_plan)
    block = next(p.intra_plan for s in plan.stages for p in s.pieces if p.name == "block")
    layouts = {p.name: p for p in parameter_layouts(block)}
    wq = next(p for name, p in layouts.items() if name.endswith("attn.wqkv"))
    moments = [p for name, p in layouts.items() if name.endswith("attn.wqkv.adam_m")]
    assert wq.role == "weight" and moments[0].role == "optimizer" and moments[0].of_weight == wq.name
    assert stage_parallelism(block).data_axes  # micro-batches are split over the batch axis


# ---------------------------------------------------------------------------------------------
# PartitionSpec export


def test_partition_specs_apply_with_jit_and_give_the_plans_shardings(runtime_dumps, tmp_path):
    step, state, data = adam_mlp()
    for name in ("shard", "zero3"):
        plan = load_plan(runtime_dumps[name])
        out = tmp_path / f"{name}_specs.py"
        result = meshplan("report", str(runtime_dumps[name]), "--partition-specs", str(out))
        assert result.returncode == 0, result.stderr
        namespace: dict = {}
        exec(out.read_text(), namespace)  # what a user pastes into their code
        assert namespace["mesh_axes"] == axis_names(len(namespace["mesh_shape"]))
        intra = plan.stages[0].intra_plan
        mesh = make_jax_mesh(intra.mesh)
        specs = namespace["partition_specs"]["args"]
        shardings = jax.tree_util.tree_map(lambda spec, m=mesh: NamedSharding(m, spec), specs,
                                           is_leaf=lambda v: isinstance(v, PartitionSpec))
        compiled = jax.jit(step, in_shardings=shardings).lower(state, data).compile()
        planned = {c.name: c.output for c in intra.nodes if c.op == "parameter"}
        paths = jax.tree_util.tree_flatten_with_path((state, data))[0]
        got = jax.tree_util.tree_leaves(compiled.input_shardings[0])
        assert len(got) == len(paths)
        split = 0
        for (path, leaf), sharding in zip(paths, got, strict=True):
            want = NamedSharding(mesh, partition_spec(planned["args" + jax.tree_util.keystr(path)]))
            assert sharding.is_equivalent_to(want, leaf.ndim), (path, sharding, want)
            split += not planned["args" + jax.tree_util.keystr(path)].is_replicated
        assert split > 0  # the plan splits something: the check is not vacuous
        if name == "shard":  # a 2x2x2 logical mesh: three named axes, the third one used
            assert namespace["mesh_axes"] == ("x", "y", "z") and namespace["mesh_shape"] == (2, 2, 2)
            assert any("z" in str(spec) for spec in jax.tree_util.tree_leaves(
                specs, is_leaf=lambda v: isinstance(v, PartitionSpec)))
        (new_state, loss), (want_state, want_loss) = compiled(state, data), jax.jit(step)(state, data)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        for a, b in zip(jax.tree_util.tree_leaves(new_state), jax.tree_util.tree_leaves(want_state), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)  # Adam divides by sqrt(v): sensitive


def test_partition_specs_of_the_default_plan_follow_the_layers(default_plan, tmp_path):
    plan = load_plan(default_plan)
    tree = partition_spec_tree(plan)
    assert len(tree["stages"]) == plan.num_stages
    every_layer = set()
    for stage, exported in zip(plan.stages, tree["stages"], strict=True):
        layers = {int(k[5:]) for k in exported["specs"] if k.startswith("layer")}
        assert layers == set(range(stage.first_layer, stage.last_layer + 1))
        every_layer |= layers
        block = next(p.intra_plan for p in stage.pieces if p.name == "block")
        wq = next(c for c in block.nodes if c.name.endswith("attn.wqkv"))
        entry = exported["specs"][f"layer{stage.first_layer}"]["attn"]["wqkv"]
        assert is_spec(entry) and tuple(entry) == tuple(partition_spec(wq.output)) + (None,) * (
            wq.output.rank - len(partition_spec(wq.output)))
        assert "adam_m" in exported["specs"]["opt_state"]
    assert every_layer == set(range(40))
    out = tmp_path / "specs.py"
    result = meshplan("report", str(default_plan), "--partition-specs", str(out))
    assert result.returncode == 0, result.stderr
    namespace: dict = {}
    exec(out.read_text(), namespace)
    assert len(namespace["stages"]) == plan.num_stages and "from jax.sharding import PartitionSpec" in result.stdout


def test_python_source_round_trips_the_tree(small_plan):
    plan = load_plan(small_plan)
    namespace: dict = {}
    exec(python_source(plan), namespace)
    tree = partition_spec_tree(plan)
    for exported, stage in zip(namespace["stages"], tree["stages"], strict=True):
        flat = jax.tree_util.tree_leaves(stage["specs"], is_leaf=is_spec)
        pasted = jax.tree_util.tree_leaves(exported["partition_specs"], is_leaf=lambda v: isinstance(v, PartitionSpec))
        assert [tuple(s) for s in flat] == [tuple(p) for p in pasted]


# ---------------------------------------------------------------------------------------------
# Chrome trace


def test_chrome_trace_of_the_default_plan(default_plan, tmp_path):
    out = tmp_path / "trace.json"
    result = meshplan("report", str(default_plan), "--chrome-trace", str(out))
    assert result.returncode == 0, result.stderr
    plan, trace = load_plan(default_plan), json.loads(out.read_text())
    names = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert len(names) == plan.num_stages
    steps = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] in ("forward", "backward")]
    assert {e["tid"] for e in steps} == set(range(plan.num_stages))
    assert len(steps) == 2 * plan.num_stages * plan.num_microbatches
    span = (max(e["ts"] + e["dur"] for e in steps) - min(e["ts"] for e in steps)) / 1e6
    # The plan's own schedule, replayed here from its stages' forward and backward seconds.
    replay = timeline(plan.schedule, [s.forward_s for s in plan.stages],
                      [s.latency_s - s.forward_s for s in plan.stages], plan.num_microbatches)
    assert span == pytest.approx(max(t.end for t in replay), rel=1e-9)
    assert span == pytest.approx(trace["otherData"]["replayed_pipeline_time_s"], rel=1e-9)
    predicted = plan.prediction.pipeline_time_s
    assert trace["otherData"]["pipeline_time_s"] == predicted
    assert span == pytest.approx(predicted, rel=1e-9)  # the trace shows what the plan predicts
    # The stage DP's closed form (kept in the metrics) is an upper bound for 1F1B's replay.
    assert span <= dict(plan.metrics)["pipeline_s.closed_form"] * (1 + 1e-9)
    everything = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert max(e["ts"] + e["dur"] for e in everything) / 1e6 == pytest.approx(plan.prediction.iteration_time_s,
                                                                               rel=1e-9)


def test_chrome_trace_span_is_the_predicted_time_where_the_closed_form_is_exact(default_plan):
    """GPipe (and any schedule with equal stages) replays to exactly the DP's closed form."""
    plan = load_plan(default_plan)
    closed_form = dict(plan.metrics)["pipeline_s.closed_form"]
    gpipe = dataclasses.replace(plan, schedule="gpipe",
                                stages=tuple(dataclasses.replace(s, forward_s=None) for s in plan.stages))
    assert pipeline_latency([s.latency_s for s in plan.stages], plan.num_microbatches) == pytest.approx(
        closed_form, rel=1e-12)
    steps = [e for e in chrome_trace(gpipe)["traceEvents"] if e.get("cat") in ("forward", "backward")]
    span = (max(e["ts"] + e["dur"] for e in steps) - min(e["ts"] for e in steps)) / 1e6
    assert span == pytest.approx(closed_form, rel=1e-9)
    same = plan.stages[0].latency_s
    equal = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, latency_s=same, forward_s=None)
                                                   for s in plan.stages))
    predicted = pipeline_latency([s.latency_s for s in equal.stages], plan.num_microbatches)
    assert max(s.end for s in iteration_spans(equal) if s.category == "backward") == pytest.approx(predicted,
                                                                                                   rel=1e-9)


def test_chrome_trace_of_a_pipeshard_dump(runtime_dumps):
    plan = load_plan(runtime_dumps["pipeshard"])
    trace = chrome_trace(plan)
    steps = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in steps} == set(range(plan.num_stages))
    span = max(s.end for s in iteration_spans(plan))
    assert span == pytest.approx(plan.prediction.pipeline_time_s, rel=1e-9)


# ---------------------------------------------------------------------------------------------
# HTML


def png_pixels(path: Path) -> tuple[int, int, bytes]:
    """(width, height, raw scanlines with filter bytes) of an 8-bit RGB(A) PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    position, chunks, width, height = 8, [], 0, 0
    while position < len(data):
        length = int.from_bytes(data[position:position + 4], "big")
        kind = data[position + 4:position + 8]
        body = data[position + 8:position + 8 + length]
        if kind == b"IHDR":
            width, height = int.from_bytes(body[:4], "big"), int.from_bytes(body[4:8], "big")
        elif kind == b"IDAT":
            chunks.append(body)
        position += 12 + length
    return width, height, zlib.decompress(b"".join(chunks))


def rendered_colours(path: Path) -> int:
    """Distinct colours in the screenshot (PNG scanlines un-filtered)."""
    width, height, raw = png_pixels(path)
    channels = (len(raw) // height - 1) // width
    stride, previous, colours = width * channels, bytearray(width * channels), set()
    for row in range(height):
        kind, line = raw[row * (stride + 1)], bytearray(raw[row * (stride + 1) + 1:(row + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        if row % 4 == 0:
            colours.update(bytes(line[i:i + 3]) for i in range(0, stride, channels * 4))
        previous = line
    return len(colours)


def external_sources(page: str) -> list[str]:
    """src/href attributes of the page's own tags that point outside it (script text is not parsed)."""
    found: list[str] = []

    class Tags(HTMLParser):
        def handle_starttag(self, tag, attrs):
            found.extend(v for k, v in attrs if k in ("src", "href") and v and not v.startswith("#"))

    Tags().feed(page)
    return found


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it when root)")
def test_html_report_renders_in_headless_chromium(default_run, tmp_path):
    folder, _ = default_run
    page = folder / "report.html"
    result = meshplan("report", str(folder / "plan.json"), "--html", str(page))
    assert result.returncode == 0, result.stderr
    simulate_page = (folder / "simulate.html").read_text()
    text = page.read_text()
    assert simulate_page == text  # `simulate --html` writes the same page
    assert external_sources(text) == []  # self-contained; chromium below also runs with no network
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,3000",
             "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>"]
    dom = subprocess.run([CHROMIUM, *flags, "--virtual-time-budget=10000", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=300).stdout
    for chart in ("schedule-chart", "memory-chart", "time-chart", "strategy-chart"):
        assert f'id="{chart}"' in dom
    assert dom.count('class="main-svg"') >= 8  # plotly drew every figure (two svg layers each)
    assert dom.count("trace bars") >= 3 and "heatmaplayer" in dom
    assert "<table>" in dom and "attn.wq" in dom
    shot = tmp_path / "report.png"
    subprocess.run([CHROMIUM, *flags, "--virtual-time-budget=10000", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=300, check=True)
    assert rendered_colours(shot) > 50  # not blank: charts in many colours


def test_html_report_of_runtime_dumps(runtime_dumps, tmp_path):
    for name in ("dp", "pipeshard"):
        out = tmp_path / f"{name}.html"
        result = meshplan("report", str(runtime_dumps[name]), "--html", str(out))
        assert result.returncode == 0, result.stderr
        assert all(f'id="{chart}"' in out.read_text() for chart in ("schedule-chart", "strategy-chart"))


def test_every_command_on_runtime_dumps(runtime_dumps, tmp_path):
    for name, folder in runtime_dumps.items():
        result = meshplan("report", str(folder), "--ops")
        assert result.returncode == 0, result.stderr
        assert "parameters" in result.stdout and "args[0]" in result.stdout
        assert max(len(line) for line in result.stdout.splitlines()) <= 80
        trace = tmp_path / f"{name}.trace.json"
        assert meshplan("report", str(folder), "--chrome-trace", str(trace)).returncode == 0
        assert json.loads(trace.read_text())["traceEvents"]
    result = meshplan("diff", str(runtime_dumps["dp"]), str(runtime_dumps["zero3"]))
    assert result.returncode == 0, result.stderr
    assert "args[0][0]['w1']" in result.stdout


# ---------------------------------------------------------------------------------------------
# diff


def test_diff_lists_the_largest_differences_first(default_plan, small_plan, tmp_path):
    a = load_plan(default_plan)
    changed = small_job(cluster=(1, 4), sizes=(4,))
    other = load_plan(small_plan)
    changes = diff_plans(other, changed)
    sizes = [c.size for c in changes]
    assert sizes == sorted(sizes, reverse=True) and changes
    assert any(c.what == "iteration time (s)" for c in changes)
    specs_a, specs_b = parameter_specs(other), parameter_specs(changed)
    layout_rows = [c for c in changes if c.what.startswith("layout")]
    assert bool(layout_rows) == any(specs_a[k][0] != specs_b[k][0] for k in specs_a.keys() & specs_b.keys())
    path = tmp_path / "changed.json"
    write_json_atomic(path, changed.to_dict())
    result = meshplan("diff", str(small_plan), str(path))
    assert result.returncode == 0, result.stderr
    assert "largest first" in result.stdout and "…" not in result.stdout
    same = meshplan("diff", str(default_plan), str(default_plan))
    assert same.returncode == 0 and "identically" in same.stdout and a.model in same.stdout


def test_diff_with_a_plan_without_layouts_says_so_once(small_plan):
    plan = load_plan(small_plan)
    bare = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, pieces=()) for s in plan.stages))
    changes = diff_plans(plan, bare)
    assert [(c.what, c.before, c.after) for c in changes] == [("parameter layouts", "recorded", "not recorded")]


def test_diff_of_two_models_is_refused(default_plan, small_plan):
    assert_user_error(meshplan("diff", str(default_plan), str(small_plan)), "llama2-13b", "same model")


# ---------------------------------------------------------------------------------------------
# Plan files


def test_plan_with_pieces_round_trips_and_stores_each_piece_plan_once(default_plan):
    data = json.loads(default_plan.read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    plan = Plan.from_dict(data)
    assert plan.to_dict() == data
    pieces = [p for s in plan.stages for p in s.pieces]
    assert len(data["piece_plans"]) == len({id(p.intra_plan) for p in pieces}) < len(pieces)


@pytest.mark.parametrize("damage, message", [
    (lambda text: json.dumps({**json.loads(text), "schema_version": SCHEMA_VERSION - 1}),
     f"schema version {SCHEMA_VERSION - 1} is not supported"),
    (lambda text: text[: len(text) // 2], "truncated"),
    (lambda text: json.dumps({"nodes": [], "edges": []}), "not a meshplan plan"),
    (lambda text: json.dumps({**json.loads(text), "stages": [{"first_layer": 0}]}), "malformed"),
])
def test_bad_plan_files_give_one_message_and_exit_2(small_plan, tmp_path, damage, message):
    bad = tmp_path / "bad.json"
    bad.write_text(damage(small_plan.read_text()))
    for command in (["report", str(bad)], ["report", str(bad), "--html", str(tmp_path / "x.html")],
                    ["diff", str(small_plan), str(bad)]):
        assert_user_error(meshplan(*command), message, "bad.json")


def test_missing_plan_and_empty_folder(tmp_path):
    assert_user_error(meshplan("report", str(tmp_path / "none.json")), "no plan file")
    assert_user_error(meshplan("report", str(tmp_path)), "without plan.json")


def test_files_are_written_with_the_umask_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "a.txt", "x")
        write_json_atomic(tmp_path / "b.json", {})
    finally:
        os.umask(old)
    for name in ("a.txt", "b.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644


def test_simulate_out_file_has_normal_permissions(default_plan):
    assert stat.S_IMODE(default_plan.stat().st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
