"""The exception tree. Every message says what is wrong, where, and how to fix it."""

from __future__ import annotations


class MeshplanError(Exception):
    """Base of every error meshplan raises on purpose (user errors, infeasible plans)."""


class GraphError(MeshplanError):
    """A graph is malformed: shapes do not match, operands are missing, ids are out of order."""


class MeshError(MeshplanError):
    """A logical mesh or cluster description is invalid."""


class InfeasiblePlanError(MeshplanError):
    """No plan satisfies the constraints (memory budget, forced shardings)."""

    def __init__(self, message: str, min_budget_bytes: float | None = None) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes


class SolverError(MeshplanError):
    """A solver backend is missing or failed without a usable answer."""


class ModelSpecError(MeshplanError):
    """A model name or model description is unknown or inconsistent."""


class OptionsError(MeshplanError):
    """An option value is out of range or options contradict each other."""


class PlanValidationError(MeshplanError):
    """A plan (or plan file) is inconsistent or of an unsupported schema version."""


class PlanMismatchError(MeshplanError):
    """A plan given to run a program was made for another program: other shapes, layers, devices or
    micro-batches (the message names the first difference)."""


class LaunchError(MeshplanError):
    """A multi-process launch cannot start: bad options, a missing script, an unreachable cluster,
    or a worker whose devices are not what the launcher gave it."""
