"""Pipeline hand-offs across processes on CPU: measured time against the cost model's prediction.

Two processes of 4 CPU devices (`meshplan launch`, gloo collectives); stage A is process 0's devices,
stage B process 1's. For activations of several sizes, `runtime.handoff.move` from A to B is timed
for three layout pairs: split along dim 0 on both (each device sends its quarter), whole on both
(each device receives the whole value from its peer) and split to whole (A gathers, then sends). The
cost model prices one direction of a hand-off as `inter_alpha + bytes / devices * inter_beta`
(inter.stages.handoff_time, each device of the sending stage moving its share over the link between
nodes); its alpha and beta here are fitted, as `meshplan profile-cluster --nodes 2
--devices-per-node 4` fits them, from all-reduces along the axis that crosses the processes. For
reference, the same moves inside one process (`jax.device_put` between two 4-device sub-meshes).

Run: python benchmarks/bench_handoff.py   (launches itself; writes results/handoff.json)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = (1 << 16, 1 << 20, 1 << 23)  # bytes of one micro-batch's activation (float32)
REPEATS = 10
LAYOUTS = ("split -> split", "whole -> whole", "split -> whole")
ROOT = Path(__file__).resolve().parents[1]


def measure(out: str) -> None:
    """One process of the job: time the hand-offs and the all-reduces; write OUT/rank<N>.json."""
    import meshplan.launch

    worker = meshplan.launch.initialize()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from meshplan.runtime.calibrate import fit_alpha_beta, measure_all_reduce
    from meshplan.runtime.handoff import move

    devices = jax.devices()
    half = len(devices) // 2
    meshes = [Mesh(np.array(part), ("d",)) for part in (devices[:half], devices[half:])]
    spec = {"split": PartitionSpec("d"), "whole": PartitionSpec()}
    results = []
    for size in SIZES:
        rows = size // 4 // 256
        value = np.ones((rows, 256), np.float32)
        for layout in LAYOUTS:
            source, target = (NamedSharding(m, spec[s]) for m, s in zip(meshes, layout.split(" -> "), strict=True))
            x = jax.device_put(value, source)
            move(x, target).block_until_ready()  # compiles, and lines the processes up
            start = time.perf_counter()
            for _ in range(REPEATS):
                y = move(x, target)
                y.block_until_ready()  # the receiver waits for the data; the sender for its send
            results.append({"bytes": size, "layout": layout, "seconds": (time.perf_counter() - start) / REPEATS})
    cross = Mesh(np.array(devices).reshape(2, half), ("nodes", "devices"))
    all_reduce = [measure_all_reduce(cross, "nodes", b, REPEATS) for b in SIZES]
    alpha, beta = fit_alpha_beta(SIZES, all_reduce, 2)
    report = {"process": jax.process_index(), "handoffs": results, "all_reduce_seconds": all_reduce,
              "inter_alpha": alpha, "inter_beta": beta, "devices_per_stage": half}
    Path(out, f"rank{worker.process_id}.json").write_text(json.dumps(report))


def in_one_process() -> list[dict]:
    """The same moves between two 4-device sub-meshes of one process (`jax.device_put`)."""
    code = (f"import sys, json; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import bench_handoff; "
            "print(json.dumps(bench_handoff.one_process_moves()))")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "JAX_NUM_CPU_DEVICES": "8"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def one_process_moves() -> list[dict]:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()
    meshes = [Mesh(np.array(part), ("d",)) for part in (devices[:4], devices[4:8])]
    spec = {"split": PartitionSpec("d"), "whole": PartitionSpec()}
    results = []
    for size in SIZES:
        value = np.ones((size // 4 // 256, 256), np.float32)
        for layout in LAYOUTS:
            source, target = (NamedSharding(m, spec[s]) for m, s in zip(meshes, layout.split(" -> "), strict=True))
            x = jax.device_put(value, source)
            jax.device_put(x, target).block_until_ready()
            start = time.perf_counter()
            for _ in range(REPEATS):
                jax.device_put(x, target).block_until_ready()
            results.append({"bytes": size, "layout": layout, "seconds": (time.perf_counter() - start) / REPEATS})
    return results


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from common import save

    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")]),
               "TF_CPP_MIN_LOG_LEVEL": "2"}
        subprocess.run([sys.executable, "-m", "meshplan.cli", "launch", "--nprocs", "2", "--devices-per-process",
                        "4", "--", "python", __file__, "--worker", out], env=env, check=True, timeout=900)
        receiver = json.loads(Path(out, "rank1.json").read_text())  # stage B's process: it waits for the data
    alpha, beta, per = receiver["inter_alpha"], receiver["inter_beta"], receiver["devices_per_stage"]
    local = {(c["bytes"], c["layout"]): c["seconds"] for c in in_one_process()}
    cases = []
    for case in receiver["handoffs"]:
        predicted = alpha + case["bytes"] / per * beta  # inter.stages.handoff_time, one direction
        cases.append({**case, "predicted_seconds": predicted, "measured_over_predicted": case["seconds"] / predicted,
                      "one_process_device_put_seconds": local[(case["bytes"], case["layout"])]})
        one = local[(case["bytes"], case["layout"])]
        print(f"{case['layout']:>15} {case['bytes']:>9} B: {case['seconds'] * 1e3:8.2f} ms measured, "
              f"{predicted * 1e3:8.2f} ms predicted, one process {one * 1e3:7.2f} ms")
    fitted = {"inter_alpha_s": alpha, "inter_beta_s_per_byte": beta, "all_reduce_bytes": list(SIZES),
              "all_reduce_seconds": receiver["all_reduce_seconds"]}
    print(f"wrote {save('handoff', [{'fitted_from_all_reduce': fitted}, *cases])}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        measure(sys.argv[2])
    else:
        main()
