"""The inter-op pass: layer costs -> latency table -> stage DP -> node-aware placement.

Pricers (the simulator's for model specs, the runtime's for captured programs) build
`LayerCosts`; `plan_pipeline` returns the stages. Schedules are pure data (`SCHEDULES`). This
package imports neither models nor the runtime.
"""

from meshplan.inter.costs import LayerCost, LayerCosts, TrainingParts, ViewCosts, layer_cost
from meshplan.inter.layers import cluster_layers, layer_flops
from meshplan.inter.schedules import SCHEDULES, Event, Phase, Schedule, get_schedule, make_schedule, timeline
from meshplan.inter.search import InterOptions, InterPlan, plan_pipeline
from meshplan.inter.stages import StageEstimate

__all__ = [
    "SCHEDULES",
    "Event",
    "InterOptions",
    "InterPlan",
    "LayerCost",
    "LayerCosts",
    "Phase",
    "Schedule",
    "StageEstimate",
    "TrainingParts",
    "ViewCosts",
    "cluster_layers",
    "get_schedule",
    "layer_cost",
    "layer_flops",
    "make_schedule",
    "plan_pipeline",
    "timeline",
]
