"""Planned vs compiled collectives: an IntraPlan and its executable's HLO -> a CollectiveCheck.

The plan says which collectives each chosen strategy and each resharding implies (kind, mesh
axes, bytes per device). The executable's HLO says what XLA emitted. XLA rewrites a program's
collectives in ways that do not change what moves, and the comparison undoes exactly those,
each one named in `NORMALISATION` (and in docs/design.md, "Runtime: planned vs compiled
collectives"):

1. combined collectives: XLA's combiners merge collectives of one kind over the same device
   groups into one instruction with several operands; each operand counts as one collective.
2. one conversion per value and layout: a value resharded to one layout for several consumers
   is converted once (the runtime makes it once; the plan lists it per consumer edge), also when
   two conversions share their first steps (e.g. a gather, `sharding.spec.conversion_path`). A
   broadcast is converted through its operand, so broadcasts of one operand converted alike
   share one collective.
3. reduce-scatter on CPU: XLA's CPU backend emits a planned reduce-scatter as an all-reduce of
   the same input followed by a local dynamic-slice (GPU and TPU backends keep it).
4. one all-reduce per axis: a sum over dims split over different mesh axes (S1S0 reduced to a
   scalar) may be emitted as one all-reduce per axis of the same buffer.

Everything else is compared as it is: a planned collective with no compiled twin of the same
kind, mesh axes and bytes is "missing", a compiled one with no planned twin "unplanned"
(e.g. collective-permutes, which no plan contains, or all-gathers XLA added to reach a layout
the plan did not ask for).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from meshplan.cluster.mesh import LogicalMesh
from meshplan.intra.plan import ChosenStrategy, IntraPlan, Resharding
from meshplan.runtime.hlo_collectives import CompiledCollective, hlo_collectives
from meshplan.sharding.spec import collectives_per_step, conversion_path

NORMALISATION = (
    "compiled: a combined collective (several operands in one instruction) counts once per operand",
    "compiled: an all-to-all in tuple form (one chunk per peer) counts once",
    "planned: a value resharded to the same layout for several consumers counts once (for broadcasts: their operand)",
    "planned on cpu: a reduce-scatter is compiled as an all-reduce of its input and a local slice",
    "planned: an all-reduce over several mesh axes may be compiled as one all-reduce per axis of the same buffer",
)


@dataclass(frozen=True, slots=True)
class PlannedCollective:
    """One collective the plan implies.

    Attributes:
        kind, axes, nbytes: as the plan priced it (`meshplan.cost.collectives.Collective`).
        compiled_kind: the kind the backend emits for it (see NORMALISATION).
        origin: where the plan puts it: the node and its strategy, or the resharding.
    """

    kind: str
    axes: tuple[int, ...]
    nbytes: int
    compiled_kind: str
    origin: str


@dataclass(frozen=True, slots=True)
class CollectiveRow:
    """Planned and compiled collectives of one kind on one set of mesh axes (None: groups that
    are no set of mesh axes)."""

    kind: str
    axes: tuple[int, ...] | None
    planned: int
    planned_bytes: int
    compiled: int
    compiled_bytes: int
    instructions: int  # compiled instructions carrying them (fewer when XLA combined them)

    @property
    def agrees(self) -> bool:
        return (self.planned, self.planned_bytes) == (self.compiled, self.compiled_bytes)


@dataclass(frozen=True, slots=True)
class CollectiveCheck:
    """The plan's collectives next to the executable's, after NORMALISATION.

    Attributes:
        backend: the platform compiled for ("cpu", "gpu", "tpu").
        planned, compiled: both lists, in plan and HLO order.
        rows: per (kind, mesh axes), counts and bytes of both.
        missing: planned collectives without a compiled twin (same kind, axes and bytes).
        unplanned: compiled collectives (one per logical collective) without a planned twin.
    """

    backend: str
    planned: tuple[PlannedCollective, ...]
    compiled: tuple[CompiledCollective, ...]
    rows: tuple[CollectiveRow, ...]
    missing: tuple[PlannedCollective, ...]
    unplanned: tuple[tuple[str, tuple[int, ...] | None, int, str], ...]

    @property
    def agrees(self) -> bool:
        """Every planned collective was compiled and nothing else was."""
        return not self.missing and not self.unplanned

    def counts(self, which: str = "compiled") -> dict[str, int]:
        """Kind -> number of collectives: of the "compiled" side after the normalisation, or of
        the "planned" side by the plan's own kinds (a reduce-scatter stays one)."""
        if which == "planned":
            return dict(Counter(p.kind for p in self.planned))
        totals: Counter[str] = Counter()
        for row in self.rows:
            totals[row.kind] += row.compiled
        return {kind: n for kind, n in totals.items() if n}

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "agrees": self.agrees, "normalisation": list(NORMALISATION),
            "rows": [{"kind": r.kind, "axes": _axes_json(r.axes), "planned": r.planned,
                      "planned_bytes": r.planned_bytes, "compiled": r.compiled, "compiled_bytes": r.compiled_bytes,
                      "instructions": r.instructions, "agrees": r.agrees} for r in self.rows],
            "missing": [{"kind": p.kind, "compiled_kind": p.compiled_kind, "axes": list(p.axes), "bytes": p.nbytes,
                         "origin": p.origin} for p in self.missing],
            "unplanned": [{"kind": k, "axes": _axes_json(a), "bytes": b, "op_name": o}
                          for k, a, b, o in self.unplanned],
            "planned": [{"kind": p.kind, "compiled_kind": p.compiled_kind, "axes": list(p.axes), "bytes": p.nbytes,
                         "origin": p.origin} for p in self.planned],
            "compiled": [{"kind": c.kind, "name": c.name, "axes": _axes_json(c.axes), "buffers": list(c.buffers),
                          "op_name": c.op_name} for c in self.compiled],
        }


def check_collectives(plan: IntraPlan, hlo_text: str | Sequence[str], backend: str) -> CollectiveCheck:
    """Compare the collectives `plan` implies with those of its compiled executable's HLO.

    Args:
        plan: the IntraPlan the executable was built from.
        hlo_text: the compiled executable's HLO (`Compiled.as_text()`); or the HLO of each
            executable that runs part of the plan (a pipeshard stage's forward and backward),
            whose collectives together are compared with the plan's.
        backend: the platform it was compiled for (`jax.default_backend()`), which decides
            how a reduce-scatter is emitted.
    """
    planned = planned_collectives(plan, backend)
    texts = (hlo_text,) if isinstance(hlo_text, str) else tuple(hlo_text)
    compiled = tuple(c for text in texts for c in hlo_collectives(text, plan.mesh.shape))
    return compare(planned, compiled, backend)


def planned_collectives(plan: IntraPlan, backend: str) -> tuple[PlannedCollective, ...]:
    """The plan's collectives: each node's own, then each distinct (value, layout) conversion."""
    found = [_planned(c, f"{n.name} {n.op} {n.strategy}", backend) for n in plan.nodes for c in n.collectives]
    by_name = {n.name: n for n in plan.nodes}
    seen = set()
    for r in plan.reshardings:
        for key, collectives in _conversions(r, by_name.get(r.producer), plan.mesh):
            if key not in seen:
                seen.add(key)
                found.extend(_planned(c, f"reshard {r.producer} {r.src} -> {r.dst} for {r.consumer}", backend)
                             for c in collectives)
    return tuple(found)


def compare(planned: Iterable[PlannedCollective], compiled: Iterable[CompiledCollective],
            backend: str) -> CollectiveCheck:
    """Match both sides by (kind as compiled, mesh axes, bytes) and count them per kind and axes."""
    planned, compiled = tuple(planned), tuple(compiled)
    logical = [(c.kind, c.axes, b, c.op_name) for c in compiled for b in c.buffers]
    left = Counter((k, a, b) for k, a, b, _ in logical)
    missing = []
    for p in planned:
        key = (p.compiled_kind, p.axes, p.nbytes)
        if left[key] > 0:
            left[key] -= 1
        else:
            missing.append(p)
    per_axis = [p for p in missing if _per_axis(p, left)]
    missing = [p for p in missing if p not in per_axis]
    unplanned = []
    for k, a, b, o in logical:
        if left[(k, a, b)] > 0:
            left[(k, a, b)] -= 1
            unplanned.append((k, a, b, o))
    return CollectiveCheck(backend, planned, compiled, _rows(planned, compiled, per_axis), tuple(missing),
                           tuple(unplanned))


def _per_axis(planned: PlannedCollective, left: Counter) -> bool:
    """Match an all-reduce over several mesh axes with one all-reduce per axis of the same
    buffer, taking them from `left`, when all are there (XLA reduces dims split over different
    axes one axis at a time)."""
    if planned.compiled_kind != "all-reduce" or len(planned.axes) < 2:
        return False
    keys = [("all-reduce", (a,), planned.nbytes) for a in planned.axes]
    if any(left[k] < 1 for k in keys):
        return False
    for k in keys:
        left[k] -= 1
    return True


def _conversions(resharding: Resharding, producer: ChosenStrategy | None,
                 mesh: LogicalMesh) -> list[tuple[tuple[Any, ...], tuple[Any, ...]]]:
    """The conversions a resharding makes, each with its collectives: the producer's value
    through each step of `conversion_path` (the runtime makes each step once per value and path
    so far, so conversions that start alike share their first steps); for a broadcast, its
    operand (the runtime converts the operand and broadcasts again, so broadcasts of one operand
    converted alike share them)."""
    collectives = resharding.collectives
    if producer is not None and producer.op == "broadcast" and producer.operand_ids:
        return [(("operand", producer.operand_ids[0], tuple((c.kind, c.axes, c.nbytes) for c in collectives)),
                 collectives)]
    path = conversion_path(resharding.src, resharding.dst, mesh)
    counts = collectives_per_step(resharding.src, resharding.dst, mesh)
    if sum(counts) != len(collectives):  # priced by another rule (Alpa's): one conversion
        return [((resharding.producer, resharding.src, resharding.dst), collectives)]
    found, start = [], 0
    for n, count in enumerate(counts, 1):
        found.append(((resharding.producer, resharding.src, path[:n]), collectives[start:start + count]))
        start += count
    return found


def _planned(collective: Any, origin: str, backend: str) -> PlannedCollective:
    kind = collective.kind.value
    compiled_kind = "all-reduce" if kind == "reduce-scatter" and backend == "cpu" else kind
    return PlannedCollective(kind, tuple(sorted(collective.axes)), round(collective.nbytes), compiled_kind, origin)


def _rows(planned: tuple[PlannedCollective, ...], compiled: tuple[CompiledCollective, ...],
          per_axis: list[PlannedCollective]) -> tuple[CollectiveRow, ...]:
    """Counts per (kind, axes); all-reduces emitted one per axis count once, in the row of the
    planned axes (their instructions stay where they are)."""
    table: dict[tuple[str, Any], list[int]] = {}
    for p in planned:
        row = table.setdefault((p.compiled_kind, p.axes), [0, 0, 0, 0, 0])
        row[0], row[1] = row[0] + 1, row[1] + p.nbytes
    for c in compiled:
        row = table.setdefault((c.kind, c.axes), [0, 0, 0, 0, 0])
        row[2], row[3], row[4] = row[2] + len(c.buffers), row[3] + c.nbytes, row[4] + 1
    for p in per_axis:
        whole = table[(p.compiled_kind, p.axes)]
        whole[2], whole[3] = whole[2] + 1, whole[3] + p.nbytes
        for a in p.axes:
            part = table[(p.compiled_kind, (a,))]
            part[2], part[3] = part[2] - 1, part[3] - p.nbytes
    table = {key: row for key, row in table.items() if any(row)}
    order = sorted(table, key=lambda key: (key[0], key[1] is None, key[1] or ()))
    return tuple(CollectiveRow(kind, axes, *table[(kind, axes)]) for kind, axes in order)


def _axes_json(axes: tuple[int, ...] | None) -> list[int] | None:
    return None if axes is None else list(axes)
