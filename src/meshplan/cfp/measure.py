"""Time a laid-out graph on the devices JAX sees (Graph + node strategies -> Measurement).

Compile, read XLA's memory analysis (bytes per device), then run `warmup` untimed and `runs`
timed calls on the same arguments, each waited for. Running out of memory is a result
(status "oom"), not a failure: either XLA's analysis exceeds the device memory given (or the
device's own limit), or the run raises RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import jax

from meshplan.cfp.lower import lower
from meshplan.cfp.measurement import ERROR, OK, OOM, Measurement
from meshplan.cluster.mesh import LogicalMesh
from meshplan.ir.graph import Graph
from meshplan.runtime.sharded import make_jax_mesh
from meshplan.sharding.strategy import Strategy


def measure(graph: Graph, layouts: Sequence[Strategy], logical: LogicalMesh, runs: int = 5, warmup: int = 2,
            memory_limit: float | None = None) -> Measurement:
    """Compile and time `graph` laid out as `layouts` on the devices of `logical`."""
    return measure_many(graph, [layouts], logical, runs, warmup, memory_limit)[0]


def measure_many(graph: Graph, variants: Sequence[Sequence[Strategy]], logical: LogicalMesh, runs: int = 5,
                 warmup: int = 2, memory_limit: float | None = None,
                 compiled: Callable[[int], None] | None = None) -> list[Measurement]:
    """Time several layouts of one graph. All are compiled first, then timed round-robin (run r
    of every variant before run r + 1 of any), so that load from other processes on a shared
    machine falls on all of them alike instead of on whichever ran during a burst. `compiled` is
    called with the number of variants compiled so far (compiling takes most of the time)."""
    mesh = make_jax_mesh(logical)  # too few devices is the caller's error, not a measurement
    limit = memory_limit if memory_limit is not None else device_memory()
    ready, results = {}, {}
    for i, layouts in enumerate(variants):
        outcome = _compile(graph, layouts, logical, mesh, limit)
        if isinstance(outcome, Measurement):
            results[i] = outcome
        else:
            ready[i] = outcome
        if compiled:
            compiled(i + 1)
    times = _time_round_robin(graph, ready, runs, warmup, results)
    for i, (_, _, peak, compile_s) in ready.items():
        if i not in results:
            t = times[i]
            results[i] = Measurement(OK, statistics.fmean(t), statistics.pstdev(t), statistics.median(t), min(t),
                                     len(t), peak, compile_s)
    return [results[i] for i in range(len(variants))]


def _compile(graph: Graph, layouts: Sequence[Strategy], logical: LogicalMesh, mesh, limit: float | None):
    """(program, executable, peak bytes, compile seconds), or a Measurement saying why not."""
    start = time.perf_counter()
    try:
        program = lower(graph, layouts, logical, mesh)
        compiled = program.jitted.lower(*program.abstract_args(graph)).compile()
    except Exception as exc:  # XLA's refusals come as several exception types; keep the message
        return _failure(exc, time.perf_counter() - start)
    compile_s = time.perf_counter() - start
    peak = peak_memory(compiled)
    if limit is not None and peak > limit:
        return Measurement(OOM, peak_memory=peak, compile_s=compile_s,
                           message=f"needs {peak / 1e6:.1f} MB per device, {limit / 1e6:.1f} MB available")
    return program, compiled, peak, compile_s


def _time_round_robin(graph: Graph, ready: dict, runs: int, warmup: int, failed: dict) -> dict[int, list[float]]:
    """Per variant, its timed runs; a variant whose run raises is moved to `failed`."""
    args = {i: program.example_args(graph) for i, (program, _, _, _) in ready.items()}
    times: dict[int, list[float]] = {i: [] for i in ready}
    for round_ in range(warmup + runs):
        for i, (_, compiled, peak, compile_s) in ready.items():
            if i in failed:
                continue
            try:
                start = time.perf_counter()
                jax.block_until_ready(compiled(*args[i]))
                elapsed = time.perf_counter() - start
            except Exception as exc:
                failed[i] = _failure(exc, compile_s, peak)
                continue
            if round_ >= warmup:
                times[i].append(elapsed)
    return times


def peak_memory(compiled) -> float:
    """Bytes per device XLA plans for the program (its peak, else arguments + results + temps)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return 0.0
    peak = getattr(stats, "peak_memory_in_bytes", 0) or 0
    return float(peak or stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
                 - stats.alias_size_in_bytes)


def device_memory() -> float | None:
    """The first device's memory limit when the backend reports one (GPUs; not CPUs)."""
    stats = jax.devices()[0].memory_stats() if hasattr(jax.devices()[0], "memory_stats") else None
    return float(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def device_kind() -> str:
    """What the profiles were measured on, e.g. "cpu x8" or "NVIDIA A100-SXM4-80GB x8"."""
    devices = jax.devices()
    return f"{devices[0].device_kind} x{len(devices)}"


def _failure(exc: Exception, compile_s: float, peak: float | None = None) -> Measurement:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    status = OOM if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() else ERROR
    return Measurement(status, peak_memory=peak, compile_s=compile_s, message=text)
