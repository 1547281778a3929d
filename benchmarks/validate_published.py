"""Predict published, measured training runs with their own model, cluster and parallel
configuration; writes benchmarks/results/validation.json (the table in docs/validation.md).

Sources (numbers as published; see docs/validation.md for the exact references):
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Table 5 (full recomputation, iteration times), A100 80GB DGX nodes.
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", Table 1 (TFLOP/s per GPU; iteration time derived with the paper's Eq. 3).
- BigScience BLOOM-176B training chronicles (105.22 s per iteration at global batch 2048).
Run: python benchmarks/validate_published.py
"""

from __future__ import annotations

import sys
import time
import warnings

from meshplan.cluster import Cluster, device_from_overrides, get_device
from meshplan.models.transformer import TransformerConfig
from meshplan.simulator import PlannerOptions, TrainingJob
from meshplan.simulator.baselines import evaluate_configuration

from common import save


def gpt(name: str, hidden: int, heads: int, layers: int, vocab: int = 51200, seq: int = 2048,
        positions: bool = True) -> TransformerConfig:
    return TransformerConfig(name, "gpt", hidden, heads, layers, 4 * hidden, vocab, norm="layer", mlp="gelu",
                             rotary=False, learned_positions=positions, max_seq_len=seq)


def eq3_seconds(batch: int, seq: int, layers: int, hidden: int, vocab: int, gpus: int, tflops: float) -> float:
    """Narayanan et al. Eq. 3 FLOPs (with recomputation) at the published TFLOP/s per GPU."""
    flops = 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return flops / (gpus * tflops * 1e12)


A100 = get_device("a100-80gb")
# BLOOM's Jean Zay nodes: 4 x 100 Gb/s Omni-Path per node of 8 GPUs.
JEAN_ZAY = device_from_overrides(A100, name="a100-80gb-jean-zay", inter_bandwidth=4 * 100e9 / 8 / 8)

CASES = [
    # name, model, nodes, device, global batch, tp, pp, micro-batch sizes, published s/iteration, source,
    # model chunks per device (the interleaved schedule)
    ("korthikanti-22b", gpt("gpt-22b", 6144, 64, 48), 1, A100, 4, 8, 1, (4,), 1.42, "Korthikanti 2022, Table 5", 1),
    ("korthikanti-175b", gpt("gpt-175b", 12288, 96, 96), 8, A100, 64, 8, 8, (1,), 18.13,
     "Korthikanti 2022, Table 5 (interleaved schedule, 3 chunks)", 3),
    ("narayanan-1.7b", gpt("gpt-1.7b", 2304, 24, 24), 4, A100, 512, 1, 1, (32, 64, 128),
     eq3_seconds(512, 2048, 24, 2304, 51200, 32, 137), "Narayanan 2021, Table 1: 137 TFLOP/s/GPU", 1),
    ("narayanan-7.5b", gpt("gpt-7.5b", 4096, 32, 36), 16, A100, 512, 4, 1, (32, 64, 128),
     eq3_seconds(512, 2048, 36, 4096, 51200, 128, 142), "Narayanan 2021, Table 1: 142 TFLOP/s/GPU", 1),
    ("narayanan-39.1b", gpt("gpt-39.1b", 8192, 64, 48), 64, A100, 1536, 8, 2, (32, 64),
     eq3_seconds(1536, 2048, 48, 8192, 51200, 512, 138), "Narayanan 2021, Table 1: 138 TFLOP/s/GPU", 1),
    ("bloom-176b", gpt("bloom-176b", 14336, 112, 70, vocab=250880, positions=False), 48, JEAN_ZAY, 2048, 4, 12,
     (16,), 105.22, "BigScience tr11-176B chronicles, 2022-03-18", 1),
]


def main(only: set[str]) -> None:
    warnings.simplefilter("ignore")
    options = PlannerOptions(workers=1)
    results = []
    for name, model, nodes, device, batch, tp, pp, sizes, published, source, chunks in CASES:
        if only and name not in only:
            continue
        start = time.perf_counter()
        cluster = Cluster(nodes, 8, device)
        job = TrainingJob(model, batch, 2048)
        plans = [evaluate_configuration(job, cluster, tp, pp, b, options, recompute=("full",), chunks=chunks)
                 for b in sizes]
        plans = [p for p in plans if p is not None]
        best = min(plans, key=lambda p: p.iteration_time) if plans else None
        predicted = best.iteration_time if best else None
        error = None if predicted is None else predicted / published - 1
        results.append({"name": name, "source": source, "gpus": cluster.num_devices, "tp": tp, "pp": pp,
                        "chunks": chunks,
                        "dp": cluster.num_devices // (tp * pp), "global_batch": batch,
                        "microbatch_size": best.microbatch_size if best else None,
                        "published_s": published, "predicted_s": predicted, "relative_error": error,
                        "planner_s": time.perf_counter() - start})
        shown = "does not fit" if predicted is None else f"{predicted:.2f} s ({error:+.1%})"
        print(f"{name:18s} published {published:7.2f} s  predicted {shown}", flush=True)
    print("wrote", save("validation", results))


if __name__ == "__main__":
    main(set(sys.argv[1:]))
