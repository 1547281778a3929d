"""Pipelined step time (loss and grads) of a 4-block GPT on 8 CPU devices under pipeshard plans:
stages from the inter-op search vs one stage per block, with planned, data-parallel or
replicated stages. Writes benchmarks/results/pipeshard_gpt.json.
Run: python benchmarks/bench_pipeshard.py

With 2 cores the 8 "devices" share one CPU: a pipeline cannot overlap stages here, so the
times rank the plans' work, not an accelerator's speed-up. The first step includes capture,
planning (ILPs, and for "auto" the stage search) and compilation.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from meshplan.parallel import (
    PipeshardParallel,  # noqa: E402
    parallelize,  # noqa: E402
)

from common import save  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import pipeshard_gpt as gpt  # noqa: E402

MICRO_BATCHES = 4
CASES = {
    "auto stages, planned stages": PipeshardParallel(MICRO_BATCHES, stages="auto"),
    "uniform 4 stages, planned stages": PipeshardParallel(MICRO_BATCHES, stages="uniform"),
    "uniform 4 stages, data-parallel stages": PipeshardParallel(MICRO_BATCHES, stage_sharding="data_parallel"),
    "uniform 4 stages, replicated stages": PipeshardParallel(MICRO_BATCHES, stage_sharding="replicated"),
}


def run(name: str, method: PipeshardParallel, steps: int = 12) -> dict:
    params = gpt.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (gpt.BATCH, gpt.SEQ + 1), 0, gpt.VOCAB)
    step = parallelize(gpt.loss_fn, method=method)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss, grads = step(params, tokens[:, :-1], tokens[:, 1:])
        jax.block_until_ready(grads)
        times.append(time.perf_counter() - start)
    plan = step.get_plan()
    return {"name": name, "first_step_s": times[0], "median_step_s": statistics.median(times[2:]),
            "loss": float(loss), "stages": [{"layers": [s.first_layer, s.last_layer], "devices": len(s.devices),
                                             "mesh_shape": list(s.logical_mesh)} for s in plan.stages],
            "predicted_latency_s": None if plan.prediction is None else plan.prediction.pipeline_time_s,
            "planned_stage_costs_s": [None if s.intra_plan is None else s.intra_plan.objective
                                      for s in plan.stages]}


def main() -> None:
    warnings.simplefilter("ignore")
    cases = []
    for name, method in CASES.items():
        case = run(name, method)
        stages = " | ".join(f"{s['layers'][0]}-{s['layers'][1]} on {s['devices']}" for s in case["stages"])
        print(f"{name:40s} median {case['median_step_s'] * 1e3:7.2f} ms  first {case['first_step_s']:5.2f} s  "
              f"loss {case['loss']:.5f}  stages {stages}", flush=True)
        cases.append(case)
    print("wrote", save("pipeshard_gpt", cases))


if __name__ == "__main__":
    main()
