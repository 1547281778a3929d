"""Two searches on two cores that share their plans: a portfolio of processes.

(reduced problem, memory rows, a feasible start, deadline) -> best plan, proven bound.

- This process prices memory (`lagrange.MemoryPricing`): fast feasible plans and a bound.
- A child process runs the exact side: the whole MIP with lazily added memory rows
  (`lazy_rows`) when the problem is small enough, else large-neighbourhood search (`lns`),
  whose windows are exact sub-MIPs.

Each side sends the other every better plan it finds (a plan is the reduced problem's choice
per node; the receiver re-prices it) and adopts the plans it receives: the MIP starts from the
priced plans, the prices restart from the MIP's. The child also sends its proven bounds. The
child is forked (it shares the parent's arrays) and dies with the parent; at the deadline the
parent stops it, and since plans were sent as they were found, stopping loses none.

Synchronisation. By default the sides exchange as soon as they can (`lockstep=False`): the
best use of a time limit, but what arrives when depends on the machine's load. With
`lockstep=True` they exchange only at numbered epochs (every few pricing rounds; every few
of HiGHS's interrupt callbacks or LNS windows) and each side waits for the other's message
of the same epoch, so a run with a seed repeats exactly, up to where the clock stops it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

PRICING_EPOCH = 4  # pricing rounds per lockstep epoch
CHILD_EPOCH = 20  # checkpoints of the child (HiGHS interrupt callbacks, LNS windows) per epoch
POLL_SECONDS = 0.1  # without lockstep, how often the child looks for plans
STOP_GRACE = 1.0  # seconds a child that said it finished gets to exit, before it is killed


@dataclass(frozen=True, slots=True)
class Message:
    """What one side tells the other: its best plan so far (or None), its best bound, whether
    it has finished (and proved its plan optimal)."""

    epoch: int
    plan: np.ndarray | None
    bound: float = -np.inf
    done: bool = False
    optimal: bool = False  # with no plan: proved that no plan exists
    error: str = ""


class Channel:
    """One end of the pipe between the two sides, with the epoch discipline of lockstep mode."""

    def __init__(self, conn, lockstep: bool, epoch_length: int, deadline: float, poll_seconds: float = 0.0) -> None:
        self.conn, self.lockstep, self.epoch_length, self.poll_seconds = conn, lockstep, epoch_length, poll_seconds
        self.deadline = deadline  # no waiting for the peer past it
        self.epoch = self.peer_epoch = 0
        self.checkpoints = 0
        self.peer_done = False
        self.peer_bound = -np.inf
        self.peer_optimal = False
        self.peer_error = ""
        self.last_poll = 0.0
        self.outbox: np.ndarray | None = None

    def publish(self, plan: np.ndarray) -> None:
        """A better plan of this side: sent now, or at the next epoch in lockstep mode."""
        if self.lockstep:
            self.outbox = plan.copy()
        else:
            self._send(Message(self.epoch, plan.copy()))

    def checkpoint(self, bound: float = -np.inf) -> list[np.ndarray]:
        """Called at every point where this side can take plans; returns the plans received."""
        self.checkpoints += 1
        if self.lockstep:
            if self.checkpoints % self.epoch_length:
                return []
            self.epoch += 1
            self._send(Message(self.epoch, self.outbox, bound))
            self.outbox = None
            return self._receive(wait_for=self.epoch)
        now = time.perf_counter()
        if now - self.last_poll < self.poll_seconds:
            return []
        self.last_poll = now
        if np.isfinite(bound):
            self._send(Message(self.epoch, None, bound))
        return self._receive(wait_for=None)

    def finish(self, plan: np.ndarray | None, bound: float, optimal: bool, error: str = "") -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(Message(self.epoch + 1, plan, bound, True, optimal, error))

    def drain(self, timeout: float) -> list[np.ndarray]:
        """Plans still in the pipe, waiting up to `timeout` for the peer to finish."""
        plans = []
        end = time.perf_counter() + timeout
        while not self.peer_done and self._poll(max(0.0, end - time.perf_counter())):
            plans += self._take()
        return plans

    def _send(self, message: Message) -> None:
        if self.peer_done:
            return
        with contextlib.suppress(OSError, ValueError):  # the peer has gone: nothing to tell it
            self.conn.send(message)

    def _poll(self, timeout: float) -> bool:
        try:
            return self.conn.poll(timeout)
        except (OSError, ValueError, EOFError):
            self.peer_done = True
            return False

    def _take(self) -> list[np.ndarray]:
        try:
            message = self.conn.recv()
        except (OSError, EOFError, ValueError, pickle.UnpicklingError):  # a peer killed mid-message
            self.peer_done = True
            return []
        self.peer_bound = max(self.peer_bound, message.bound)
        if message.done:
            self.peer_done, self.peer_optimal, self.peer_error = True, message.optimal, message.error
        self.peer_epoch = message.epoch
        return [] if message.plan is None else [message.plan]

    def _receive(self, wait_for: int | None) -> list[np.ndarray]:
        plans: list[np.ndarray] = []
        if wait_for is None:
            while not self.peer_done and self._poll(0):
                plans += self._take()
            return plans
        while not self.peer_done:  # lockstep: wait for the peer's message of this epoch
            if not self._poll(max(0.0, self.deadline - time.perf_counter())):
                break
            plans += self._take()
            if self.peer_epoch >= wait_for:
                break
        return plans


class ChannelHooks:
    """`lazy_rows.Hooks` / `lns` hooks over a channel: report plans, take the peer's best."""

    def __init__(self, channel: Channel, cost: Callable[[np.ndarray], float]) -> None:
        self.channel, self.cost = channel, cost
        self.bound = -np.inf

    def found(self, choice: np.ndarray, cost: float) -> None:
        self.channel.publish(choice)

    def proved(self, bound: float) -> None:
        self.bound = max(self.bound, bound)

    def offered(self) -> tuple[np.ndarray, float] | None:
        plans = self.channel.checkpoint(self.bound)
        if not plans:
            return None
        priced = [(self.cost(p), k) for k, p in enumerate(plans)]
        cost, k = min(priced)
        return plans[k], cost


@dataclass(frozen=True, slots=True)
class ChildResult:
    """What the parent learned from the child: its plans, bound and whether it proved one optimal."""

    plans: list[np.ndarray]
    bound: float
    optimal: bool
    error: str


class Child:
    """The forked exact side: `work(channel, deadline) -> (plan, bound, optimal)` in a process."""

    def __init__(self, work: Callable, deadline: float, lockstep: bool) -> None:
        context = multiprocessing.get_context("fork")
        parent_end, child_end = context.Pipe(duplex=True)
        self.channel = Channel(parent_end, lockstep, PRICING_EPOCH, deadline)
        self.process = context.Process(target=_child_main, args=(work, child_end, deadline, lockstep), daemon=True)
        self.process.start()
        child_end.close()

    def stop(self) -> ChildResult:
        """Collect what the child sent and end it at once: it sent its plans as it found them,
        and HiGHS, deep in a long LP, can take seconds to notice a polite request."""
        plans = self.channel.drain(0.0)
        if self.channel.peer_done:
            self.process.join(STOP_GRACE)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        plans += self.channel.drain(0.0)
        c = self.channel
        return ChildResult(plans, c.peer_bound, c.peer_optimal, c.peer_error)


def _child_main(work: Callable, conn, deadline: float, lockstep: bool) -> None:
    _die_with_parent()
    channel = Channel(conn, lockstep, CHILD_EPOCH, deadline, POLL_SECONDS)

    def leave(signum, frame):  # asked to stop: the plans were sent as they were found
        channel.finish(None, -np.inf, False)
        os._exit(0)

    signal.signal(signal.SIGTERM, leave)
    try:
        plan, bound, optimal = work(channel, deadline)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        channel.finish(plan, bound, optimal)
    except Exception:  # noqa: BLE001 - report any failure to the parent, which carries on alone
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        channel.finish(None, -np.inf, False, traceback.format_exc(limit=8))
    finally:
        os._exit(0)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (no orphaned solver)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def can_fork() -> bool:
    """Forking is possible here: POSIX, and not inside a daemonic pool worker."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    return not multiprocessing.current_process().daemon
