"""Halo exchanges: the collective-permutes that bring each device its neighbours' border rows
when a windowed op (convolution, pooling) is split along a dim its window slides over.

XLA's SPMD partitioner sends each halo as one collective-permute per direction: every device
but the last (first) sends its first (last) `rows` to the device before (after) it along the
mesh axis. Each carries rows x the rest of the device's block: bytes = rows / block rows x the
operand's local bytes. With two dims split (2-D tiles), the partitioner exchanges them in dim
order, the later dim's rows spanning the block grown by the earlier dim's halo (corners
included), measured on JAX 0.10.2.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from meshplan.cost.collectives import Collective, CollectiveKind
from meshplan.ir.node import Node
from meshplan.ir.windows import Halo
from meshplan.sharding.context import RuleContext
from meshplan.sharding.spec import ShardingSpec


def halo_exchange(ctx: RuleContext, operand: Node, spec: ShardingSpec, dim: int, halo: Halo,
                  grown: Mapping[int, int] | None = None) -> tuple[Collective, ...]:
    """The collective-permutes that give each device `halo` rows of `operand` (laid out as
    `spec`, split along `dim`) from its neighbours; `grown`: rows the device's block has already
    received along other dims (their halos, exchanged before)."""
    axes = spec.dims[dim]
    block = list(spec.shard_shape(operand.shape, ctx.mesh))
    for other, rows in (grown or {}).items():
        block[other] += rows
    per_row = math.prod(block) // block[dim] * operand.dtype.itemsize
    return tuple(ctx.collective(CollectiveKind.COLLECTIVE_PERMUTE, axes, n * per_row)
                 for n in (halo.left, halo.right) if n)
