"""Shared by the benchmarks: where results go and what machine and commit made them."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

from meshplan.files import write_json_atomic

RESULTS = Path(__file__).parent / "results"


def environment() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"commit": commit, "machine": platform.machine(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "platform": platform.platform(), "when": time.strftime("%Y-%m-%dT%H:%M:%S")}


def save(name: str, cases: list[dict]) -> Path:
    path = RESULTS / f"{name}.json"
    write_json_atomic(path, {"benchmark": name, "environment": environment(), "cases": cases})
    return path
