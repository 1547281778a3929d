"""Intra-operator pass: strategy graph, follower merging, ILP, solver backends, IntraPlan."""

from meshplan.intra.aliases import unshareable_pairs
from meshplan.intra.ilp import build_ilp
from meshplan.intra.options import IntraOptions
from meshplan.intra.plan import ChosenStrategy, IntraPlan, Resharding
from meshplan.intra.program import LinearProgram
from meshplan.intra.solve import build_intra_problem, solve_intra
from meshplan.intra.solvers import SolveResult, SolveStatus, solve_program
from meshplan.intra.strategy_graph import Breakdown, StrategyGraph, build_strategy_graph

__all__ = [
    "Breakdown", "ChosenStrategy", "IntraOptions", "IntraPlan", "LinearProgram", "Resharding", "SolveResult",
    "SolveStatus", "StrategyGraph", "build_ilp", "build_intra_problem", "build_strategy_graph", "solve_intra",
    "solve_program", "unshareable_pairs",
]
