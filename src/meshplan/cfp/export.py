"""A CfpPlan in the house's formats (CfpPlan -> IntraPlan -> Plan), so reports and the runtime
read it like the ILP's: every operator's chosen strategy, the reshardings between them, the
cost model's objective, and the plan's predicted and measured figures."""

from __future__ import annotations

from typing import Any

from meshplan.cfp.analysis import Analysis
from meshplan.cfp.models import ModelSpec
from meshplan.cfp.price import price, reshard
from meshplan.cfp.search import CfpPlan
from meshplan.intra.plan import IntraPlan, Resharding, chosen_strategy
from meshplan.intra.strategy_graph import Breakdown
from meshplan.plan import Plan, Prediction, single_stage_plan


def intra_plan(analysis: Analysis, plan: CfpPlan) -> IntraPlan:
    """Every operator's strategy under `plan`; the objective is the cost model's price (the
    profile-based prediction is the Plan's). Each block is one decision group."""
    g, layouts = analysis.graph, analysis.node_strategies(plan.block_choice)
    aliased = {param for param, _ in g.aliases}
    chosen = tuple(chosen_strategy(n, s, aliased) for n, s in zip(g.nodes, layouts, strict=True))
    moves = []
    for n in g.nodes:
        for operand, required in zip(n.operands, layouts[n.id].operands, strict=True):
            collectives = reshard(g, operand, layouts[operand].output, required, analysis.mesh, analysis.options.cost)
            if collectives:
                moves.append(Resharding(g[operand].label, n.label, n.id, layouts[operand].output, required,
                                        collectives))
    p = price(g, layouts, analysis.mesh, analysis.options.cost)
    return IntraPlan(g.name, analysis.mesh, chosen, p.time, Breakdown(p.compute, p.communication, p.resharding),
                     p.peak_memory, plan.memory_budget, plan.solve, tuple(moves), False, len(analysis.blocks),
                     plan.num_variables, plan.num_constraints, 0.0)


def house_plan(analysis: Analysis, plan: CfpPlan, spec: ModelSpec, device: str = "",
               measured: dict[str, float] | None = None) -> Plan:
    """The one-stage Plan `meshplan cfp` writes as plan.json: block choices as notes, CFP's
    settings as options, its prediction, and the measured run under `measured.`."""
    g = analysis.graph
    notes = tuple(f"block {b.index} ({g[b.lead].label}): {b.strategies[k].label}  {b.strategies[k].name}"
                  for b, k in zip(analysis.blocks, plan.block_choice, strict=True))
    options: tuple[tuple[str, Any], ...] = (
        ("profiles", plan.mode), ("statistic", plan.statistic), ("step", "training" if spec.train else "forward"),
        ("max_combinations", str(analysis.options.max_combinations)), ("sizes", ", ".join(spec.changes) or "full"))
    metrics = (("cfp.segment_time_s", plan.segment_time), ("cfp.resharding_time_s", plan.resharding_time),
               *((f"measured.{k}", float(v)) for k, v in (measured or {}).items()))
    prediction = Prediction(plan.predicted_time, plan.predicted_time, peak_memory_bytes=plan.predicted_memory)
    return single_stage_plan(intra_plan(analysis, plan), "cfp", spec.config.name, global_batch=spec.batch,
                             seq_len=spec.seq_len, device=device, prediction=prediction, options=options,
                             metrics=metrics, notes=notes)
