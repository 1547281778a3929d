"""IntraOptions: every knob of the intra-op pass in one frozen object."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from meshplan.cost.collectives import CollectiveKind
from meshplan.cost.model import CostModel
from meshplan.errors import OptionsError
from meshplan.intra.method_layout import MethodLayout
from meshplan.sharding.context import RuleConfig
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import StrategySpace

SOLVERS = ("highs", "cbc")


@dataclass(frozen=True, slots=True)
class IntraOptions:
    """Options of `solve_intra`.

    Attributes:
        cost: how strategies are priced (collectives, compute on/off, resharding rule).
        space: FULL strategy enumeration, or ALPA to reproduce Alpa's playground lists.
        memory_budget: bytes per device; None takes the mesh's memory_per_device.
        force_batch_dim_to_mesh_dim: contractions must split the batch dim over this axis.
        allow_replicated_parameters: parameters may stay whole on every device.
        share_layers: nodes of identical repeated layers take one shared choice.
        solver: "highs" (default) or "cbc" (PuLP, Alpa's solver).
        time_limit: seconds the solver may run; the best plan found so far is kept.
        mip_gap: relative gap at which the solver may stop.
        contractions_use_all_axes: see RuleConfig; None decides by whether compute is priced.
        reduce_scatter: see RuleConfig.
        layout: the layout a parallelization method promises (intra.method_layout); AUTO
            leaves every choice to the cost model.
        gather_choices: see RuleConfig.
        fixed_specs: see RuleConfig.fixed.
        halo_splits: see RuleConfig.
        runtime_exchanges: see RuleConfig.
    """

    cost: CostModel = field(default_factory=CostModel)
    space: StrategySpace = StrategySpace.FULL
    memory_budget: float | None = None
    force_batch_dim_to_mesh_dim: int | None = None
    allow_replicated_parameters: bool = True
    share_layers: bool = False
    solver: str = "highs"
    time_limit: float = 60.0
    mip_gap: float = 0.0
    contractions_use_all_axes: bool | None = None
    reduce_scatter: bool = False
    layout: MethodLayout = MethodLayout.AUTO
    gather_choices: bool = False
    fixed_specs: tuple[tuple[int, ShardingSpec], ...] = ()
    halo_splits: bool = True
    runtime_exchanges: bool = True

    def __post_init__(self) -> None:
        if self.solver not in SOLVERS:
            raise OptionsError(f"unknown solver {self.solver!r}; use one of {', '.join(SOLVERS)}")
        if self.time_limit <= 0:
            raise OptionsError(f"time_limit must be positive, got {self.time_limit}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise OptionsError(f"memory_budget must be positive bytes, got {self.memory_budget}")

    @property
    def rules(self) -> RuleConfig:
        return RuleConfig(self.space, self.allow_replicated_parameters, self.force_batch_dim_to_mesh_dim,
                          self.contractions_use_all_axes, self.reduce_scatter, self.gather_choices, self.fixed_specs,
                          self.halo_splits, self.runtime_exchanges)

    def replace(self, **changes) -> IntraOptions:
        return replace(self, **changes)

    @staticmethod
    def alpa_unit(forced_costs: dict[CollectiveKind, float] | None = None, **changes) -> IntraOptions:
        """Alpa's playground setting: its strategy lists, truncated unit costs, compute off."""
        return IntraOptions(cost=CostModel.alpa_unit(forced_costs), space=StrategySpace.ALPA, **changes)
