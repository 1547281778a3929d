"""Batch inputs of a captured step: which flat inputs carry the batch, and along which dim.

A training step `step(params, opt_state, batch)` gives its arguments in any order, and its
optimizer state is a pytree of moments and counters as large as the weights. The batch is found
from the program, not from argument positions:

1. *State* is an input that the step returns updated: some result of its shape and dtype is
   computed from it by elementwise ops (`w - lr * g`, `b1 * m + (1 - b1) * g`) or by writing a
   window into it (a KV cache), and from some other input too (`2 * x` only rescales x).
   Weights, optimizer moments and step counters are state; a batch never is.
2. The other inputs' dims are followed through the program (`meshplan.ir.dimflow`). Dims that
   meet in some value (`x @ w - y` puts x's rows and y's rows on one dim) form a *family*. A
   family that reaches an updated state value is a feature dim (y's columns run into w's
   gradient and w's update); the batch dim is contracted away in every weight gradient.
3. The batch is the dim along which examples are independent: nothing mixes positions along
   it before sums end it (the loss's mean, the weights' gradients). Each family is checked for
   that on the captured program (`meshplan.ir.independence`): attention mixes the sequence dim
   (its scores hold it twice), nothing mixes the batch. Of the families so proved, the one
   reaching the most values is the batch (it runs through every activation and its gradient);
   ties go to the earliest argument, then the lower dim. When none is proved, the family
   reaching the most values is taken and flagged (`UnprovenBatchWarning`, raised by the methods
   that split it; micro-batching refuses it: `check_micro_batchable`).

`batch_argnums` names the batch arguments instead: their leaves are split along dim 0, which
they must share. Arguments that are state, or hold no array, are refused with the reason.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.capture.jaxpr import Captured
from meshplan.errors import OptionsError
from meshplan.ir import Graph, OpKind
from meshplan.ir.dimflow import trace_dims
from meshplan.ir.independence import find_mixing

_PROVED = "proved independent: nothing mixes positions along it before sums over it (the loss's mean, the " \
          "weights' gradients)"
_MAX_OTHERS = 4  # other candidate families an explanation lists


class UnprovenBatchWarning(UserWarning):
    """No input dim was proved to hold independent examples: the batch split is a guess."""


@dataclass(frozen=True, slots=True)
class BatchInputs:
    """The batch inputs of a captured function.

    Attributes:
        dims: (flat input index, batch dim) of every batch leaf, in input order.
        argnums: positions of the arguments holding them.
        inferred: True when found from the program, False when given by `batch_argnums`.
        independent: whether the program was proved to keep positions along `dims` apart
            (`meshplan.ir.independence`): only then may the batch be cut into micro-batches.
        reason: the proof's verdict, e.g. the op that mixes the dims.
        others: the other candidate families, each with why it was not chosen (most reach first).
    """

    dims: tuple[tuple[int, int], ...]
    argnums: tuple[int, ...]
    inferred: bool
    independent: bool = False
    reason: str = ""
    others: tuple[str, ...] = ()

    def describe(self, captured: Captured) -> str:
        """E.g. "args[2] i32[8, 16] (dim 0)"."""
        return _members_text(captured, self.dims) or "none"

    def explain(self, captured: Captured, how: str | None = None) -> str:
        """The batch, how it was chosen (`how`, default "inferred" or "given by batch_argnums") and
        why, e.g. "args[2] i32[8, 16] (dim 0), inferred: proved independent: ...; other candidates:
        args[2] i32[8, 16] (dim 1) reaches 812 values, but ..."."""
        if not self.dims:
            return "none"
        how = how or ("inferred" if self.inferred else "given by batch_argnums")
        text = f"{self.describe(captured)}, {how}: {self.reason}"
        return text + (f"; other candidates: {'; '.join(self.others)}" if self.others else "")


@dataclass(frozen=True, slots=True)
class _Family:
    """Input dims that meet in some value, and the (node, dim) pairs they reach."""

    members: tuple[tuple[int, int], ...]
    reached: frozenset[tuple[int, int]]
    feeds_results: bool  # some result depends on a member (an unused key is trivially independent, no batch)

    def rank(self) -> tuple[int, list[int], list[int]]:
        """Larger is preferred: more values reached, then earlier arguments, then lower dims."""
        return len(self.reached), [-i for i, _ in self.members], [-d for _, d in self.members]


def find_batch_inputs(captured: Captured, batch_argnums: Sequence[int] | None, fn_name: str) -> BatchInputs:
    """The batch leaves of `captured`: given by `batch_argnums`, or inferred when it is None.

    Raises:
        OptionsError: `batch_argnums` names a position out of range, an argument the step updates
            (weights, optimizer state), an argument with no array of rank >= 1, or arguments whose
            leading dims differ. The message names the argument and the batch meshplan infers.
    """
    inferred = infer_batch_inputs(captured)
    if batch_argnums is None:
        return inferred
    argnums = tuple(batch_argnums)
    problem = _argnums_problem(captured, argnums, fn_name)
    if problem:
        hint = (f"the batch looks like {inferred.describe(captured)}: pass batch_argnums={inferred.argnums}, or "
                if inferred.dims else "pass the positions of the arguments whose leading dim is the batch, or ")
        raise OptionsError(f"parallelize({fn_name}, batch_argnums={argnums}): {problem}; {hint}leave "
                           "batch_argnums out to let meshplan infer the batch from the program")
    return given_batch_inputs(captured, argnums)


def given_batch_inputs(captured: Captured, argnums: Sequence[int]) -> BatchInputs:
    """The leaves of the arguments at `argnums` as the batch, along dim 0 (unchecked), with the
    verdict of the independence proof."""
    argnums = tuple(argnums)
    dims = tuple((i, 0) for k in argnums for i in _leaves_of(captured, k) if _rank(captured, i))
    mixing = _mixing(captured, dims)
    return BatchInputs(dims, argnums, inferred=False, independent=mixing is None, reason=_verdict(mixing))


def infer_batch_inputs(captured: Captured) -> BatchInputs:
    """The batch family of the inputs that are not state: the proved-independent family reaching
    the most values, else (flagged not independent) the family reaching the most values (see the
    module doc); none when every input with a dim is state."""
    state = updated_inputs(captured)
    updates = {captured.output_nodes[k] for k in state.values()}
    candidates = [(i, d) for i in range(len(captured.input_nodes)) if i not in state
                  for d in range(_rank(captured, i)) if _shape(captured, i)[d] > 1]
    read = _outputs_read(captured)
    families = sorted((_Family(tuple(members), frozenset(reached), any(read >> i & 1 for i, _ in members))
                       for members, reached in _families(captured.graph, captured.input_nodes, candidates)
                       if not any(node in updates for node, _ in reached)), key=_Family.rank, reverse=True)
    if not families:
        return BatchInputs((), (), inferred=True, reason="no input dim is a candidate: every input with a dim "
                                                         "comes back updated, or has only size-1 dims")
    chosen, mixings = _first_proved(captured, families)
    proved = chosen is not None
    chosen = chosen if proved else 0
    best = families[chosen]
    dims: dict[int, int] = {}
    for i, d in best.members:
        dims.setdefault(i, d)  # a leaf with two dims in the family (x @ x.T) keeps the lower one
    argnums = tuple(sorted({_argnum(captured, i) for i in dims}))
    listed = [k for k in range(len(families)) if k != chosen][:_MAX_OTHERS]
    others = tuple(_other_text(captured, families[k], _checked(mixings, k, captured, families[k]), best)
                   for k in listed)
    reason = _PROVED if proved else (f"{_verdict(mixings[0] or 'no result depends on it')}; taken as the "
                                     f"candidate reaching the most values")
    return BatchInputs(tuple(sorted(dims.items())), argnums, inferred=True, independent=proved,
                       reason=reason, others=others)


def warn_if_unproven(batch: BatchInputs, captured: Captured, fn_name: str, stacklevel: int = 2) -> None:
    """Warn (UnprovenBatchWarning) when an inferred batch was not proved to hold independent examples."""
    if batch.inferred and batch.dims and not batch.independent:
        warnings.warn(f"{fn_name}: no input dim is proved to hold independent examples, so the batch split is a "
                      f"guess: {batch.explain(captured)}. If that is not the batch, pass parallelize(..., "
                      f"batch_argnums=(i, ...)) with the positions of the arguments whose leading dim is the batch",
                      UnprovenBatchWarning, stacklevel=stacklevel + 1)


def check_micro_batchable(batch: BatchInputs, captured: Captured, fn_name: str, count: int,
                          how: str | None = None) -> None:
    """Micro-batches are cut only along dims proved to hold independent examples.

    Args:
        how: how the batch was chosen, when not by `find_batch_inputs` (then `batch_argnums`
            cannot change it and is not offered as a fix).

    Raises:
        OptionsError: `count` > 1 and the batch is not so proved; the message names the dims, the
            op that mixes them and the fixes.
    """
    if count <= 1 or batch.independent or not batch.dims:
        return
    choose = "" if how else ("pass parallelize(..., batch_argnums=(i, ...)) with the positions of the arguments "
                             "whose leading dim holds independent examples, or ")
    how = how or ("inferred" if batch.inferred else "given by batch_argnums")
    raise OptionsError(
        f"PipeshardParallel cuts {fn_name}'s batch into {count} micro-batches only along a dim whose examples are "
        f"independent, and {batch.describe(captured)} ({how}) is not: {batch.reason}. Micro-batches along it "
        f"would change what the step computes. To fix it, {choose}use PipeshardParallel(num_micro_batches=1), or a "
        f"method that splits the batch without cutting it (DataParallel, Zero2Parallel, Zero3Parallel)")


def _first_proved(captured: Captured, families: list[_Family]) -> tuple[int | None, dict[int, str | None]]:
    """The first family (widest first) proved independent that some result depends on, or None;
    and where each family checked on the way mixes."""
    mixings: dict[int, str | None] = {}
    for k, family in enumerate(families):
        mixings[k] = _mixing(captured, family.members)
        if mixings[k] is None and family.feeds_results:
            return k, mixings
    return None, mixings


def _mixing(captured: Captured, members: Sequence[tuple[int, int]]) -> str | None:
    """Where the program mixes positions along these input dims, or None when it never does."""
    graph = captured.graph
    mixing = find_mixing(graph, [(captured.input_nodes[i], d) for i, d in members])
    return None if mixing is None else mixing.describe(graph)


def _verdict(mixing: str | None) -> str:
    return _PROVED if mixing is None else f"not proved independent: {mixing}"


def _checked(mixings: dict[int, str | None], k: int, captured: Captured, family: _Family) -> str | None:
    """Where family `k` mixes, checked now if it was not yet."""
    if k not in mixings:
        mixings[k] = _mixing(captured, family.members)
    return mixings[k]


def _other_text(captured: Captured, family: _Family, mixing: str | None, best: _Family) -> str:
    """Why `family` is not the batch: where it mixes, that nothing depends on it, or that it
    reaches fewer values."""
    count = len(family.reached)
    what = f"{_members_text(captured, family.members, most=3)} reaches {count} value{'s' * (count != 1)}"
    if mixing is not None:
        return f"{what}, but {mixing}"
    if not family.feeds_results:
        return f"{what}, but no result depends on it"
    return f"{what}, fewer than the batch's {len(best.reached)}"


def _members_text(captured: Captured, members: Sequence[tuple[int, int]], most: int | None = None) -> str:
    """E.g. "args[2] i32[8, 16] (dim 0), args[3] f32[8] (dim 0)"; past `most` members, "and N more"."""
    shown = ", ".join(f"{_leaf(captured, i)} (dim {d})" for i, d in members[:most])
    return shown + (f" and {len(members) - most} more" if most is not None and len(members) > most else "")


def updated_inputs(captured: Captured) -> dict[int, int]:
    """Flat input index -> index of a result that updates it (same shape and dtype, computed from
    it by elementwise ops, and from some other input too: `2 * x` rescales x, `w - lr * g(x)`
    updates w). A result that is the input itself does not count."""
    graph, found = captured.graph, {}
    position = {node: i for i, node in enumerate(captured.input_nodes)}
    reads = _inputs_read(graph, position)
    for k, out in enumerate(captured.output_nodes):
        node = graph[out]
        for n in _elementwise_cone(graph, out) - {out}:
            if n in position and graph[n].shape == node.shape and graph[n].dtype == node.dtype \
                    and reads[out] & ~(1 << position[n]):
                found.setdefault(position[n], k)
    return found


def _outputs_read(captured: Captured) -> int:
    """A bit mask of the flat inputs some result depends on."""
    position = {node: i for i, node in enumerate(captured.input_nodes)}
    masks = _inputs_read(captured.graph, position)
    mask = 0
    for out in captured.output_nodes:
        mask |= masks[out]
    return mask


def _inputs_read(graph: Graph, position: dict[int, int]) -> list[int]:
    """Per node, a bit mask of the flat inputs its value depends on."""
    masks: list[int] = []
    for node in graph.nodes:
        mask = 1 << position[node.id] if node.id in position else 0
        for o in node.operands:
            mask |= masks[o]
        masks.append(mask)
    return masks


def _elementwise_cone(graph: Graph, out: int) -> set[int]:
    """`out` and every node it is computed from through elementwise ops of its shape (and through
    the operand of window writes: a KV cache updated in place is state too)."""
    shape, seen, stack = graph[out].shape, {out}, [out]
    while stack:
        node = graph[stack.pop()]
        if node.kind is OpKind.DYNAMIC_UPDATE_SLICE:
            operands = node.operands[:1]
        elif node.kind is OpKind.ELEMENTWISE:
            operands = node.operands
        else:
            continue
        for o in operands:
            if o not in seen and graph[o].shape == shape:
                seen.add(o)
                stack.append(o)
    return seen


def _families(graph: Graph, input_nodes: Sequence[int],
              candidates: list[tuple[int, int]]) -> list[tuple[list[tuple[int, int]], set[tuple[int, int]]]]:
    """Group (input, dim) candidates whose traces share a (node, dim); each family with the
    (node, dim) pairs its members reach."""
    parent = list(range(len(candidates)))

    def root(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    reached: list[set[tuple[int, int]]] = []
    owner: dict[tuple[int, int], int] = {}
    for k, (i, d) in enumerate(candidates):
        reached.append(set(trace_dims(graph, {input_nodes[i]: d}).items()))
        for pair in reached[-1]:
            if pair in owner:
                parent[root(k)] = root(owner[pair])
            else:
                owner[pair] = k
    groups: dict[int, tuple[list[tuple[int, int]], set[tuple[int, int]]]] = {}
    for k, candidate in enumerate(candidates):
        members, pairs = groups.setdefault(root(k), ([], set()))
        members.append(candidate)
        pairs.update(reached[k])
    return list(groups.values())


def _argnums_problem(captured: Captured, argnums: tuple[int, ...], fn_name: str) -> str | None:
    """What is wrong with `argnums` as batch positions, or None."""
    nargs = len(captured.in_tree.children())
    bad = [k for k in argnums if not 0 <= k < nargs]
    if bad or not argnums:
        return (f"position(s) {bad or list(argnums)} name no argument; {fn_name} was called with {nargs} "
                f"argument(s), at positions 0..{nargs - 1}")
    state = updated_inputs(captured)
    for k in argnums:
        leaves = _leaves_of(captured, k)
        updated = [i for i in leaves if i in state]
        if updated:
            i = updated[0]
            return (f"argument {k} of {fn_name} is updated by the step ({_leaf(captured, i)} comes back as "
                    f"result {state[i]}): it is weights or optimizer state, not a batch")
        if not any(_rank(captured, i) for i in leaves):
            return f"argument {k} of {fn_name} holds no array with a dim to split (only scalars)"
    leaves = [i for k in argnums for i in _leaves_of(captured, k) if _rank(captured, i)]
    sizes = {_shape(captured, i)[0] for i in leaves}
    if len(sizes) > 1:
        first = next(i for i in leaves if _shape(captured, i)[0] != _shape(captured, leaves[0])[0])
        return (f"the batch arguments' leading dims differ ({_leaf(captured, leaves[0])} vs "
                f"{_leaf(captured, first)}); batch leaves are split along dim 0, which they must share")
    return None


def _leaves_of(captured: Captured, argnum: int) -> range:
    counts = [child.num_leaves for child in captured.in_tree.children()]
    start = sum(counts[:argnum])
    return range(start, start + counts[argnum])


def _argnum(captured: Captured, leaf: int) -> int:
    counts, total = [child.num_leaves for child in captured.in_tree.children()], 0
    for k, count in enumerate(counts):
        total += count
        if leaf < total:
            return k
    raise IndexError(leaf)


def _shape(captured: Captured, leaf: int) -> tuple[int, ...]:
    return captured.graph[captured.input_nodes[leaf]].shape


def _rank(captured: Captured, leaf: int) -> int:
    return len(_shape(captured, leaf))


def _leaf(captured: Captured, leaf: int) -> str:
    node = captured.graph[captured.input_nodes[leaf]]
    return f"{node.name} {node.dtype.name.lower()}{list(node.shape)}"
