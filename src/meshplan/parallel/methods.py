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
    """Data parallelism: a 1-D mesh of all devices, batch arguments split over it.

    Parameters carry no memory price, so the plan keeps them whole on every device unless
    splitting one is strictly cheaper in the cost model (e.g. a value used only elementwise).
    """

    def mesh(self, num_devices: int) -> tuple[int, ...]:
        return (num_devices,)

    def options(self, costs: DeviceCosts) -> IntraOptions:
        return _plain_options(costs, force_batch_dim_to_mesh_dim=0)

    @property
    def splits_batch(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True, slots=True)
class Zero2Parallel(DataParallel):
    """Data parallelism with a memory price that shards what is cheap to shard (ZeRO-2-like).

    A captured function does not tell weights from optimizer state: both are inputs, and
    without `donate_argnums` meshplan's captured graphs carry no parameter->update aliases,
    so each input's layout is chosen on its own. A price of half a byte's transfer time per
    byte held makes a split pay off only when it costs (almost) no communication: optimizer
    moments, used only elementwise with reduce-scattered gradients, end up sharded; weights
    that the forward pass needs whole stay replicated (splitting them would cost an
    all-gather per step).
    Whether a given tensor is sharded is the ILP's decision; read it from `get_plan()`.
    """

    def options(self, costs: DeviceCosts) -> IntraOptions:
        cost = CostModel(flops_per_second=costs.flops_per_second, memory_price=0.5 * costs.beta)
        return IntraOptions(cost=cost, force_batch_dim_to_mesh_dim=0)


@dataclasses.dataclass(frozen=True, slots=True)
class Zero3Parallel(DataParallel):
    """Data parallelism with every non-batch input (weights and optimizer state) sharded (ZeRO-3).

    Inputs with no dim that the mesh can split (scalars, tiny vectors) stay replicated.
    """

    def options(self, costs: DeviceCosts) -> IntraOptions:
        cost = CostModel(flops_per_second=costs.flops_per_second, memory_price=10 * costs.beta)
        return IntraOptions(cost=cost, force_batch_dim_to_mesh_dim=0, allow_replicated_parameters=False)


@dataclasses.dataclass(frozen=True, slots=True)
class TensorParallel:
    """Megatron-style tensor parallelism: a 1-D mesh of all devices on which no input may stay
    whole, so weights are split (column then row in an MLP) and the ILP picks how."""

    def mesh(self, num_devices: int) -> tuple[int, ...]:
        return (num_devices,)

    def options(self, costs: DeviceCosts) -> IntraOptions:
        return _plain_options(costs, allow_replicated_parameters=False)

    @property
    def splits_batch(self) -> bool:
        return False


SPMD_METHODS = (ShardParallel, DataParallel, Zero2Parallel, Zero3Parallel, TensorParallel)
