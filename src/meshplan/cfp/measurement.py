"""Measurement: what timing one program on the devices gave (pure data; `measure.py` makes them)."""

from __future__ import annotations

from dataclasses import dataclass

OK, OOM, ERROR = "ok", "oom", "error"


@dataclass(frozen=True, slots=True)
class Measurement:
    """One program's measured time and memory.

    Attributes:
        status: "ok", "oom" (did not fit) or "error" (XLA refused it; `message` says why).
        mean_s, std_s, median_s, min_s: over the timed runs (None unless ok).
        runs: timed runs made.
        peak_memory: bytes per device by XLA's memory analysis (None when not compiled).
        compile_s: seconds spent lowering and compiling.
        message: the error or out-of-memory detail.
    """

    status: str
    mean_s: float | None = None
    std_s: float | None = None
    median_s: float | None = None
    min_s: float | None = None
    runs: int = 0
    peak_memory: float | None = None
    compile_s: float = 0.0
    message: str = ""

    def statistic(self, name: str) -> float | None:
        """The time called `name`: "mean", "median" or "min"."""
        return {"mean": self.mean_s, "median": self.median_s, "min": self.min_s}[name]
