"""The registry of strategy rules, keyed by op kind."""

from __future__ import annotations

from collections.abc import Callable

from meshplan.ir.node import Node, OpKind
from meshplan.sharding.context import RuleContext
from meshplan.sharding.strategy import NodeStrategies

Rule = Callable[[Node, RuleContext], NodeStrategies]
_RULES: dict[OpKind, Rule] = {}


def register_rule(*kinds: OpKind) -> Callable[[Rule], Rule]:
    """Decorator: `rule` enumerates the strategies of nodes of these kinds."""

    def decorate(rule: Rule) -> Rule:
        for kind in kinds:
            _RULES[kind] = rule
        return rule

    return decorate


def rule_for(kind: OpKind) -> Rule | None:
    return _RULES.get(kind)
