"""Text report of a pipeshard Plan: stages, sub-meshes, predicted times and parameter layouts."""

from __future__ import annotations

from meshplan.plan import Plan


def _ranges(indices: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"."""
    parts, start = [], None
    for i, value in enumerate(indices):
        if start is None:
            start = value
        if i + 1 == len(indices) or indices[i + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ",".join(parts)


def pipeshard_text(plan: Plan) -> str:
    """The plan as lines of text: one header per stage, then each parameter's planned layout and
    its gradient's (R = whole, S0/S1 = split over mesh axis 0/1, per tensor dim)."""
    lines = [f"pipeshard plan: {plan.num_stages} stage(s), {plan.num_microbatches} micro-batch(es), "
             f"{plan.schedule}, stage sharding {plan.option('stage_sharding', '-')}"]
    if plan.prediction is not None:
        lines.append(f"predicted step latency {plan.prediction.pipeline_time_s * 1e3:.3f} ms (cost model)")
    for k, stage in enumerate(plan.stages):
        head = (f"stage {k}: layer(s) {stage.layers} on devices {_ranges(stage.devices)} as "
                f"{'x'.join(map(str, stage.logical_mesh))}")
        if stage.latency_s is not None:
            head += f"; predicted {stage.latency_s * 1e3:.3f} ms per micro-batch"
        lines.append(head)
        intra = stage.intra_plan
        if intra is None:
            continue
        b = intra.breakdown
        lines.append(f"  intra-op plan cost {intra.objective:.3e} s (compute {b.compute:.3e}, communication "
                     f"{b.communication:.3e}, resharding {b.resharding:.3e})")
        grads = {c.name.removeprefix("grad."): c for c in intra.nodes if c.name.startswith("grad.")}
        for c in intra.nodes:
            if c.op == "parameter" and c.name.startswith("args[0]"):
                grad = grads.get(c.name)
                lines.append(f"  {c.name:<40} {c.output!s:<8} grad {grad.output if grad else '-'}")
    return "\n".join(lines)
