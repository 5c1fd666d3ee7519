"""Parts of a complete plan solved again exactly, the rest held: one mesh axis, or a region.

Before: an OpGraph, a complete GraphPlan of it (recursive_programming's), the specs the user
fixed, carried-state ties, a CostModel, one mesh axis. After: the cheapest plan in which every
op keeps how its strategy uses the other axes (the dims each operand and result is cut on over
them, the reductions over them) and every free input keeps its cut on them; only the use of
`axis` changes. It is dynamic_programming over those candidates (a handful per op where the
full lists hold hundreds), so it is exact over them, and repeated layers are solved once.

recursive_programming decides the axes one at a time with a model of its units' links, which
prices roughly a layout that cuts one block one way and its neighbour another (a tensor
parallel MLP inside data parallel attention). Solved again so, the last axis takes the layout
the exact objective prefers given the others: a GPT step (2 layers, d 1024) on 2 x 2 x 2
devices, default objective, 4.264 -> 4.136 ms (the exact search: 4.086).

A region of the graph is solved again so too (solve_region): its ops may take any strategy,
over every axis, and the free inputs they read any spec, while every other op and input keeps
the plan's. Its tables hold the region alone (tables.Region: what crosses its border is
priced from the held specs), so it costs what the region's size does, not the graph's.
recursive_programming solves so the neighbourhood of the largest carried state (a language
model's embedding table, read by the lookup and by the tied output head); the
sharding_propagation mode its step's tail (solve_tail) and its latency-bound collectives
(solve_latency_bound).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from jaxpar import progress
from jaxpar.cost.model import COMBINED_KINDS, CostModel, OpCost
from jaxpar.ir.graph import OpGraph
from jaxpar.ir.repeat import ROUNDS
from jaxpar.search.exact import dynamic_programming, repeats
from jaxpar.search.propagation import GraphIndex, GraphPlan, graph_cost
from jaxpar.search.tables import Region
from jaxpar.spec import OpStrategy, Spec, derived

_SMALL_HOPS = 4  # solve_latency_bound: def-use steps through small values around its seeds
_UNTIED_OPS = 500  # the solves again search a graph of at most this many ops op by op
_DEEP_ROUNDS = 2   # a deep model's solves again tie ops alike within this many hops
REGION_AXES = 2    # on meshes of more axes than this plus one, a region's op changes its
                   # use of at most this many axes at once (solve_region)


def _tying(graph: OpGraph) -> dict:
    """dynamic_programming's tie_repeats and tie_rounds for a solve again: the repeats
    op_classes finds tied (a solve again trades exactness for speed: the 8-layer GPT step of
    benchmarks/search_time.py took 1.4 to 3.4 times as long to plan with them untied), but in
    a small graph only where exact.repeats ties them (a 128 x 128 MLP's two weights, alike
    within op_classes' eight hops, tied to one layout kept recursive_programming off the
    Megatron pair: 1.5x the objective).

    In a deep model (exact.repeats' rule over _DEEP_ROUNDS hops: ops alike within them at
    most a quarter of the ops, a GPT or ViT step of 4 layers or more) the ties are by two
    hops, not eight: eight tell apart the four layers nearest each end (a 48-layer GPT step's
    tables: 1025 nodes, more than a 2-layer step's untied), two tie them to the rest (its op
    classes 940 -> 417, as many as at 4 or 8 layers). benchmarks/search_time.py's 48-layer
    step: recursive_programming 6.5 -> 5.3 s, sharding_propagation 7.5 -> 4.7 s, every plan
    of 2 to 48 layers the same. GPT and ViT steps of 4 and 8 layers (d 256 and 128), over
    search_gap.py's meshes, hardware profiles and objectives (72 cases), each planned with
    these ties and with eight hops in one process: recursive_programming 18%, 29% and 38%
    faster on 8, 4 x 2 and 2 x 2 x 2 devices, 68 plans scoring the same and four more, the
    GPT's under tpu-v5e at the speed objective on 4 x 2 and 2 x 2 x 2 (1.0096x at 4 layers,
    1.0054x at 8: an end layer's own layout is worth about its share of the layers);
    sharding_propagation 29-48% faster, 68 the same and four 4.1-5.0% lower. Two layers are
    all ends: not deep (two hops' classes are 42% of a 2-layer GPT step's ops), and
    search_gap.py's quick preset plans the same."""
    if len(graph.ops) <= _UNTIED_OPS:
        return {"tie_repeats": None}
    deep = repeats(graph, _DEEP_ROUNDS) is not None
    return {"tie_repeats": True, "tie_rounds": _DEEP_ROUNDS if deep else ROUNDS}


def solve_axis(graph: OpGraph, model: CostModel, plan: GraphPlan, fixed_in: dict[int, Spec],
               fixed_out: dict[int, Spec], ties: tuple[tuple[int, int], ...], axis: str,
               time_limit: float = 10.0, held: frozenset[int] = frozenset()) -> GraphPlan:
    """The cheapest plan that differs from `plan` only in how it uses `axis`.

    Args:
      graph, model: the program and its cost model.
      plan: a complete plan (every op's choice and every input's spec).
      fixed_in: {value: Spec} the user fixed; fixed_out: {output position: Spec}.
      ties: (input value, output position) pairs of carried state.
      axis: the mesh axis solved again.
      time_limit: seconds for the search (past it, the best plan it found).
      held: ops that keep their choice in `plan` whole (sharding propagation's pinned ops).

    Returns:
      The plan the exact search finds over those candidates (`plan` is one of them; the
      caller compares the two with graph_cost).

    Example:
      >>> better = solve_axis(graph, model, gp, {}, {}, ties, "d1")
    """
    return _solved_axis(graph, model, [plan], fixed_in, fixed_out, ties, axis, time_limit,
                        held)[0]


def _solved_axis(graph: OpGraph, model: CostModel, plans: Sequence[GraphPlan],
                 fixed_in: dict[int, Spec], fixed_out: dict[int, Spec],
                 ties: tuple[tuple[int, int], ...], axis: str, time_limit: float = 10.0,
                 held: frozenset[int] = frozenset(),
                 free: tuple[frozenset[int], frozenset[int]] | None = None,
                 group_tail: bool = False) -> tuple[GraphPlan, bool]:
    """solve_axis from one plan, or solve_axis_from_any from several (held ops: one plan
    only; free, group_tail: solve_axis_from_any's), and whether the plan it found is proven
    optimal over its candidates (not where the search stopped at its time limit)."""
    allow = _OtherAxes(plans[0], axis, held, model.axis_groups) if len(plans) == 1 else \
        _OtherAxesOfAny(plans, axis, model.axis_groups)
    if free is not None:
        allow = _AlsoFree(allow, *free)
    found, solution = dynamic_programming(graph, model, fixed_in, fixed_out,
                                          time_limit=time_limit, ties=ties, **_tying(graph),
                                          allow=allow, group_tail=group_tail)
    return found, solution.optimal


def solve_axes(graph: OpGraph, model: CostModel, plan: GraphPlan, fixed_in: dict[int, Spec],
               fixed_out: dict[int, Spec], ties: tuple[tuple[int, int], ...],
               axes: Sequence[str], score: Callable[[GraphPlan], float],
               before: float | None = None, held: frozenset[int] = frozenset(),
               solved: list | None = None
               ) -> tuple[GraphPlan, float, list[tuple[str, float, float]]]:
    """`plan` with each of `axes` in turn solved again (solve_axis, the others held as the plan
    kept so far has them), each solution kept where `score` of it is lower.

    Args:
      graph, model, plan, fixed_in, fixed_out, ties, held: as for solve_axis.
      axes: the mesh axes, in the order they are solved.
      score: a plan's objective (lower is better).
      before: score(plan), when the caller has it.
      solved: the solves made so far, shared by calls over one graph, model, fixed specs,
        ties and held ops (recursive_programming solves the axes from several starts, which
        often meet): an axis is not solved again from a plan it was solved from, or one such
        a solve found and proved optimal over that axis. Appended to.

    Returns:
      (the plan kept, its score, [(axis, score before, score after)] for each solution taken).
    """
    before = score(plan) if before is None else before
    taken = []
    for axis in axes:
        known = _recall(solved, axis, plan, before)
        if known is None:
            progress.step(f"axis {axis} solved again exactly")
            found, optimal = _solved_axis(graph, model, [plan], fixed_in, fixed_out, ties,
                                          axis, held=held)
            after = score(found)
            if solved is not None:
                solved.append((axis, before, plan, found, after))
                if optimal:  # solved from itself, the axis finds it again
                    solved.append((axis, after, found, found, after))
        else:
            progress.step(f"axis {axis}: solved from this plan before")
            found, after = known
        if after < before * (1 - 1e-9):
            taken.append((axis, before, after))
            plan, before = found, after
    return plan, before, taken


def solve_axis_from_any(graph: OpGraph, model: CostModel, plans: Sequence[GraphPlan],
                        fixed_in: dict[int, Spec], fixed_out: dict[int, Spec],
                        ties: tuple[tuple[int, int], ...], axis: str,
                        time_limit: float = 10.0,
                        free: tuple[frozenset[int], frozenset[int]] | None = None,
                        group_tail: bool = False) -> GraphPlan:
    """The cheapest plan in which every op uses every axis but `axis` as one of `plans` does
    (each op as any of them: neighbours taking different plans' layouts pay the resharding
    between them) and every free input keeps its cut on them in one of the plans; the use of
    `axis` is free. Every candidate of solve_axis from any of `plans` is one of its own, so
    over the tables its optimum is no worse than each of those: one search where solving
    from each apart takes one each (recursive_programming's starts: the walk's plan, the
    lockstep and the grouped one).

    free: (ops, free inputs) that may also change their use of the other axes: any candidate
    (_AlsoFree). recursive_programming frees so its carried state's updates on a mesh of two
    axes.

    group_tail: price the step's tail one latency per kind of reduction and device group, as
    XLA combines them (dynamic_programming's group_tail, its rarest groups dropped and solved
    again), not a share of one each: recursive_programming's first solve of an axis with the
    carried state's updates free, which make the tail (a share each, a mix of device groups
    for the weights' state looked as cheap as one).

    Example:
      >>> better = solve_axis_from_any(graph, model, [walk, flat], {}, {}, ties, "d2")
    """
    return _solved_axis(graph, model, plans, fixed_in, fixed_out, ties, axis, time_limit,
                        free=free, group_tail=group_tail)[0]


def _recall(solved: list | None, axis: str, plan: GraphPlan, score: float
            ) -> tuple[GraphPlan, float] | None:
    """(the plan found, its score) where `axis` was solved from a plan equal to `plan` (one
    scoring `score` exactly, then the same specs and strategies), else None."""
    for was_axis, was_score, was, found, after in solved or ():
        if was_axis == axis and was_score == score and _same_plan(was, plan):
            return found, after
    return None


def _same_plan(a: GraphPlan, b: GraphPlan) -> bool:
    """Whether two plans give every value the same spec and every op the same strategy (what
    solve_axis reads of a plan), loop bodies' plans included."""
    if a is b:
        return True
    if a.specs != b.specs or a.choices.keys() != b.choices.keys():
        return False
    for x, one in a.choices.items():
        other = b.choices[x]
        if one.strategy != other.strategy or len(one.regions) != len(other.regions) or \
                not all(map(_same_plan, one.regions, other.regions)):
            return False
    return True


def solve_lockstep(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
                   fixed_out: dict[int, Spec], ties: tuple[tuple[int, int], ...],
                   time_limit: float = 10.0) -> GraphPlan:
    """The cheapest plan in which every op uses all the mesh axes together: each dim of each
    operand and result is cut over every axis (in mesh order) or over none, and a partial sum
    is over all of them or none (an op with no such candidate keeps all of its own). These
    are the plans of the flattened mesh, whose one axis holds the devices in the same order.

    recursive_programming decides the axes one at a time, so on make_mesh(8)'s three axes of
    2 its first decision is a two-way cut that suits two devices, and the axes solved again
    one at a time cannot all move at once. Where an eight-way cut of one dim is best (a MoE
    layer's tokens), this finds it: the MoE step of benchmarks/search_gap.py on 2 x 2 x 2,
    h100-nvlink, level 2, 0.240 -> 0.144 ms of objective (the exact search's: 0.144).

    Example:
      >>> flat = solve_lockstep(graph, model, {}, {}, ties)
    """
    return solve_grouped(graph, model, fixed_in, fixed_out, ties, (model.mesh.names,),
                         time_limit)


def solve_grouped(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
                  fixed_out: dict[int, Spec], ties: tuple[tuple[int, int], ...],
                  groups: tuple[tuple[str, ...], ...], time_limit: float = 10.0) -> GraphPlan:
    """solve_lockstep over a mesh of fewer axes: each of `groups` (runs of neighbouring mesh
    axes, in order) used as one axis. Each dim of each operand and result is cut over whole
    groups or none, a partial sum is over whole groups: the plans of the mesh of one axis per
    group. On make_mesh(8)'s 2 x 2 x 2 the groups (d0, d1) and (d2) hold the plans of a 4 x 2
    mesh, a 2-D tensor parallel layout (a weight cut over d0+d1 and d2) among them, which the
    walk, deciding an axis at a time, does not reach and lockstep, an 8-way cut or none, does
    not hold.

    Example:
      >>> plan = solve_grouped(graph, model, {}, {}, ties, (("d0", "d1"), ("d2",)))
    """
    found, _ = dynamic_programming(graph, model, fixed_in, fixed_out, time_limit=time_limit,
                                   ties=ties, **_tying(graph),
                                   allow=_Lockstep(model, groups),
                                   group_tail=False)
    return found


def axis_runs(model: CostModel) -> tuple[tuple[str, ...], ...]:
    """The runs of neighbouring mesh axes solve_grouped is given (recursive_programming's and,
    with no weight fixed, sharding_propagation's grouped start): the runs of axes over one kind
    of link (across two nodes: the node axis, then the axes inside a node; the plans of a
    nodes x GPUs mesh), else (every axis over one link, or each over its own) the leading
    axes and the last (a 4 x 2 mesh of 2 x 2 x 2). Over search_gap's 2 x 2 x 2 cases these are
    the groupings that scored lower, of the two; one is solved, for each costs several
    lockstep solves (the 48-layer GPT step on a slow day: 5 s against 1 s).

    Example:
      >>> axis_runs(model)  # make_mesh(8) under h100-nvlink: one link
      (('d0', 'd1'), ('d2',))
    """
    def kind(name: str) -> tuple:
        link = model.links[name]
        return (link.name, link.bandwidth, link.latency)

    names = model.mesh.names
    runs: list[tuple[str, ...]] = []
    for name in names:
        if runs and kind(name) == kind(runs[-1][-1]):
            runs[-1] += (name,)
        else:
            runs.append((name,))
    if 1 < len(runs) < len(names):
        return tuple(runs)
    return (names[:-1], names[-1:])


class _Lockstep:
    """tables.Allow: the candidates that use each of `groups` of mesh axes together
    (solve_grouped; one group of every axis: solve_lockstep)."""

    def __init__(self, model: CostModel, groups: tuple[tuple[str, ...], ...]):
        self.groups = groups
        # Each candidate list's kept indices, by list and groups: kept with the model, whose
        # lists they are (model.options; the mesh's cache outlives them).
        self.kept = model.lockstep_cache
        wholes = [()]
        for g in self.groups:  # the dims over whole groups, in mesh order
            wholes += [w + g for w in wholes]
        self.dims = frozenset(wholes)
        self.partials = frozenset(frozenset(w) for w in wholes)
        self.spec_ok: dict[Spec, bool] = {}

    def _spec(self, s: Spec) -> bool:
        hit = self.spec_ok.get(s)
        if hit is None:
            hit = self.spec_ok[s] = all(d in self.dims for d in s.dims)
        return hit

    def op(self, x: int, cands: list) -> tuple[int, ...]:
        def kept() -> tuple[int, ...]:
            found = tuple(i for i, s in enumerate(cands)
                          if all(map(self._spec, s.ins + s.outs)) and
                          all(frozenset(p) in self.partials for p in s.partial))
            return found or tuple(range(len(cands)))
        return derived(self.kept, "lockstep", cands, self.groups, kept)

    def op_key(self, x: int) -> None:
        return None  # (tables.Allow: the same indices for every op of one list)

    def specs(self, v: int, specs: tuple[Spec, ...]) -> tuple[Spec, ...]:
        return tuple(s for s in specs if self._spec(s)) or specs


class _OtherAxes:
    """tables.Allow: the candidates that use every axis but one as `plan` does (a held op: its
    choice in `plan`). `groups`: where each candidate list's strategies are grouped by their
    use of the other axes, {(id(list), axis): (list, {use: indices})}; CostModel.axis_groups
    keeps them for every solve of the axis again (recursive_programming makes several per
    search, and up to nine searches under a memory budget)."""

    def __init__(self, plan: GraphPlan, axis: str, held: frozenset[int] = frozenset(),
                 groups: dict | None = None):
        self.plan, self.axis, self.held = plan, axis, held
        self.plans = (plan,)  # tables.Allow: the plans searched around
        self.groups = {} if groups is None else groups
        self.projected: dict[Spec, tuple] = {}
        self.keys: dict[int, tuple] = {}  # id(strategy) -> (strategy, its _key)
        self.kept: dict[tuple, tuple] = {}  # ids of (list, chosen) -> (list, chosen, op())

    def _spec(self, s: Spec) -> tuple:
        """A spec's dims over the other axes."""
        hit = self.projected.get(s)
        if hit is None:
            hit = self.projected[s] = tuple(tuple(a for a in d if a != self.axis)
                                            for d in s.dims)
        return hit

    def _key(self, s: OpStrategy) -> tuple:
        hit = self.keys.get(id(s))  # ops alike share strategy objects: each keyed once
        if hit is None:
            hit = self.keys[id(s)] = (s, (tuple(self._spec(sp) for sp in s.ins + s.outs),
                                          tuple(tuple(a for a in p if a != self.axis)
                                                for p in s.partial)))
        return hit[1]

    def op(self, x: int, cands: list) -> tuple[int, ...]:
        choice = self.plan.choices.get(x)
        chosen = None if choice is None else choice.strategy
        if x in self.held and chosen in cands:  # (list.index compares by identity first)
            return (cands.index(chosen),)
        memo = self.kept.get((id(cands), id(chosen)))  # ops alike chose alike: asked once
        if memo is not None and memo[0] is cands and memo[1] is chosen:
            return memo[2]
        hit = self.groups.get((id(cands), self.axis))
        if hit is None or hit[0] is not cands:
            by: dict[tuple, list[int]] = {}
            for i, s in enumerate(cands):
                by.setdefault(self._key(s), []).append(i)
            hit = self.groups[(id(cands), self.axis)] = (
                cands, {k: tuple(v) for k, v in by.items()})
        kept = hit[1].get(self._key(chosen)) if chosen is not None else None
        kept = kept or tuple(range(len(cands)))
        self.kept[(id(cands), id(chosen))] = (cands, chosen, kept)
        return kept

    def op_key(self, x: int) -> tuple:
        """tables.Allow: what op() depends on beside the candidate list: the op's choice in
        the plan (its strategy's id: the plan holds it) and whether it is held."""
        choice = self.plan.choices.get(x)
        return (None if choice is None else id(choice.strategy), x in self.held)

    def specs(self, v: int, specs: tuple[Spec, ...]) -> tuple[Spec, ...]:
        now = self.plan.specs.get(v)
        if now is None:
            return specs
        now = now.resolved()
        kept = tuple(s for s in specs if self._spec(s) == self._spec(now))
        return kept if now in kept else kept + (now,)


class _OtherAxesOfAny:
    """tables.Allow: the candidates that use every axis but one as any of `plans` does (the
    union of each plan's _OtherAxes; each loop and cond is also offered its choice in each
    plan, body plans and all)."""

    def __init__(self, plans: Sequence[GraphPlan], axis: str, groups: dict | None = None):
        self.parts = [_OtherAxes(p, axis, groups=groups) for p in plans]
        self.plans = list(plans)
        self.unions: dict[tuple, tuple[int, ...]] = {}  # each plan's indices -> their union

    def op(self, x: int, cands: list) -> tuple[int, ...]:
        each = tuple(part.op(x, cands) for part in self.parts)
        if all(kept is each[0] for kept in each):  # the plans agree here (ops alike: memo)
            return each[0]
        hit = self.unions.get(each)
        if hit is None:
            hit = self.unions[each] = tuple(sorted(set().union(*each)))
        return hit

    def op_key(self, x: int) -> tuple:
        return tuple(part.op_key(x) for part in self.parts)

    def specs(self, v: int, specs: tuple[Spec, ...]) -> tuple[Spec, ...]:
        return tuple(dict.fromkeys(s for part in self.parts for s in part.specs(v, specs)))


class _AlsoFree:
    """tables.Allow: `inner`'s candidates, and every candidate for the ops `ops` and every
    spec for the free inputs `inputs`."""

    def __init__(self, inner, ops: frozenset[int], inputs: frozenset[int]):
        self.inner, self.ops, self.inputs = inner, ops, inputs
        self.plans = inner.plans  # tables.Allow: the plans searched around

    def op(self, x: int, cands: list) -> tuple[int, ...]:
        return tuple(range(len(cands))) if x in self.ops else self.inner.op(x, cands)

    def op_key(self, x: int) -> tuple:
        """tables.Allow: a freed op's indices depend on its list alone, the others' on what
        `inner` says."""
        return ("free",) if x in self.ops else ("held", self.inner.op_key(x))

    def specs(self, v: int, specs: tuple[Spec, ...]) -> tuple[Spec, ...]:
        return specs if v in self.inputs else self.inner.specs(v, specs)


class _FewAxes:
    """tables.Allow: the candidates that use at most `free` mesh axes otherwise than `plan`
    does (OpStrategy.usage: the dims each operand and result is cut on over the axis, and
    whether the op reduces over it; for a free input, the dim each axis cuts), the plan's own
    choice among them. solve_region's, on a mesh of more than REGION_AXES + 1 axes: a
    region's joint moves then change at most REGION_AXES axes of an op at once, and its
    tables keep about the size of a 3-axis mesh's (on make_mesh(16)'s four axes of size 2 a
    matmul has up to 4,096 strategies, a scatter-add 6,561: 417 change at most two)."""

    def __init__(self, plan: GraphPlan, names: Sequence[str], free: int):
        self.plan, self.names, self.free = plan, tuple(names), free
        self.plans = (plan,)  # tables.Allow: the plan searched around
        self.kept: dict[tuple, tuple] = {}  # ids of (list, chosen) -> (list, chosen, op())
        self.near: dict[tuple[Spec, Spec], bool] = {}

    def _near(self, a: OpStrategy, b: OpStrategy) -> bool:
        return sum(a.usage(n) != b.usage(n) for n in self.names) <= self.free

    def op(self, x: int, cands: list) -> tuple[int, ...]:
        choice = self.plan.choices.get(x)
        chosen = None if choice is None else choice.strategy
        if chosen is None:
            return tuple(range(len(cands)))
        memo = self.kept.get((id(cands), id(chosen)))  # ops alike chose alike: asked once
        if memo is not None and memo[0] is cands and memo[1] is chosen:
            return memo[2]
        kept = tuple(i for i, s in enumerate(cands) if s is chosen or self._near(s, chosen))
        kept = kept or tuple(range(len(cands)))
        self.kept[(id(cands), id(chosen))] = (cands, chosen, kept)
        return kept

    def op_key(self, x: int) -> tuple:
        """tables.Allow: what op() depends on beside the candidate list: the op's strategy
        in the plan (its id: the plan holds it)."""
        choice = self.plan.choices.get(x)
        return (None if choice is None else id(choice.strategy),)

    def specs(self, v: int, specs: tuple[Spec, ...]) -> tuple[Spec, ...]:
        now = self.plan.specs.get(v)
        if now is None:
            return specs
        now = now.resolved()
        kept = tuple(s for s in specs if self._spec_near(s, now))
        return kept if now in kept else kept + (now,)

    def _spec_near(self, s: Spec, now: Spec) -> bool:
        hit = self.near.get((s, now))
        if hit is None:
            hit = self.near[(s, now)] = sum(s.dim_of(n) != now.dim_of(n)
                                            for n in self.names) <= self.free
        return hit


def solve_region(graph: OpGraph, model: CostModel, plan: GraphPlan, fixed_in: dict[int, Spec],
                 fixed_out: dict[int, Spec], ties: tuple[tuple[int, int], ...], ops: set[int],
                 inputs: set[int], time_limit: float = 10.0, group_tail: bool = False
                 ) -> GraphPlan:
    """The cheapest plan that differs from `plan` only at `ops` and the free `inputs`.

    Args:
      graph, model, plan, fixed_in, fixed_out, ties: as for solve_axis.
      ops: the op indices that may take any of their strategies.
      inputs: the free inputs (carried state included) that may take any spec their readers
        read; every other input keeps the plan's spec.
      time_limit: seconds for the search.
      group_tail: also solve it again with the tail's reductions kept to one device group
        and round per kind (dynamic_programming's group_tail).

    On a mesh of more than REGION_AXES + 1 axes the ops (loops and conds aside) and inputs
    may change their use of at most REGION_AXES axes at once (_FewAxes): make_mesh(16)'s
    four axes of size 2 give a GPT step's ops up to 6,561 strategies each, and its region
    around the embedding table took 8 s of recursive_programming's 18 s (its tables 5 s,
    97,000 spec pairs priced), for no lower plan.

    Returns:
      The plan the exact search finds over those candidates (`plan` is one of them).

    Example:
      >>> better = solve_region(graph, model, gp, {}, {}, ties, {4, 5, 6}, {27})
    """
    names = model.mesh.names
    few = _FewAxes(plan, names, REGION_AXES) if len(names) > REGION_AXES + 1 and not any(
        graph.ops[x].regions for x in ops) else None
    found, _ = dynamic_programming(graph, model, fixed_in, fixed_out, time_limit=time_limit,
                                   ties=ties, **_tying(graph), allow=few,
                                   group_tail=group_tail,
                                   region=Region(plan, frozenset(ops), frozenset(inputs)))
    return found


def solve_tail(graph: OpGraph, model: CostModel, plan: GraphPlan, fixed_in: dict[int, Spec],
               fixed_out: dict[int, Spec], ties: tuple[tuple[int, int], ...],
               index: GraphIndex, pinned: frozenset[int] = frozenset(),
               time_limit: float = 5.0) -> tuple[GraphPlan, float]:
    """`plan` with a training step's tail solved again exactly (solve_region), the rest held:
    the ops making what no matmul, conv or loop reads (OpGraph.tail_values: the gradients'
    last matmuls and reductions, the optimizer), less `pinned`, with the free inputs they
    read. Returns the solution where its objective is lower (carried outputs priced back into
    their input's spec), else `plan`, with that plan's objective.

    Sharding propagation decides a gradient's matmul from its operands alone: a reduce-scatter
    of its partial sum is cheaper than an all-reduce, and the optimizer chain after it is then
    computed cut, and each of a parameter's and its moments' updates gathered back into the
    replicated spec the user fixed for them. Solved together, the all-reduce and a replicated
    update win (gpt_plans' data-parallel layout through jaxpar, the step's modelled total:
    2.53 ms as propagated then, 1.27 ms polished by semi.py)."""
    return _lower(graph, model, plan, fixed_in, fixed_out, ties, _tail_ops(graph, pinned),
                  index, time_limit)


def _tail_ops(graph: OpGraph, pinned: frozenset[int]) -> set[int]:
    """The ops all of whose results lie in the step's tail (OpGraph.tail_values), less
    `pinned`: what solve_tail and solve_tail_rounds solve again."""
    tail = graph.tail_values()
    return {op.index for op in graph.ops
            if op.outputs and op.index not in pinned and all(v in tail for v in op.outputs)}


def solve_tail_rounds(graph: OpGraph, model: CostModel, plan: GraphPlan,
                      fixed_in: dict[int, Spec], fixed_out: dict[int, Spec],
                      ties: tuple[tuple[int, int], ...], index: GraphIndex,
                      pinned: frozenset[int] = frozenset(), before: float | None = None,
                      time_limit: float = 5.0, always: bool = False
                      ) -> tuple[GraphPlan, float]:
    """`plan` with a training step's tail solved again exactly where the reductions of
    several of its ops wait for others' results (plan.tail_reductions' waits), or where one
    device group's latency is paid for a single reduction (or `always`: recursive_programming
    on a mesh of two axes), with each kind's reductions then kept to fewer device groups and
    rounds (solve_region's group_tail), `pinned` ops aside:
    the solution where its objective is lower, else `plan`; with the objective of the plan
    returned (`before`: plan's, when known). (search_gap's deep GPT on 4 x 2 across two nodes
    at level 2: recursive_programming's plan reduce-scattered one gradient over d0+d1 beside
    three other groups, 0.786 ms of objective; its tail solved again, 0.761, where the exact
    search finds 0.756.)

    The searches price each tail reduction at a share of one latency, so cutting a global
    norm's sum of squares (optax.clip_by_global_norm) looks all but free: its partial sums'
    all-reduce waits for the gradients' (XLA cannot combine the two: a collective of its own,
    over the gradients' devices or others), and one op at a time no move removes it (one op
    alone can: a GPT step's loss, summed over the batch after the vocabulary's all-reduce,
    is not solved again for, 0.5 s at 2 layers, 1.0 s at 48, for nothing). A 2-layer GPT
    Adam step with the clip (d 128, vocab 512, seq 64, batch 16) on make_mesh(8) under
    h100-nvlink was planned with the squares summed cut by every mode (25.1 us of
    communication modelled, eight all-reduces compiled: 130.1 us by estimate_time); now with
    them summed whole, 25.1 us modelled and compiled (one all-reduce; tests/test_exact.py)."""
    from jaxpar.plan import tail_reductions

    waited: list[int] = []  # the ops whose operands wait for a reduction
    groups = tail_reductions(graph, plan,
                             waits=lambda x, at: waited.append(x) if at else None)
    several = sum(any(c.kind in COMBINED_KINDS for c in plan.choices[x].cost.collectives)
                  for x in waited) > 1
    lone = 1 in groups.values()  # a device group paying a whole latency for one reduction
    return _lower(graph, model, plan, fixed_in, fixed_out, ties,
                  _tail_ops(graph, pinned) if several or lone or always else set(), index,
                  time_limit,
                  before, group_tail=True)


def solve_latency_bound(graph: OpGraph, model: CostModel, plan: GraphPlan,
                        fixed_in: dict[int, Spec], fixed_out: dict[int, Spec],
                        ties: tuple[tuple[int, int], ...], index: GraphIndex,
                        pinned: frozenset[int] = frozenset(), hops: int = _SMALL_HOPS,
                        time_limit: float = 5.0, before: float | None = None
                        ) -> tuple[GraphPlan, float]:
    """`plan` with its latency-bound collectives solved again exactly with the ops around
    them (solve_region), the rest held. Small: a value whose gathering takes more time in
    latency than in moving its bytes (latency_bound). The seeds: the ops reduce-scattering
    a small result, and those resharding a small operand; none are solved where no small
    result is reduce-scattered. The region: the ops at most `hops` def-use steps from a
    seed, either way, through small values; less `pinned`; with the free inputs they read.
    Returns the solution where its objective is lower, else `plan`, with that plan's objective
    (`before`: `plan`'s, when the caller has it).

    Propagation decides a reduction from its operand alone: reduce-scattering a partial sum
    moves half the bytes of an all-reduce. For a small result (a BatchNorm's batch mean and
    variance, 32 floats) both take one latency, and the consumers that need it whole then
    gather it: two collectives where one all-reduce was enough (an nnx CNN with two
    BatchNorms, Adam, batch 64, semi_auto on 8 devices under h100-nvlink: 275 us modelled, 27
    collectives, as polished by refine and solve_tail; 138 us solved so, 21). The exact
    solve prices every pair of candidate specs along the region's edges. Seeded by any
    small resharding, it also ran on the toy programs of jaxpar.models.programs, whose
    values are all small, for 0.4-0.55 s more and the same plans (attention_tensor_parallel,
    conv_net_feature_parallel); a reduce-scattered small result is what it mends."""
    small = latency_bound(model)
    seeds, scattered = set(), False
    for op in graph.ops:
        if op.index in pinned:
            continue
        choice = plan.choices[op.index]
        if op.outputs and any(c.kind == "reduce-scatter" for c in choice.cost.collectives) \
                and all(small(index.nbytes(w)) for w in op.outputs):
            seeds.add(op.index)
            scattered = True
            continue
        for v, need in zip(op.inputs, choice.strategy.ins, strict=True):
            if isinstance(v, int) and small(index.nbytes(v)):
                have = plan.specs[v]
                if have is not need and not have.placed_as(need):
                    seeds.add(op.index)
                    break
    ops = index.neighbourhood(seeds, hops, pinned, lambda v: small(index.nbytes(v))) - pinned \
        if scattered else set()
    return _lower(graph, model, plan, fixed_in, fixed_out, ties, ops, index, time_limit,
                  before)


def _lower(graph: OpGraph, model: CostModel, plan: GraphPlan, fixed_in: dict[int, Spec],
           fixed_out: dict[int, Spec], ties: tuple[tuple[int, int], ...], ops: set[int],
           index: GraphIndex, time_limit: float, before: float | None = None,
           group_tail: bool = False) -> tuple[GraphPlan, float]:
    """solve_region over `ops` and the free inputs they read (group_tail passed on): its
    solution where its objective is lower than `plan`'s (`before`, when known), else `plan`;
    with the objective of the plan returned."""
    if before is None:
        before = objective(graph, model, plan, fixed_out, ties)
    if not ops:
        return plan, before
    found = solve_region(graph, model, plan, fixed_in, fixed_out, ties, ops,
                         index.free_reads(ops, fixed_in), time_limit, group_tail)
    after = objective(graph, model, found, fixed_out, ties)
    return (found, after) if after < before * (1 - 1e-9) else (plan, before)


def latency_bound(model: CostModel):
    """bytes -> whether gathering an array of that many bytes over every mesh axis takes
    more time in latency than in moving its bytes (under `model`'s links)."""
    mesh = model.mesh
    if not mesh.names:
        return lambda nbytes: False
    # the score's line (per byte, per call); the level's weight on both cancels out
    per_byte, fixed = model.reshard_line(Spec((tuple(mesh.names),)), Spec.replicated(1))
    limit = fixed / per_byte if per_byte > 0 else math.inf
    return lambda nbytes: nbytes < limit


def objective(graph: OpGraph, model: CostModel, plan: GraphPlan, fixed_out: dict[int, Spec],
              ties: Sequence[tuple[int, int]]) -> float:
    """`model`'s exact objective of a complete plan: the outputs in `fixed_out` resharded into
    their specs, each carried (input value, output position) output (ties) back into its
    input's spec, and the step's tail reductions paying one latency per kind and device group
    as XLA combines them (plan.tail_latency, as Plan.cost prices them; graph_cost gives each
    a share of one)."""
    from jaxpar.plan import tail_latency

    back = dict(fixed_out) | {pos: plan.specs[v] for v, pos in ties}
    return model.score(graph_cost(graph, plan, model, back) +
                       OpCost(comm_s=tail_latency(graph, plan, model)))
