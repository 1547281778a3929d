"""Strategy: one way to run a node on a mesh, with the specs it needs and what it costs."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from meshplan.cost.collectives import Collective
from meshplan.sharding.spec import ShardingSpec


class StrategySpace(enum.Enum):
    """Which strategies the rules enumerate.

    FULL: every assignment of mesh axes to tensor dims (multi-axis splits included).
    ALPA: the strategy lists of Alpa's playground solver, to reproduce its objectives.
    """

    FULL = "full"
    ALPA = "alpa"


@dataclass(frozen=True, slots=True)
class Strategy:
    """A node's sharding choice.

    Attributes:
        name: readable name, e.g. "S0R = S0R x RR" or "S1 @ 0".
        output: spec of the node's output.
        operands: the spec each operand must arrive in (producers are resharded to it).
        compute: compute cost of the local shard.
        communication: cost of the collectives the strategy itself implies.
        memory: bytes of the output's local shard on one device.
        collectives: those collectives, for reports.
        penalty: a price put on the strategy's memory (CostModel.memory_price), not a time.
    """

    name: str
    output: ShardingSpec
    operands: tuple[ShardingSpec, ...]
    compute: float = 0.0
    communication: float = 0.0
    memory: float = 0.0
    collectives: tuple[Collective, ...] = ()
    penalty: float = 0.0

    @property
    def cost(self) -> float:
        return self.compute + self.communication + self.penalty


@dataclass(frozen=True, slots=True)
class NodeStrategies:
    """The strategies of one node; a follower's strategy i goes with its leader's strategy i.

    Attributes:
        node: node id.
        strategies: the candidates.
        follows: operand position of the followed operand, or None for a free choice.
        fallback: True when no rule knew the op and it was planned replicated.
    """

    node: int
    strategies: tuple[Strategy, ...]
    follows: int | None = None
    fallback: bool = False
