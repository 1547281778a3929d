"""Parallelization methods: small frozen records saying how `parallelize` plans a function.

Every method gives the intra-op ILP's options for the devices' costs (`Method`). The methods
that shard one step over one logical mesh (`SpmdMethod`: ShardParallel, DataParallel,
Zero2Parallel, Zero3Parallel, TensorParallel) also give that mesh's shape and whether the
batch arguments are split; PipeshardParallel (meshplan.parallel.pipeshard) pipelines stages.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol, runtime_checkable

from meshplan.cluster.costs import DeviceCosts, default_mesh_shape
from meshplan.cost.model import CostModel
from meshplan.errors import MeshError
from meshplan.intra.method_layout import MethodLayout
from meshplan.intra.options import IntraOptions


@runtime_checkable
class Method(Protocol):
    """What every method gives `parallelize`: the ILP options to plan with."""

    def options(self, costs: DeviceCosts) -> IntraOptions:
        """The intra-op ILP's options on devices that cost `costs`."""
        ...


@runtime_checkable
class SpmdMethod(Method, Protocol):
    """A method that shards one step over one logical mesh of all devices."""

    def mesh(self, num_devices: int) -> tuple[int, ...]:
        """The logical mesh shape for `num_devices` devices."""
        ...

    @property
    def splits_batch(self) -> bool:
        """Whether the batch arguments are split over mesh axis 0 (data parallelism)."""
        ...


def _plain_options(costs: DeviceCosts, **extra) -> IntraOptions:
    return IntraOptions(cost=CostModel(flops_per_second=costs.flops_per_second), **extra)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardParallel:
    """Automatic intra-op parallelism: the ILP chooses every sharding.

    Attributes:
        mesh_shape: logical mesh shape; its product must equal the device count.
            None: `default_mesh_shape(n)`.
        memory_price: price of each byte a device holds, in units of the slowest link's
            seconds per byte: 0 plans for time alone; 0.5 (Zero2Parallel's price) makes a
            split pay off when it costs (almost) no communication, e.g. a KV cache split by
            batch or heads (`meshplan.serve`'s default).
    """

    mesh_shape: tuple[int, ...] | None = None
    memory_price: float = 0.0

    def mesh(self, num_devices: int) -> tuple[int, ...]:
        shape = default_mesh_shape(num_devices) if self.mesh_shape is None else tuple(self.mesh_shape)
        if math.prod(shape) != num_devices:
            raise MeshError(
                f"ShardParallel(mesh_shape={shape}) needs {math.prod(shape)} devices but {num_devices} are "
                f"used; give a mesh_shape whose product is {num_devices}, e.g. {default_mesh_shape(num_devices)}, "
                f"or pass that many devices to parallelize(devices=...)")
        return shape

    def options(self, costs: DeviceCosts) -> IntraOptions:
        cost = CostModel(flops_per_second=costs.flops_per_second, memory_price=self.memory_price * costs.beta)
        return IntraOptions(cost=cost)

    @property
    def splits_batch(self) -> bool:
        return False


@dataclasses.dataclass(frozen=True, slots=True)
class DataParallel:
    """Data parallelism: a 1-D mesh of all devices; every value the batch reaches is split along
    its batch dim and nothing else, every other value (weights, gradients once summed, optimizer
    state and update) is whole on every device. The only collectives are the all-reduces that
    sum gradients (and losses) over the batch, which XLA fuses into one per bucket
    (`MethodLayout.DATA_PARALLEL`, a constraint on the plan, not a price).
    """

    def mesh(self, num_devices: int) -> tuple[int, ...]:
        return (num_devices,)

    def options(self, costs: DeviceCosts) -> IntraOptions:
        return _plain_options(costs, force_batch_dim_to_mesh_dim=0, layout=MethodLayout.DATA_PARALLEL)

    @property
    def splits_batch(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True, slots=True)
class Zero2Parallel(DataParallel):
    """Data parallelism with the optimizer state sharded at rest (ZeRO-2).

    Batch values as under DataParallel; weights (inputs the forward pass reads) whole at rest,
    before and after the step; optimizer state (the other inputs the step updates) split along
    one dim over all devices, before and after the step. Gradients may be reduce-scattered onto
    that split, the update runs on each device's shard and the new weights are all-gathered;
    how is the cost model's choice (`MethodLayout.ZERO2`). Inputs with no dim the device count
    divides stay whole.
    """

    def options(self, costs: DeviceCosts) -> IntraOptions:
        return _plain_options(costs, force_batch_dim_to_mesh_dim=0, reduce_scatter=True, layout=MethodLayout.ZERO2)


@dataclasses.dataclass(frozen=True, slots=True)
class Zero3Parallel(DataParallel):
    """Data parallelism with weights and optimizer state sharded at rest (ZeRO-3).

    Batch values as under DataParallel; every other input the step updates (weights and
    optimizer state) split along one dim over all devices, before and after the step; each
    weight is all-gathered where an operator uses it (`MethodLayout.ZERO3`). Inputs with no dim
    the device count divides stay whole.
    """

    def options(self, costs: DeviceCosts) -> IntraOptions:
        return _plain_options(costs, force_batch_dim_to_mesh_dim=0, reduce_scatter=True, layout=MethodLayout.ZERO3)


@dataclasses.dataclass(frozen=True, slots=True)
class TensorParallel:
    """Megatron-style tensor parallelism on a 1-D mesh of all devices: the batch inputs are
    whole on every device and no value is split along its batch dim; every weight of rank 2 or
    more is split along one dim (column then row in an MLP, as the ILP finds cheapest)
    (`MethodLayout.TENSOR_PARALLEL`)."""

    def mesh(self, num_devices: int) -> tuple[int, ...]:
        return (num_devices,)

    def options(self, costs: DeviceCosts) -> IntraOptions:
        return _plain_options(costs, layout=MethodLayout.TENSOR_PARALLEL)

    @property
    def splits_batch(self) -> bool:
        return False


SPMD_METHODS = (ShardParallel, DataParallel, Zero2Parallel, Zero3Parallel, TensorParallel)


_LAYOUT_RULES = {
    MethodLayout.AUTO: "every layout is the cost model's choice (the ILP prices compute, collectives and "
                       "resharding; it may split element-wise work and gather activations where a data-parallel "
                       "plan would replicate weights and all-reduce gradients)",
    MethodLayout.DATA_PARALLEL: "batch values split along the batch dim, everything else whole; only gradient "
                                "(and loss) all-reduces",
    MethodLayout.ZERO2: "batch values split along the batch dim, weights whole at rest, optimizer state split "
                        "along one dim at rest; gradients reduce-scattered or all-reduced, new weights all-gathered",
    MethodLayout.ZERO3: "batch values split along the batch dim, weights and optimizer state split along one dim "
                        "at rest, each weight all-gathered for its use",
    MethodLayout.TENSOR_PARALLEL: "batch inputs whole, no value split along its batch dim, weights split along one "
                                  "dim and used where they lie (no weight gathered)",
}


def layout_rule(method: SpmdMethod) -> str:
    """What `method` promises about the layout of every value, in words (for reports)."""
    layout = method.options(DeviceCosts()).layout
    return f"{type(method).__name__}: {_LAYOUT_RULES[layout]}"
