"""Pipeline schedules as pure data: the steps the runtime dispatches and the latency the DP prices.

One registry entry per schedule gives both, so the two cannot drift apart:

- `steps(stage, num_stages, num_microbatches)`: the order in which one stage runs its forward (F)
  and backward (B) steps; `make_schedule` interleaves the stages into the dispatch order and
  `timeline` replays it with step durations (the simulated schedule of a plan);
- `latency(stage_latencies, num_microbatches, chunks)`: the closed form the stage DP minimises,
  B * max_s t_s + (sum_s t_s - max_s t_s) / chunks, or, interleaved with fewer micro-batches
  than stages, sum_s t_s + (B - 1) * max_s t_s / chunks when that is larger. Replaying the steps
  with `timeline` gives exactly this when the stages take equal time; with unequal stages whose
  backward is a fixed multiple of their forward, exactly this for GPipe and at most this for
  1F1B and interleaved 1F1B (which can hide part of a slow stage's wait), so the DP's price is
  exact or conservative (tests/test_schedules.py). Interleaved 1F1B is replayed in Megatron-LM's
  order, which the runtime does not run, for B <= stages or B a multiple of the stages
  (Megatron-LM's condition for the schedule; the DP still prices other B by the closed form);
- `inflight(stages_left, num_microbatches)`: micro-batches whose activations a stage holds at
  its peak (the memory rule of the inter-op pass).

No JAX here: the runtime executes these steps, the planners price them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from meshplan.errors import OptionsError


class Phase(enum.Enum):
    """A pipeline step: the forward or the backward of one stage on one micro-batch."""

    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True, slots=True)
class Event:
    """One step: `phase` of `stage` on micro-batch `micro_batch`; under interleaved 1F1B, of the
    stage's model chunk `chunk` (virtual stage chunk * num_stages + stage)."""

    stage: int
    micro_batch: int
    phase: Phase
    chunk: int = 0

    @property
    def label(self) -> str:
        """E.g. "F0.1": phase, stage, micro-batch (and "c1" for the stage's second model chunk)."""
        return f"{self.phase.value}{self.stage}.{self.micro_batch}" + (f"c{self.chunk}" if self.chunk else "")


@dataclass(frozen=True, slots=True)
class TimedEvent:
    """A step placed on the simulated timeline (seconds from the start of the iteration)."""

    event: Event
    start: float
    end: float


StepOrder = Callable[[int, int, int], Iterator[Event]]


def _gpipe_steps(stage: int, num_stages: int, num_microbatches: int) -> Iterator[Event]:
    del num_stages
    yield from (Event(stage, m, Phase.FORWARD) for m in range(num_microbatches))
    yield from (Event(stage, m, Phase.BACKWARD) for m in range(num_microbatches))


def _one_f_one_b_steps(stage: int, num_stages: int, num_microbatches: int) -> Iterator[Event]:
    warmup = min(num_stages - stage - 1, num_microbatches)
    yield from (Event(stage, m, Phase.FORWARD) for m in range(warmup))
    for i in range(num_microbatches - warmup):
        yield Event(stage, warmup + i, Phase.FORWARD)
        yield Event(stage, i, Phase.BACKWARD)
    yield from (Event(stage, m, Phase.BACKWARD) for m in range(num_microbatches - warmup, num_microbatches))


def _interleaved_steps(stage: int, num_stages: int, num_microbatches: int, chunks: int) -> Iterator[Event]:
    """Megatron-LM's interleaved 1F1B on one stage: forwards in groups of min(stages, B)
    micro-batches, chunk by chunk (backwards with the chunks reversed); 2 (stages - stage - 1) +
    (chunks - 1) * group warm-up forwards, then one forward / one backward. Defined, as in
    Megatron-LM, for B up to the stage count or a multiple of it (other B can deadlock)."""
    if num_microbatches > num_stages and num_microbatches % num_stages:
        raise OptionsError(f"interleaved 1F1B runs B <= stages or B a multiple of the stages (as Megatron-LM); "
                           f"got B = {num_microbatches} on {num_stages} stages: use B = {num_stages} * "
                           f"{num_microbatches // num_stages} or {num_stages} * {num_microbatches // num_stages + 1}")
    group = min(num_stages, num_microbatches)
    forwards, backwards = [], []
    for start in range(0, num_microbatches, group):
        batch = range(start, min(start + group, num_microbatches))
        forwards += [Event(stage, m, Phase.FORWARD, c) for c in range(chunks) for m in batch]
        backwards += [Event(stage, m, Phase.BACKWARD, c) for c in reversed(range(chunks)) for m in batch]
    warmup = min(2 * (num_stages - stage - 1) + (chunks - 1) * group, len(forwards))
    yield from forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards, strict=False):
        yield forward
        yield backward
    yield from backwards[len(forwards) - warmup:]


def _fill_and_drain(stage_latencies: Sequence[float], num_microbatches: int, chunks: int = 1) -> float:
    """B steps of the slowest stage plus the fill and drain of the others. With the interleaved
    schedule (each device holds `chunks` model chunks, Narayanan et al. 2021) the fill and drain
    shrink by that factor, as long as there are micro-batches enough to keep the stages busy
    while the first one comes round again; with fewer micro-batches than stages each one still
    passes every stage `chunks` times in turn: the first takes sum_s t_s, the others follow
    1 / chunks of the slowest stage apart (for one chunk both terms are equal)."""
    slowest, total = max(stage_latencies), sum(stage_latencies)
    return max(num_microbatches * slowest + (total - slowest) / chunks,
               total + (num_microbatches - 1) * slowest / chunks)


@dataclass(frozen=True, slots=True)
class Schedule:
    """A pipeline schedule.

    Attributes:
        name: the registry key.
        steps: per-stage step order; None when the runtime cannot execute the schedule (the
            planners can still price it).
        replay_steps: the per-stage order (stage, stages, B, chunks) that `timeline` replays
            where the runtime runs none.
        holds_all: every stage holds all micro-batches' activations at its peak (GPipe) rather
            than one per stage after it (1F1B).
        chunked: the latency takes model chunks per device (interleaved 1F1B).
    """

    name: str
    steps: StepOrder | None
    holds_all: bool = False
    chunked: bool = False
    replay_steps: Callable[[int, int, int, int], Iterator[Event]] | None = None

    def latency(self, stage_latencies: Sequence[float], num_microbatches: int, chunks: int = 1) -> float:
        """Pipeline latency of one iteration from each stage's forward + backward per micro-batch."""
        return _fill_and_drain(stage_latencies, num_microbatches, chunks if self.chunked else 1)

    def inflight(self, stages_left: int, num_microbatches: int) -> int:
        """Micro-batches of activations held by the stage that is `stages_left`-th from the end."""
        return num_microbatches if self.holds_all else min(stages_left, num_microbatches)


SCHEDULES: dict[str, Schedule] = {
    "1f1b": Schedule("1f1b", _one_f_one_b_steps),
    "gpipe": Schedule("gpipe", _gpipe_steps, holds_all=True),
    "interleaved-1f1b": Schedule("interleaved-1f1b", None, chunked=True, replay_steps=_interleaved_steps),
}
RUNNABLE_SCHEDULES = tuple(sorted(name for name, s in SCHEDULES.items() if s.steps is not None))


def get_schedule(name: str, runnable: bool = False) -> Schedule:
    """The registered schedule `name`.

    Raises:
        OptionsError: no such schedule, or (with `runnable`) the runtime cannot execute it.
    """
    choices = RUNNABLE_SCHEDULES if runnable else tuple(sorted(SCHEDULES))
    if name not in choices:
        raise OptionsError(f"unknown pipeline schedule {name!r}; use one of {list(choices)}")
    return SCHEDULES[name]


def pipeline_latency(latencies: Sequence[float], num_microbatches: int, chunks: int = 1) -> float:
    """1F1B/GPipe latency of one iteration (`Schedule.latency`); `chunks` > 1: interleaved 1F1B."""
    return _fill_and_drain(latencies, num_microbatches, chunks)


def megatron_inflight(num_stages: int, stage: int, chunks: int = 1) -> float:
    """Micro-batches of activations stage `stage` holds at its peak as Megatron-LM schedules
    them: 1F1B warms up with num_stages - stage; interleaved 1F1B with
    ((num_stages - stage - 1) * 2 + (chunks - 1) * num_stages + 1) chunks of 1/chunks of the
    stage's layers, i.e. num_stages + (num_stages - 1) / chunks on the first stage."""
    if chunks == 1:
        return float(num_stages - stage)
    return ((num_stages - stage - 1) * 2 + (chunks - 1) * num_stages + 1) / chunks


def _dependencies(event: Event, num_stages: int, chunks: int = 1) -> tuple[Event, ...]:
    """The steps whose outputs `event` reads: the previous virtual stage's forward, or its own
    forward and the next virtual stage's backward."""
    virtual, m = event.chunk * num_stages + event.stage, event.micro_batch
    at = lambda v, phase: Event(v % num_stages, m, phase, v // num_stages)  # noqa: E731
    if event.phase is Phase.FORWARD:
        return (at(virtual - 1, Phase.FORWARD),) if virtual else ()
    deps = (at(virtual, Phase.FORWARD),)
    if virtual < num_stages * chunks - 1:
        deps += (at(virtual + 1, Phase.BACKWARD),)
    return deps


def _queues(schedule: str, num_stages: int, num_microbatches: int, chunks: int = 1,
            runnable: bool = True) -> list[list[Event]]:
    found = get_schedule(schedule, runnable)
    if found.steps is not None and chunks == 1:
        return [list(found.steps(s, num_stages, num_microbatches)) for s in range(num_stages)]
    if found.replay_steps is None:
        raise OptionsError(f"the {schedule!r} schedule has one model chunk per stage, not {chunks}; "
                           "use chunks=1 or the 'interleaved-1f1b' schedule")
    return [list(found.replay_steps(s, num_stages, num_microbatches, chunks)) for s in range(num_stages)]


def make_schedule(schedule: str, num_stages: int, num_microbatches: int) -> tuple[Event, ...]:
    """The order the runtime dispatches steps in, by clock ticks.

    At each tick every stage whose next step (in its own order) has its inputs from earlier
    ticks runs that step; steps of one tick are listed by stage.

    Args:
        schedule: a runnable name in `SCHEDULES` ("gpipe": all forwards then all backwards per
            stage; "1f1b": `num_stages - stage - 1` warm-up forwards, then one forward / one backward).
        num_stages: how many stages.
        num_microbatches: how many micro-batches.
    """
    return _dispatch(schedule, _queues(schedule, num_stages, num_microbatches), num_stages, 1)


def _dispatch(schedule: str, queues: list[list[Event]], num_stages: int, chunks: int) -> tuple[Event, ...]:
    done: set[Event] = set()
    order: list[Event] = []
    while any(queues):
        tick = [q[0] for q in queues if q and set(_dependencies(q[0], num_stages, chunks)) <= done]
        if not tick:
            raise OptionsError(f"schedule {schedule!r} deadlocks with steps {[q[0] for q in queues if q]} waiting")
        for event in tick:
            queues[event.stage].pop(0)
        done.update(tick)
        order.extend(tick)
    return tuple(order)


def replayed_latency(schedule: str, forward_s: Sequence[float], backward_s: Sequence[float],
                     num_microbatches: int, chunks: int = 1) -> float:
    """The iteration's pipeline time by replaying `timeline`: exact for the given per-stage forward
    and backward times, where the closed form (`Schedule.latency`) assumes the slowest stage
    paces fill and drain alike and so can exceed it when stages differ."""
    return max(t.end for t in timeline(schedule, forward_s, backward_s, num_microbatches, chunks))


def timeline(schedule: str, forward_s: Sequence[float], backward_s: Sequence[float],
             num_microbatches: int, chunks: int = 1) -> tuple[TimedEvent, ...]:
    """Every step of one iteration with its start and end: a stage runs its steps in its own
    order, each as soon as the stage is free and the step's inputs exist (sends take no time
    of their own: they are part of the stage's durations, as the DP prices them).

    Args:
        schedule: a runnable schedule name, or one the planners price and `timeline` replays
            ("interleaved-1f1b").
        forward_s, backward_s: per stage, seconds of one micro-batch's forward / backward (of
            all its chunks: each chunk's step takes 1 / chunks of it).
        num_microbatches: B.
        chunks: model chunks per stage (> 1 only for "interleaved-1f1b").
    """
    num_stages = len(forward_s)
    if len(backward_s) != num_stages:
        raise OptionsError(f"timeline got {num_stages} forward and {len(backward_s)} backward durations; "
                           "give one of each per stage")
    end: dict[Event, float] = {}
    placed: list[TimedEvent] = []
    free = [0.0] * num_stages
    queues = _queues(schedule, num_stages, num_microbatches, chunks, runnable=False)
    for event in _dispatch(schedule, queues, num_stages, chunks):
        duration = (forward_s if event.phase is Phase.FORWARD else backward_s)[event.stage] / chunks
        start = max([free[event.stage], *(end[d] for d in _dependencies(event, num_stages, chunks))])
        end[event] = free[event.stage] = start + duration
        placed.append(TimedEvent(event, start, start + duration))
    return tuple(sorted(placed, key=lambda t: (t.start, t.event.stage)))
