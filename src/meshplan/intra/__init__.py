"""Intra-operator pass: strategy graph, follower merging, ILP, solver backends, IntraPlan."""

from meshplan.intra.aliases import unshareable_pairs
from meshplan.intra.ilp import build_ilp
from meshplan.intra.method_layout import MethodLayout
from meshplan.intra.options import IntraOptions
from meshplan.intra.plan import ChosenStrategy, IntraPlan, Resharding
from meshplan.intra.problem.arrays import ProblemError, StrategyProblem, strategy_problem
from meshplan.intra.problem.iopddl import read_iopddl
from meshplan.intra.program import LinearProgram
from meshplan.intra.search.problem_solver import ProblemOptions, ProblemSolution, solve_problem
from meshplan.intra.solve import LayoutWarning, build_intra_problem, solve_intra
from meshplan.intra.solvers import SolveResult, SolveStatus, solve_program
from meshplan.intra.strategy_graph import Breakdown, StrategyGraph, build_strategy_graph

__all__ = [
    "Breakdown", "ChosenStrategy", "IntraOptions", "IntraPlan", "LayoutWarning", "LinearProgram", "MethodLayout",
    "ProblemError", "ProblemOptions", "ProblemSolution", "Resharding", "SolveResult", "SolveStatus", "StrategyGraph",
    "StrategyProblem", "build_ilp", "build_intra_problem", "build_strategy_graph", "read_iopddl", "solve_intra",
    "solve_problem", "solve_program", "strategy_problem", "unshareable_pairs",
]
