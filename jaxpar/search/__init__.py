"""Choosing one strategy per op: the search modes.

sharding_propagation (propagation.py) plans outward from the fixed strategies, op by op, and
semi.py polishes its plan (refine.py, and the step's tail solved exactly by resolve.py);
dynamic_programming (exact.py over the solver in dynamic.py) finds the cost model's optimum;
recursive_programming (recursive.py: SAPP over the units and links of links.py, completed by
propagation, refine.py and state.py) cuts the main ops axis by axis, then solves the last
axis and the first again exactly, each with the others held, and the ops around the largest
carried state over every axis (resolve.py).
"""

import contextlib
import gc

from jaxpar.search.dynamic import Problem, Solution, brute_force, prune_dominated, solve
from jaxpar.search.propagation import Choice, GraphPlan, propagate

__all__ = ["Choice", "GraphPlan", "Problem", "Solution", "brute_force", "paused_gc", "propagate",
           "prune_dominated", "solve"]


@contextlib.contextmanager
def paused_gc():
    """Python's cyclic garbage collector off for a search: a search makes many small objects
    and frees few of them early, and with a big program's jaxpr, graph and caches alive each
    full collection walks them all (a third of a 48-layer GPT's planning time).

    On the way out, what the search left alive (its caches, the plan: close to a million
    objects for a 48-layer GPT) joins the oldest generation unscanned (gc.freeze, then
    gc.unfreeze), where a young collection would walk it all once more (0.3 to 0.5 s).
    Garbage among it goes at the next full collection. Not when the caller froze objects of
    its own (before a fork, say): unfreeze would release theirs too."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()
