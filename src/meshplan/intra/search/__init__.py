"""Searches over a presolved StrategyProblem: solve_problem and the portfolio, memory prices and
their dual, vectorized local moves, the MIP (whole, with lazy rows, or in windows)."""
