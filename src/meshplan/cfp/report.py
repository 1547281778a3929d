"""Readable text of CFP's passes: blocks and segments, profiles, the plan, the comparison."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshplan.cfp.analysis import Analysis
    from meshplan.cfp.compare import Comparison
    from meshplan.cfp.measurement import Measurement
    from meshplan.cfp.profile import Profiles
    from meshplan.cfp.search import CfpPlan


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if abs(seconds) >= 1:
        return f"{seconds:.3f} s"
    if abs(seconds) >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def analysis_text(analysis: Analysis) -> list[str]:
    """Blocks of every unique segment with their candidates, then every occurrence's mapping."""
    g, blocks = analysis.graph, analysis.blocks
    lines = [f"CFP analysis of {g.name} on mesh {analysis.mesh.name}: {len(g)} operators, {len(blocks)} "
             f"ParallelBlocks, {len(analysis.segments)} unique segments, "
             f"{sum(s.combinations for s in analysis.segments)} combinations to profile"]
    for segment in analysis.segments:
        count = len(analysis.occurrences_of(segment.index))
        lines.append(f"segment {segment.index}: blocks {segment.span}, sub-search space {list(segment.space)} = "
                     f"{segment.combinations} combinations, {count} occurrence(s)")
        for b in segment.blocks:
            block = blocks[b]
            free = "" if block.communication_free else "  [communicates inside]"
            lines.append(f"  block {b}: {', '.join(g[d].label for d in block.dots)} "
                         f"({len(block.members)} operators, {len(block.strategies)} candidates){free}")
            lines += [f"      {s.label:<8} {s.name}" for s in block.strategies]
    lines.append("occurrences (blocks -> representative):")
    lines += [f"  {(o.start, o.stop)} -> {analysis.segments[o.segment].span}" for o in analysis.occurrences]
    return lines


def profiles_text(analysis: Analysis, profiles: Profiles, statistic: str = "min") -> list[str]:
    lines = [f"profiles ({profiles.mode}; best and worst by the {statistic} of the runs):"]
    for segment, prof in zip(analysis.segments, profiles.segments, strict=True):
        ok = [c for c in prof.combinations if c.ok]
        source = "cached" if segment.index in profiles.cached else prof.device
        text = f"  segment {segment.index} {list(segment.space)}: {len(ok)}/{len(prof.combinations)} ok ({source})"
        if ok:
            best, worst = min(ok, key=lambda c: c.time(statistic)), max(ok, key=lambda c: c.time(statistic))
            text += (f", best {format_time(best.time(statistic))} [{' | '.join(best.names)}], "
                     f"worst {format_time(worst.time(statistic))}")
        failed = [c for c in prof.combinations if not c.ok]
        if failed:
            text += f", {len(failed)} {'/'.join(sorted({c.status for c in failed}))}"
        lines.append(text)
    return lines


def plan_text(analysis: Analysis, plan: CfpPlan, measured: Measurement | None, flops: float) -> list[str]:
    g = analysis.graph
    source = f"{plan.mode} profiles" + (f", {plan.statistic} of the runs" if plan.mode != "analytic" else "")
    lines = [f"CFP plan from {source} ({plan.solve.backend} {plan.solve.status.value} in {plan.solve.wall_s:.2f} s):"]
    for block, k in zip(analysis.blocks, plan.block_choice, strict=True):
        s = block.strategies[k]
        lines.append(f"  block {block.index:<3} {g[block.lead].label:<28} {s.label:<8} {s.name}")
    budget = f" (budget {format_bytes(plan.memory_budget)})" if plan.memory_budget else ""
    lines.append(f"predicted: {format_time(plan.predicted_time)} (segments {format_time(plan.segment_time)} + "
                 f"resharding {format_time(plan.resharding_time)}), memory {format_bytes(plan.predicted_memory)} "
                 f"per device{budget}")
    if measured is not None:
        lines.append(measured_text("measured", measured, flops))
    return lines


def measured_text(what: str, m: Measurement, flops: float) -> str:
    if m.status != "ok":
        return f"{what}: {m.status} ({m.message})"
    return (f"{what}: {format_time(m.mean_s)} +- {format_time(m.std_s)} over {m.runs} runs, "
            f"{flops / m.mean_s / 1e12:.4f} TFLOP/s, XLA peak memory {format_bytes(m.peak_memory)} per device")


def comparison_text(comparison: Comparison, limit: int = 12) -> list[str]:
    lines = [f"communication volume vs time, per combination (cost model vs measured, {comparison.statistic} of "
             "the runs):"]
    for segment, rows in comparison.by_segment().items():
        rho = comparison.rank_correlation.get(segment)
        lines.append(f"  segment {segment} (rank correlation predicted/measured: "
                     f"{'-' if rho is None else f'{rho:.2f}'})")
        lines.append(f"    {'combination':<44} {'volume':>10} {'predicted':>11} {comparison.statistic:>11}")
        ranked = sorted(rows, key=lambda r: (r.measured_s is None, r.measured_s or 0.0))
        for r in ranked[:limit]:
            measured = format_time(r.measured_s) if r.status == "ok" else r.status
            lines.append(f"    {' | '.join(r.labels):<44} {format_bytes(r.volume):>10} "
                         f"{format_time(r.predicted_s):>11} {measured:>11}")
        if len(rows) > limit:
            lines.append(f"    ... {len(rows) - limit} more in comparison.json")
    lines.append("CFP plan vs meshplan's ILP plan (same graph, mesh and cost model; measured the same way):")
    lines.append(f"  {'plan':<5} {'cost model':>11} {'CFP profiles':>13} {'ILP objective':>14} {'measured':>11} "
                 f"{'TFLOP/s':>9} {'volume':>10} {'XLA memory':>11}")
    for p in comparison.plans:
        measured = format_time(p.measured.mean_s) if p.measured.status == "ok" else p.measured.status
        tflops = f"{p.tflops:.4f}" if p.tflops is not None else "-"
        lines.append(f"  {p.name:<5} {format_time(p.predicted_s):>11} {format_time(p.profiled_s):>13} "
                     f"{format_time(p.ilp_objective):>14} {measured:>11} {tflops:>9} {format_bytes(p.volume):>10} "
                     f"{format_bytes(p.measured.peak_memory):>11}")
    return lines
