"""Costs of collectives over the axes of a logical mesh: node-aware (meshplan.cost.links) on a mesh
that knows its nodes, alpha-beta per axis otherwise (Alpa's unit setting, measured costs)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.links import CollectiveKind, Group, Links, collective_seconds


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective a strategy implies: its kind, the mesh axes it spans, bytes per device.

    `nbytes` is the per-device buffer: the reduced buffer for all-reduce, the gathered
    output for all-gather, the input for reduce-scatter, the held bytes for all-to-all, the
    bytes each device sends to one other for a collective-permute.
    """

    kind: CollectiveKind
    axes: tuple[int, ...]
    nbytes: float
    cost: float

    def __str__(self) -> str:
        return f"{self.kind.value}@{''.join(map(str, self.axes))}({_fmt_bytes(self.nbytes)})"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "axes": list(self.axes), "bytes": self.nbytes, "cost": self.cost}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Collective:
        return Collective(CollectiveKind(data["kind"]), tuple(data["axes"]), data["bytes"], data["cost"])


# Bandwidth term factors (n = devices in the group). The all-to-all term follows a switched
# network where each device sends (n-1)/n of its bytes; Alpa's playground scaled it by 1.5/n.
_BANDWIDTH_FACTOR = {
    CollectiveKind.ALL_REDUCE: lambda n: 2 * (n - 1) / n,
    CollectiveKind.ALL_GATHER: lambda n: (n - 1) / n,
    CollectiveKind.REDUCE_SCATTER: lambda n: (n - 1) / n,
    CollectiveKind.ALL_TO_ALL: lambda n: (n - 1) / n,
    CollectiveKind.COLLECTIVE_PERMUTE: lambda n: 1.0,
}
_ALPA_ALL_TO_ALL_FACTOR = lambda n: 1.5 * (n - 1) / n / n  # noqa: E731

# Alpa's playground adds a tiny per-kind constant so that objectives count collectives and
# ties break towards fewer of them; the unit setting keeps it to reproduce those numbers.
TIE_CONSTANT = {
    CollectiveKind.ALL_REDUCE: 0.01,
    CollectiveKind.ALL_GATHER: 0.1,
    CollectiveKind.REDUCE_SCATTER: 0.001,
    CollectiveKind.ALL_TO_ALL: 0.001,
    CollectiveKind.COLLECTIVE_PERMUTE: 0.001,
}


@dataclass(frozen=True, slots=True)
class CollectiveCosts:
    """How collectives are priced.

    Attributes:
        truncate: round the alpha-beta term down to an integer (Alpa's playground cost units).
        tie_constants: add TIE_CONSTANT per collective (Alpa's playground).
        alpa_all_to_all: use Alpa's scaled-down all-to-all term instead of (n-1)/n.
        forced: a fixed cost per collective kind, whatever the bytes (Alpa's force_*_cost).
        link_efficiency: on a mesh that knows its nodes (`LogicalMesh.topology`), price each
            collective as one NCCL communicator over its ranks with the node-aware link model
            (meshplan.cost.links) at this fraction of the nominal bandwidths; None keeps the
            per-axis alpha-beta terms.
        hidden: (axes, share) pairs: that share of every collective over exactly those axes runs
            under compute (tensor-parallel communication overlapped with GEMMs, `tpo=on`).
    """

    truncate: bool = False
    tie_constants: bool = False
    alpa_all_to_all: bool = False
    forced: tuple[tuple[CollectiveKind, float], ...] = ()
    link_efficiency: float | None = None
    hidden: tuple[tuple[tuple[int, ...], float], ...] = ()

    def cost(self, kind: CollectiveKind, mesh: LogicalMesh, axes: Sequence[int], nbytes: float) -> float:
        """Cost of one collective of `kind` over mesh `axes` with `nbytes` per device.

        Over several axes the collective runs hierarchically, one axis after another (an
        all-reduce as reduce-scatter down the axes and all-gather back up); each later phase
        moves the buffer shrunk by the axes already done. The cheapest axis order is used.
        """
        forced = dict(self.forced)
        if kind in forced:
            return forced[kind]
        axes = tuple(a for a in axes if mesh.shape[a] > 1)
        if not axes:
            return 0.0
        if self.link_efficiency is not None and mesh.topology is not None:
            links = Links.of(mesh.topology, self.link_efficiency)
            seconds = collective_seconds(kind, nbytes, Group(*mesh.group_locality(axes)), links)
            share = next((h for over, h in self.hidden if over == axes), 0.0)
            return seconds * (1 - share)
        if kind is CollectiveKind.COLLECTIVE_PERMUTE:  # one send of the shard, over the slowest link it crosses
            total = max(mesh.alpha[a] + mesh.beta[a] * nbytes for a in axes)
            total = math.floor(total) if self.truncate else total
        else:
            total = min(self._ordered_cost(kind, mesh, order, nbytes) for order in itertools.permutations(axes))
        if self.tie_constants:
            total += TIE_CONSTANT[kind]
        return total

    def _ordered_cost(self, kind: CollectiveKind, mesh: LogicalMesh, order: Sequence[int], nbytes: float) -> float:
        total, done = 0.0, 1
        for axis in order:
            n = mesh.shape[axis]
            if kind is CollectiveKind.ALL_TO_ALL and self.alpa_all_to_all:
                factor = _ALPA_ALL_TO_ALL_FACTOR(n)
            else:
                factor = _BANDWIDTH_FACTOR[kind](n)
            # All-gather runs up from the smallest pieces; the others shrink going down.
            shrink = done if kind is not CollectiveKind.ALL_TO_ALL else 1
            if kind is CollectiveKind.ALL_GATHER:
                shrink = mesh.axis_size(order) // (done * n)
            term = mesh.alpha[axis] + mesh.beta[axis] * factor * nbytes / shrink
            total += math.floor(term) if self.truncate else term
            done *= n
        return total

    def collective(self, kind: CollectiveKind, mesh: LogicalMesh, axes: Sequence[int], nbytes: float) -> Collective:
        axes = tuple(a for a in axes if mesh.shape[a] > 1)
        key = (self, kind, axes, nbytes)
        found = mesh.priced.get(key)
        if found is None:  # remembered per mesh: ~90 % of a piece's collectives were priced before
            found = mesh.priced[key] = Collective(kind, axes, nbytes, self.cost(kind, mesh, axes, nbytes))
        return found


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}B"
