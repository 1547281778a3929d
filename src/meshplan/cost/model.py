"""CostModel: how strategies are priced (collectives, compute, resharding rule)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from meshplan.cost.collectives import CollectiveCosts, CollectiveKind
from meshplan.cost.kernels import KernelCosts


class ReshardingRule(enum.Enum):
    """How a change of sharding is priced.

    EXACT: axes that move to another dim cost an all-to-all of the local shard, axes that are
    dropped cost an all-gather of the resulting shard, new splits are free slicing.
    ALPA: Alpa's playground rule: one all-gather of the full tensor per mesh axis whose split
    changes (moves are not all-to-alls); used to reproduce its published objectives.
    """

    EXACT = "exact"
    ALPA = "alpa"


@dataclass(frozen=True, slots=True)
class CostModel:
    """Prices communication and compute of strategies on one logical mesh.

    Attributes:
        collectives: the collective cost formulas (alpha-beta per mesh axis).
        flops_per_second: sustained FLOP/s of one device; None switches compute cost off
            (Alpa's setting: then every device must take part in every contraction, or
            replication would look free).
        resharding: how changes of sharding between producer and consumer are priced.
        accumulation_weight: weight of the collectives of nodes marked `accumulated`
            (parameter gradients summed over micro-batches and synchronised once per
            iteration): 1 / number of micro-batches when the graph is one micro-batch.
        memory_price: cost per byte of parameter memory held per device; a positive price
            trades time for memory (sharded weights and optimizer state) without a budget.
        activation_price: cost per byte of every other value; a tiny price breaks ties
            between plans of equal time towards the one holding less memory.
        parameters_held: the liveness rule of memory. True (meshplan's default): parameters
            are the caller's buffers (weights, optimizer state, inputs), held for the whole step
            whatever the plan, as they are on the devices; every other value lives from its
            definition to its last use. False (Alpa's playground): every value, parameters
            included, lives from its definition to its last use.
        replicated_parameter_cost: cost added to a parameter's replicated strategy (Alpa's
            playground charges 2 units, so that ties break towards sharded parameters).
        kernels: the device's kernel models (meshplan.cost.kernels): contractions on the GEMM
            efficiency curve, attention cores as fused attention, every other op as a
            memory-bound kernel by the bytes it moves under kernel fusion (meshplan.cost.fusion),
            values that are never written hold no memory. None: every op at
            `flops_per_second`, every value held (Alpa's model, the runtime's measured costs).
        gradient_bytes: bytes per element of accumulated gradients, held and reduced (4: fp32
            main gradients, Megatron's default); None: the gradient's own dtype.
    """

    collectives: CollectiveCosts = field(default_factory=CollectiveCosts)
    flops_per_second: float | None = None
    resharding: ReshardingRule = ReshardingRule.EXACT
    accumulation_weight: float = 1.0
    memory_price: float = 0.0
    activation_price: float = 0.0
    parameters_held: bool = True
    replicated_parameter_cost: float = 0.0
    kernels: KernelCosts | None = None
    gradient_bytes: int | None = None

    @property
    def compute_on(self) -> bool:
        return self.flops_per_second is not None

    def compute_cost(self, flops: float) -> float:
        return flops / self.flops_per_second if self.flops_per_second else 0.0

    def contraction_cost(self, flops: float, m: float, n: float, k: float, batch: float = 1.0) -> float:
        """Seconds of `batch` local (m x k) @ (k x n) products (`flops` in all)."""
        if not self.flops_per_second:
            return 0.0
        if self.kernels is None:
            return self.compute_cost(flops)
        return self.kernels.gemm(m, n, k, batch)

    @staticmethod
    def alpa_unit(forced: dict[CollectiveKind, float] | None = None) -> CostModel:
        """Alpa's playground cost units: truncated alpha-beta terms, tie constants, compute off,
        2 units per replicated parameter, and its liveness rule (parameters freed after their
        last use), so objectives and memory-budget boundaries equal its solver's."""
        return CostModel(
            CollectiveCosts(truncate=True, tie_constants=True, alpa_all_to_all=True,
                            forced=tuple(sorted((forced or {}).items(), key=lambda kv: kv[0].value))),
            flops_per_second=None,
            resharding=ReshardingRule.ALPA,
            parameters_held=False,
            replicated_parameter_cost=2.0,
        )
