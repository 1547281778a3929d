"""Plan LLaMA2-13B training on 50x4 V100-32GB (global batch 1000 x 4096 tokens), as the default
`meshplan simulate` does; record planner time per phase and the predicted throughput of the
auto plan and the baselines, without and with reduce-scattered contractions (PlannerOptions
.reduce_scatter). Writes benchmarks/results/simulate_llama2_13b.json.
Run: python benchmarks/bench_simulate.py
"""

from __future__ import annotations

import time
import warnings

from meshplan.cluster import Cluster, get_device
from meshplan.models.transformer import PRESETS
from meshplan.simulator import PlannerOptions, TrainingJob, simulate

from common import save


def main() -> None:
    warnings.simplefilter("ignore")
    cases = [_case(reduce_scatter) for reduce_scatter in (True, False)]  # the default first
    print("wrote", save("simulate_llama2_13b", cases))


def _case(reduce_scatter: bool) -> dict:
    start = time.perf_counter()
    job = TrainingJob(PRESETS["llama2-13b"], global_batch=1000, seq_len=4096)
    sim = simulate(job, Cluster(50, 4, get_device("v100-32gb")), PlannerOptions(reduce_scatter=reduce_scatter))
    total = time.perf_counter() - start
    name = "llama2-13b-50x4-v100-32gb" + ("" if reduce_scatter else " without reduce-scatter")
    case = {"name": name, "planner_total_s": total, "phases_s": sim.phases,
            "auto": _prediction(sim.plan),
            "stages": [[s.first_layer, s.last_layer, list(s.submesh), list(s.logical_mesh), s.recompute]
                       for s in sim.plan.stages],
            "microbatch_size": sim.plan.microbatch_size,
            "baselines": {b.name: (_prediction(b.plan) if b.plan else {"fits": False, "reason": b.reason})
                          | {"config": b.config} for b in sim.baselines}}
    print(f"{name}: planner {total:.1f} s {sim.phases}")
    print(f"auto: {case['auto']}")
    for baseline, result in case["baselines"].items():
        print(f"{baseline}: {result}")
    return case


def _prediction(plan) -> dict:
    p = plan.prediction
    return {"fits": True, "iteration_time_s": p.iteration_time_s, "tokens_per_s": p.tokens_per_s,
            "tflops_per_device": p.tflops_per_device, "mfu": p.mfu, "peak_memory_gb": p.peak_memory_bytes / 1e9}


if __name__ == "__main__":
    main()
