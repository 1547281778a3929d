"""Step time of a small GPT training step on 8 CPU devices under three plans: the automatic
plan (ShardParallel on a 2x4 mesh), DataParallel and Megatron-style TensorParallel.
Writes benchmarks/results/runtime_gpt.json. Run: python benchmarks/bench_runtime.py

With 2 cores the 8 "devices" share the same CPU, so the absolute times say little about
accelerators; the ranking and the planned cost are what this benchmark records.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import importlib.util  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from meshplan.parallel import DataParallel, ShardParallel, TensorParallel, parallelize  # noqa: E402

from common import save  # noqa: E402

_spec = importlib.util.spec_from_file_location("gpt_example", Path(__file__).parents[1] / "examples" / "gpt.py")
gpt = importlib.util.module_from_spec(_spec)
sys.modules["gpt_example"] = gpt  # dataclasses look their module up while the module runs
_spec.loader.exec_module(gpt)

METHODS = {"auto (ShardParallel 2x4)": ShardParallel(), "data parallel": DataParallel(),
           "tensor parallel (Megatron)": TensorParallel()}


def run(name: str, method, cfg, steps: int = 12) -> dict:
    params = gpt.init(cfg, jax.random.key(0))
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    state = (params, zeros, zeros, jnp.zeros((), jnp.float32))
    tokens = jax.random.randint(jax.random.key(1), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    step = parallelize(gpt.make_step(cfg), method=method)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, loss = step(state, tokens)
        float(loss)
        times.append(time.perf_counter() - start)
    plan = step.get_plan()
    return {"name": name, "first_step_s": times[0], "median_step_s": statistics.median(times[2:]),
            "final_loss": float(loss), "planned_cost_s": plan.objective, "mesh": list(plan.mesh.shape),
            "peak_memory_mb": plan.peak_memory / 1e6}


def main() -> None:
    warnings.simplefilter("ignore")
    cfg = gpt.Config(hidden=128, layers=2, batch=32, seq=64)
    cases = []
    for name, method in METHODS.items():
        case = run(name, method, cfg)
        print(f"{name:28s} median step {case['median_step_s'] * 1e3:7.2f} ms  first step {case['first_step_s']:.2f} s"
              f"  planned {case['planned_cost_s'] * 1e3:.3f} ms  loss {case['final_loss']:.4f}", flush=True)
        cases.append(case)
    print("wrote", save("runtime_gpt", cases))


if __name__ == "__main__":
    main()
