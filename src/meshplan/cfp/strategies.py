"""Candidate strategies of a contraction, in CFP's readable form (dot node -> candidates).

A contraction's dims fall into four groups: batch (B), lhs free (M), rhs free (N) and
contracting (K). A CFP candidate hands every mesh axis with more than one device to one
group; inside a group the axis splits the first dim it divides evenly (a runnable program
needs even splits). A 2-D mesh thus gives at most 16 candidates (9 without batch dims), a
1-D mesh 3 or 4, instead of one per assignment of axes to single dims. A split contracting
group leaves partial sums, all-reduced over its axes.

Names follow CFP's notation: `SS = SR x RS @ {0,1}` is out = lhs x rhs with S for a split dim,
R for a whole one, and after `@` the mesh axes of each split, read left to right through lhs
then rhs (a dim split in both counts once), e.g. `RS = RS x SS @ {1,0} (allreduce @ 1)`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from meshplan.cluster.mesh import LogicalMesh
from meshplan.ir.graph import Graph
from meshplan.ir.node import Node
from meshplan.sharding.rules.dot import DotDims, Slot
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import NodeStrategies

_GROUP_OF_SLOT = {"b": "B", "l": "M", "r": "N", "c": "K"}


@dataclass(frozen=True, slots=True)
class DotCandidate:
    """One candidate of a contraction.

    Attributes:
        index: position of the matching strategy in the node's (meshplan) strategy list.
        groups: the group of each mesh axis that has devices, e.g. (("M", 0), ("N", 1)).
        name: the readable CFP form.
    """

    index: int
    groups: tuple[tuple[str, int], ...]
    name: str

    @property
    def label(self) -> str:
        """Short form, e.g. "M0 N1": which group each mesh axis splits."""
        return " ".join(f"{g}{a}" for g, a in self.groups)


def dot_candidates(graph: Graph, node: Node, mesh: LogicalMesh, strategies: NodeStrategies) -> tuple[DotCandidate, ...]:
    """The CFP candidates of dot `node` that exist in its strategy list (in group order)."""
    dims = DotDims(node, graph[node.operands[0]], graph[node.operands[1]])
    by_specs = {(s.output, s.operands): i for i, s in enumerate(strategies.strategies)}
    found = []
    for groups, assignment in _group_assignments(dims, mesh):
        out, lhs, rhs = dims.specs(assignment)
        index = by_specs.get((out, (lhs, rhs)))
        if index is not None:
            found.append(DotCandidate(index, groups, readable_name(dims, assignment, out, lhs, rhs)))
    return tuple(found)


def _group_assignments(dims: DotDims, mesh: LogicalMesh) -> Iterator[tuple[tuple, dict[Slot, tuple[int, ...]]]]:
    """Every hand-out of the mesh axes (with devices) to the groups present, as slot -> axes."""
    slots = dims.slots()
    present = [g for g in "BMNK" if any(_GROUP_OF_SLOT[s[0]] == g for s in slots)]
    axes = [a for a, size in enumerate(mesh.shape) if size > 1]
    for picks in itertools.product(present, repeat=len(axes)):
        assignment: dict[Slot, tuple[int, ...]] = {}
        for axis, group in zip(axes, picks, strict=True):
            slot = _first_divisible(dims, slots, group, assignment, axis, mesh)
            if slot is None:
                break
            assignment[slot] = assignment.get(slot, ()) + (axis,)
        else:
            yield tuple(zip(picks, axes, strict=True)), assignment


def _first_divisible(dims: DotDims, slots: list[Slot], group: str, assignment: dict, axis: int,
                     mesh: LogicalMesh) -> Slot | None:
    for slot in slots:
        if _GROUP_OF_SLOT[slot[0]] == group:
            devices = mesh.axis_size(assignment.get(slot, ())) * mesh.shape[axis]
            if dims.size(slot) % devices == 0:
                return slot
    return None


def readable_name(dims: DotDims, assignment: dict[Slot, tuple[int, ...]], out: ShardingSpec, lhs: ShardingSpec,
                  rhs: ShardingSpec) -> str:
    """`out = lhs x rhs @ {axes}`, plus `(allreduce @ axes)` when contracting dims are split."""
    letters = lambda spec: "".join("S" if a else "R" for a in spec.dims) or "R"
    seen: list[Slot] = []
    for slot in _slots_by_operand_dim(dims):
        if slot in assignment and slot not in seen:
            seen.append(slot)
    axes = ",".join("".join(map(str, assignment[s])) for s in seen)
    name = f"{letters(out)} = {letters(lhs)} x {letters(rhs)} @ {{{axes}}}"
    reduced = sorted(a for (group, _), ax in assignment.items() if group == "c" for a in ax)
    return name + (f" (allreduce @ {''.join(map(str, reduced))})" if reduced else "")


def _slots_by_operand_dim(dims: DotDims) -> list[Slot]:
    """The slot of each lhs dim, then of each rhs dim, in dim order."""
    def slot_of(d: int, batch, free, contracting, side: str) -> Slot:
        if d in batch:
            return ("b", batch.index(d))
        if d in contracting:
            return ("c", contracting.index(d))
        return (side, free.index(d))

    lhs = [slot_of(d, dims.lb, dims.lf, dims.lc, "l") for d in range(dims.lhs.rank)]
    rhs = [slot_of(d, dims.rb, dims.rf, dims.rc, "r") for d in range(dims.rhs.rank)]
    return lhs + rhs
