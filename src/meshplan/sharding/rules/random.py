"""Rules for random numbers and PRNG keys (the RANDOM op kind).

Partitionable `random_bits` (threefry whose bits depend on key and position only) may be split
any way: each device draws its own part, free of communication, and the numbers equal one
device's. Keys, `rng_bit_generator` and raw threefry are replicated: their values would change
with the layout, and keys are a few bytes.
"""

from __future__ import annotations

from meshplan.ir.node import Node, OpKind
from meshplan.sharding.context import RuleContext
from meshplan.sharding.rules.leaves import full_specs
from meshplan.sharding.rules.registry import register_rule
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import NodeStrategies, Strategy


@register_rule(OpKind.RANDOM)
def random_strategies(node: Node, ctx: RuleContext) -> NodeStrategies:
    keys = tuple(ShardingSpec.replicated(ctx.graph[o].rank) for o in node.operands)
    specs = [ShardingSpec.replicated(node.rank)]
    if node.attr("partitionable"):
        specs += [s for s in full_specs(node, ctx) if not s.is_replicated]
    return NodeStrategies(node.id, tuple(_strategy(node, spec, keys, ctx) for spec in specs))


def _strategy(node: Node, out: ShardingSpec, keys: tuple[ShardingSpec, ...], ctx: RuleContext) -> Strategy:
    memory = ctx.held_bytes(node, out)
    compute = 0.0 if ctx.fusion is not None else ctx.model.compute_cost(ctx.local_flops(node, out.axes()))
    return Strategy(f"{out} = {node.op}", out, keys, compute=compute,
                    memory=memory, penalty=ctx.model.activation_price * memory)
