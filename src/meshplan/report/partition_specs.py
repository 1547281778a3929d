"""A plan's parameter layouts as JAX PartitionSpecs, in the parameter tree's structure.

Input: a Plan. Output: nested dicts/tuples whose leaves are PartitionSpec entries (one entry per
tensor dim: None, a mesh axis name, or a tuple of names), and the same as Python source a user
pastes into Flax/MaxText code. Mesh axis k is named as the runtime names it ("x", "y", "z", then
"a3", ...), so the specs apply to the meshes `meshplan.runtime.make_jax_mesh` builds.

Tree structure: a captured program's leaves are named by their path ("args[0]['w1']",
"args[1][0].mu['w']"): dict keys stay keys, sequence indices become tuple positions and
attributes become keys. A simulated model's names ("layer3.attn.wq") nest by their dots, each
piece plan repeated for every layer it covers; optimizer state goes under `opt_state` by kind
(`adam_m`, `adam_v`, `master`), in the same structure. Batch inputs of simulated pieces
(activations, cotangents, tokens, labels) are stage internals and left out.
"""

from __future__ import annotations

import re
from typing import Any

from meshplan.errors import PlanValidationError
from meshplan.intra.plan import IntraPlan
from meshplan.plan import Plan, Stage
from meshplan.report.breakdown import stage_plans
from meshplan.report.layouts import optimizer_owner, parameter_layouts
from meshplan.sharding.spec import ShardingSpec

_AXIS_NAMES = ("x", "y", "z")
_PATH_PART = re.compile(r"\[(\d+)\]|\['((?:[^'\\]|\\.)*)'\]|\[\"((?:[^\"\\]|\\.)*)\"\]|\.?([A-Za-z_][\w\-]*)")
_LAYER = re.compile(r"^layer\d+\.")

Entry = None | str | tuple[str, ...]


def axis_names(ndim: int) -> tuple[str, ...]:
    """The runtime's mesh axis names (meshplan.runtime.axis_names, without importing JAX)."""
    return tuple(_AXIS_NAMES[i] if i < len(_AXIS_NAMES) else f"a{i}" for i in range(ndim))


def spec_entries(spec: ShardingSpec) -> tuple[Entry, ...]:
    """PartitionSpec entries of a spec: per dim None, an axis name, or a tuple of names."""
    names = axis_names(1 + max(spec.axes(), default=0))
    entries: list[Entry] = []
    for axes in spec.dims:
        entries.append(None if not axes else names[axes[0]] if len(axes) == 1 else tuple(names[a] for a in axes))
    return tuple(entries)


def path_parts(name: str) -> list[str | int] | None:
    """"args[0]['w1']" -> ["args", 0, "w1"]; "layer3.attn.wq" -> ["layer3", "attn", "wq"]; None
    when the name is not a path (e.g. "%12")."""
    parts: list[str | int] = []
    position = 0
    while position < len(name):
        match = _PATH_PART.match(name, position)
        if match is None or match.end() == position:
            return None
        index, single, double, attr = match.groups()
        parts.append(int(index) if index is not None else single if single is not None
                     else double if double is not None else attr)
        position = match.end()
    return parts or None


def partition_spec_tree(plan: Plan) -> dict[str, Any]:
    """{"mesh_axes": ..., "stages": [per stage {"mesh_shape", "specs"}]}; `specs` is the stage's
    parameter tree of PartitionSpec entries (see the module docstring)."""
    stages = []
    for stage in plan.stages:
        leaves: dict[tuple[str | int, ...], tuple[Entry, ...]] = {}
        for name, layers, intra in _stage_pieces(stage):
            for p in parameter_layouts(intra):
                for path in _paths(p.name, p.role, name, layers):
                    leaves[path] = spec_entries(p.layout)
        if not leaves:
            continue
        stages.append({"mesh_shape": tuple(stage.logical_mesh), "mesh_axes": axis_names(len(stage.logical_mesh)),
                       "layers": (stage.first_layer, stage.last_layer), "specs": _nest(leaves)})
    if not stages:
        raise PlanValidationError(f"the plan of {plan.model!r} holds no parameter layouts (no intra-op plan per "
                                  "stage); write it with `meshplan simulate --out`, `meshplan intra --out` or "
                                  "dump_debug_info")
    return {"model": plan.model, "stages": stages}


def _stage_pieces(stage: Stage) -> list[tuple[str, tuple[int, int], IntraPlan]]:
    if stage.pieces:
        return [(p.name, (p.first_layer, p.last_layer), p.intra_plan) for p in stage.pieces]
    return [("stage", (stage.first_layer, stage.last_layer), i) for _, _, i in stage_plans(stage)]


def _paths(name: str, role: str, piece: str, layers: tuple[int, int]) -> list[tuple[str | int, ...]]:
    if piece == "stage":  # a captured or hand-built graph: the name is the path
        parts = path_parts(name)
        return [tuple(parts)] if parts else []
    if role == "input":
        return []
    owner = optimizer_owner(name)
    prefix: tuple[str, ...] = ()
    if owner is not None:
        prefix = ("opt_state", name[len(owner) + 1:])
        name = owner
    if _LAYER.match(name):
        local = _LAYER.sub("", name)
        return [(*prefix, *path_parts(f"layer{k}.{local}")) for k in range(layers[0], layers[1] + 1)]
    parts = path_parts(name)
    return [(*prefix, *parts)] if parts else []


def _nest(leaves: dict[tuple[str | int, ...], tuple[Entry, ...]]) -> Any:
    """Paths -> nested dicts; a dict whose keys are exactly 0..n-1 becomes a tuple."""
    root: dict[Any, Any] = {}
    for path, entries in leaves.items():
        node = root
        for key in path[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):  # a leaf and a subtree share a name: keep the subtree apart
                child = node[key] = {"": child}
            node = child
        node[path[-1]] = _Spec(entries)
    return _sequences(root)


class _Spec(tuple):
    """A leaf: PartitionSpec entries (a distinct type so nesting can tell leaves from tuples)."""


def _sequences(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    converted = {k: _sequences(v) for k, v in node.items()}
    if converted and all(isinstance(k, int) for k in converted) and sorted(converted) == list(range(len(converted))):
        return tuple(converted[i] for i in range(len(converted)))
    return converted


def is_spec(value: Any) -> bool:
    """Whether a value of `partition_spec_tree`'s output is a leaf (PartitionSpec entries)."""
    return isinstance(value, _Spec)


def python_source(plan: Plan) -> str:
    """The layouts as a Python module: `mesh_axes`, `mesh_shape` and `partition_specs` (one
    stage), or `stages` (a list of dicts with those keys) for a pipeline."""
    tree = partition_spec_tree(plan)
    lines = [f'"""PartitionSpecs of the meshplan plan of {plan.model} ({plan.source}); mesh axis k is named',
             f'{", ".join(axis_names(3))}, ... as in meshplan.runtime.make_jax_mesh."""', "",
             "from jax.sharding import PartitionSpec as P", ""]
    if len(tree["stages"]) == 1:
        stage = tree["stages"][0]
        lines += [f"mesh_axes = {stage['mesh_axes']!r}", f"mesh_shape = {stage['mesh_shape']!r}",
                  f"partition_specs = {_source(stage['specs'], 0)}"]
    else:
        lines.append("stages = [")
        for stage in tree["stages"]:
            lines += [f"    {{  # layers {stage['layers'][0]}-{stage['layers'][1]}",
                      f"        'mesh_axes': {stage['mesh_axes']!r},",
                      f"        'mesh_shape': {stage['mesh_shape']!r},",
                      f"        'partition_specs': {_source(stage['specs'], 2)},", "    },"]
        lines.append("]")
    return "\n".join(lines) + "\n"


def _source(node: Any, depth: int) -> str:
    pad, inner = "    " * depth, "    " * (depth + 1)
    if is_spec(node):
        return "P(" + ", ".join(repr(e) for e in node) + ")"
    if isinstance(node, tuple):
        items = [f"{inner}{_source(v, depth + 1)}," for v in node]
        return "(\n" + "\n".join(items) + f"\n{pad})"
    items = [f"{inner}{k!r}: {_source(v, depth + 1)}," for k, v in node.items()]
    return "{\n" + "\n".join(items) + f"\n{pad}}}"
