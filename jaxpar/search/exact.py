"""dynamic_programming: the exact optimum of the cost model over every op's strategies.

Before: an OpGraph, fixed input/output specs, a CostModel, an optional per-device memory budget.
After: a GraphPlan (as sharding_propagation returns) and the solver's report (optimal or not, gap,
method, seconds). The graph becomes cost tables (tables.py), the tables a `Problem` for the exact
solver (dynamic.py), and the answer a plan again. The memory budget bounds the bytes live at
every point of the program (Alpa's peak of live tensors); the solver prices them per choice,
and a plan holding more than the budget by what two choices make together (plan.peak_memory
counts it) is solved again for a budget lower by that (at most _REFITS times), and what is
still over has the carried states whose end copies break it moved (copies.py). The search runs
without the budget first: the plans that fit are some of all plans, so where the optimum of all
fits, it is the answer, found without live sets on the folded tables (_unbudgeted_fits).

Repeated layers are solved once: with tie_repeats (by default in a deep model, below), ops that
play the same part in identical layers (one Weisfeiler-Lehman class, ir/repeat.py, and one
candidate list) are tied to one strategy, and so are the free inputs they read in the same way
(a layer's weights and their optimizer state). The answer is then exact over the plans in which
repeated layers agree, which is what a deep model is planned as by hand; the search costs
about as much for 48 layers as for 2. Without a memory budget each tied group is one node of the
tables as they are built
(build_tables' `classes`: a 48-layer model's tables are built about as fast as a few layers'),
and the Solution's `choice` is per node of those; with one, every op is a node and the solver
ties the nodes that folding would make one (build_tables' fold=False lists them: its live sets
count the layers apart).
tie_repeats=False searches every op on its own, and so does the default (None) where tying
would leave more than _TIE_SHARE of the ops as nodes (a shallow model, an MLP): tying saves
little there, and it costs both ways. The answer is exact only over the plans in which tied
ops agree, and in a shallow step ops of different layers look alike (the two (1024,) bias
updates of a 256-1024-1024-256 MLP's Adam step, alike within the eight hops op_classes
looks, were tied to one strategy that suited neither: level 1, 1.425e-4 of objective where
the untied optimum is 1.327e-4), and a node made of ops with different neighbours makes
cycles the tree DP and the dual ascent cannot close (that MLP: 26.5 s of ILP, 0.3 s untied).
The GPT step of benchmarks/search_time.py (d 1024) has the same optimum either way at 1 to 48
layers; untied it is proven as fast up to 8 layers (2: 3.3 s against 7.3 s on a busy machine;
8, op classes 28% of the ops: 9.7 s against 8.7 s on an idle one), tied from 16 on (16: 9.3 s
against 17.8 s; 48: 12.3 s against 55.4 s, op classes 5% of the ops; busy).
When it ties, the Solution says so (`repeats_tied`) and the plan's note names it. The
solves again of parts of a plan inside recursive_programming and sharding_propagation
(resolve.py) tie wherever op_classes finds repeats in a graph of more than a few hundred
ops (resolve._tying: tie_repeats=True): untied, recursive_programming planned the 8-layer GPT
step in 1.4 times the time, sharding_propagation in 3.4 times. In a deep model they tie by
two hops (tie_rounds), which ties the layers by the ends with the rest too.

A loop (scan, while; and a cond, see regions.py) is one node whose candidates are plans of its
bodies (regions.region_candidates): by propagation, and with `CostModel.search_bodies`
(jaxpar.shard sets it) also solved exactly, for free operands. Such a graph is then solved again
with each loop also offering its bodies solved for the operand specs the first answer gives
it, so that a step's forward and backward scans agree on the residuals passed between them,
and (a scan or while loop) for the specs that answer wants its results in (_wanted: a
stacked gradient in its parameter's spec; the body alone would reduce-scatter it);
and again while an answer gives the loops operand specs not yet tried (at most _LOOP_PASSES
times: a scanned GPT step, 2 layers, d 1024, 3.734 -> 3.550 ms of objective). A region's loops
are also planned for the operand specs its held plan gives them. Under a memory budget each
loop also offers its bodies solved for the least memory (CostModel.lean_bodies): the bodies
solved for time may all hold more than a budget allows.

A step's tail (gradient reductions, the optimizer) prices each reduction at a share of one
latency, as if XLA combined them all; it combines those of one kind over one device group, and
only those that do not wait for one another (tail_groups: a global norm's sum of squares,
reduced after the gradient it reads was, is a second round). A plan whose tail reduces over
more groups than kinds is searched again with each kind kept to one group (its first round's
most used), where it reduces in several rounds also with its first round's groups, in one
round both, and with its groups less the one making fewest reductions (again from each plan
so found that scores lower, _DROPS times at most; not under a memory budget, nor in the
search without it that a budgeted one runs first: their time goes to fitting the plan);
whichever plan is cheapest with one latency per group (and one per reduction of a later
round) is kept. Each search again is exact over its own plans only: where the first stopped
at its time limit, the plan is unproven whichever is kept, its gap to the first's bound. Under
a memory budget the tail is searched again so too (its nodes tied to others held alike:
_tied_alike), unless the first search stopped at its limit: the time left then goes to
fitting the plan (_refit).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Collection, Sequence

import numpy as np

from jaxpar import progress
from jaxpar.cost.comm import Collective
from jaxpar.cost.model import (
    COMBINED_KINDS,
    CostModel,
    OpCost,
    reduces_as_matmul,
    reduction_steps,
)
from jaxpar.ir.graph import Op, OpGraph, scan_counts
from jaxpar.ir.repeat import ROUNDS, op_classes
from jaxpar.rules.registry import has_rule
from jaxpar.search.copies import shed_copies
from jaxpar.search.dynamic import (
    BudgetUnmet,
    NotFound,
    Problem,
    Solution,
    byte_count,
    objective,
    restricted,
    solve,
)
from jaxpar.search.propagation import Choice, GraphPlan
from jaxpar.search.regions import LOOPS, RESULT_SPECS
from jaxpar.search.tables import (
    Allow,
    Region,
    Tables,
    build_tables,
    local_costs,
    touching_edges,
)
from jaxpar.spec import Spec

_LOOP_PASSES = 4  # at most this many solves again with loop bodies planned for their neighbours
_TIE_SHARE = 0.25  # tie_repeats ties only where op classes are at most this share of the ops
_AGAIN_TIMES, _AGAIN_MIN_S = 3.0, 1.0  # the tail's solve again: 3x the first solve, 1 s at least
_DROPS = 2  # at most this many solves again with the tail's rarest device group dropped
_REFITS = 3       # under a budget: solves again, the budget lowered by what the plan held over it
_LOOSE_SHARE = 0.5  # under a budget: at most this share of time_limit for the search without
                    # it first (_unbudgeted_fits)


def dynamic_programming(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
                        fixed_out: dict[int, Spec], memory_budget: float | None = None,
                        time_limit: float = 30.0, ties: tuple[tuple[int, int], ...] = (),
                        tie_repeats: bool | None = None, allow: Allow | None = None,
                        group_tail: bool = True, region: Region | None = None,
                        tie_rounds: int = ROUNDS, tail_drops: bool = True
                        ) -> tuple[GraphPlan, Solution]:
    """The cheapest plan of `graph` under `model` (see the module docstring).

    Args:
        graph, model: the program and its cost model.
        fixed_in: value id -> the spec the user fixed; fixed_out: output position -> spec.
        memory_budget: bytes per device for everything live at once (None: no bound).
        time_limit: seconds for the whole search (pricing, tables, every solve); past it the
            best plan found comes with its gap.
        ties: (input value, output position) pairs whose output must come back in the input's
            spec (the caller fixes those outputs to the planned input specs).
        tie_repeats: give the ops of repeated layers one shared strategy (see above): None
            where that pays (repeats: a deep model), True wherever op_classes finds them
            (the solves again inside recursive_programming and sharding_propagation, which
            trade exactness for speed), False never.
        tie_rounds: with tie_repeats True, the hops op_classes tells ops apart by (fewer:
            more ops alike, fewer nodes; the solves again of a deep model's plan, resolve.py).
        allow: the candidates each op and free input may take (tables.Allow; None: all):
            the optimum over the plans made of those.
        group_tail: price the tail's reductions one latency per device group as XLA
            combines them (see below); False keeps the tables' price, a share of one latency
            each (graph_cost's: what recursive_programming compares plans with).
        tail_drops: with group_tail, also search again with the tail's rarest device groups
            dropped (_one_latency_per_group); never under a memory budget, whose time goes
            to fitting the plan, nor in the search without it that a budgeted one runs first
            (_unbudgeted_fits), whose time is the budget's too.
        region: search only its ops and free inputs, the rest of its plan held
            (tables.Region; no memory budget then): the optimum over the plans that differ
            from its plan there only, returned whole.

    Returns:
        (GraphPlan, Solution): the plan and how it was found (optimal, gap, method, seconds).
    """
    deadline = time.perf_counter() + time_limit

    def left() -> float:  # seconds to the deadline (negative: past it)
        return deadline - time.perf_counter()

    budget = _budget_left(graph, model, fixed_in, memory_budget)
    if budget is not None and model.search_bodies and not model.lean_bodies and \
            any(op.name in LOOPS for op in graph.ops):  # loops also offer lean bodies
        model = model.variant(lean_bodies=True)
    if region is not None and budget is not None:
        raise ValueError("dynamic_programming: a region is searched without a memory budget "
                         "(live sets count every op); pass memory_budget=None with it")
    if budget is not None:
        found = _unbudgeted_fits(graph, model, fixed_in, fixed_out, memory_budget,
                                 min(left(), time_limit * _LOOSE_SHARE), ties, tie_repeats,
                                 allow, group_tail, tie_rounds)
        if found is not None:
            return found
    with progress.stage(""):
        progress.step("pricing strategies and resharding")

        def tables(seeds=None) -> tuple[Tables, Problem]:
            # No budget: no live sets to count copies in, so each tied group is one node as
            # built; with one, every op is a node and the solver ties the groups (t.tied).
            t = build_tables(graph, model, fixed_in, fixed_out, tuple(ties), allow, classes,
                             region, fold=budget is None, region_seeds=seeds)
            return t, Problem(tuple(t.node_cost),
                              tuple((e.u, e.v, e.cost, e.row, e.col) for e in t.edges),
                              tuple(t.node_mem), None, budget, t.tied or None,
                              live_ranges(graph, t) if budget is not None else None)

        def solved(t: Tables, problem: Problem) -> Solution:
            found = solve(problem, max(left(), 0.1))  # a first solve: a tenth at least
            # Under a budget, a first solve stopped at its limit leaves the time to fitting
            # the plan (_refit), not to the tail: recursive_programming's exact search under
            # the budget (10 s) for the memory_budget benchmark's GPT at 0.3 solved its tail
            # again for 2.3 s, did not keep it, and its refits came short: 21.6x the
            # optimum's objective, not 13.1x.
            if group_tail and left() > 0 and (budget is None or found.optimal):
                found = _one_latency_per_group(graph, model, t, problem, found, left,
                                               None if region is None else region.plan,
                                               tail_drops and budget is None)
            return found

        classes = repeats(graph) if tie_repeats is None else \
            op_classes(graph, tie_rounds) if tie_repeats else None
        loops = [op for op in graph.ops if op.name in LOOPS
                 and (region is None or op.index in region.ops)]
        t, problem = tables()
        progress.step("solving")
        try:
            solution = solved(t, problem)
        except BudgetUnmet as err:  # no assignment fits (or none found in time): said in the
            # user's terms
            said = str(err)
            bodies = ""
            if loops:  # the bound holds over the loops' few body plans, not over every plan
                said = said.replace("no strategy assignment fits",
                                    "no plan among those searched fits", 1).replace(
                    "the smallest possible peak is", "the smallest peak of those is", 1)
                bodies = (". Each loop's body (each cond's branches) is one of a few plans "
                          "(propagated, solved for time, solved for the least memory), so "
                          "that peak is over those: a leaner layout of the loops' operands may "
                          "exist (give it in in_strategy, e.g. the parameters cut FSDP-style, "
                          "with search_mode='sharding_propagation'), and "
                          "search_mode='recursive_programming' plans bodies anew for a larger "
                          "mem_coeff.")
            placed = ""
            if fixed_in:  # the solver's budget is what they leave: said so, not as the user's
                placed = (f" once the fixed inputs are placed (they take "
                          f"{memory_budget - budget:.0f} bytes per device)")
                said = said.replace(f"memory_budget={byte_count(budget)} bytes per device",
                                    f"the {byte_count(budget)} bytes per device they leave", 1)
                said = said.replace("the smallest possible peak is",
                                    "the smallest possible peak of the rest is", 1).replace(
                    "the smallest peak of those is", "the smallest peak of the rest is", 1)
            timed_out = isinstance(err, NotFound)  # none found in time: that type again
            fix = "" if timed_out else (  # (none found in time: the caller tries the walk)
                ("" if bodies else ".") + " Cut more dimensions in in_strategy/parameter_plan, "
                "use a larger mesh, or raise the budget.")
            raise (NotFound if timed_out else BudgetUnmet)(
                f"memory_budget={memory_budget:.0f} bytes per device "
                f"{'was not met' if timed_out else 'cannot be met'}{placed}: {said}{bodies}{fix}",
                reason=f"{said}{bodies}", placed=placed) from None
        plan = _to_plan(graph, t, solution.choice, fixed_in, region)
        # Each loop's body was solved for free operands; solved again for the operand specs
        # this plan gives it (a region's: and those its held plan gives it), the loops of a
        # step (forward and backward scans) can agree on what passes between them. Again so
        # while a new answer gives the loops operand specs not yet tried. The candidates
        # only grow: the optimum can only drop.
        seeds: dict[int, list] = {}  # the operand specs the tables' loops were planned for
        for n in range(_LOOP_PASSES if model.search_bodies and allow is None else 0):
            if left() <= 0:
                break
            grown = _seeds(graph, loops, plan, seeds, fixed_out, ties)
            if n == 0 and region is not None:
                grown = _seeds(graph, loops, region.plan, grown, fixed_out, ties)
            if grown == seeds:
                break
            seeds = grown
            progress.step("solving again, loop bodies planned for their neighbours")
            t, problem = tables(seeds)
            again = solved(t, problem)
            solution = dataclasses.replace(again, seconds=solution.seconds + again.seconds)
            plan = _to_plan(graph, t, solution.choice, fixed_in, region)
        if budget is not None:
            plan, solution = _refit(graph, model, fixed_in, fixed_out, ties, memory_budget,
                                    t, problem, plan, solution, solved, left)
    return plan, dataclasses.replace(solution, repeats_tied=classes is not None)


def _unbudgeted_fits(graph, model, fixed_in, fixed_out, memory_budget, time_limit, ties,
                     tie_repeats, allow, group_tail, tie_rounds
                     ) -> tuple[GraphPlan, Solution] | None:
    """The search without the budget, its answer where it is proven optimal and fits the
    budget (its peak as plan.peak_memory counts it, as _refit's), else None. The plans that
    fit are some of all plans, so the optimum of all that fits is theirs too; found without
    live sets, repeated layers are one node of the tables (the budget unfolds them: every
    op a node), and a budget the optimum meets (memory_budget="hardware", most often) costs
    about what no budget does: benchmarks/search_time.py's 48-layer GPT step searched in
    9.5 s under "hardware", 5.8 s now; at its optimum's own peak 37.9 s, 6.0 s now. A budget
    it misses pays for this search too, out of time_limit."""
    from jaxpar.plan import search_peak

    with progress.stage("without the budget (its optimum, where that fits)"):
        plan, solution = dynamic_programming(graph, model, fixed_in, fixed_out, None,
                                             time_limit, ties, tie_repeats, allow, group_tail,
                                             tie_rounds=tie_rounds, tail_drops=False)
    fits = search_peak(graph, plan, model.mesh, fixed_out, ties) <= memory_budget
    return (plan, solution) if solution.optimal and fits else None


def _refit(graph, model, fixed_in, fixed_out, ties, memory_budget, t, problem, plan, solution,
           solved, left) -> tuple[GraphPlan, Solution]:
    """The plan under the budget as plan.peak_memory counts it. The live sets price memory
    per choice, and miss what two choices make together: a carried output made in another
    spec than its input's (both held at the end), one made in a donated argument's buffer in
    another spec (held apart). Where the plan holds more than the budget so, it is solved
    again for a budget lower by that, at most _REFITS times; the first plan that fits is
    kept, else the one holding least, with the carried states whose end copies break the
    budget moved (copies.shed_copies: its time is not bounded by the search's limit, one
    second at least). Where none of that fits, the caller's check refuses it, quoting its
    peak."""
    from jaxpar.plan import search_peak

    def peak(p) -> float:
        return search_peak(graph, p, model.mesh, fixed_out, ties)

    held = peak(plan)
    best = (held, plan, solution)
    for _ in range(_REFITS):
        over = held - memory_budget
        if over <= 0 or left() <= 0 or problem.budget - over <= 0:
            break
        progress.step("solving again, the budget lowered by what the plan held over it")
        problem = dataclasses.replace(problem, budget=problem.budget - over)
        try:
            again = solved(t, problem)
        except ValueError:  # none fits the lower budget
            break
        solution = dataclasses.replace(again, seconds=solution.seconds + again.seconds,
                                       refitted=True)
        plan = _to_plan(graph, t, again.choice, fixed_in, None)
        held = peak(plan)
        if held < best[0]:
            best = (held, plan, solution)
    held, plan, found = best
    if held > memory_budget:  # what the refits left over: carried states moved
        progress.step("moving carried state whose copies at the end break the budget")
        choice, plan, moved = shed_copies(graph, t, problem, found.choice, plan, held, ties,
                                          memory_budget,
                                          lambda c: _to_plan(graph, t, c, fixed_in, None),
                                          peak, left())
        if moved:
            cost = objective(problem, choice)
            bound = found.cost * (1 - found.gap)
            found = dataclasses.replace(found, choice=choice, cost=cost, optimal=False,
                                        gap=max(0.0, 1 - bound / cost) if cost > 0 else 0.0,
                                        moved=moved)
    return plan, dataclasses.replace(found, seconds=solution.seconds)


def repeats(graph: OpGraph, rounds: int = ROUNDS) -> list[int] | None:
    """op_classes (of `rounds` hops) where tying repeated layers pays (at most _TIE_SHARE of
    the ops as classes: a deep model), else None (see the module docstring)."""
    classes = op_classes(graph, rounds)
    return classes if len(set(classes)) <= _TIE_SHARE * len(classes) else None


def _seeds(graph: OpGraph, loops: list, plan: GraphPlan, seeds: dict[int, list],
           fixed_out: dict[int, Spec], ties: tuple[tuple[int, int], ...]
           ) -> dict[int, list]:
    """build_tables' region_seeds: `seeds` and, for each loop, its operand specs in `plan`
    (None: not planned); for a scan or while loop whose results the plan wants elsewhere
    (_wanted), those operands and free ones, each with the results made as wanted; for a scan
    whose stacked results the plan cuts, the same with those results whole (the plan
    around a scanned step may hold its state cut consistently, FSDP-style, and want nothing
    else; data parallel needs the gradients whole). Each pair once."""
    out, users, ends = {}, None, None
    for op in loops:
        known = [plan.specs.get(v) if isinstance(v, int) else None for v in op.inputs]
        free = [None] * len(known)
        pairs = [(known, None)]
        if op.name in RESULT_SPECS:
            if users is None:
                users, ends = graph.users(), _ends(graph, plan, fixed_out, ties)
            wanted = _wanted(graph, plan, op, ends, users)
            if wanted is not None:
                pairs += [(known, wanted), (free, wanted)]
        whole = _whole(graph, plan, op)
        if whole is not None:
            pairs += [(known, whole), (free, whole)]
        tried = list(seeds.get(op.index, []))
        tried += [p for p in pairs if p not in tried]
        out[op.index] = tried
    return out


def _whole(graph: OpGraph, plan: GraphPlan, op: Op) -> tuple[Spec | None, ...] | None:
    """For a scan whose stacked results `plan` cuts: those results whole (its carries None,
    free), else None."""
    if op.name != "scan":
        return None
    carries = scan_counts(op.params)[1]
    stacked = op.outputs[carries:]
    if not any(w in plan.specs and plan.specs[w].resolved().axes() for w in stacked):
        return None
    return (None,) * carries + tuple(Spec.replicated(len(graph.shape(w))) for w in stacked)


_FOLLOW = 4  # _wanted follows a loop's result through at most this many ops


def _ends(graph: OpGraph, plan: GraphPlan, fixed_out: dict[int, Spec],
          ties: tuple[tuple[int, int], ...]) -> dict[int, list[Spec]]:
    """{output value: the specs it is handed back in}: a fixed output's, a carried one's
    input's in `plan`."""
    tied = {pos: plan.specs.get(v) for v, pos in ties}
    ends: dict[int, list[Spec]] = {}
    for pos, v in enumerate(graph.outputs):
        s = fixed_out.get(pos, tied.get(pos))
        if isinstance(v, int) and s is not None:
            ends.setdefault(v, []).append(s.resolved())
    return ends


def _wanted(graph: OpGraph, plan: GraphPlan, op: Op, ends: dict[int, list[Spec]],
            users: dict) -> tuple[Spec | None, ...] | None:
    """The spec each result of loop `op` is wanted in, where `plan` makes it in another (None
    where not; None for all: no result is). A result is followed through the ops that pass it
    on in its shape and spec (elementwise ops, up to _FOLLOW): wanted is the spec such an op
    reads it in, that of another operand it is read beside (where the plan slices that
    operand to match: a parameter the stacked gradient updates), or a fixed or carried
    output's spec it becomes. The loop's body alone makes its results where that body is
    cheapest (a gradient reduce-scattered), and every reader then follows it. ends:
    _ends(); users: graph.users()."""

    def want(w: int) -> Spec | None:
        shape, frontier, seen = graph.shape(w), [w], {w}
        for _ in range(_FOLLOW):
            after = []
            for u in frontier:
                made = plan.specs[u].resolved()
                for s in ends.get(u, ()):
                    if s != made:
                        return s
                for reader, i in users.get(u, ()):
                    choice = plan.choices.get(reader.index)
                    if choice is None or reader.regions:
                        continue
                    st = choice.strategy
                    read = st.ins[i].resolved()
                    if read != made:
                        return read
                    if len(reader.outputs) != 1 or graph.shape(reader.outputs[0]) != shape \
                            or st.outs[0].resolved() != read:
                        continue  # does not pass it on as it is
                    for k, x in enumerate(reader.inputs):
                        src = plan.specs.get(x) if isinstance(x, int) and k != i else None
                        if src is not None and graph.shape(x) == shape and \
                                st.ins[k].resolved() == read and src.resolved() != read:
                            return src.resolved()
                    if reader.outputs[0] not in seen:
                        seen.add(reader.outputs[0])
                        after.append(reader.outputs[0])
            frontier = after
        return None

    found = tuple(want(w) if w in plan.specs else None for w in op.outputs)
    return None if all(s is None for s in found) else found


def _one_latency_per_group(graph: OpGraph, model: CostModel, t: Tables, problem: Problem,
                           solution: Solution, left: Callable[[], float],
                           held: GraphPlan | None = None, drops: bool = True) -> Solution:
    """The reductions of a step's tail (gradients) pay a share of one latency each in the
    tables, as if XLA combined them all into one collective; it combines only those of one
    kind over one device group that do not wait for one another (tail_groups' rounds). When
    the plan's tail reduces over more groups than kinds, the search runs again with each kind
    kept to its first round's most used group; where it reduces in more than one round, also
    with the first round's groups kept as they are; and with the plan's groups less the one
    making fewest reductions, then that plan's less its own fewest, while each scores lower
    (_DROPS solves at most: a count, not a time, so that the plan does not depend on the
    machine's pace).
    In every solve again a node reduces over a kept group only in its first round (one whose
    operands waited for a reduction of a group, a global norm's sum of squares reading a
    reduced gradient, may not reduce over that group). The plan whose objective is lowest
    once each group pays one whole latency (and each later round's reduction one of its own)
    is kept. That plan is optimal over the plans whose tail reduces over those groups alone,
    in one round (Solution.tail_groups, which the plan's note names), not over every plan: no
    solve minimises the objective with whole latencies, and a looser memory budget can end
    with a costlier plan. held: the plan a region's tables were built around (its other ops'
    reductions count as that plan makes them). drops: whether to drop the rarest groups."""
    waits: dict[int, dict] = {}  # node -> the latest round of each group its ops wait for
    groups = _tail_groups(graph, t, solution.choice, model, waits, held)
    kinds = {kind for kind, _, _ in groups}
    if len(groups) <= len(kinds):
        return solution
    most = {kind: max((g for g in groups if g[0] == kind), key=lambda g: (-g[2], groups[g], g))
            for kind in kinds}
    first = {g for g in groups if g[2] == 1}
    variants = [set(most.values())]  # the (kind, axes, round) groups each solve again keeps
    if first != variants[0] and any(g[2] > 1 for g in groups):
        variants.append(first)
    progress.step("solving again, the tail's reductions over fewer device groups")
    # each tail node's candidates' reductions, as (kind, axes, the round they would run in)
    rounds = {node: [[(kind, axes, waits.get(node, {}).get((kind, axes), 0) + 1)
                      for kind, axes in _reductions(s, matmul, model)] for s in t.cands[node]]
              for node, (matmul, _) in _tail_nodes(graph, t).items()}
    best, score = solution, grouped_objective(graph, model, t, problem, solution.choice, held)
    seconds = solution.seconds

    def again(keep: set) -> bool:
        """The search again with the tail's reductions in `keep` alone; True where its plan
        scores lower than the best so far (then kept)."""
        nonlocal best, score, seconds
        kept = _tied_alike({node: np.array([k for k, made in enumerate(each)
                                            if keep.issuperset(made)], dtype=np.int64)
                            for node, each in rounds.items()}, problem.tied)
        try:
            smaller, back = restricted(problem, kept)
        except ValueError:  # a node left without a candidate: no plan reduces so
            return False
        # At most a few times the first solve's time: a tail held to fewer groups can be far
        # harder to prove (a ViT step on 2 x 2 x 2 devices: 26 s, unproven, at twice the
        # first plan's objective, after a first solve of 0.9 s); past it, its best plan and
        # gap.
        try:
            found = solve(smaller, min(left(), max(_AGAIN_MIN_S, _AGAIN_TIMES * solution.seconds)))
        except ValueError:  # under a budget: no plan whose tail reduces so fits it
            return False
        found = dataclasses.replace(found, choice=back(found.choice))
        seconds += found.seconds
        after = grouped_objective(graph, model, t, problem, found.choice, held)
        if after >= score:
            return False
        cost = objective(problem, found.choice)
        best, score = dataclasses.replace(
            found, cost=cost, optimal=found.optimal and solution.optimal,
            gap=_whole_gap(solution, found.gap, cost),
            tail_groups=tuple(sorted((kind, axes) for kind, axes, _ in keep))), after
        return True

    for keep in variants:
        again(keep)
    # Then the first plan's groups less the one making fewest reductions, and so on from each
    # plan that scores lower, _DROPS times at most: a group of few reductions pays a whole
    # latency (search_gap's deep GPT on 4 x 2 across two nodes at level 2: a reduce-scatter
    # over both axes for the embedding's gradient alone, beside three groups that each kind
    # keeping one breaks up; 0.786 -> 0.756 ms of objective).
    made = groups
    for _ in range(_DROPS if drops else 0):
        if len(made) < 2 or left() <= 0:
            break
        fewer = set(made) - {min(made, key=lambda g: (made[g], -g[2], g))}
        if fewer in variants or not again(fewer):
            break
        made = _tail_groups(graph, t, best.choice, model, None, held)
    return dataclasses.replace(best, seconds=seconds)


def _tied_alike(kept: dict[int, np.ndarray], tied: tuple[tuple[int, ...], ...] | None
                ) -> dict[int, np.ndarray]:
    """`kept` (node -> the candidate indices it may take) with each group of tied nodes that
    has a member in it cut to what every such member keeps: tied nodes take one index. Built
    unfolded (under a memory budget) a tail op's node is tied to the same op's in other
    layers, which may wait on other rounds, and to nodes that are no tail node of their own
    (its results' spans, its partial sums while it runs); restricted() refused the kept sets
    apart, and the tail was never solved again under a budget (a 1-layer GPT Adam step, d_model
    32, at 0.8 of its optimum's peak kept a tail reducing over five device groups: 3.5x the
    optimum's objective, where recursive_programming's plan under the budget scored 1.6x)."""
    out = dict(kept)
    for group in tied or ():
        own = [kept[i] for i in group if i in kept]
        if own:
            common = functools.reduce(np.intersect1d, own)
            out.update((i, common) for i in group)
    return out


def _whole_gap(first: Solution, gap: float, cost: float) -> float:
    """The gap of the tail's solve again as a plan of the whole problem: its own `gap` (over
    the plans whose tail reduces over one group per kind) where the first solve was proven,
    else from `cost` (its plan's objective on the whole problem) to the first solve's bound,
    which holds over every plan (and is no larger than the solve again's own). The solve
    again is exact over its plans only: after a first solve stopped at its time limit it is
    unproven too (a 5-layer MLP AdamW step at mem_coeff 100: the first stopped after 27 s,
    the solve again was proven in 0.14 s, and the plan was said optimal)."""
    if first.optimal:
        return gap
    lower = first.cost * (1 - first.gap)
    return max((cost - lower) / max(abs(cost), 1e-300), 0.0)


def grouped_objective(graph: OpGraph, model: CostModel, t: Tables, problem: Problem,
                      choice: np.ndarray, held: GraphPlan | None = None) -> float:
    """`objective` with the tail's reductions paying one latency per (kind, device group,
    round) instead of a share each (what XLA's combiners make of them); held: as for
    _tail_groups."""
    extra = tail_latency(graph, model, _tail_groups(graph, t, choice, model, held=held))
    return objective(problem, choice) + model.score(OpCost(comm_s=extra))


def tail_latency(graph: OpGraph, model: CostModel, groups: dict[tuple, int]) -> float:
    """Seconds the step's tail reductions, {(kind, axes, round): how many} (tail_groups'),
    pay beyond the share of one latency each that the tables and graph_cost give them
    (OpGraph.latency_share): XLA combines those of one kind over one device group that do
    not wait for one another into one collective, which pays one whole latency; one that
    waits (a later round) pays a whole latency of its own. XLA's combiner walks the program
    in post order and closes the collective it is filling at the first that waits for a
    member: a global norm's sums of squares, each read after its own gradient, alternate with
    the gradients, and each closes one (optax.clip_by_global_norm in a 2-layer GPT step,
    d 256, 4 x 2 devices, data parallel with nine of the squares summed cut: ten all-reduces
    compiled). Negative where the shares add up to more."""
    if not groups:
        return 0.0
    share = graph.latency_share(next(iter(graph.tail_values())))
    return sum(model.collectives_cost([Collective(kind, axes, 0.0)]).comm_s *
               ((1 if at == 1 else n) - n * share) for (kind, axes, at), n in groups.items())


def tail_groups(graph: OpGraph, reductions: Callable[[int], Sequence[tuple] | None],
                ops: Collection[int] | None = None,
                waits: Callable[[int, dict], None] | None = None) -> dict[tuple, int]:
    """{(kind, axes, round): how many} of the reductions the step's tail ops make, each op's
    from `reductions(x)`: [(kind, axes, count)] (empty or None: it reduces nothing). XLA
    combines the reductions of one kind over one device group into one collective where
    none waits for another: one reading (through any ops) what another of its group made
    runs in a later round, a collective of its own (a global norm's sum of squares over a
    gradient cut after its all-reduce waits for that all-reduce: optax.clip_by_global_norm
    in a 2-layer GPT step on 8 devices, data parallel with the squares summed cut, compiled
    to ten all-reduces where the Adam step alone has one). One waiting for a reduction of
    another group only joins its own group's first (dynamic_programming's plan of
    search_gap's GPT on 4 x 2 has an all-reduce over d0 after one over d1; priced so, its
    communication is 303.3 us modelled, 308.3 compiled). A reduction's round is one
    more than the latest of its group among the reductions its operands wait for (none: 1).
    ops: those to count (None: all; the others still pass their rounds on). waits: called
    with (op index, {(kind, axes): the latest round of that group its operands wait for})
    for each (the dict is not to be changed)."""
    none: dict[tuple, int] = {}
    latest: dict[int, dict[tuple, int]] = {}  # value -> the rounds it waits for, by group
    out: dict[tuple, int] = {}
    for x in graph.tail_ops():
        op = graph.ops[x]
        at = none
        for v in op.inputs:
            got = latest.get(v, none) if isinstance(v, int) else none
            if got is at or not got:
                continue
            if not at:
                at = got
            else:  # the latest of each group over both (a new dict: both stay as they were)
                at = {g: max(r, got.get(g, 0)) for g, r in at.items()} | \
                    {g: r for g, r in got.items() if g not in at}
        if waits is not None:
            waits(x, at)
        found = reductions(x)
        if found:
            mine = {}
            for kind, axes, n in found:
                r = mine[(kind, axes)] = at.get((kind, axes), 0) + 1
                if ops is None or x in ops:
                    out[(kind, axes, r)] = out.get((kind, axes, r), 0) + n
            at = at | mine
        if at:
            for v in op.outputs:
                latest[v] = at
    return out


def _tail_nodes(graph: OpGraph, t: Tables) -> dict[int, tuple[bool, int]]:
    """The nodes of the searched ops whose results lie in the step's tail (ops with bodies
    aside), each with whether its op is a matmul (how its reductions run: reduction_steps)
    and how many of those ops it stands for (repeated layers folded into one node)."""
    out: dict[int, tuple[bool, int]] = {}
    for x in graph.tail_ops():
        node = t.op_nodes.get(x)
        if node is not None:
            out[node] = (reduces_as_matmul(graph.ops[x].name), out.get(node, (False, 0))[1] + 1)
    return out


def _tail_groups(graph: OpGraph, t: Tables, choice: np.ndarray, model: CostModel,
                 waits: dict[int, dict] | None = None, held: GraphPlan | None = None
                 ) -> dict[tuple, int]:
    """{(kind, axes, round): how many} of the reductions the tail's ops make under `choice`
    (tail_groups); waits: filled with {node: {(kind, axes): the latest round of that group
    its ops' operands wait for}}.
    held: the plan a region's tables were built around: its other ops reduce as it has them
    (counted too, and passing their rounds on: a region's sum of squares waits for a held
    gradient's all-reduce); None: ops without a node reduce nothing."""
    nodes, memo = t.op_nodes, {}

    def reductions(x: int) -> list | None:
        node = nodes.get(x)
        if node is None:
            other = None if held is None else held.choices.get(x)
            if other is None:
                return None
            return [(kind, axes, 1) for kind, axes in _reductions(
                other.strategy, reduces_as_matmul(graph.ops[x].name), model)]
        hit = memo.get(node)
        if hit is None:
            matmul = reduces_as_matmul(graph.ops[x].name)
            hit = memo[node] = [(kind, axes, 1) for kind, axes in
                                _reductions(t.cands[node][int(choice[node])], matmul, model)]
        return hit

    def wait(x: int, at: dict) -> None:
        node = nodes.get(x)
        if node is not None and at:
            was = waits.get(node)
            waits[node] = at if not was else \
                {g: max(was.get(g, 0), at.get(g, 0)) for g in {*was, *at}}

    return tail_groups(graph, reductions, waits=wait if waits is not None else None)


def _reductions(s, matmul: bool, model: CostModel) -> list[tuple[str, tuple[str, ...]]]:
    """(kind, axes) of the all-reduces and reduce-scatters an op strategy's own reductions
    (cost.model.reduction_steps) run on model's mesh, as its cost counts them (the pair's
    collectives, CostModel.one_byte, worked out once per mesh): a
    partial sum reduce-scattered over some of its axes and all-reduced over the others is
    one of each (a conv's weight gradient summed over d0 and d1 into a spec cut on d1: a
    reduce-scatter over d1, then an all-reduce over d0, which crosses the nodes apart).
    Remembered per mesh (in its cache): the tail's solves again ask it for every candidate
    of every tail node, and on make_mesh(16) an op has up to 6,561."""
    memo = model.mesh.cache.setdefault("tail reductions", {})
    key = (s, matmul)
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = [(c.kind, c.axes)
                           for _, raw, out in reduction_steps(s, matmul, model.mesh)
                           for c in model.one_byte(raw, out, matmul)
                           if c.kind in COMBINED_KINDS]
    return hit


def _budget_left(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
                 memory_budget: float | None) -> float | None:
    """Bytes per device left for the searched values once the fixed inputs are placed."""
    if memory_budget is None:
        return None
    fixed = sum(graph.values[v].nbytes / s.shards(model.mesh) for v, s in fixed_in.items())
    if fixed > memory_budget:
        raise ValueError(f"memory_budget={memory_budget:.0f} bytes per device: the inputs whose "
                         f"strategy is fixed already take {fixed:.0f} bytes per device. Cut "
                         "them further, use a larger mesh, or raise the budget.")
    return memory_budget - fixed


def least_peak(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
               fixed_out: dict[int, Spec], ties: tuple[tuple[int, int], ...] = ()) -> float:
    """The least peak of live bytes per device any plan of `graph` can have, as
    plan.peak_memory counts it (the fixed inputs in their specs): at every program point the
    values alive then, each at its leanest candidate. A graph with loops or conds has none
    (their bodies' plans are not among the tables' candidates): a ValueError."""
    if any(op.regions for op in graph.ops):
        raise ValueError("least_peak: a graph with loops or conds has no such bound here")
    t = build_tables(graph, model, fixed_in, fixed_out, tuple(ties), None, op_classes(graph),
                     fold=False)
    problem = Problem(tuple(t.node_cost), (), tuple(t.node_mem), None, 1.0, None,
                      live_ranges(graph, t))
    usage = problem.usage([m.min() for m in problem.node_mem])
    fixed = sum(graph.values[v].nbytes / s.shards(model.mesh) for v, s in fixed_in.items())
    return fixed + (float(usage.max()) if len(usage) else 0.0)


def live_ranges(graph: OpGraph, t: Tables) -> np.ndarray:
    """(first, last) program point at which each node's results are alive: an op's from its
    own index to its last reader (to the end, len(graph.ops), for program outputs and
    results nothing reads); a free input's throughout; what a region op's bodies add and an
    op's partial sums before their reduce-scatter, at the op's own point (t.running); an op
    whose results die at different points, each node of it to its results' point (t.spans).
    plan.peak_memory counts the same."""
    last = graph.last_points()
    ranges = np.zeros((len(t.cands), 2), dtype=np.int64)
    ranges[list(t.input_nodes.values()), 1] = len(graph.ops)
    for op in graph.ops:
        end = max((last[v] for v in op.outputs), default=op.index)
        ranges[t.op_nodes[op.index]] = (op.index, end)
    for node, index in t.running.items():  # bodies, partial sums: while the op runs
        ranges[node] = (index, index)
    for node, span in t.spans.items():
        ranges[node] = span
    return ranges


def _leanest(t: Tables, choice: np.ndarray, node: int, touching: list) -> int:
    """Free input `node`'s candidate: of those that cost what its chosen one does with its
    readers as chosen, the one holding the fewest bytes per device (the solver takes any of
    them: a weight each device slices for free was left whole on every device, a tensor
    parallel MLP's at level 1 holding 3.7x the memory of the same plan with it cut)."""
    k = int(choice[node])
    local = local_costs(t, choice, node, touching)
    same = np.flatnonzero(local <= local[k] + 1e-12 * abs(local[k]))
    return int(same[np.argmin(t.node_mem[node][same])]) if len(same) else k


def _to_plan(graph: OpGraph, t: Tables, choice: np.ndarray, fixed_in: dict[int, Spec],
             region: Region | None = None) -> GraphPlan:
    """The plan `choice` makes of the tables' nodes (a region's: the rest of its plan)."""
    plan = GraphPlan(specs=dict(fixed_in)) if region is None else \
        GraphPlan(dict(region.plan.specs), dict(region.plan.choices))
    touching = touching_edges(t)
    tied = {node for group in t.tied for node in group}
    for v, node in t.input_nodes.items():
        k = int(choice[node])
        if node not in tied:
            k = _leanest(t, choice, node, touching.get(node, []))
        plan.specs[v] = t.cands[node][k]
    picked: dict[int, tuple] = {}  # node -> what its ops' Choice says and, for ops without
                                   # bodies, the Choice (a folded node's members share it,
                                   # its costs per member; no one changes a Choice)
    for x, node in t.op_nodes.items():
        op = graph.ops[x]
        hit = picked.get(node)
        if hit is None:
            local = local_costs(t, choice, node, touching.get(node, [])) / \
                (t.count[node] if t.count else 1)
            k = int(choice[node])
            others = np.argsort(local, kind="stable")[:2]
            runner = next((int(j) for j in others if j != k), None)
            says = (t.cands[node][k], t.own[node][k], float(local[k]),
                    t.cands[node][runner] if runner is not None else None,
                    float(local[runner]) if runner is not None else None, len(t.cands[node]),
                    has_rule(op.primitive) or bool(op.regions))
            hit = picked[node] = (says, Choice(*says))
        bodies = t.regions.get(x)
        if bodies is None:
            plan.choices[x] = hit[1]
        else:
            plans, trips, _ = bodies.get(id(hit[0][0]), ((), 1, None))
            plan.choices[x] = Choice(*hit[0], plans, trips)
        plan.specs.update(zip(op.outputs, hit[0][0].outs, strict=True))
    for v in graph.inputs:
        plan.specs.setdefault(v, Spec.replicated(len(graph.values[v].shape)))
    return plan
