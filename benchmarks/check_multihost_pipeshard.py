"""Whole-step pipeshard across processes, every layout: Hugging Face Flax GPT-2 + AdamW (global-norm
clipping, tied embedding) under PipeshardParallel over 2 processes x 4 CPU devices and 4 x 2, with
2 and 4 stages, layers fixed and "auto", each equal to one device after 3 steps (loss <= 1e-5 relative,
parameters <= 1e-4 mean relative). tests/test_multihost.py runs one of these layouts in CI; this runs
them all (each a `meshplan launch` job of tests/multihost_gpt2.py, 1-3 minutes on 2 cores).

Run: python benchmarks/check_multihost_pipeshard.py [--only 2x4]   (writes results/multihost_pipeshard.json)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import save

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ((2, 4), (4, 2))
VARIANTS = {"2 layers": ("--layers", "2"), "4 layers": ("--layers", "4"),
            "auto layers": ("--layers", "auto"),
            "auto layers, auto stages": ("--layers", "auto", "--stages", "auto"),
            "4 layers, gpipe": ("--layers", "4", "--schedule", "gpipe")}


def run_case(nprocs: int, devices: int, options: tuple[str, ...]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]),
               "TF_CPP_MIN_LOG_LEVEL": "2"}
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "meshplan.cli", "launch", "--nprocs", str(nprocs),
                                 "--devices-per-process", str(devices), "--", "python",
                                 str(ROOT / "tests" / "multihost_gpt2.py"), out, *options],
                                capture_output=True, text=True, env=env, timeout=1800, check=False)
        wall = time.monotonic() - start
        if result.returncode:
            return {"ok": False, "wall_s": wall, "error": result.stderr[-2000:]}
        reports = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nprocs)]
    totals: dict = {}
    for report in reports:
        for name, (diff, size, _) in report["params"].items():
            total = totals.setdefault(name, [0.0, 0.0])
            total[0], total[1] = total[0] + diff, total[1] + size
    loss_error = max(float(np.max(np.abs(np.subtract(r["losses"], r["one_device_losses"])
                                         / np.abs(r["one_device_losses"])))) for r in reports)
    param_error = float(np.mean([d / s for d, s in totals.values()]))
    same_plan = len({r["plan"] for r in reports}) == 1
    return {"ok": same_plan and loss_error <= 1e-5 and param_error <= 1e-4, "wall_s": wall,
            "stages": reports[0]["stages"], "same_plan_everywhere": same_plan, "loss_relative_error": loss_error,
            "param_mean_relative_error": param_error, "losses": reports[0]["losses"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one layout, e.g. 2x4")
    args = parser.parse_args()
    cases = []
    for nprocs, devices in LAYOUTS:
        if args.only and args.only != f"{nprocs}x{devices}":
            continue
        for name, options in VARIANTS.items():
            case = {"processes": nprocs, "devices_per_process": devices, "variant": name,
                    **run_case(nprocs, devices, options)}
            print(json.dumps({k: v for k, v in case.items() if k != "losses"}), flush=True)
            cases.append(case)
    path = save("multihost_pipeshard", cases)
    print(f"{sum(c['ok'] for c in cases)}/{len(cases)} layouts equal one device; wrote {path}")


if __name__ == "__main__":
    main()
