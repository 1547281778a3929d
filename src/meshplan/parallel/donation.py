"""Donation: donated argument leaves of a Captured program -> (argument, result) pairs as aliases.

A donated argument's buffer can hold a result of the same shape and dtype (new parameters
overwrite the old ones). Each donated leaf takes the first result of its shape and dtype that
no earlier donated leaf took, in result order — the rule `jax.jit` itself uses to match
donated buffers, so the pairs planned here are the ones XLA aliases. The pairs become
`Graph.aliases`, so the intra-op ILP gives each argument and its result one layout (a buffer
can only be reused in place when both are split the same way). A pair for which the strategy
space offers no common layout makes the ILP infeasible; `drop_unplaceable` removes such pairs.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.capture import Captured
from meshplan.cluster.mesh import LogicalMesh
from meshplan.intra.aliases import unshareable_pairs
from meshplan.intra.options import IntraOptions
from meshplan.ir import Graph, OpKind


class UnusedDonationWarning(UserWarning):
    """Some donated arguments are not donated: no result of their shape and dtype, or the plan
    cannot lay out the argument and its result alike."""


@dataclass(frozen=True, slots=True)
class Donation:
    """Which flat argument buffers a compiled function reuses for which flat results.

    Attributes:
        pairs: (flat argument index, flat result index) pairs, in argument order.
        unmatched: donated flat argument indices with no result to reuse; not donated.
        unplaceable: donated flat argument indices the plan cannot lay out like their result;
            not donated.
    """

    pairs: tuple[tuple[int, int], ...] = ()
    unmatched: tuple[int, ...] = ()
    unplaceable: tuple[int, ...] = ()

    def without_pairs(self) -> Donation:
        """Nothing donated: every paired argument counted as unplaceable."""
        return Donation((), self.unmatched, tuple(sorted({*self.unplaceable, *self.donated})))

    @property
    def donated(self) -> tuple[int, ...]:
        """Flat argument indices to pass as `jax.jit(..., donate_argnums=...)`."""
        return tuple(arg for arg, _ in self.pairs)


def pair_donated(captured: Captured, leaves: Sequence[int]) -> Donation:
    """Pair each donated flat argument with the first free result of its shape and dtype.

    Args:
        captured: the captured program.
        leaves: flat argument indices the caller donates.
    """
    free = list(range(len(captured.program.outputs)))
    pairs, unmatched = [], []
    for arg in sorted(set(leaves)):
        match = next((out for out in free if _same_aval(captured, arg, out)), None)
        if match is None or not _same_node_shape(captured, arg, match):
            unmatched.append(arg)
            continue
        free.remove(match)
        pairs.append((arg, match))
    return Donation(tuple(pairs), tuple(unmatched))


def pair_updated(captured: Captured, leaves: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(flat argument, flat result) pairs: each of `leaves` with the result that is its new value.

    A result is a candidate for an argument of its shape and dtype when it is computed from it
    by element-wise ops alone (`w - lr * u`, `b1 * m + (1 - b1) * g`). An update reads other
    state too (Adam's new weight reads both moments), so candidates are taken nearest first: the
    fewest element-wise steps between argument and result, then argument order.
    """
    graph, position = captured.graph, {node: i for i, node in enumerate(captured.input_nodes)}
    wanted = set(leaves)
    candidates = []
    for out, node in enumerate(captured.output_nodes):
        for arg, steps in _elementwise_distances(graph, node).items():
            leaf = position.get(arg)
            if leaf in wanted and _same_aval(captured, leaf, out) and _same_node_shape(captured, leaf, out):
                candidates.append((steps, leaf, out))
    pairs, args, results = [], set(), set()
    for _, leaf, out in sorted(candidates):
        if leaf not in args and out not in results:
            pairs.append((leaf, out))
            args.add(leaf)
            results.add(out)
    return tuple(sorted(pairs))


def _elementwise_distances(graph: Graph, out: int) -> dict[int, int]:
    """Nodes `out` is computed from through element-wise ops of its shape -> fewest such ops
    in between (`out` itself excluded)."""
    shape, found, frontier, steps = graph[out].shape, {out: 0}, [out], 0
    while frontier:
        steps += 1
        ahead = []
        for n in frontier:
            if graph[n].kind is not OpKind.ELEMENTWISE:
                continue
            for o in graph[n].operands:
                if o not in found and graph[o].shape == shape:
                    found[o] = steps
                    ahead.append(o)
        frontier = ahead
    del found[out]
    return found


def alias_donated(captured: Captured, donation: Donation) -> Captured:
    """`captured` with each donated pair added to its graph's aliases (parameter, result node)."""
    aliases = tuple((captured.input_nodes[arg], captured.output_nodes[out]) for arg, out in donation.pairs)
    graph = dataclasses.replace(captured.graph, aliases=(*captured.graph.aliases, *aliases))
    return dataclasses.replace(captured, graph=graph)


def drop_unplaceable(captured: Captured, donation: Donation, mesh: LogicalMesh,
                     options: IntraOptions) -> Donation:
    """`donation` without the arguments that share no layout with their result in the strategy space.

    The others are paired again, as jax.jit will pair them once the dropped ones are no longer
    donated (a freed result may go to another argument), until every pair can share a layout.
    Seen: under forced data parallelism a bias gradient is all-reduced, so the update of a bias
    is offered only replicated, while Zero3Parallel offers the bias itself only split.
    """
    requested = sorted({*donation.donated, *donation.unmatched})
    dropped = set(donation.unplaceable)
    while True:
        current = pair_donated(captured, [a for a in requested if a not in dropped])
        nodes = {(captured.input_nodes[a], captured.output_nodes[r]): a for a, r in current.pairs}
        bad = {nodes[pair] for pair in unshareable_pairs(captured.graph, mesh, options, nodes)}
        if not bad:
            return dataclasses.replace(current, unplaceable=tuple(sorted(dropped)))
        dropped |= bad


def warn_not_donated(captured: Captured, donation: Donation, where: str, stacklevel: int = 2) -> None:
    """Emit an UnusedDonationWarning naming the donated leaves that are not donated, and why."""
    graph = captured.graph
    name = lambda a: f"{graph[captured.input_nodes[a]].name} {_aval_text(captured, a)}"  # noqa: E731
    reasons = []
    if donation.unmatched:
        reasons.append(f"{', '.join(map(name, donation.unmatched))} (no result of the same shape and dtype "
                       f"left to reuse the buffer)")
    if donation.unplaceable:
        reasons.append(f"{', '.join(map(name, donation.unplaceable))} (the planner offers the argument "
                       f"and its result no common layout)")
    if reasons:
        warnings.warn(
            f"{where}: donated argument leaves {'; '.join(reasons)} are not donated and stay valid. Drop those "
            f"arguments from donate_argnums, or pass donate_argnums=\"auto\" to donate what can be donated "
            f"without this warning.", UnusedDonationWarning, stacklevel=stacklevel + 1)


def _same_aval(captured: Captured, arg: int, out: int) -> bool:
    program = captured.program
    a, r = program.avals[program.inputs[arg]], program.avals[program.outputs[out]]
    return (tuple(a.shape), a.dtype) == (tuple(r.shape), r.dtype)


def _same_node_shape(captured: Captured, arg: int, out: int) -> bool:
    # Graph.aliases need equal node shapes. A result node standing for a value of another
    # shape cannot be aliased; its argument is then not donated at all, which keeps jax.jit's
    # own matching (by shape and dtype, like `_same_aval`) equal to these pairs.
    graph = captured.graph
    return graph[captured.input_nodes[arg]].shape == graph[captured.output_nodes[out]].shape


def _aval_text(captured: Captured, arg: int) -> str:
    aval = captured.program.avals[captured.program.inputs[arg]]
    return f"{aval.dtype}{list(aval.shape)}"
