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


def test_interleaved_is_priced_but_not_run():
    schedule = get_schedule("interleaved-1f1b")
    assert schedule.latency([1.0, 1.0], 4, chunks=2) == pytest.approx(4 + 0.5)
    with pytest.raises(OptionsError, match="unknown pipeline schedule 'interleaved-1f1b'; use one of"):
        make_schedule("interleaved-1f1b", 2, 4)
