"""Fold JAX's form of an average pooling's gradient into the form XLA's ReduceWindow has for it.

JAX transposes a window sum by padding the cotangent (`lax.pad`: zeros around it and, for a
strided pooling, between its entries) and summing stride-1 windows of the padded result. One
`reduce_window_sum` of the cotangent with that padding and base dilation computes the same
values, and is the form the IR's autodiff gives (`ir/autodiff.py`): the planner can then split
its rows with a halo (`sharding/rules/pooling.py`) instead of meeting a padded tensor whose rows
no device count divides.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from meshplan.capture.flatten import FlatProgram, Step


def fold_padded_window_sums(prog: FlatProgram) -> None:
    """Replace each stride-1, unpadded `reduce_window_sum` of a zero `pad` by one window sum of
    the pad's operand (the pad stays for its other uses; unused, it is pruned later)."""
    made_by = {vid: step for step in prog.steps for vid in step.outputs}
    for k, step in enumerate(prog.steps):
        pad = made_by.get(step.inputs[0]) if step.name == "reduce_window_sum" else None
        if pad is not None and pad.name == "pad" and _is_plain(step) and _pads_with_zeros(prog, pad):
            config = pad.params["padding_config"]
            params = {**step.params, "padding": tuple((int(lo), int(hi)) for lo, hi, _ in config),
                      "base_dilation": tuple(int(interior) + 1 for _, _, interior in config)}
            prog.steps[k] = dataclasses.replace(step, params=params, inputs=(pad.inputs[0],))


def _is_plain(step: Step) -> bool:
    p = step.params
    return (all(s == 1 for s in p["window_strides"]) and all(d == 1 for d in p["base_dilation"])
            and all(tuple(pair) == (0, 0) for pair in p["padding"]))


def _pads_with_zeros(prog: FlatProgram, pad: Step) -> bool:
    value = prog.constants.get(pad.inputs[1])
    return (value is not None and bool(np.all(np.asarray(value) == 0))
            and all(lo >= 0 and hi >= 0 and interior >= 0 for lo, hi, interior in pad.params["padding_config"]))
