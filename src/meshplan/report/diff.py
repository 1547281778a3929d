"""`meshplan diff A B`: what changed between two plans of one model, largest differences first.

Each difference gets a size so that unlike changes can be ranked together: a number's relative
change (|b - a| / |a|); a change of structure (stage count, a stage's layers, meshes,
recomputation) counts 1; a parameter's layout change counts its share of the model's parameter
bytes (so a change to every layer's attention weights outranks one to a norm's gain). Layout
changes of the same parameter with the same before/after in several layers are one row.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from meshplan.errors import PlanValidationError
from meshplan.plan import Plan
from meshplan.report.breakdown import stage_plans
from meshplan.report.layouts import parameter_layouts


@dataclass(frozen=True, slots=True)
class Difference:
    """One change: what, its value in A and in B, and its size (module docstring)."""

    what: str
    before: str
    after: str
    size: float


_LAYER = re.compile(r"^layer\d+\.")


def check_comparable(a: Plan, b: Plan, a_name: str = "A", b_name: str = "B") -> None:
    """Raise PlanValidationError when the plans are of different models."""
    if a.model != b.model:
        raise PlanValidationError(f"{a_name} is a plan of {a.model!r} but {b_name} of {b.model!r}; `meshplan diff` "
                                  "compares two plans of the same model")


def diff_plans(a: Plan, b: Plan) -> tuple[Difference, ...]:
    """Every difference between `a` and `b`, largest first."""
    changes = _prediction(a, b) + _stages(a, b) + _layouts(a, b)
    return tuple(sorted(changes, key=lambda d: -d.size))


def _relative(before: float | None, after: float | None) -> float:
    if before is None or after is None:
        return 0.0 if before == after else 1.0
    if before == after:
        return 0.0
    return abs(after - before) / abs(before) if before else math.inf


def _number(what: str, before: float | None, after: float | None, fmt: str) -> list[Difference]:
    size = _relative(before, after)
    if size < 1e-9:
        return []
    text = lambda v: "-" if v is None else format(v, fmt)  # noqa: E731
    return [Difference(what, text(before), text(after), size)]


def _prediction(a: Plan, b: Plan) -> list[Difference]:
    pa, pb = a.prediction, b.prediction
    out = _number("micro-batches", a.num_microbatches, b.num_microbatches, "d")
    out += _number("micro-batch size", a.microbatch_size, b.microbatch_size, "d") if a.microbatch_size else []
    if pa is None or pb is None:
        return out
    out += _number("iteration time (s)", pa.iteration_time_s, pb.iteration_time_s, ".4g")
    out += _number("pipeline time (s)", pa.pipeline_time_s, pb.pipeline_time_s, ".4g")
    out += _number("gradient sync + optimizer (s)", pa.sync_time_s, pb.sync_time_s, ".4g")
    out += _number(f"{a.sample_unit}/s", pa.tokens_per_s, pb.tokens_per_s, ",.0f")
    out += _number("MFU", pa.mfu, pb.mfu, ".1%")
    gb = lambda v: None if v is None else v / 1e9  # noqa: E731
    out += _number("peak memory (GB/device)", gb(pa.peak_memory_bytes), gb(pb.peak_memory_bytes), ".2f")
    return out


def _stages(a: Plan, b: Plan) -> list[Difference]:
    out = []
    if a.num_stages != b.num_stages:
        out.append(Difference("stages", str(a.num_stages), str(b.num_stages), 1.0))
    if a.schedule != b.schedule:
        out.append(Difference("schedule", a.schedule, b.schedule, 1.0))
    for k in range(max(a.num_stages, b.num_stages)):
        sa = a.stages[k] if k < a.num_stages else None
        sb = b.stages[k] if k < b.num_stages else None
        if sa is None or sb is None:
            present = sa or sb
            out.append(Difference(f"stage {k}", "-" if sa is None else f"layers {present.layers}",
                                  "-" if sb is None else f"layers {present.layers}", 1.0))
            continue
        for what, va, vb in (("layers", sa.layers, sb.layers),
                             ("sub-mesh", _shape(sa.submesh), _shape(sb.submesh)),
                             ("logical mesh", _shape(sa.logical_mesh), _shape(sb.logical_mesh)),
                             ("recompute", sa.recompute, sb.recompute), ("intra-op plan", sa.memory_plan,
                                                                          sb.memory_plan)):
            if va != vb:
                out.append(Difference(f"stage {k} {what}", va, vb, 1.0))
        out += _number(f"stage {k} ms per micro-batch", _ms(sa.latency_s), _ms(sb.latency_s), ".4g")
        out += _number(f"stage {k} memory (GB/device)", _gb(sa.memory_bytes), _gb(sb.memory_bytes), ".2f")
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _gb(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 1e9


def _shape(shape) -> str:
    return "-" if not shape else "x".join(map(str, shape))


def parameter_specs(plan: Plan) -> dict[str, tuple[str, int]]:
    """Every parameter's layout by a name that does not depend on the stage cut: a simulated
    piece's parameters once per layer ("layer7.attn.wq"), a runtime stage's prefixed with its
    stage when the plan has several; value (layout, elements)."""
    out: dict[str, tuple[str, int]] = {}
    for k, stage in enumerate(plan.stages):
        pieces = [(p.first_layer, p.last_layer, p.intra_plan) for p in stage.pieces] or \
                 [(None, None, intra) for _, _, intra in stage_plans(stage)]
        for first, last, intra in pieces:
            for p in parameter_layouts(intra):
                if p.role == "input":
                    continue
                size = math.prod(p.shape) if p.shape else 1
                if first is not None and _LAYER.match(p.name):
                    for layer in range(first, last + 1):
                        out[f"layer{layer}." + _LAYER.sub("", p.name)] = (str(p.layout), size)
                else:
                    out[p.name if plan.num_stages == 1 or first is not None else f"stage{k}:{p.name}"] = \
                        (str(p.layout), size)
    return out


def _layouts(a: Plan, b: Plan) -> list[Difference]:
    specs_a, specs_b = parameter_specs(a), parameter_specs(b)
    if not specs_a or not specs_b:  # a plan without intra-op plans (e.g. a priced layout) records no layouts
        words = ("recorded" if specs_a else "not recorded", "recorded" if specs_b else "not recorded")
        return [] if words[0] == words[1] else [Difference("parameter layouts", *words, 1.0)]
    total = sum(size for _, size in specs_a.values()) or 1
    groups: dict[tuple[str, str, str], list[tuple[int | None, int]]] = {}
    for name in sorted(set(specs_a) | set(specs_b)):
        la, size = specs_a.get(name, ("-", 0))
        lb, size_b = specs_b.get(name, ("-", 0))
        if la == lb:
            continue
        match = re.match(r"^layer(\d+)\.(.*)$", name)
        layer, local = (int(match.group(1)), match.group(2)) if match else (None, name)
        groups.setdefault((local, la, lb), []).append((layer, max(size, size_b)))
    out = []
    for (local, la, lb), members in groups.items():
        layers = sorted(layer for layer, _ in members if layer is not None)
        where = f"layers {_ranges(layers)} " if layers else ""
        out.append(Difference(f"layout {where}{local}", la, lb, sum(s for _, s in members) / total))
    return out


def _ranges(values: list[int]) -> str:
    parts: list[list[int]] = []
    for v in values:
        if parts and v == parts[-1][1] + 1:
            parts[-1][1] = v
        else:
            parts.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)
