"""Max pooling's gradient split along a dim its window slides over, run with the halo exchanges
the plan priced (`sharding/rules/pooling.py`).

Left to XLA's SPMD partitioner, a row-split `select_and_scatter_add` (JAX lowers it as a padding
of the pooled input, which makes the rows uneven, then a select-and-scatter and a slice) sends
wider, padded blocks than a halo: measured on JAX 0.10.2, a 3x3 stride-2 "SAME" pooling of
16x16x4 rows over 4 devices sent five collective-permutes (2 cotangent rows, 3 input rows, then
2, 2 and 3 rows of the padded 17-wide result) where one input row and one gradient row suffice.
So the runtime runs this op itself, in a `shard_map` over the plan's layout:

1. each device receives the pooled input's halo rows from its neighbours (the forward pooling's
   halo; the devices at either end fill theirs with the padding value, -inf for a max pooling);
2. it scatters the cotangent of its own windows over its rows and the halo rows
   (`select_and_scatter_add` on its block, the window padding reduced by the halo,
   `ir/windows.py`'s `halo_window_padding`): every window sees the entries, in the order, it
   sees on one device, so it selects the same entry;
3. it sends the halo rows' sums back to the neighbours that own those rows, which add them.

Four collective-permutes at most (two when the halo is one-sided), each of halo rows x the rest
of the device's block, as the rule prices them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from meshplan.ir.node import Node
from meshplan.ir.windows import Halo, window_halo, windowed_dims
from meshplan.sharding.spec import ShardingSpec


@dataclass(frozen=True, slots=True)
class HaloSplit:
    """How a device's block of the pooled input sits among its neighbours' along `dim`, split
    over mesh axis `axis` in `shards` blocks of `rows` rows: its halo and the window padding of
    the block extended by the halo (`padding`)."""

    dim: int
    axis: int
    shards: int
    rows: int
    halo: Halo
    padding: tuple[int, int]


def halo_split(node: Node, operand_shape: tuple[int, ...], spec: ShardingSpec,
               mesh_shape: tuple[int, ...]) -> HaloSplit | None:
    """The split of `node` (a select_and_scatter_add laid out as `spec`, its cotangent of
    `operand_shape`) along a windowed dim, if the plan keeps one split (the rule allows one, over
    one mesh axis)."""
    for dim in sorted(windowed_dims(node)):
        axes = spec.dims[dim]
        if len(axes) != 1:
            continue
        shards = mesh_shape[axes[0]]
        found = window_halo(node, operand_shape, dim, shards)
        if found is not None and found[1] is not None:
            return HaloSplit(dim, axes[0], shards, node.shape[dim] // shards, *found)
    return None


def halo_select_and_scatter_add(primitive: Any, params: dict[str, Any], split: HaloSplit, mesh: Mesh,
                                layout: Any) -> Callable[[Any, Any], Any]:
    """A function of (cotangent, pooled input) laid out as `layout` (a PartitionSpec) computing
    `primitive` (select_and_scatter_add with `params`) as described above."""
    axis = mesh.axis_names[split.axis]
    dim, halo, n = split.dim, split.halo, split.shards
    padding = list(params["padding"])
    padding[dim] = split.padding
    local_params = {**params, "padding": tuple(padding)}
    take = lambda x, start, size: jax.lax.slice_in_dim(x, start, start + size, axis=dim)  # noqa: E731
    to_next, to_previous = [(j, j + 1) for j in range(n - 1)], [(j + 1, j) for j in range(n - 1)]

    def block(cotangent: Any, operand: Any) -> Any:
        index = jax.lax.axis_index(axis)
        fill = _padding_value(params["select_prim"], operand.dtype)
        parts = [operand]
        if halo.left:  # the previous device's last rows; the first device's are padding
            left = jax.lax.ppermute(take(operand, split.rows - halo.left, halo.left), axis, to_next)
            parts.insert(0, jnp.where(index == 0, fill, left))
        if halo.right:
            right = jax.lax.ppermute(take(operand, 0, halo.right), axis, to_previous)
            parts.append(jnp.where(index == n - 1, fill, right))
        extended = jax.lax.concatenate(parts, dim) if len(parts) > 1 else operand
        scattered = primitive.bind(cotangent, extended, **local_params)
        own = take(scattered, halo.left, split.rows)
        if halo.left:  # sums over the previous device's rows go back to it, added to its last rows
            back = jax.lax.ppermute(take(scattered, 0, halo.left), axis, to_previous)
            own = _add_rows(own, back, split.rows - halo.left, dim)
        if halo.right:
            ahead = jax.lax.ppermute(take(scattered, halo.left + split.rows, halo.right), axis, to_next)
            own = _add_rows(own, ahead, 0, dim)
        return own

    return jax.shard_map(block, mesh=mesh, in_specs=(layout, layout), out_specs=layout)


def _padding_value(select: Any, dtype: Any) -> Any:
    """What JAX pads the pooled input with: the max's identity for select >= (max pooling), the min's for <=."""
    name = getattr(select, "name", str(select))
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.array(-np.inf if name == "ge" else np.inf, dtype)
    info = jnp.iinfo(dtype)
    return jnp.array(info.min if name == "ge" else info.max, dtype)


def _add_rows(x: Any, rows: Any, start: int, dim: int) -> Any:
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, start + rows.shape[dim])
    return x.at[tuple(index)].add(rows)
