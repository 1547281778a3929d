"""What went wrong in a launched job, read off the ranks' states: a rank that failed, or one that hangs.

A failure is a rank whose process ended with a non-zero status or a signal, or whose worker was lost
(e.g. its Ray node). A hang is decided by one rule over the ranks' progress reports
(`meshplan.launch.progress`), because from outside a rank that waits for its peers inside a collective
looks exactly like a rank that sleeps:

    a rank hangs when it has started fewer parallelized calls than another rank and has reported
    nothing for `timeout` seconds, while no rank is building a call (capturing, planning, compiling).

Every rank calls its parallelized functions in the same order (their collectives span all processes),
so the rank left behind is the one the others wait for; a rank still building is progress (the rank
behind may catch up meanwhile). Ranks that all stopped at the same call are not blamed (a long step, or
a hang no rank's progress can attribute).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.launch.progress import Progress


@dataclass(frozen=True, slots=True)
class RankState:
    """What the launcher knows of one rank at one moment.

    Attributes:
        rank: the process id.
        exit_status: None while it runs; its exit status, or -N when signal N ended it.
        progress: its last progress report (None: it has not called `meshplan.launch.initialize()`).
        quiet_s: seconds since it last reported (since it started, when it has not).
        lost: why its worker was lost when the process's own status cannot be known ("" otherwise).
    """

    rank: int
    exit_status: int | None
    progress: Progress | None
    quiet_s: float
    lost: str = ""

    @property
    def calls(self) -> int:
        """Parallelized calls started; 0 once joined; -1 before `initialize`."""
        return -1 if self.progress is None else self.progress.calls

    @property
    def failed(self) -> bool:
        return bool(self.lost) or self.exit_status not in (None, 0)


def describe_exit(status: int) -> str:
    """ "exit status 3", or "killed by signal 9 (SIGKILL)" for a negative status."""
    if status >= 0:
        return f"exit status {status}"
    try:
        name = f" ({signal.Signals(-status).name})"
    except ValueError:
        name = ""
    return f"killed by signal {-status}{name}"


def failure_message(states: Sequence[RankState]) -> str | None:
    """One line naming every failed rank (the first rank first), or None when none failed."""
    failed = [s for s in states if s.failed]
    if not failed:
        return None
    parts = [f"rank {s.rank} {'was lost: ' + s.lost if s.lost else 'failed (' + describe_exit(s.exit_status) + ')'}"
             for s in failed]
    return "; ".join(parts)


def hang_message(states: Sequence[RankState], timeout: float) -> str | None:
    """One line naming the ranks that hang by the module's rule, or None (no hang, or `timeout` <= 0)."""
    if timeout <= 0 or not states or any(s.progress and s.progress.building for s in states):
        return None
    furthest = max(s.calls for s in states)
    behind = [s for s in states if s.calls < furthest and s.quiet_s >= timeout]
    if not behind:
        return None
    leaders = [str(s.rank) for s in states if s.calls == furthest]
    where = "joined the job" if furthest == 0 else f"started parallelized call {furthest}"
    return (f"{'; '.join(map(_behind, behind))}, while rank{'s' * (len(leaders) > 1)} {', '.join(leaders)} "
            f"{where} (--hang-timeout {timeout:g} s)")


def _behind(state: RankState) -> str:
    """How a rank left behind stopped, e.g. "rank 1 hangs: it joined the job 31 s ago and started no
    parallelized call since"."""
    if state.exit_status is not None:
        after = ("before calling meshplan.launch.initialize()", "without starting a parallelized call",
                 f"after starting parallelized call {state.calls}")[min(state.calls + 1, 2)]
        return f"rank {state.rank} exited ({describe_exit(state.exit_status)}) {after}"
    ago = f"{state.quiet_s:.0f} s"
    if state.calls < 0:
        return f"rank {state.rank} hangs: it has not called meshplan.launch.initialize() in the {ago} since it started"
    if state.calls == 0:
        return f"rank {state.rank} hangs: it joined the job {ago} ago and started no parallelized call since"
    return f"rank {state.rank} hangs: it started parallelized call {state.calls} {ago} ago and no other since"
