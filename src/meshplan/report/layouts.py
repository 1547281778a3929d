"""Parameter layouts read off a plan, in plain words: data parallel, tensor parallel column/row on
mesh axis k, replicated, optimizer state sharded ZeRO-1/2/3 style.

Input: an IntraPlan (every node's chosen strategy, with the node's shape, operands and tags).
Output: one `ParameterLayout` per parameter and a `StageParallelism` summary per plan.

How a parameter is read:
* its *layout* is the spec it is stored in (the parameter node's output);
* its *use* is the spec the first dot it reaches (through single-operand ops such as converts
  and transposes) requires of it: the forward use, since the forward comes first in the graph.
  A mesh axis splitting the weight there is a *row* split when that dot sums partial results
  over the axis (its all-reduce or reduce-scatter spans it), else a *column* split;
* the *data-parallel axes* split the batch dim (dim 0) of the batch inputs, the *sequence-parallel
  axes* their other dims (batch inputs: nodes tagged so; for graphs without tags, the parameters
  that are neither updated in place nor differentiated, or in a forward graph of layers, the
  parameters outside every layer). Both split the tokens: the *token axes*;
* a weight stored split over a token axis and gathered for use is ZeRO-3; optimizer state (Adam
  moments, fp32 master copies) split over one is ZeRO-1, and ZeRO-2 when the weight's gradient
  is reduce-scattered over it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from meshplan.cost.collectives import CollectiveKind
from meshplan.intra.plan import ChosenStrategy, IntraPlan
from meshplan.sharding.spec import ShardingSpec

# Names the simulator's optimizer gives a weight's state: "<weight>.master", "<weight>.adam_m", ...
OPTIMIZER_SUFFIXES = (".master", ".adam_m", ".adam_v", ".momentum")
_SUMMING = (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER)


@dataclass(frozen=True, slots=True)
class ParameterLayout:
    """One parameter of a plan.

    Attributes:
        name: the parameter's label (a capture path such as "args[0]['w1']", or "layer3.attn.wq").
        shape: its shape ( () when the plan does not record shapes).
        role: "weight" (feeds a contraction), "state" (other trained or carried state),
            "optimizer" (optimizer state of a weight) or "input" (batch data).
        layout: the spec it is stored in.
        use: the spec its first contraction needs (None when it feeds none).
        classification: the plain words, e.g. "tensor parallel column on axis 1, data parallel on axis 0".
        of_weight: for optimizer state, the weight it belongs to.
    """

    name: str
    shape: tuple[int, ...]
    role: str
    layout: ShardingSpec
    use: ShardingSpec | None
    classification: str
    of_weight: str = ""


@dataclass(frozen=True, slots=True)
class StageParallelism:
    """What a plan does overall: data-, sequence- and tensor-parallel axes, ZeRO level."""

    data_axes: tuple[int, ...]
    sequence_axes: tuple[int, ...]
    tensor_axes: tuple[int, ...]
    zero: int  # 0: none, 1: optimizer state sharded, 2: + gradients reduce-scattered, 3: + weights sharded
    batch_option: str  # Alpa's force_batch_dim_to_mesh_dim, read off the batch inputs

    @property
    def summary(self) -> str:
        parts = []
        if self.data_axes:
            parts.append(f"data parallel on {_axes_words(self.data_axes)}")
        if self.sequence_axes:
            parts.append(f"sequence parallel on {_axes_words(self.sequence_axes)}")
        if self.tensor_axes:
            parts.append(f"tensor parallel on {_axes_words(self.tensor_axes)}")
        if self.zero:
            parts.append(f"ZeRO-{self.zero}")
        return ", ".join(parts) or "replicated"


class _Reader:
    """Graph facts of one plan, indexed for the classification."""

    def __init__(self, plan: IntraPlan) -> None:
        self.plan = plan
        self.nodes = {c.node: c for c in plan.nodes}
        self.by_name = {c.name: c for c in plan.nodes}
        self.users: dict[int, list[int]] = {}
        for c in plan.nodes:
            for operand in c.operand_ids:
                self.users.setdefault(operand, []).append(c.node)
        self.params = [c for c in plan.nodes if c.op == "parameter"]
        self.active_axes = tuple(a for a, size in enumerate(plan.mesh.shape) if size > 1)
        self.inputs = {c.node for c in self.params if self._is_input(c)}
        splits = [self.input_split(c) for c in self.params if c.node in self.inputs]
        self.token_axes = tuple(sorted({a for spec in splits for a in spec.axes()}))
        self.data_axes = tuple(sorted({a for spec in splits if spec.rank for a in spec.dims[0]}))
        self.sequence_axes = tuple(a for a in self.token_axes if a not in self.data_axes)

    def _is_input(self, chosen: ChosenStrategy) -> bool:
        if "batch_input" in chosen.tags:
            return True
        tagged = any("batch_input" in c.tags for c in self.params)
        updated = any("aliased" in c.tags for c in self.params)
        if tagged:
            return False
        if not updated:  # a forward graph of layers: the inputs are the parameters outside every layer
            return chosen.layer is None and any(c.layer is not None for c in self.params)
        return "aliased" not in chosen.tags and f"grad.{chosen.name}" not in self.by_name \
            and optimizer_owner(chosen.name) is None

    def input_split(self, chosen: ChosenStrategy) -> ShardingSpec:
        """An input's split: as stored, or (stored whole) as its first contraction slices it."""
        found = self.first_dot(chosen.node)
        if chosen.output.axes() or found is None:
            return chosen.output
        return found[0].operands[found[1]]

    def first_dot(self, node: int) -> tuple[ChosenStrategy, int] | None:
        """The first dot `node` reaches through single-operand ops, with the operand position."""
        frontier, seen, best = [node], set(), None
        while frontier:
            current = frontier.pop()
            for user in self.users.get(current, ()):
                chosen = self.nodes[user]
                if chosen.op == "dot":
                    candidate = (chosen, chosen.operand_ids.index(current))
                    best = candidate if best is None or chosen.node < best[0].node else best
                elif len(chosen.operand_ids) == 1 and user not in seen:
                    seen.add(user)
                    frontier.append(user)
        return best


def optimizer_owner(name: str) -> str | None:
    """The weight whose optimizer state `name` is ("layer0.wq.adam_m" -> "layer0.wq"), else None."""
    for suffix in OPTIMIZER_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return None


def parameter_layouts(plan: IntraPlan) -> tuple[ParameterLayout, ...]:
    """Every parameter of the plan, classified (module docstring)."""
    reader = _Reader(plan)
    return tuple(_classify(reader, c) for c in reader.params)


def stage_parallelism(plan: IntraPlan) -> StageParallelism:
    """The plan's data-parallel and tensor-parallel axes, its ZeRO level and its batch option."""
    reader = _Reader(plan)
    layouts = parameter_layouts(plan)
    data = set(reader.token_axes)
    tensor = sorted({a for p in layouts if p.role == "weight" and p.use for a in p.use.axes()})
    zero = 0
    if any(p.role == "optimizer" and set(p.layout.axes()) & data for p in layouts):
        zero = 2 if _gradients_scattered(reader, data) else 1
    if any(p.role == "weight" and (set(p.layout.axes()) - set(p.use.axes() if p.use else ())) & data for p in layouts):
        zero = 3
    return StageParallelism(reader.data_axes, reader.sequence_axes, tuple(tensor), zero, _batch_option(reader))


def _classify(reader: _Reader, chosen: ChosenStrategy) -> ParameterLayout:
    layout, data = chosen.output, set(reader.token_axes)
    if chosen.node in reader.inputs:
        axes = reader.input_split(chosen).axes()
        words = "input, replicated" if not axes else f"batch input, split over {_axes_words(axes)}" + (
            "" if layout.axes() else " where used (stored whole)")
        return ParameterLayout(chosen.name, chosen.shape, "input", layout, None, words)
    owner = optimizer_owner(chosen.name)
    if owner is not None:
        return ParameterLayout(chosen.name, chosen.shape, "optimizer", layout, None,
                               _state_words(reader, layout, data, "optimizer state"), owner)
    found = reader.first_dot(chosen.node)
    if found is None:
        return ParameterLayout(chosen.name, chosen.shape, "state", layout, None,
                               _state_words(reader, layout, data, ""))
    dot, position = found
    use = dot.operands[position]
    summed = {a for c in dot.collectives if c.kind in _SUMMING for a in c.axes}
    parts = []
    for axis in use.axes():
        parts.append(f"tensor parallel {'row' if axis in summed else 'column'} on axis {axis}")
    gathered = [a for a in layout.axes() if a not in use.axes()]
    if gathered:
        kind = "ZeRO-3" if set(gathered) <= data else "sharded"
        parts.append(f"{kind} on {_axes_words(gathered)} (gathered for use)")
    dp = [a for a in reader.data_axes if a not in use.axes()]
    if dp:
        parts.append(f"data parallel on {_axes_words(dp)}")
    sp = [a for a in reader.sequence_axes if a not in use.axes() and a not in layout.axes()]
    if sp:
        parts.append(f"sequence parallel on {_axes_words(sp)}")
    idle = [a for a in reader.active_axes if a not in use.axes() and a not in data and a not in layout.axes()]
    if idle and not parts:
        parts.append("replicated")
    elif idle:
        parts.append(f"replicated on {_axes_words(idle)}")
    return ParameterLayout(chosen.name, chosen.shape, "weight", layout, use, ", ".join(parts) or "replicated")


def _state_words(reader: _Reader, layout: ShardingSpec, data: set[int], what: str) -> str:
    split = layout.axes()
    if not split:
        if not reader.active_axes:
            return f"{what} (one device)".strip() if what else "one device"
        words = "replicated" + (" (data parallel)" if data else "")
        return f"{what}, {words}" if what else words
    over_data = [a for a in split if a in data]
    others = [a for a in split if a not in data]
    parts = []
    if over_data:
        parts.append(f"sharded ZeRO-style on {_axes_words(over_data)}")
    if others:
        parts.append(f"split on {_axes_words(others)}")
    text = ", ".join(parts)
    return f"{what} {text}" if what else text


def _gradients_scattered(reader: _Reader, data: set[int]) -> bool:
    """Some weight gradient is reduce-scattered over a data-parallel axis (ZeRO-2)."""
    return any(any(k.kind is CollectiveKind.REDUCE_SCATTER and set(k.axes) & data for k in c.collectives)
               for c in reader.plan.nodes if c.name.startswith("grad.") or "accumulated" in c.tags)


def _batch_option(reader: _Reader) -> str:
    """Alpa's force_batch_dim_to_mesh_dim: the mesh axis the batch inputs' dim 0 is split over."""
    return "none" if not reader.data_axes else ",".join(map(str, reader.data_axes))


def _axes_words(axes: Iterable[int]) -> str:
    axes = tuple(axes)
    return f"axis {axes[0]}" if len(axes) == 1 else "axes " + ",".join(map(str, axes))
