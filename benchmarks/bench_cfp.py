"""CFP on 8 CPU devices: its plan against meshplan's ILP plan, and profiling time against depth.
Writes benchmarks/results/cfp.json. Run: python benchmarks/bench_cfp.py [--quick]

1. Plans. The devices are measured first (collective latency and bandwidth, matmul FLOP/s:
   `meshplan profile-cluster`'s measurement), and both planners price with those costs. For a
   small GPT and a small GShard MoE forward step and a small GPT training step (reduced sizes,
   2x4 mesh), CFP profiles its segments and searches; the ILP solves the same graph. Both plans
   are then run by the same lowering, compiled once and timed round-robin (so load from other
   processes hits both alike).
2. Depth. GPT stacks of 2, 4, 8, 16 layers are analysed and profiled from an empty cache: the
   number of unique segments (what is profiled) and the profiling time should stay flat.

With 2 cores the 8 "devices" share the same CPU: absolute times say little about accelerators;
what matters is the comparison under equal conditions. The load average is recorded.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from meshplan.cfp import CfpOptions, ProfileCache, ProfileSettings, analyze, model_graph, model_spec  # noqa: E402
from meshplan.cfp import profile as cfp_profile  # noqa: E402
from meshplan.cfp.compare import ilp_layouts, ilp_plan  # noqa: E402
from meshplan.cfp.measure import measure_many  # noqa: E402
from meshplan.cfp.price import price  # noqa: E402
from meshplan.cfp.search import search  # noqa: E402
from meshplan.cluster.cluster import load_cluster_file  # noqa: E402
from meshplan.cluster.costs import DeviceCosts  # noqa: E402
from meshplan.cost.model import CostModel  # noqa: E402
from meshplan.files import write_json_atomic  # noqa: E402
from meshplan.ir.counting import graph_flops  # noqa: E402
from meshplan.runtime.calibrate import profile_cluster  # noqa: E402

from common import save  # noqa: E402

MESH = (2, 4)
# (model, layers, training step): layer 1 of the MoE is an expert layer
MODELS = (("gpt3-125m", 2, False), ("moe-1.3b", 2, False), ("gpt3-125m", 2, True))
DEPTHS = (2, 4, 8, 16)


def load() -> float:
    return os.getloadavg()[0]


def device_costs() -> DeviceCosts:
    """The 8 devices measured as one node (what `meshplan profile-cluster` writes)."""
    path = Path(tempfile.mkdtemp()) / "cluster.json"
    write_json_atomic(path, profile_cluster(1, 8, 16e9))
    return DeviceCosts.from_cluster(load_cluster_file(str(path)))


def compare(model: str, layers: int, train: bool, costs: DeviceCosts, runs: int) -> dict:
    spec = model_spec(model, layers, batch=8, train=train)
    mesh = costs.mesh(MESH)
    a = analyze(model_graph(spec), mesh, CfpOptions(CostModel(flops_per_second=costs.flops_per_second)))
    start, load_before = time.perf_counter(), load()
    profiles = cfp_profile(a, ProfileSettings(runs=5, warmup=2))
    profile_s = time.perf_counter() - start
    plan = search(a, profiles)
    ilp = ilp_plan(a, None)
    layouts = {"CFP": a.node_strategies(plan.block_choice), "ILP": ilp_layouts(ilp)}
    measured = dict(zip(layouts, measure_many(a.graph, list(layouts.values()), mesh, runs, 3), strict=True))
    flops = graph_flops(a.graph)
    case = {"model": spec.describe(), "mesh": list(MESH), "blocks": len(a.blocks), "unique_segments": len(a.segments),
            "combinations": sum(s.combinations for s in a.segments), "profile_s": profile_s,
            "load_during_profile": [load_before, load()], "cfp_search_s": plan.solve.wall_s,
            "cfp_predicted_s": plan.predicted_time, "ilp_objective_s": ilp.objective,
            "cfp_blocks": [b.strategies[k].label for b, k in zip(a.blocks, plan.block_choice, strict=True)],
            "operators_laid_out_alike": sum(c.output == i.output for c, i in zip(*layouts.values(), strict=True)),
            "operators": len(a.graph)}
    for name, m in measured.items():
        model_price = price(a.graph, layouts[name], a.mesh, a.options.cost)
        case[name] = {"mean_s": m.mean_s, "median_s": m.median_s, "min_s": m.min_s, "std_s": m.std_s,
                      "runs": m.runs, "tflops": flops / m.mean_s / 1e12, "cost_model_s": model_price.time,
                      "volume_bytes": model_price.volume, "xla_peak_memory_bytes": m.peak_memory}
    case["load_after"] = load()
    print(f"{spec.name}: CFP median {case['CFP']['median_s'] * 1e3:.2f} ms "
          f"(predicted {plan.predicted_time * 1e3:.2f}), "
          f"ILP median {case['ILP']['median_s'] * 1e3:.2f} ms; profiling {profile_s:.1f} s "
          f"({case['combinations']} combinations), load {load():.1f}", flush=True)
    return case


def depth(layers: int, costs: DeviceCosts) -> dict:
    spec = model_spec("gpt3-125m", layers, batch=8)
    start = time.perf_counter()
    a = analyze(model_graph(spec), costs.mesh(MESH), CfpOptions(CostModel(flops_per_second=costs.flops_per_second)))
    analysis_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        start, load_before = time.perf_counter(), load()
        profiles = cfp_profile(a, ProfileSettings(runs=3, warmup=1), ProfileCache(folder))
        profile_s = time.perf_counter() - start
    start = time.perf_counter()
    search(a, profiles)
    case = {"layers": layers, "nodes": len(a.graph), "blocks": len(a.blocks), "unique_segments": len(a.segments),
            "occurrences": len(a.occurrences), "combinations": sum(s.combinations for s in a.segments),
            "analysis_s": analysis_s, "profile_s": profile_s, "search_s": time.perf_counter() - start,
            "load": [load_before, load()]}
    print(f"{layers:2d} layers: {case['blocks']:3d} blocks, {case['unique_segments']} unique segments, "
          f"{case['combinations']} combinations, analysis {analysis_s:.2f} s, profiling {profile_s:.1f} s, "
          f"search {case['search_s']:.2f} s, load {load():.1f}", flush=True)
    return case


def main() -> None:
    quick = "--quick" in sys.argv
    costs = device_costs()
    print(f"devices: latency {costs.intra_alpha * 1e6:.0f} us, {1 / costs.intra_beta / 1e9:.2f} GB/s, "
          f"{costs.flops_per_second / 1e9:.1f} GFLOP/s", flush=True)
    cases = [{"kind": "plans", **compare(*model, costs, 10 if quick else 30)} for model in MODELS]
    cases += [{"kind": "depth", **depth(n, costs)} for n in (DEPTHS[:2] if quick else DEPTHS)]
    cases.append({"kind": "device_costs", "alpha_s": costs.intra_alpha, "beta_s_per_byte": costs.intra_beta,
                  "flops_per_second": costs.flops_per_second})
    print("wrote", save("cfp", cases))


if __name__ == "__main__":
    main()
