"""Reports of the default `meshplan simulate` plan (LLaMA2-13B on 50x4 V100-32GB): what keeping
each stage's piece plans costs the simulator (seconds, plan.json bytes) and how long each report
takes. Writes benchmarks/results/report.json. Run: python benchmarks/bench_report.py
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path

from meshplan.cluster import Cluster, get_device
from meshplan.files import write_json_atomic
from meshplan.models.transformer import PRESETS
from meshplan.report.diff import diff_plans
from meshplan.report.html import html_report
from meshplan.report.load import load_plan
from meshplan.report.partition_specs import python_source
from meshplan.report.text import OpFilter, render
from meshplan.report.timeline import chrome_trace_text
from meshplan.simulator import PlannerOptions, TrainingJob, simulate

from common import save


def timed(fn, *args):
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


def main() -> None:
    warnings.simplefilter("ignore")
    job = TrainingJob(PRESETS["llama2-13b"], global_batch=1000, seq_len=4096)
    sim, total = timed(simulate, job, Cluster(50, 4, get_device("v100-32gb")), PlannerOptions())
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        write_json_atomic(path, sim.plan.to_dict())
        plan, load_s = timed(load_plan, path)
        size = path.stat().st_size
    text, text_s = timed(render, plan)
    ops, ops_s = timed(render, plan, OpFilter())
    page, html_s = timed(html_report, plan)
    specs, specs_s = timed(python_source, plan)
    trace, trace_s = timed(chrome_trace_text, plan)
    changes, diff_s = timed(diff_plans, plan, plan)
    pieces = [p for s in plan.stages for p in s.pieces]
    case = {"name": "llama2-13b-50x4-v100-32gb", "simulate_total_s": total,
            "stage_plans_s": sim.phases.get("stage plans"), "phases_s": sim.phases,
            "stages": plan.num_stages, "pieces": len(pieces), "distinct_piece_plans": len({id(p.intra_plan)
                                                                                          for p in pieces}),
            "plan_json_bytes": size, "html_bytes": len(page.encode()), "partition_specs_bytes": len(specs),
            "chrome_trace_bytes": len(trace), "report_lines": len(text.splitlines()),
            "report_with_ops_lines": len(ops.splitlines()),
            "seconds": {"load": load_s, "text": text_s, "text_with_ops": ops_s, "html": html_s,
                        "partition_specs": specs_s, "chrome_trace": trace_s, "diff_with_itself": diff_s},
            "diff_with_itself_rows": len(changes)}
    print(case)
    print("wrote", save("report", [case]))


if __name__ == "__main__":
    main()
