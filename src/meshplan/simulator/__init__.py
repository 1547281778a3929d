"""The simulator: prices model specs for the inter-op pass and predicts time, memory, MFU.

`simulate(TrainingJob, Cluster)` plans a transformer's training on a cluster and returns the
auto plan with the data-parallel, ZeRO-2 and Megatron-style baselines under the same cost
model.
"""

from meshplan.simulator.baselines import evaluate_configuration
from meshplan.simulator.job import PlannerOptions, TrainingJob
from meshplan.simulator.simulate import BaselineResult, Simulation, simulate, to_plan

__all__ = ["BaselineResult", "PlannerOptions", "Simulation", "TrainingJob", "evaluate_configuration", "simulate",
           "to_plan"]
