"""Pricing strategies: hardware profiles, collective and resharding costs, per-op costs."""

from jaxpar.cost.comm import Collective, collective_time, reshard
from jaxpar.cost.hardware import HardwareProfile, Link, load_profile
from jaxpar.cost.model import CostModel, OpCost

__all__ = ["Collective", "CostModel", "HardwareProfile", "Link", "OpCost", "collective_time",
           "load_profile", "reshard"]
