"""The examples run as a new user runs them, and their loss falls."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parents[1] / "examples"


def run_example(name: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the example sets its own 8 devices
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    return done.stdout


def test_pipeshard_gpt_example_trains():
    # Its default, stages="auto"; uniform stages train like one device in tests/test_pipeshard*.py.
    out = run_example("pipeshard_gpt.py", "--steps", "3")
    losses = [float(x) for x in re.findall(r"step \d+: loss (\d+\.\d+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "pipeshard plan:" in out and "stage 0: layer(s) 0" in out


def test_hf_flax_gpt2_example_trains_with_adamw():
    # The example runs every method through the same loop; dp stands for the data-parallel ones here.
    # Each method trains this step like one device in tests/test_framework_models.py
    # (test_adamw_steps_match_one_device: GPT-2 and AdamW under Shard/Data/Zero2/Zero3/TensorParallel).
    out = run_example("hf_flax_gpt2.py", "--steps", "3", "--methods", "dp,pipeshard")
    losses = {}
    for method in ("dp", "pipeshard"):
        losses[method] = [float(x) for x in re.findall(rf"{method} step \d+: loss (\d+\.\d+)", out)]
        assert len(losses[method]) == 3 and losses[method][-1] < losses[method][0]
    assert "dp: mesh (8,), batch args[2] i32[16, 32] (dim 0)" in out  # the ids, found as the batch
    assert losses["pipeshard"] == losses["dp"]  # printed to 4 decimals
    assert "pipeshard: stages layer 0 on devices (0, 1) as (2,), layer 1 on devices (2, 3)" in out


def test_serve_example_generates_like_one_device():
    out = run_example("serve.py", "--model", "llama", "--new-tokens", "8")
    assert "greedy equals one device: True" in out
    assert re.search(r"decode plan: mesh \(2, 4\)", out) and "cached_key']: S" in out
