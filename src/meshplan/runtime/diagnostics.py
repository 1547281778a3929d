"""Compile diagnostics: a lowered function -> its compiled executable and what XLA logged.

XLA's SPMD partitioner reports, in its C++ log on stderr and nowhere else, every value it
could not reshard with collectives: "[SPMD] Involuntary full rematerialization ... As the last
resort, SPMD will replicate the tensor and then partition it". For a meshplan plan that means
the plan is incoherent: a layout it chose cannot be reached from the producer's layout, so
every device gathers the whole tensor and slices it again. `compile_lowered` counts these
messages by redirecting file descriptor 2 while XLA compiles.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

REMAT_MARKER = "Involuntary full rematerialization"
# absl's log line header, e.g. "W1122 02:22:55.416714   16187 spmd_partitioner.cc:656] ".
_HEADER = re.compile(r"([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]]+\] ")
_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}
_WARNING = _SEVERITY["W"]


class RematerializationWarning(UserWarning):
    """XLA fully rematerialized values while compiling a plan: the plan is incoherent."""


@dataclass(frozen=True, slots=True)
class CompileDiagnostics:
    """What XLA reported while compiling one executable.

    Attributes:
        rematerializations: XLA's "Involuntary full rematerialization" messages, one per
            value it had to gather whole and split again.
        compile_s: wall time of the compilation.
    """

    rematerializations: tuple[str, ...]
    compile_s: float

    @property
    def num_rematerializations(self) -> int:
        return len(self.rematerializations)

    def to_dict(self) -> dict[str, Any]:
        return {"involuntary_rematerializations": self.num_rematerializations,
                "rematerialization_messages": list(self.rematerializations), "compile_s": self.compile_s}


def compile_lowered(lowered: Any) -> tuple[Any, CompileDiagnostics]:
    """Compile `lowered` (a `jax.stages.Lowered`) and count XLA's full rematerializations.

    XLA logs them at WARNING level; for the compilation only, the C++ log threshold is lowered
    to WARNING (TF_CPP_MIN_LOG_LEVEL=2 would hide them) and fd 2 goes to a temporary file.
    Afterwards everything captured is written back to stderr except the rematerialization
    messages and the records only the lowered threshold let through. Other threads' stderr
    output during the compilation is delayed, not lost. A compilation served from JAX's
    persistent compilation cache logs nothing, so it reports zero.

    Returns:
        The `jax.stages.Compiled` executable and its CompileDiagnostics.
    """
    start = time.perf_counter()
    with _captured_stderr() as captured, _cpp_log_threshold(_WARNING):
        compiled = lowered.compile()
    elapsed = time.perf_counter() - start
    remats, passed_on = split_log(captured.text, _cpp_min_log_level())
    if passed_on:
        os.write(2, passed_on.encode())
    return compiled, CompileDiagnostics(remats, elapsed)


def split_log(text: str, min_level: int) -> tuple[tuple[str, ...], str]:
    """Split captured stderr into rematerialization messages and the rest to pass on.

    Log records below `min_level` (0 info ... 3 fatal) are dropped; text that is not an absl
    log record (Python warnings, prints) is always passed on.
    """
    remats: list[str] = []
    rest: list[str] = []
    for severity, record in _records(text):
        if REMAT_MARKER in record:
            remats.append(record.strip())
        elif severity is None or severity >= min_level:
            rest.append(record)
    return tuple(remats), "".join(rest)


def warn_if_rematerialized(diagnostics: CompileDiagnostics, where: str, stacklevel: int = 2) -> None:
    """Emit a RematerializationWarning when XLA fully rematerialized any value."""
    n = diagnostics.num_rematerializations
    if not n:
        return
    first = diagnostics.rematerializations[0]
    first = first[first.find("[SPMD]"):] if "[SPMD]" in first else first
    warnings.warn(
        f"{where}: XLA fully rematerialized {n} value(s) while compiling the plan: the plan is incoherent "
        f"(a planned layout cannot be reached from its producer's layout by collectives, so every device "
        f"gathers the whole tensor and splits it again, costing memory and time). First: {first[:400]} "
        f"Write dump_debug_info(folder) to see all messages and the plan; a different mesh_shape or "
        f"method may avoid it.", RematerializationWarning, stacklevel=stacklevel + 1)


@dataclass(slots=True)
class _Captured:
    text: str = ""


@contextmanager
def _captured_stderr() -> Iterator[_Captured]:
    """Send fd 2 (C++ logs and Python's sys.stderr) to a temporary file for the duration."""
    result = _Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield result
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            result.text = sink.read().decode(errors="replace")


@contextmanager
def _cpp_log_threshold(level: int) -> Iterator[None]:
    """Let C++ log records of `level` and above through (absl's threshold is process-wide)."""
    before = _cpp_min_log_level()
    setter = _absl_setter()
    if setter is None or before <= level:
        yield
        return
    setter(level)
    try:
        yield
    finally:
        setter(before)


def _cpp_min_log_level() -> int:
    """The C++ log threshold JAX set: from jax_logging_level, else TF_CPP_MIN_LOG_LEVEL."""
    import jax

    level = jax.config.jax_logging_level
    by_name = {"CRITICAL": 3, "FATAL": 3, "ERROR": 2, "WARN": 1, "WARNING": 1, "INFO": 0, "DEBUG": 0}
    if level in by_name:
        return by_name[level]
    try:
        return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1"))  # jax's import sets "1" by default
    except ValueError:
        return 1


def _absl_setter() -> Any:
    # Private JAX API (what jax_logging_level uses); without it the threshold stays as it is.
    try:
        from jax._src.lib import utils
    except ImportError:
        return None
    return getattr(utils, "absl_set_min_log_level", None)


def _records(text: str) -> Iterator[tuple[int | None, str]]:
    """(severity, line) per line; severity None for lines that are not absl record headers
    (continuations of multi-line records, Python output), which are always passed on."""
    for line in text.splitlines(keepends=True):
        match = _HEADER.match(line)
        yield (_SEVERITY[match.group(1)] if match else None), line
