"""Choosing one strategy per op: the search modes.

sharding_propagation (propagation.py) plans outward from the fixed strategies, op by op;
dynamic_programming (exact.py over the solver in dynamic.py) finds the cost model's optimum.
"""

from jaxpar.search.dynamic import Problem, Solution, brute_force, prune_dominated, solve
from jaxpar.search.propagation import Choice, GraphPlan, propagate

__all__ = ["Choice", "GraphPlan", "Problem", "Solution", "brute_force", "propagate",
           "prune_dominated", "solve"]
