"""Sharding rules, one module per primitive family; see registry.py."""

from jaxpar.rules.registry import RULES, Loop, OpInfo, candidates, has_rule, loop_strategies

__all__ = ["RULES", "Loop", "OpInfo", "candidates", "has_rule", "loop_strategies"]
