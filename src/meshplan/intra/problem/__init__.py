"""The intra-op problem as arrays: StrategyProblem, its readers (IOPDDL files, strategy graphs, the
generator of contest-shaped instances), exact presolve and the compact memory rows."""
