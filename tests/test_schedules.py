"""Schedules as pure data: the steps the runtime runs and the latency and memory the DP prices agree."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.errors import OptionsError
from meshplan.inter.schedules import (
    RUNNABLE_SCHEDULES,
    Phase,
    get_schedule,
    make_schedule,
    replayed_latency,
    timeline,
)


@pytest.mark.parametrize("name", RUNNABLE_SCHEDULES)
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 4), (4, 4), (4, 8), (3, 2), (5, 9)])
def test_timeline_makespan_equals_the_latency_the_dp_minimises(name, stages, microbatches):
    """Stages taking equal time: replaying the runtime's steps gives exactly the closed form."""
    forward, backward = [1.0] * stages, [2.0] * stages
    events = timeline(name, forward, backward, microbatches)
    makespan = max(e.end for e in events)
    assert makespan == pytest.approx(get_schedule(name).latency([3.0] * stages, microbatches))
    assert len(events) == 2 * stages * microbatches


@settings(max_examples=200, deadline=None)
@given(forward=st.lists(st.floats(0.1, 2.0), min_size=1, max_size=5), ratio=st.floats(1.0, 3.0),
       microbatches=st.integers(1, 8))
def test_closed_form_on_unequal_stages(forward, ratio, microbatches):
    """Backward a fixed multiple of forward, stages unequal: GPipe's replay equals the closed form;
    1F1B's never exceeds it (the DP's price is conservative: 1F1B can hide a slow stage's wait)."""
    backward = [f * ratio for f in forward]
    latencies = [f + b for f, b in zip(forward, backward, strict=True)]
    for name, equal in (("gpipe", True), ("1f1b", False)):
        makespan = replayed_latency(name, forward, backward, microbatches)
        closed = get_schedule(name).latency(latencies, microbatches)
        assert makespan == pytest.approx(closed) if equal else makespan <= closed * (1 + 1e-12)


@pytest.mark.parametrize("name", RUNNABLE_SCHEDULES)
@pytest.mark.parametrize(("stages", "microbatches"), [(4, 8), (4, 2), (3, 3)])
def test_inflight_rule_is_the_peak_of_the_executed_steps(name, stages, microbatches):
    """The memory rule's micro-batches in flight per stage equal the most forwards a stage has run
    without their backward, replaying the runtime's order."""
    schedule = get_schedule(name)
    for stage in range(stages):
        held = peak = 0
        for event in make_schedule(name, stages, microbatches):
            if event.stage == stage:
                held += 1 if event.phase is Phase.FORWARD else -1
                peak = max(peak, held)
        assert peak == schedule.inflight(stages - stage, microbatches)


def test_interleaved_is_priced_and_replayed_but_not_run():
    schedule = get_schedule("interleaved-1f1b")
    assert schedule.latency([1.0, 1.0], 4, chunks=2) == pytest.approx(4 + 0.5)
    assert replayed_latency("interleaved-1f1b", [1 / 3] * 2, [2 / 3] * 2, 4, chunks=2) == pytest.approx(4 + 0.5)
    with pytest.raises(OptionsError, match="unknown pipeline schedule 'interleaved-1f1b'; use one of"):
        make_schedule("interleaved-1f1b", 2, 4)
    with pytest.raises(OptionsError, match="the '1f1b' schedule has one model chunk per stage, not 2"):
        timeline("1f1b", [1.0] * 2, [2.0] * 2, 4, chunks=2)
    with pytest.raises(OptionsError, match="interleaved 1F1B runs B <= stages or B a multiple of the stages"):
        timeline("interleaved-1f1b", [1.0] * 4, [2.0] * 4, 6, chunks=2)


# (stages, micro-batches, chunks): fewer micro-batches than stages (the closed form B t + (p - 1) t / v
# alone would price these (p - B)(1 - 1 / v) t = 0.75-3 t too low), as many, and multiples (Megatron-LM's condition).
INTERLEAVED = [(4, 1, 2), (4, 2, 2), (4, 3, 4), (8, 2, 2), (8, 5, 3), (6, 4, 2),
               (2, 2, 2), (4, 4, 3), (3, 6, 2), (4, 8, 4)]


@pytest.mark.parametrize(("stages", "microbatches", "chunks"), INTERLEAVED)
def test_interleaved_replay_equals_the_closed_form(stages, microbatches, chunks):
    """Equal stages: replaying Megatron-LM's interleaved order takes exactly the price: the first
    micro-batch passes every stage `chunks` times (p t), the others follow t / v apart, or the
    fill and drain of B t + (p - 1) t / v, whichever is longer."""
    t = 3.0
    makespan = replayed_latency("interleaved-1f1b", [1.0] * stages, [2.0] * stages, microbatches, chunks)
    price = get_schedule("interleaved-1f1b").latency([t] * stages, microbatches, chunks)
    fill_and_drain = microbatches * t + (stages - 1) * t / chunks
    assert makespan == pytest.approx(price)
    assert price == pytest.approx(max(fill_and_drain, stages * t + (microbatches - 1) * t / chunks))
    assert (price > fill_and_drain * (1 + 1e-9)) == (microbatches < stages)
    events = timeline("interleaved-1f1b", [1.0] * stages, [2.0] * stages, microbatches, chunks)
    assert len(events) == 2 * stages * microbatches * chunks


@settings(max_examples=150, deadline=None)
@given(forward=st.lists(st.floats(0.1, 2.0), min_size=1, max_size=6), ratio=st.floats(1.0, 3.0),
       microbatches=st.integers(1, 6), chunks=st.integers(2, 4))
def test_interleaved_closed_form_is_conservative_on_unequal_stages(forward, ratio, microbatches, chunks):
    """Unequal stages, B <= p or a multiple of p: the replay never exceeds the price."""
    if microbatches > len(forward) and microbatches % len(forward):
        microbatches = len(forward)
    backward = [f * ratio for f in forward]
    makespan = replayed_latency("interleaved-1f1b", forward, backward, microbatches, chunks)
    price = get_schedule("interleaved-1f1b").latency([f + b for f, b in zip(forward, backward, strict=True)],
                                                     microbatches, chunks)
    assert makespan <= price * (1 + 1e-12)
