"""Choosing one strategy per op: the search modes."""

from jaxpar.search.propagation import Choice, GraphPlan, propagate

__all__ = ["Choice", "GraphPlan", "propagate"]
