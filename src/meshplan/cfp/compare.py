"""CFP's check of its premise and of its result (Analysis + Profiles + CfpPlan -> Comparison).

1. Per profiled combination: the cost model's communication volume and predicted time next to
   the measured time, and per segment the rank correlation of predicted and measured times (does
   the cost model order the combinations as the devices do?).
2. The CFP plan next to meshplan's ILP plan of the same graph on the same mesh with the same cost
   model: the cost model's price of each, CFP's profile-based prediction, the ILP's objective,
   and both measured the same way (the same lowering, runs and arguments).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshplan.cfp.analysis import Analysis
from meshplan.cfp.measurement import Measurement
from meshplan.cfp.price import price
from meshplan.cfp.profile import ANALYTIC, Profiles
from meshplan.cfp.search import CfpPlan
from meshplan.intra.options import IntraOptions
from meshplan.intra.plan import IntraPlan
from meshplan.intra.solve import solve_intra
from meshplan.ir.counting import graph_flops
from meshplan.sharding.strategy import Strategy


@dataclass(frozen=True, slots=True)
class CombinationRow:
    segment: int
    labels: tuple[str, ...]
    names: tuple[str, ...]
    volume: float
    predicted_s: float
    measured_s: float | None
    status: str


@dataclass(frozen=True, slots=True)
class PlanRow:
    """One plan, predicted and measured.

    Attributes:
        name: "CFP" or "ILP".
        predicted_s: the cost model's price of the whole graph under the plan.
        profiled_s: CFP's prediction from its profiles (CFP only).
        ilp_objective: the ILP's own objective (ILP only).
        volume: bytes each device sends in collectives (cost model).
        measured: the measured run.
        tflops: model FLOPs / measured time / 1e12.
    """

    name: str
    predicted_s: float
    profiled_s: float | None
    ilp_objective: float | None
    volume: float
    measured: Measurement
    tflops: float | None


@dataclass(frozen=True, slots=True)
class Comparison:
    rows: tuple[CombinationRow, ...]
    rank_correlation: dict[int, float | None]
    plans: tuple[PlanRow, ...] = field(default=())
    statistic: str = "min"  # which time of a combination's runs `rows` hold

    def by_segment(self) -> dict[int, list[CombinationRow]]:
        out: dict[int, list[CombinationRow]] = {}
        for row in self.rows:
            out.setdefault(row.segment, []).append(row)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "combinations": [{"segment": r.segment, "labels": list(r.labels), "names": list(r.names),
                              "volume_bytes": r.volume, "predicted_s": r.predicted_s, "measured_s": r.measured_s,
                              "status": r.status} for r in self.rows],
            "rank_correlation": {str(k): v for k, v in self.rank_correlation.items()}, "statistic": self.statistic,
            "plans": [{"name": p.name, "predicted_s": p.predicted_s, "profiled_s": p.profiled_s,
                       "ilp_objective": p.ilp_objective, "volume_bytes": p.volume, "measured_s": p.measured.mean_s,
                       "measured_std_s": p.measured.std_s, "status": p.measured.status,
                       "xla_peak_memory_bytes": p.measured.peak_memory, "tflops": p.tflops} for p in self.plans],
        }


def combination_rows(analysis: Analysis, profiles: Profiles, statistic: str = "min") -> Comparison:
    """Every profiled combination with its volume, predicted and measured time (`statistic`
    of its runs: the time the search uses)."""
    rows, rho = [], {}
    for segment, prof in zip(analysis.segments, profiles.segments, strict=True):
        blocks = [analysis.blocks[b] for b in segment.blocks]
        measured = prof.mode != ANALYTIC  # analytic profiles hold predictions only
        for c in prof.combinations:
            labels = tuple(b.strategies[k].label for b, k in zip(blocks, c.choice, strict=True))
            rows.append(CombinationRow(segment.index, labels, c.names, c.volume, c.predicted_s,
                                       c.time(statistic) if measured else None, c.status if measured else "not run"))
        ok = [c for c in prof.combinations if c.ok and measured]
        rho[segment.index] = rank_correlation([c.predicted_s for c in ok], [c.time(statistic) for c in ok])
    return Comparison(tuple(rows), rho, (), statistic)


def rank_correlation(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rho (ties ranked by order); None when either side is constant or too short."""
    if len(a) < 3:
        return None
    ra, rb = (np.argsort(np.argsort(np.asarray(x, dtype=float))).astype(float) for x in (a, b))
    if np.std(np.asarray(a)) == 0 or np.std(np.asarray(b)) == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def ilp_plan(analysis: Analysis, memory_budget: float | None, time_limit: float = 60.0) -> IntraPlan:
    """meshplan's ILP plan of the same graph, mesh and cost model."""
    options = IntraOptions(cost=analysis.options.cost, memory_budget=memory_budget, time_limit=time_limit)
    return solve_intra(analysis.graph, analysis.mesh, options)


def ilp_layouts(plan: IntraPlan) -> tuple[Strategy, ...]:
    return tuple(Strategy(c.strategy, c.output, c.operands, c.compute, c.communication, c.memory, c.collectives)
                 for c in plan.nodes)


def compare_plans(analysis: Analysis, plan: CfpPlan, ilp: IntraPlan, runs: int, warmup: int
                  ) -> tuple[PlanRow, PlanRow]:
    """Both plans priced by the cost model and measured with the same lowering, compiled
    first and timed round-robin (needs JAX)."""
    from meshplan.cfp.measure import measure_many  # the profiler's side: only here does comparing run JAX

    layouts = (analysis.node_strategies(plan.block_choice), ilp_layouts(ilp))
    measured = measure_many(analysis.graph, layouts, analysis.mesh, runs, warmup)
    flops = graph_flops(analysis.graph)
    rows = []
    for name, plan_layouts, profiled, objective, m in zip(("CFP", "ILP"), layouts, (plan.predicted_time, None),
                                                          (None, ilp.objective), measured, strict=True):
        model = price(analysis.graph, plan_layouts, analysis.mesh, analysis.options.cost)
        tflops = flops / m.mean_s / 1e12 if m.status == "ok" else None
        rows.append(PlanRow(name, model.time, profiled, objective, model.volume, m, tflops))
    return rows[0], rows[1]
