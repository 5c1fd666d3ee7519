"""Carried state moved in a complete plan: the exact check of what a search priced roughly.

Before: a Refiner holding a complete plan of a training step, the step's carried units
(links.Units: a parameter and its optimizer moments, whose updates are made together) grouped
in classes (units alike in identical layers, first one first), and the inputs the user fixed.
After: the plan with some units' free state (inputs not fixed by the user) in other specs,
each move kept only where the plan's total (graph_cost) drops.

A unit's state is tried, in turn:
- replicated (its update planned again from what consumers need: gradient reductions may
  all-reduce; small state, where a gather's latency outweighs the work it saves);
- in the spec its update computes it in (Adam's moments follow their parameter's unit in a
  search; when the update cuts them further, keeping them so saves gathering them back each
  step, and memory);
- cut on one dim over some mesh axes, each dim and set of axes in turn (ZeRO: the gradient
  reduce-scattered, the update run on a shard, the new parameter gathered once; planned again
  forwards from the gradient, and where that does not pay, backwards from the state's spec:
  the gradient's sum then lands in it rather than where it is cheapest to reduce).
The main ops making the gradients are planned again with the update (a bias gradient's
reduction then lands where the moved state wants it, not where the search cut it). A class is
tried on its first unit; if a move gains there, on the rest.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

from jaxpar.search.links import Units
from jaxpar.search.refine import Refiner
from jaxpar.spec import MeshInfo, Spec

Move = str | tuple[int, tuple[str, ...]]  # "replicated", "as updated" or (dim, axes)


def place_state(refiner: Refiner, units: Units, classes: Iterable[list[int]],
                user_fixed: dict[int, Spec], mesh: MeshInfo) -> None:
    """Move carried state in `refiner`'s plan (see the module docstring).

    Args:
      refiner: holds the plan; its fixed_in has the carried inputs' specs (updated here).
      units: the search's units; carried ones are numbered from len(graph.ops).
      classes: the units of each class, first one first (main ops' classes are skipped).
      user_fixed: {value: Spec} the user fixed; those inputs never move.
      mesh: the mesh the plan is for.

    Example:
      >>> place_state(refiner, sapp.units, sapp.members.values(), fixed_in, model.mesh)
    """
    g, names = refiner.g, mesh.names
    for xs in classes:
        if xs[0] < len(g.ops):
            continue
        rank = len(g.values[units.state(xs[0])[0][0]].shape)
        cuts = [(d, axes) for d in range(rank) for k in range(len(names), 0, -1)
                for axes in itertools.combinations(names, k)]
        for how in ("replicated", "as updated", *cuts):
            for x in xs:
                if not _move(refiner, units, user_fixed, mesh, x, how):
                    break


def _move(refiner: Refiner, units: Units, user_fixed: dict[int, Spec], mesh: MeshInfo, x: int,
          how: Move) -> bool:
    """Carried unit x's free state moved as `how` says; True if kept."""
    g, specs = refiner.g, refiner.plan.specs
    state = [(v, w) for v, _, w in units.state(x)
             if v not in user_fixed and v in refiner.fixed_in]
    if how == "replicated":
        state = state if any(specs[v].axes() for v, _ in state) else []
        new = {v: Spec.replicated(len(g.values[v].shape)) for v, _ in state}
    elif how == "as updated":
        state = [(v, w) for v, w in state if specs[w].resolved() != specs[v]]
        new = {v: specs[w].resolved() for v, w in state}
    else:
        dim, axes = how
        pieces = math.prod(mesh.axis_size(a) for a in axes)
        new = {v: Spec(tuple(axes if d == dim else () for d in range(len(g.values[v].shape))))
               for v, _ in state if len(g.values[v].shape) > dim
               and g.values[v].shape[dim] % pieces == 0}
        state = [(v, w) for v, w in state if v in new and new[v] != specs[v]]
    if not state:
        return False
    starts = {"replicated": ("needs",), "as updated": ("current",)}.get(how,
                                                                       ("operands", "needs"))
    region, outputs = units.update_region(x), {w: new[v] for v, w in state}
    if not any(refiner.replan(region, new, outputs, set(), start) for start in starts):
        return False
    refiner.fixed_in.update(new)
    return True
