"""Compiled HLO text -> the collectives the executable runs, on which axes of the plan's mesh.

Each collective instruction of the optimized HLO (`jax.stages.Compiled.as_text()`) is read
with its result shapes, its operands' shapes and its device groups. The groups are written
in one of three forms, all read here: explicit lists (`{{0,1},{2,3}}`), iota tiles
(`[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)`) and Shardy's mesh form (`mesh['axis_0'=2,'axis_1'=4]
{'axis_1'}`, optionally with `device_ids=...`, a member possibly a sub-axis: `{'axis_1':(2)2}`).
Device ids are the positions in the jit's
device assignment, i.e. row-major over the plan's logical mesh, so a group set names the mesh
axes it spans when it equals the groups of those axes.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\((?P<rest>.*)$")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[subf]\d+|bf16|c64|c128|f8\w*)\[(?P<dims>[\d,]*)\]")
_DTYPE_BYTES = {"pred": 1, "bf16": 2, "c64": 8, "c128": 16}
_OPERAND = re.compile(r"%[\w.\-]+")


@dataclass(frozen=True, slots=True)
class CompiledCollective:
    """One collective instruction of a compiled executable.

    Attributes:
        kind: "all-reduce", "all-gather", "reduce-scatter", "all-to-all" or "collective-permute".
        name: the HLO instruction's name.
        axes: the mesh axes its device groups span, sorted; None when the groups are not those
            of any set of mesh axes (or, for a collective-permute, when its pairs move data
            along no single set of axes).
        buffers: bytes per device of each logical collective it carries, by the plan's
            convention (`meshplan.cost.collectives.Collective.nbytes`: the reduced buffer of an
            all-reduce, the gathered output of an all-gather, the input of a reduce-scatter,
            the bytes held for an all-to-all). XLA's combiners merge collectives of one kind
            over the same groups into one instruction with a tuple of operands: one entry each.
            An all-to-all in tuple form (one chunk per peer) is one collective.
        op_name: the JAX operation it was lowered from (HLO metadata), "" when not recorded.
    """

    kind: str
    name: str
    axes: tuple[int, ...] | None
    buffers: tuple[int, ...]
    op_name: str = ""

    @property
    def nbytes(self) -> int:
        return sum(self.buffers)


def hlo_collectives(hlo_text: str, mesh_shape: Sequence[int]) -> tuple[CompiledCollective, ...]:
    """Every collective instruction of `hlo_text` (async `-start`/`-done` pairs counted once),
    with the mesh axes of `mesh_shape` its device groups span."""
    shapes = _instruction_shapes(hlo_text)
    found = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            found.append(_collective(match, shapes, tuple(mesh_shape)))
    return tuple(found)


def axis_groups(mesh_shape: Sequence[int], axes: Sequence[int]) -> frozenset[frozenset[int]]:
    """The device groups of a collective over `axes` of a row-major mesh of `mesh_shape`."""
    ids = np.arange(math.prod(mesh_shape)).reshape(tuple(mesh_shape))
    rest = [a for a in range(len(mesh_shape)) if a not in axes]
    moved = np.transpose(ids, (*rest, *axes)).reshape(-1, math.prod(mesh_shape[a] for a in axes))
    return frozenset(frozenset(int(i) for i in row) for row in moved)


def _collective(match: re.Match, shapes: dict[str, list[int]], mesh_shape: tuple[int, ...]) -> CompiledCollective:
    kind, rest = match.group("kind"), match.group("rest")
    results = _array_bytes(match.group("shape"))
    operands = _operand_bytes(rest, shapes)
    groups = _pairs_axes(rest, mesh_shape) if kind == "collective-permute" else _groups_axes(rest, mesh_shape)
    if kind == "reduce-scatter":
        buffers = tuple(operands) if len(operands) == len(results) else tuple(r * _group_size(rest) for r in results)
    elif kind == "all-to-all":
        buffers = (sum(results),) if "dimensions=" not in rest else tuple(results)
    else:
        buffers = tuple(results)
    op_name = re.search(r'op_name="([^"]*)"', rest)
    return CompiledCollective(kind, match.group("name"), groups, buffers, op_name.group(1) if op_name else "")


def _instruction_shapes(hlo_text: str) -> dict[str, list[int]]:
    """Instruction name -> bytes of each array in its result (for reading operand sizes)."""
    shapes = {}
    for line in hlo_text.splitlines():
        match = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^=]*?\)|\S+)\s", line)
        if match:
            shapes[match.group(1)] = _array_bytes(match.group(2))
    return shapes


def _array_bytes(text: str) -> list[int]:
    return [math.prod(int(d) for d in m.group("dims").split(",") if d) * _itemsize(m.group("dtype"))
            for m in _ARRAY.finditer(text)]


def _itemsize(dtype: str) -> int:
    if dtype in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype]
    bits = re.search(r"\d+", dtype)
    return max(1, int(bits.group()) // 8) if bits else 4


def _operand_bytes(rest: str, shapes: dict[str, list[int]]) -> list[int]:
    args = rest[:_closing_paren(rest)]
    return [b for name in _OPERAND.findall(args) for b in shapes.get(name[1:], [])]


def _closing_paren(text: str) -> int:
    depth = 1
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return i
    return len(text)


def _group_size(rest: str) -> int:
    groups = _device_groups(rest)
    return max((len(g) for g in groups), default=1) if groups else 1


def _groups_axes(rest: str, mesh_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    groups = _device_groups(rest)
    if groups is None:
        return None
    groups = frozenset(g for g in groups if len(g) > 1)
    for axes in _axis_subsets(mesh_shape):
        if groups == frozenset(g for g in axis_groups(mesh_shape, axes) if len(g) > 1):
            return tuple(a for a in axes if mesh_shape[a] > 1)
    return None


def _axis_subsets(mesh_shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    axes = [a for a, n in enumerate(mesh_shape) if n > 1]
    for k in range(len(axes) + 1):
        yield from itertools.combinations(axes, k)


def _pairs_axes(rest: str, mesh_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The mesh axes along which a collective-permute's source -> target pairs move data."""
    match = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
    if not match:
        return None
    pairs = [tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{(\d+,\d+)", match.group(1) + "}")]
    moved = [(np.unravel_index(s, mesh_shape), np.unravel_index(t, mesh_shape)) for s, t in pairs if s != t]
    return tuple(sorted({a for s, t in moved for a in range(len(mesh_shape)) if s[a] != t[a]}))


def _device_groups(rest: str) -> list[frozenset[int]] | None:
    """The replica groups of an instruction's attributes, in any of the three forms."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=(\(?[^ ]*?\)?))?\s*\{([^}]*)\}", rest)
    if mesh:
        return _mesh_groups(mesh.group(1), mesh.group(2), mesh.group(3))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if iota:
        count, size = int(iota.group(1)), int(iota.group(2))
        ids = _iota_tile(iota.group(3), iota.group(4)).reshape(count, size)
        return [frozenset(int(i) for i in row) for row in ids]
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", rest)
    if explicit:
        return [frozenset(int(i) for i in g.split(",") if i) for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
    return None


def _mesh_groups(axes_text: str, device_ids: str | None, grouped: str) -> list[frozenset[int]]:
    names = re.findall(r"'([^']+)'=(\d+)", axes_text)
    sizes = [int(n) for _, n in names]
    total = math.prod(sizes)
    if device_ids is None:
        ids = np.arange(total)
    elif "[" in device_ids and "<=" not in device_ids and re.fullmatch(r"\(?\[[\d,]+\](T\([\d,]+\))?\)?", device_ids):
        dims = re.search(r"\[([\d,]+)\]", device_ids).group(1)
        perm = re.search(r"T\(([\d,]+)\)", device_ids)
        ids = _iota_tile(dims, perm.group(1) if perm else None)
    else:
        ids = np.array([int(i) for i in re.findall(r"\d+", device_ids)])
    # A member is an axis ('a') or a sub-axis of one ('a':(pre)size: the `size` devices after
    # every `pre`-th along it), so each axis is cut into (pre, size, rest) dims.
    members = {name: (int(pre or 1), int(size) if size else None)
               for name, pre, size in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", grouped)}
    dims, inside = [], []
    for name, n in names:
        pre, size = members.get(name, (1, None))
        size = int(n) // pre if size is None else size
        parts = (pre, size, int(n) // (pre * size))
        if name in members:
            inside.append(len(dims) + 1)
        dims.extend(parts)
    ids = ids.reshape(dims)
    outside = [k for k in range(len(dims)) if k not in inside]
    rows = np.transpose(ids, (*outside, *inside)).reshape(-1, math.prod(dims[k] for k in inside))
    return [frozenset(int(i) for i in row) for row in rows]


def _iota_tile(dims: str, perm: str | None) -> np.ndarray:
    """The ids of an iota tile `[dims]T(perm)`, flattened."""
    shape = tuple(int(d) for d in dims.split(","))
    ids = np.arange(math.prod(shape)).reshape(shape)
    if perm:
        ids = np.transpose(ids, tuple(int(p) for p in perm.split(",")))
    return ids.reshape(-1)
