"""recursive_programming: MindSpore's SAPP (double recursive) search over an OpGraph.

Before: an OpGraph, the specs the user fixed (inputs and outputs), carried-state ties, a
CostModel of the automatic modes (heavy ops use every device), an optional memory budget per
device. After: a GraphPlan like propagate()'s, and the decision log.

1. Units. Main ops (dot_general, conv, gather, scatter-add, reductions over big tensors) are
   units; so is carried state: a training step's parameter and its optimizer moments, whose
   updates are made together, form one unit with one spec (links.Units). Units at the same
   place in identical layers form a class (ir.repeat.op_classes) and are decided once, by the
   class's first unit in its context; a class linked to itself alternates (Megatron's column
   and row kernels), and carried state splits by the classes of the ops that read it.
2. Links. Units are linked through the ops between them (elementwise ops, reshapes, ...): a
   link says which dimension of one unit's operand or result is which of the other's, and
   what the ops it passes cost (they run cut when either end cuts what the link carries).
3. The outer recursion walks the device count factor by factor (the mesh axes, outermost
   first); the inner one the classes: main ops by cost, then carried state, then the main ops
   that make its updates (gradients; deciding after the state, they see whether it is kept
   cut). Each chooses which of its loops the axis cuts (I, J, K or batch of a matmul; a
   dimension of other ops; or none) among the cuts its strategies allow given the axes decided
   before. A cut costs its op-cost (the cheapest of the op's strategies that cut so;
   mem_coeff included) plus its rest-cost: its links to classes decided on this axis and to
   fixed specs (resharding over the axes decided so far, and the ops between), plus for each
   undecided neighbour the extra cost of its best answer to the cut. The cheapest cut wins (cuts
   within 2% of it count as equal and the first listed, the lower dim, wins: neighbours then
   agree on batch rather than mix batch and sequence) and every price goes to the log, in
   MindSpore's words. Other ways to cut the axis are priced
   over all links against the greedy one and taken when cheaper: a second greedy pass from the
   first class's runner-up cut (when dearer by at most 5%), every class cutting as on the
   axis before (greedy passes trust their one-step look-ahead too much on long chains), and
   joint moves: from each of those, classes change their cut one at a time while the links'
   price drops (coordinate descent), and an axis of at most 64 classes is solved exactly
   (dynamic.solve). Greedy passes decide one class at a time; a tensor parallel MLP needs
   several classes to change together.
4. With the main ops and the state that no main op reads (optimizer moments) fixed,
   sharding propagation plans every other op (per class) and the parameters, then
   refine.Refiner improves the plan with the exact objective, one op at a time, and plans
   again the chains of ops that one-at-a-time moves leave in a layout their consumer must
   gather (Refiner.unchain: a bias-add and relu between two tensor-parallel matmuls, a loss
   whose difference two ops read, an MoE router's masks gathered by each reader). In the
   plan kept (see below) carried state is then moved where that lowers the total
   (state.place_state: replicated, in the spec its update makes it in, or cut ZeRO-style).
   Carried outputs are priced against their input's spec throughout, so the plan holds for
   a step called in a loop (a ZeRO-style gather at the end of the step shows).
   The axes are decided twice: with the joint moves, and without them with the links of a
   value read by several main ops sharing its resharding (one move serves readers that need
   one spec; readers that need others each pay theirs, as the first pass prices them). The
   links price a cut roughly and the joint moves trust them most; when the two passes
   decide differently each is planned in full and the plan with the lower exact objective
   is kept. (A third pass, without joint moves and with every link priced whole, made none
   of search_gap's 48 plans better once step 5 had run: without it 47 score the same and
   one lower.)
5. Last, the last mesh axis is solved again exactly with the others held (resolve.solve_axis:
   the exact search over the strategies that use every other axis as the plan does, a
   handful per op): where links mislead, most of all about a layout that cuts neighbouring
   blocks differently (a tensor parallel MLP inside data parallel attention), the last axis
   takes the layout the exact objective prefers. Then the first axis so, the others held:
   it was decided before any other was known (an MoE router cut on its experts on the
   first axis where the exact search cuts d_model). On a mesh of several axes the best plan
   that uses all the axes together (resolve.solve_lockstep: exact over the plans of the
   flattened mesh, cheap as a 1-D search) is a start too: the walk's first decision is a
   two-way cut, which may suit two devices and not eight (on make_mesh(8)'s 2 x 2 x 2, an MoE
   step's experts took the first axis and its tokens one: 1.66x the optimum at level 2 under
   h100-nvlink, and no axis solved alone could move all three; from the lockstep plan,
   1.00x). On a mesh of three or more axes so is the best plan that uses each run of
   neighbouring axes over one kind of link together (resolve.solve_grouped; across two nodes
   (d0) and (d1, d2), else the leading axes and the last: the plans of a 2 x 4 or a 4 x 2
   mesh): a 2-D tensor parallel MLP is out of the walk's reach and not a lockstep plan
   (search_gap's MLP on 2 x 2 x 2 across two nodes, default objective: 1.027x the optimum,
   then 1.006x). The axes are solved again from the start that scores least, each op free to
   use the other axes as any start does (resolve.solve_axis_from_any: the union of each
   start's candidates, and the neighbours of ops taking different starts' layouts pay the
   resharding between them): one solve per axis where each start's solved apart cost one
   each, and no worse than the best of those over the axis solved first. Over search_gap's 72
   cases against the axes solved from each start apart and the best end kept: 11 plans lower,
   2 higher (by 0.07% and 0.02%), the rest the same; the worst 1.036x the optimum then,
   1.025x now. Every start is kept, however far above the walk's it scores (once only those
   within 5% of it, when each was solved apart): a start adds candidates to a solve, not a
   solve, and a plan dearer as a whole may hold the layout some ops need (a 2-layer GPT step
   on 4 x 2 under tpu-v5e, d 512, vocab 2048, seq 64: its lockstep plan scores 1.10x the
   walk's; the axes solved from the walk's alone end at 1.058x the exact search's objective,
   with the lockstep plan's layouts to choose from too at 1.000x). On a mesh of two axes,
   which has no grouped start, the ops making the carried state's updates (from the
   gradients' matmuls) and the state's inputs are free over both axes in these solves
   (_Sapp._state_updates): a tensor parallel MLP on one axis needs its weights' optimizer
   state moved on the other (the GPT step, 2 layers, d 1024, on 4 x 4 devices: 1.041x the
   exact search's objective, then 0.994x). The first of those solves (the last axis) prices
   the step's tail, which the freed updates make, one latency per kind of reduction and
   device group (solve_axis_from_any's group_tail): 80 small GPT steps on 4 x 2 and 2 x 4
   went from 1.0054x the exact search's objective on average to 1.0020x (16 lower, 2 higher
   by 0.03% at most; a 1-layer one, d 512, vocab 2048, seq 64, on 4 x 2 under h100-nvlink,
   1.049x -> 1.000x), 22% more time; both solves so, none lower than that and 74% more time.
   Then the ops around the largest carried state (those within _HOPS of the ops reading it
   and its update) over every axis, the rest held, the step's tail priced one latency per
   kind of reduction and device group as XLA combines them (resolve.solve_region with its
   group_tail; a share of one each made a ZeRO cut of an embedding's update, its own group
   of reductions, look all but free: 1.082x the optimum, then 1.000x): a language model's
   embedding table, read by the lookup and the tied output head, is priced path by path by
   the links, and its better layout changes two axes at once (so does an MoE step's expert
   weight on 4 x 2 devices across two nodes at level 2: 1.044x the optimum with both axes
   solved again, 1.000x after). With loop
   bodies searched (model.search_bodies), the same region also takes the ops between the
   loops (scan, while, cond) and the main ops around them, those included: a loop is no unit
   of the walk, which decides the ops around it without its costs, and its body is then planned
   for what they chose (a scanned GPT step scored 2.5x the exact search's objective; solved
   again so, 1.00x). Each kept where that objective drops.
   Last, where the reductions of two of the plan's tail ops or more wait for others' results
   (a global norm's sums of squares cut, so summed after the gradients' all-reduce, which XLA
   cannot combine with them), or where a device group pays its latency for one reduction,
   the tail is solved again with each kind's reductions kept to fewer device groups and
   rounds (resolve.solve_tail_rounds): optax.clip_by_global_norm in a 2-layer GPT Adam step
   (d 128) on 8 devices compiled to eight all-reduces, then to one. On a mesh of two axes
   the tail is always solved so: there the axes solved again moved the carried state's
   updates over both axes with each tail reduction priced a share of one latency, and a mix
   of device groups (some weights' state cut over both axes, some over one, some whole)
   looked as cheap as fewer groups (a 1-layer GPT step, d 128, vocab 512, seq 64, on 2 x 4
   under tpu-v5e: 1.050x the exact search's objective, then 1.000x, every weight's state
   cut over d0; 80 small GPT steps on 4 x 2 and 2 x 4: worst 1.071x -> 1.062x, mean
   1.011x -> 1.006x, none higher, 10% more time).
6. A plan over the memory budget is searched again with mem_coeff four times larger (more model
   parallel, less memory) a few times. Once one fits, mem_coeffs between the last two are
   tried (bisected twice) and the fitting plan of least objective is kept: four times the
   mem_coeff may give up more time than the budget asks for (budget.within_budget, which
   sharding_propagation uses too). When none fits, the exact search under the budget
   (dynamic_programming, for at most _EXACT_S seconds) plans it, or the ValueError says what
   each found: the peak need not fall as mem_coeff grows.
The work is linear in the number of ops but for step 5: every op is walked, propagated and
refined a bounded number of times, and the units of repeated layers are decided once per
class; step 5 solves repeated layers once too (build_tables folds them; in a deep model the
layers by the ends with the rest: resolve._tying), and its region solve builds tables over
the region alone (tables.Region), but its exact searches on what remains are not bounded so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from jaxpar import progress
from jaxpar.cost.model import CostModel
from jaxpar.ir.graph import Lit, Op, OpGraph
from jaxpar.ir.repeat import op_classes
from jaxpar.rules.registry import OpInfo
from jaxpar.search import paused_gc
from jaxpar.search.budget import RETRIES, Run, bigger, within_budget
from jaxpar.search.copies import moved_note
from jaxpar.search.dynamic import BudgetUnmet, Problem, solve
from jaxpar.search.links import Link, Slot, Units, mapped
from jaxpar.search.propagation import GraphIndex, GraphPlan, propagate
from jaxpar.search.refine import Refiner
from jaxpar.search.regions import LOOPS
from jaxpar.search.resolve import (
    axis_runs,
    objective,
    solve_axis_from_any,
    solve_grouped,
    solve_lockstep,
    solve_region,
    solve_tail_rounds,
)
from jaxpar.search.state import place_state
from jaxpar.spec import MeshInfo, OpStrategy, Spec

log = logging.getLogger("jaxpar.search.recursive")

_ALWAYS_MAIN = frozenset({"dot_general", "conv_general_dilated", "gather", "scatter-add"})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})
_EXACT_S = 10.0       # seconds for the exact search under a budget no plan of the walk meets
_TIE = 1e-9           # relative: costs this close count as equal (the first one wins)
_NEAR = 2e-2          # relative: a class's cuts this close count as equal, the first listed
                      # (the lower dim) wins, so that classes agree (batch, not sequence)
_CLOSE = 1.05         # a first decision's runner-up this close is tried as a second start
_EXACT_CLASSES = 64   # up to this many classes an axis's joint choice is solved exactly
_SWEEPS = 50          # coordinate descent over classes: at most this many sweeps
_PASSES = ("with joint moves", "with shared reads")  # the two passes over the axes (run)
_HOPS = 3             # the ops this many def-use hops from the largest carried state's
                      # readers and update are solved again exactly (over every axis)


def recursive_programming(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
                          fixed_out: dict[int, Spec], memory_budget: float | None = None,
                          ties: Sequence[tuple[int, int]] = (),
                          index: GraphIndex | None = None, notes: list[str] | None = None
                          ) -> tuple[GraphPlan, list[str]]:
    """Plan `graph` the SAPP way (see the module docstring).

    Args:
      graph: the program.
      model: prices strategies; its mem_coeff trades data parallel (small) for model parallel.
      fixed_in: {value id: Spec} the user fixed; fixed_out: {output position: Spec}.
      memory_budget: bytes per device the plan's peak must fit in, or None.
      ties: (input value, output position) pairs of carried state (a training step's
        parameters and optimizer state): the output comes back in the input's spec; the
        plan prices that (see the module docstring) and gives the input its spec.
      index: the graph's GraphIndex, when the caller has one.
      notes: a list to which what a memory budget made it do is added, for the plan's notes
        (the plan kept from searching again with larger mem_coeffs, or the exact search
        under the budget); None: the decision log alone says it.

    Returns:
      (GraphPlan, decision log lines); each line also goes to the "jaxpar.search.recursive"
      logger at debug level.

    Example:
      >>> gp, decisions = recursive_programming(graph, model, {}, {})
      >>> [d for d in decisions if "Choose NOT to cut" in d]
    """
    with paused_gc():
        return _search(graph, model, fixed_in, fixed_out, memory_budget, tuple(ties),
                       GraphIndex.of(graph, index), [] if notes is None else notes)


def _search(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
            fixed_out: dict[int, Spec], memory_budget: float | None,
            ties: tuple[tuple[int, int], ...], index: GraphIndex, notes: list[str]
            ) -> tuple[GraphPlan, list[str]]:
    _check_fixed(graph, model.mesh, fixed_in, memory_budget)
    classes = op_classes(graph)

    def walk(m: CostModel) -> tuple[GraphPlan, list[str]]:
        lines: list[str] = []
        return _Sapp(index, m, fixed_in, fixed_out, classes, lines, ties).run(), lines

    if memory_budget is None:
        return walk(model)
    runs, kept, lines = within_budget(graph, model, fixed_in, fixed_out, ties, memory_budget,
                                      walk, "recursive_programming")
    for line in lines:
        log.debug(line)
    if kept is None:
        gp, said = _exact_within(graph, model, fixed_in, fixed_out, memory_budget, ties, runs)
        notes.extend(f"recursive_programming: {line}" for line in said)
        return gp, said
    if kept is not runs[0]:
        fit = sum(r.peak <= memory_budget for r in runs)
        notes.append(f"recursive_programming: memory_budget={memory_budget:.0f} bytes per "
                     f"device: its plan with mem_coeff={model.mem_coeff:g} peaked at "
                     f"{runs[0].peak:.0f} bytes, so it searched again with larger mem_coeffs "
                     f"({len(runs) - 1} more plans); kept the plan of mem_coeff="
                     f"{kept.mem_coeff:g} (peak {kept.peak:.0f} bytes), the lowest objective "
                     f"of the {fit} that fit")
    return kept.plan, lines + kept.lines


def _exact_within(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
                  fixed_out: dict[int, Spec], memory_budget: float,
                  ties: tuple[tuple[int, int], ...], runs: list[Run]
                  ) -> tuple[GraphPlan, list[str]]:
    """No plan of the walk's fits the budget (`runs`: budget.within_budget's): the exact
    search under the budget (dynamic_programming), which bounds the peak itself. A larger
    mem_coeff weighs the bytes a plan holds, not their peak, so the peaks of the walk's plans
    need not fall as it grows (an MLP step: 193,796 bytes at 9.05, 198,148 at 25.6, 197,188
    at 409.6), and a budget between them was refused that one of them met. A ValueError
    saying what each found when neither fits."""
    from jaxpar.search.exact import dynamic_programming

    leanest = min(r.peak for r in runs)
    tried = (f"its leanest plan peaks at {leanest:.0f} bytes per device (mem_coeff up to "
             f"{bigger(model.mem_coeff, RETRIES):g})")
    try:
        gp, found = dynamic_programming(graph, model, fixed_in, fixed_out, memory_budget,
                                        time_limit=_EXACT_S, ties=ties)
    except ValueError as err:  # its reason without its own "memory_budget=... met" (where
        # it gives one: exact.dynamic_programming's budget errors)
        unmet = isinstance(err, BudgetUnmet)
        said = (err.reason if unmet else str(err)).rstrip(".") + "."
        raise ValueError(
            f"memory_budget={memory_budget:.0f} bytes per device cannot be met by "
            f"recursive_programming: {tried}, and the exact search under the budget found "
            f"none either{err.placed if unmet else ''}: {said} Cut more dimensions in "
            "in_strategy/parameter_plan, use a larger mesh, or raise the budget.") from None
    lines: list[str] = []
    _note(lines, f"memory_budget={memory_budget:.0f} bytes per device: no plan of the walk "
          f"fits; {tried}. The exact search under the budget (dynamic_programming, "
          f"{'optimal' if found.optimal else f'stopped at {_EXACT_S:g} s, gap {found.gap:.1%}'}"
          f"{_moved(found.moved)}) planned it.")
    return gp, lines


def _moved(moved: int) -> str:
    """What exact._refit's moves of carried state (Solution.moved) add to a note."""
    return f"; {moved_note(moved)}" if moved else ""


def _check_fixed(graph: OpGraph, mesh: MeshInfo, fixed_in: dict[int, Spec],
                 budget: float | None) -> None:
    if budget is None:
        return
    fixed = sum(graph.values[v].nbytes / s.shards(mesh) for v, s in fixed_in.items())
    if fixed > budget:
        raise ValueError(f"memory_budget={budget:.0f} bytes per device: the inputs whose "
                         f"strategy is fixed already take {fixed:.0f} bytes per device. Cut "
                         "them further, use a larger mesh, or raise the budget.")


def _note(lines: list[str], line: str) -> None:
    log.debug(line)
    lines.append(line)


def main_ops(graph: OpGraph, index: GraphIndex | None = None) -> list[int]:
    """Indices of the ops SAPP decides itself: matmuls, convs, gathers, scatter-adds, and
    reductions whose operand is at least as big as the smallest of those ops' largest operands
    (every reduction when there are none)."""
    size = (index or GraphIndex(graph)).nbytes

    def nbytes(v: int | Lit) -> float:
        return 0 if isinstance(v, Lit) else size(v)
    heavy = [op for op in graph.ops if op.name in _ALWAYS_MAIN]
    big = min((max(nbytes(v) for v in op.inputs) for op in heavy), default=0)
    return [op.index for op in graph.ops if not op.regions and (
        op.name in _ALWAYS_MAIN or (op.name in _REDUCTIONS and nbytes(op.inputs[0]) >= big))]


def _slot(s: OpStrategy, slot: Slot) -> Spec:
    return s.ins[slot[1]] if slot[0] == 0 else s.outs[slot[1]]


class _Sapp:
    """One search: units and links, the axis-by-axis decisions, then the rest of the plan."""

    def __init__(self, index: GraphIndex, model: CostModel, fixed_in, fixed_out,
                 classes: list[int], lines: list[str], ties: tuple = ()):
        self.g, self.index, self.model = index.g, index, model
        self.mesh, self.lines = model.mesh, lines
        self.mains = main_ops(index.g, index)
        self.units = Units(index, self.mains, fixed_in, fixed_out, ties,
                           min(model.mesh.sizes, default=2))
        self.fixed_in, self.fixed_out = fixed_in, self.units.fixed_out
        self.linker, self.is_carried = self.units.linker, self.units.is_carried
        self.scores_cache: dict = {}
        self.usage_cache: dict = {}
        self.joint = True  # whether _axis also tries joint moves (run() decides both ways)
        self.divisor: dict[int, int] = {}  # link number -> what its resharding is divided by
                                           # (absent: 1)
        self.shares = index.shares
        self.classes = self._main_classes(classes)

    # -- setup ---------------------------------------------------------------------------
    def share(self, op: Op) -> float:
        """graph.op_latency_share(op)."""
        return max((self.shares(v) for v in op.outputs), default=1.0)

    def options(self, x: int) -> tuple[list[OpStrategy], list[float]]:
        """A unit's candidates and their scores (carried state: every spec, free)."""
        info = self.units.info(x)
        if self.is_carried(x):
            cands, _ = self.model.options(info)
            key = ("carried", id(cands))
            if key not in self.scores_cache:
                self.scores_cache[key] = [0.0] * len(cands)
            return cands, self.scores_cache[key]
        cands, costs = self.model.options(info, self.share(self.g.ops[x]))
        if id(cands) not in self.scores_cache:
            self.scores_cache[id(cands)] = [self.model.score(cost) for cost in costs]
        return cands, self.scores_cache[id(cands)]

    def _main_classes(self, classes: list[int]) -> list[int]:
        """op_classes, with main ops also told apart by their reductions' latency share and
        carried units by the classes of the ops making their outputs and by their state's
        shapes and dtypes (one op, a cond, may make them all); each class remembers its
        members (first one first)."""
        units, producer, values = self.units, self.index.producer, self.g.values
        out, number = list(classes) + [0] * len(units.groups), {}
        self.members: dict[int, list[int]] = {}
        keys = [(x, (classes[x], self.share(self.g.ops[x]))) for x in self.mains]
        keys += [(len(classes) + gi, ("carried", tuple(sorted(
            (classes[producer[w]], values[w].shape, str(values[w].dtype))
            for w in (units.carried[k][2] for k in ks)))))
                 for gi, ks in enumerate(units.groups)]
        for x, key in keys:
            c = number.setdefault(key, len(out) + len(number))
            out[x] = c
            self.members.setdefault(c, []).append(x)
        return out

    def run(self) -> GraphPlan:
        # Pricing; each pass's axes and the plan of the other ops; the carried state; the
        # axes solved again; the region around the largest carried state.
        several = len(self.mesh.names) > 1  # the axes are also solved again from lockstep
        grouped = len(self.mesh.names) > 2
        steps = (1 + len(_PASSES) * (len(self.mesh.names) + 1) + 1
                 + several + grouped + len(self._again()) + 1)
        with progress.stage("", total=steps):
            return self._run()

    def _run(self) -> GraphPlan:
        g, model = self.g, self.model
        progress.step("pricing the units' cuts and links")
        links = self._link_classes()
        self.cands, self.scores, self.alive = {}, {}, {}
        for c, xs in self.members.items():
            self.cands[c], self.scores[c] = self.options(xs[0])
            self.alive[c] = list(range(len(self.cands[c])))
        self.op_links, self.fixed_links, rev = {}, {}, {}
        for c in self.members:
            self.op_links[c] = [lk for lk in links[c] if lk.other >= 0]
            self.fixed_links[c] = [lk for lk in links[c] if lk.other < 0]
            for lk in self.op_links[c]:
                if self.classes[lk.other] != c:
                    rev.setdefault(self.classes[lk.other], []).append((c, lk))
        self.rev = rev
        self._path_costs(links)
        shared = self._shared_reads(links)
        order = sorted(self.members, key=self._rank)
        _note(self.lines, f"recursive_programming: {len(self.mains)} main ops of "
                          f"{len(g.ops)} and {len(self.units.carried)} carried states "
                          f"({len(order)} classes), mesh {self.mesh.describe()}, "
                          f"mem_coeff={model.mem_coeff:g}; costs in modeled seconds")
        # Two passes over the axes: with the joint moves, and with greedy passes alone and a
        # value's main readers sharing its resharding. The links price a cut roughly; when
        # the passes decide differently each is planned in full and the plan with the lower
        # exact objective is kept (joint moves can mislead).
        passes = dict(zip(_PASSES, [(True, {}), (False, shared)], strict=True))
        alive, outer, done = {c: list(a) for c, a in self.alive.items()}, self.lines, []
        for n, (how, (self.joint, self.divisor)) in enumerate(passes.items(), 1):
            self.alive = {c: list(a) for c, a in alive.items()}
            self.factor, self.lines = {}, []
            for k, axis in enumerate(self.mesh.names):
                progress.step(f"axis {axis}, pass {n} of {len(passes)}")
                self._axis(k, axis, order)
            progress.step(f"planning the other ops, pass {n} of {len(passes)}")
            decided = self._decided()
            if any(decided == d[0] for d in done):
                continue
            refiner = self._complete(*decided)
            done.append((decided, refiner, self._score(refiner.plan, decided[2]), self.lines,
                         how))
        best = min(done, key=lambda d: d[2])
        for line in best[3]:
            _note(outer, line)
        if len(done) > 1:
            others = ", ".join(f"{d[4]} {d[2]:.6g}" for d in done if d is not best)
            _note(outer, f"kept the plan {best[4]}: it scores {best[2]:.6g} ({others})")
        self.lines = outer
        refiner = best[1]
        progress.step("placing the carried state")
        place_state(refiner, self.units, self.members.values(), self.fixed_in, self.mesh)
        for x in self.mains:  # as propagate() reports them: with the runner-up
            refiner.plan.choices[x] = refiner.report(x)
        return self._solve_again(refiner.plan)

    def _solve_again(self, plan: GraphPlan) -> GraphPlan:
        """Parts of the plan solved again exactly, the rest held (step 5 of the module
        docstring): the last mesh axis, then the first (decided before any other was known),
        then the ops around the largest carried state and the step's tail. Each plan found is
        kept where its exact objective is lower. On a mesh of several axes the best plans
        that use the axes together are starts too (_starts): the axes are solved again from
        the best start, each op also free to use the other axes as any other start does
        (resolve.solve_axis_from_any): the walk decides an axis at a time, so a cut that pays
        only over several axes (a MoE layer's tokens over all eight devices, its experts
        two-way) is out of its reach, and a start's layout may suit some ops only."""
        ties = tuple((v, pos) for v, pos, _ in self.units.carried if v not in self.fixed_in)
        starts = self._starts(plan, ties)
        what, plan, before = min(starts, key=lambda s: s[2])
        others = [s for s in starts if s[1] is not plan]
        if others:
            _note(self.lines, f"the axes solved again from the plan of {what} ({before:.6g}, "
                              "the lowest of the starts), each op also free to use the other "
                              "axes as " + " or as ".join(f"{w}" for w, _, _ in others) +
                              " does")
        free = self._state_updates()
        two_axes = free is not None  # a mesh of two axes, with carried state
        held = "the other axes held but by the carried state's updates" if two_axes else \
            "the other axes held"
        # (from the starts, the best of them too once left behind)
        for k, axis in enumerate(self._again()):
            progress.step(f"axis {axis} solved again exactly")
            found = solve_axis_from_any(self.g, self.model,
                                        [plan, *(s[1] for s in starts if s[1] is not plan)],
                                        self.fixed_in, self.fixed_out, ties, axis, free=free,
                                        group_tail=two_axes and k == 0)
            after = self._score(found, self.fixed_out)
            if after < before * (1 - 1e-9):
                _note(self.lines, f"axis {axis}: every op's use of it solved again exactly, "
                                  f"{held}, scores {after:.6g}, less than {before:.6g}: "
                                  "taken instead")
                plan, before = found, after
        plan = self._solve_neighbourhoods(plan, before, ties)
        found, after = solve_tail_rounds(self.g, self.model, plan, self.fixed_in,
                                         self.fixed_out, ties, self.index, always=two_axes)
        if found is not plan:
            why = "on two axes, always" if two_axes else \
                "one waited for another, or a group made one"
            _note(self.lines, f"the step's tail solved again exactly, its reductions kept to "
                              f"fewer device groups and rounds ({why}): scores {after:.6g}, "
                              "taken instead")
        return found

    def _starts(self, plan: GraphPlan, ties: tuple) -> list[tuple[str, GraphPlan, float]]:
        """The plans _solve_again solves the axes again from, each with its name and score:
        the walk's, and on a mesh of several axes the best that uses them all together and
        (three axes or more) the best that uses each of resolve.axis_runs() together,
        whatever they score (the module docstring, step 5)."""
        walk = self._score(plan, self.fixed_out)
        starts = [("the walk", plan, walk)]
        if len(self.mesh.names) < 2:
            return starts
        names = self.mesh.names
        progress.step("every axis used together, solved exactly")
        flat = solve_lockstep(self.g, self.model, self.fixed_in, self.fixed_out, ties)
        starts.append((f"every axis used together ({'+'.join(names)} as one)", flat,
                       self._score(flat, self.fixed_out)))
        if len(names) > 2:
            groups = axis_runs(self.model)
            what = f"axes {' and '.join('+'.join(g) for g in groups)} each used together"
            progress.step(f"{what}, solved exactly")
            grouped = solve_grouped(self.g, self.model, self.fixed_in, self.fixed_out, ties,
                                    groups)
            starts.append((what, grouped, self._score(grouped, self.fixed_out)))
        _note(self.lines, "solved exactly over fewer axes: " + "; ".join(
            f"{w} scores {score:.6g}" for w, _, score in starts[1:]))
        return starts

    def _state_updates(self) -> tuple[frozenset[int], frozenset[int]] | None:
        """On a mesh of two axes, what the axes solved again leave free over both: the ops
        making the carried state's updates (links.Units.update_region: from the main ops
        making the gradients) and the state's free inputs; None on other meshes, and where
        there is no carried state (a step with nothing returned updated).

        There the starts are the walk's plan and the lockstep one, and neither holds a 2-D
        layout: both cut the optimizer state over both axes (ZeRO), and a tensor parallel MLP
        on the last axis needs its weights' state moved on the first as well, two axes at
        once that no axis solved alone reaches (the GPT step, 2 layers, d 1024, on 4 x 4
        devices: 1.041x the exact search's objective, then 0.994x; search_gap's GPT on 4 x 2
        under tpu-v5e: 1.024x, then 1.000x). On three axes or more the grouped start holds
        such layouts (_starts), and freeing the updates there made search_gap's 24 plans on
        2 x 2 x 2 no lower but one (by 0.04%; one 0.5% higher) and 36% slower to find."""
        if len(self.mesh.names) != 2:
            return None
        n = len(self.g.ops)
        ops = {y for x in range(n, n + len(self.units.groups))
               for y in self.units.update_region(x)}
        inputs = {v for v, _, _ in self.units.carried if v not in self.fixed_in}
        return (frozenset(ops), frozenset(inputs)) if ops or inputs else None

    def _again(self) -> list[str]:
        """The mesh axes _solve_again solves again, in order: the last, then the first."""
        return list(dict.fromkeys((self.mesh.names[-1], self.mesh.names[0])))

    def _solve_neighbourhoods(self, plan: GraphPlan, before: float, ties: tuple) -> GraphPlan:
        """The ops within _HOPS of the largest carried state (the ops reading it and its
        update), and with loop bodies searched (model.search_bodies) those between the loops
        and the main ops around them, solved again exactly over every axis, the rest held
        (resolve.solve_region), with the free inputs they read. A big parameter read and
        written along several paths (an embedding table, read by the lookup and by the tied
        output head) has each path priced apart by the links, and its layout is a joint
        choice of several axes that one axis at a time does not reach. A loop (a model's
        layers under lax.scan) is no unit of the walk: the walk decides the ops around it
        without its costs, and its body is planned for what they chose; solved again, the
        loops and their neighbours choose together (a loop's body also solved for the
        operand specs the plan gives it). Returns the plan kept (`plan` unless the region's
        solution scores lower than `before`).

        The region is solved with the step's tail priced as XLA runs it, one latency per kind
        of reduction and device group (solve_region's group_tail): the largest state's update
        is in the tail, and priced a share of a latency each, its gradient's reduce-scatter
        and the new value's gather (a ZeRO cut of an embedding table's update, its own device
        group beside the other gradients' all-reduce) looked all but free: a GPT step (2
        layers, d 256, vocab 2048, seq 128) on 4 x 2 devices under h100-nvlink scored 1.082x
        the exact search's objective, and now 1.000x."""
        units, index, n = self.units, self.index, len(self.g.ops)
        ops, near, what = set(), [], []
        carried = [x for xs in self.members.values() for x in xs if x >= n]
        if carried:
            x = max(carried, key=lambda x: (max(index.nbytes(v) for v, _, _ in units.state(x)),
                                            -x))
            seeds = set(units.update_region(x))
            seeds.update(r for v, _, _ in units.state(x) for r, _ in index.readers.get(v, ()))
            ops |= index.neighbourhood(seeds, _HOPS)
            near.append("the largest carried state")
            what.append(f"within {_HOPS} hops of the readers and update of {units.name(x)}")
        loops = {op.index for op in self.g.ops if op.name in LOOPS}
        if loops and self.model.search_bodies:
            ops |= index.neighbourhood(loops, None, frozenset(self.mains))
            near.append("the loops")
            what.append(f"between the {len(loops)} loops and the main ops around them")
        if not ops:
            return plan
        progress.step(f"the neighbourhood of {' and of '.join(near)} solved again exactly")
        made = {w for y in ops for w in self.g.ops[y].outputs}
        inputs = index.free_reads(ops, self.fixed_in)
        inputs.update(v for v, _, w in units.carried if w in made and v not in self.fixed_in)
        found = solve_region(self.g, self.model, plan, self.fixed_in, self.fixed_out, ties, ops,
                             inputs, group_tail=True)
        after = self._score(found, self.fixed_out)
        if after >= before * (1 - 1e-9):
            return plan
        _note(self.lines, f"the {len(ops)} ops {' or '.join(what)} solved again exactly, the "
                          f"rest held, score {after:.6g}, less than {before:.6g}: taken instead")
        return found

    def _complete(self, fixed: dict, fixed_in: dict, fixed_out: dict) -> Refiner:
        """The whole plan from the main ops' decisions: propagation, then refinement (the
        Refiner holding it: run() moves the carried state of the plan it keeps)."""
        g, model = self.g, self.model
        ties = tuple((v, pos) for v, pos, _ in self.units.carried if v not in fixed_in)
        classes = self.classes[:len(g.ops)]
        gp = propagate(g, model, fixed_in, fixed_out, fixed, classes, ties, self.index)
        refiner = Refiner(g, model, gp, fixed_in, fixed_out, classes, ties, self.index)
        refiner.run()
        mains = self.units.mains
        if refiner.unchain(mains):
            refiner.run()
        return refiner

    def _score(self, plan: GraphPlan, fixed_out: dict) -> float:
        """The plan's exact objective, carried outputs back in their input's spec."""
        return objective(self.g, self.model, plan, fixed_out,
                         [(v, pos) for v, pos, _ in self.units.carried])

    def _decided(self) -> tuple[dict, dict, dict]:
        """(main op -> strategy, fixed inputs, fixed outputs): the main ops' decisions, and
        the carried state no main op reads (optimizer moments) in and out in its unit's spec
        (parameters are placed with the ops reading them)."""
        fixed, fixed_in, fixed_out = {}, dict(self.fixed_in), dict(self.fixed_out)
        n, units = len(self.g.ops), self.units
        for c, xs in self.members.items():
            best = self.cands[c][min(self.alive[c], key=self.scores[c].__getitem__)]
            if xs[0] < n:
                fixed.update((x, best) for x in xs)
                continue
            read = [bool(units.main_readers(v)) for v, _, _ in units.state(xs[0])]
            for x in xs:
                state = units.state(x)
                if len(state) != len(read):  # another make-up: look again
                    read = [bool(units.main_readers(v)) for v, _, _ in state]
                for (v, pos, _), r in zip(state, read, strict=True):
                    if not r:
                        fixed_in[v] = fixed_out[pos] = best.ins[0]
        return fixed, fixed_in, fixed_out

    def _rank(self, c: int) -> tuple:
        """The order classes decide in, most expensive first within three tiers: main ops,
        then carried state (zero op-cost, after the ops reading it), then the main ops that
        make the updates of carried state (gradients), which then see the state decided."""
        x = self.members[c][0]
        if self.is_carried(x):
            return (1, 0.0, x)
        writes = any(self.is_carried(lk.other) and lk.other_slot == (0, 0)
                     for lk in self.op_links[c])
        return (2 if writes else 0, -min(self.scores[c]), x)

    # -- links ---------------------------------------------------------------------------
    def _link_classes(self) -> dict[int, list[Link]]:
        """Each class's links (from its first unit). A main class linked to itself is split
        in two, its ops alternating between them: a stack of identical layers may alternate
        (Megatron's column- and row-parallel matmuls); carried state then splits by the
        classes of the main ops reading it."""
        walk = self.linker.walk_all
        found = {c: walk(xs[0]) for c, xs in self.members.items()}
        for c in list(self.members):
            xs = self.members[c]
            if len(xs) > 1 and not self.is_carried(xs[0]) and any(
                    lk.other >= 0 and self.classes[lk.other] == c for lk in found[c]):
                self._split(c, [xs[0::2], xs[1::2]], found)
        for c in list(self.members):
            xs = self.members[c]
            if len(xs) > 1 and self.is_carried(xs[0]):
                by: dict[tuple, list[int]] = {}
                for x in xs:
                    readers = {y for v, _, _ in self.units.state(x)
                               for y in self.units.main_readers(v)}
                    by.setdefault(tuple(sorted({self.classes[y] for y in readers})),
                                  []).append(x)
                self._split(c, list(by.values()), found)
        return {c: self.linker.merged(xs[0], found[c], self.classes)
                for c, xs in self.members.items()}

    def _split(self, c: int, parts: list[list[int]], found: dict) -> None:
        """Class c keeps its first part; each other part becomes a class of its own."""
        self.members[c] = parts[0]
        for part in parts[1:]:
            new = max(self.members) + 1
            self.members[new] = part
            for x in part:
                self.classes[x] = new
            found[new] = self.linker.walk_all(part[0])

    def _path_costs(self, links: dict[int, list[Link]]) -> None:
        """What the ops between linked units cost uncut (`self.path`, by link number). An op
        on several links is shared out among them, so that summed over every link of every
        unit (both ends of a link count it) it costs twice its own cost, as a resharding
        between two units is priced from both ends."""
        passes: dict[int, int] = {}
        for c, lks in links.items():
            for lk in lks:
                for q in lk.path:
                    passes[self.classes[q]] = passes.get(self.classes[q], 0) + \
                        lk.count * len(self.members[c])
        sizes: dict[int, int] = {}
        for q in passes:
            sizes[q] = 0
        for x in range(len(self.g.ops)):
            if self.classes[x] in sizes:
                sizes[self.classes[x]] += 1
        weight: dict[int, float] = {}
        for lks in links.values():
            for lk in lks:
                for q in lk.path:
                    qc = self.classes[q]
                    if qc not in weight:
                        op = self.g.ops[q]
                        _, costs = self.model.options(self.units.info(q), self.share(op))
                        weight[qc] = 2 * self.model.score(costs[0]) * sizes[qc] / passes[qc]
        self.path = {lk.n: sum(weight[self.classes[q]] for q in lk.path)
                     for lks in links.values() for lk in lks}
        self.factor: dict[int, int] = {}

    def _shared_reads(self, links: dict[int, list[Link]]) -> dict[int, int]:
        """How many main ops read the value each link between two main ops delivers, by
        link number, where more than one does. One resharding of it serves all of them when
        they need one spec, so each such link may be priced at that share of it (a
        transposed activation read by three weight-gradient matmuls is moved once, not three
        times): run() decides the axes with links priced so and with each priced whole
        (readers that need other specs each pay theirs)."""
        g, n_ops, mains = self.g, len(self.g.ops), self.units.mains
        readers, out = self.index.readers, {}
        for lks in links.values():
            for lk in lks:
                if not (0 <= lk.other < n_ops and lk.owner < n_ops):
                    continue  # a fixed spec or carried state at an end
                x, slot = (lk.owner, lk.slot) if lk.into else (lk.other, lk.other_slot)
                w = g.ops[x].inputs[slot[1]] if slot[0] == 0 else None
                if isinstance(w, int):
                    k = len({r for r, _ in readers.get(w, ()) if r in mains})
                    if k > 1:
                        out[lk.n] = k
        return out

    # -- one axis ------------------------------------------------------------------------
    def _axis(self, k: int, axis: str, order: list[int]) -> None:
        """Decide one mesh axis for every main class: the greedy pass, or one of two others
        when its links price cheaper over the whole graph: a greedy pass started from the
        first class's runner-up cut when that was close, and every class cutting as on the
        axis before."""
        self.k, self.axis = k, axis
        self.axes = frozenset(self.mesh.names[:k + 1])
        self.before = frozenset(self.mesh.names[:k])
        self.tab, self.base, self.vectors, self.geo = {}, {}, {}, {}
        self.link_shapes, self.shape_ids = {}, {}
        self.opts = {c: self._options(c) for c in order}
        self._vectors(order)
        self.start = {c: [sum(self._cost(lk, self.dxs[lk.n][n], None)
                              for lk in self.fixed_links[c]) for n in range(len(self.opts[c]))]
                      for c in order}
        runs = [self._greedy(order)]
        second = runs[0][2]
        if second is not None:
            runs.append(self._greedy(order, {order[0]: second}))
        if k > 0:
            again = {c: self.prev[c] if any(u == self.prev[c] for u, _, _ in self.opts[c])
                     else u for c, u in runs[0][0].items()}
            runs.append((again, [], None))
        joint = len(runs)
        if self.joint:
            runs += [(chosen, [], None) for chosen in
                     self._jointly(order, [chosen for chosen, _, _ in runs])]
        costs = [self._objective(chosen) for chosen, _, _ in runs]
        best = min(range(len(runs)), key=lambda n: (costs[n] * (1 + _TIE * n), n))
        chosen, lines, _ = runs[best]
        self.lines.extend(runs[0][1] if not runs[best][1] else lines)  # logged if kept
        if best:
            if best >= joint:
                how = "cutting classes together where that lowers the links' price"
            elif not runs[best][1]:
                how = f"cutting every main op as on axis {self.mesh.names[k - 1]}"
            else:
                how = f"starting from the runner-up cut of op {self.members[order[0]][0]}"
            self.lines.append(f"axis {axis}: {how} costs {costs[best]:.6g} over the links, "
                              f"less than the greedy choices ({costs[0]:.6g}): taken instead")
        size = self.mesh.axis_size(axis)
        for c, u in chosen.items():  # links that carry a cut: the ops between run cut
            for lk in self.op_links[c] + self.fixed_links[c]:
                dy = lk.fixed.dim_of(axis) if lk.other < 0 else \
                    self._dy(lk, chosen[self.classes[lk.other]])
                if _carries(lk, u[lk.slot[0]][lk.slot[1]], dy):
                    self.factor[lk.n] = self.factor.get(lk.n, 1) * size
        for c, u in chosen.items():
            usage = self.usage_cache[(id(self.cands[c]), axis)]
            self.alive[c] = [i for i in self.alive[c] if usage[i] == u]
        self.prev = chosen

    def _greedy(self, order: list[int], forced: dict | None = None):
        """One greedy pass: (cut per class, log lines, the first class's runner-up cut when
        it priced above the best but within _CLOSE of it, else None)."""
        self.decided = dict.fromkeys(order)
        self.acc = {c: list(acc) for c, acc in self.start.items()}
        self.gather = {c: [0.0] * len(acc) for c, acc in self.start.items()}
        lines: list[str] = []
        second = None
        for c in order:
            rows = self._decide(c, (forced or {}).get(c), lines)
            if c == order[0]:
                mine = next(r[0] for r in rows if r[2] == self.decided[c])
                others = sorted(r for r in rows if r[2] != self.decided[c])
                if others and mine < others[0][0] <= _CLOSE * mine:
                    second = others[0][5]
        return {c: self.opts[c][n][0] for c, n in self.decided.items()}, lines, second

    def _pairwise(self, order: list[int]) -> tuple[list[np.ndarray], dict]:
        """`_objective` as unary and pairwise terms over the classes' cuts on this axis:
        (per class of `order`, the cost of each of its options; {(i, j): table} between the
        classes at positions i < j). A carried state's dearest reader is counted as all of
        them (the one term that is not pairwise), so this prices such state a little high."""
        at = {c: i for i, c in enumerate(order)}
        n_ops = len(self.g.ops)
        unary = [np.array([(op_cost + start) * len(self.members[c]) for (_, op_cost, _), start
                           in zip(self.opts[c], self.start[c], strict=True)]) for c in order]
        pairs: dict[tuple[int, int], np.ndarray] = {}
        for c in order:
            carried = self.members[c][0] >= n_ops
            for lk in self.op_links[c]:
                if not carried and lk.other >= n_ops and lk.other_slot == (1, 0):
                    continue  # priced at the state, as its reader
                weight = len(self.members[c]) * (1.0 if carried and lk.slot == (1, 0) else 0.5)
                d = self.classes[lk.other]
                if d == c:
                    unary[at[c]] += weight * np.asarray(self._diagonal(lk))
                    continue
                table = weight * np.array([self._answers(lk, dx) for dx in self.dxs[lk.n]])
                key = (at[c], at[d])
                if key[0] > key[1]:
                    key, table = key[::-1], table.T
                pairs[key] = pairs[key] + table if key in pairs else table
        return unary, pairs

    def _jointly(self, order: list[int], starts: list[dict[int, tuple]]) -> list[dict]:
        """Cuts for every class that lower the links' price over the whole graph together
        (greedy passes decide one class at a time, while a tensor parallel MLP inside data
        parallel attention needs several classes to change their cut at once): each start
        improved class by class until no class gains alone, and with few classes the exact
        optimum (dynamic.solve; it takes milliseconds there)."""
        unary, pairs = self._pairwise(order)
        out = [self._descend(order, unary, pairs, start) for start in starts]
        if len(order) <= _EXACT_CLASSES:
            choice = solve(Problem(tuple(unary), tuple((i, j, t) for (i, j), t in
                                                       pairs.items()))).choice
            out.append({c: self.opts[c][int(choice[i])][0] for i, c in enumerate(order)})
        return out

    def _descend(self, order: list[int], unary: list[np.ndarray], pairs: dict,
                 start: dict[int, tuple]) -> dict[int, tuple]:
        """Coordinate descent from `start`: each class in turn takes its cheapest option
        against its neighbours' current ones, until a sweep changes nothing."""
        pick = [next(n for n, (u, _, _) in enumerate(self.opts[c]) if u == start[c])
                for c in order]
        near: list[list[tuple[int, np.ndarray]]] = [[] for _ in order]
        for (i, j), table in pairs.items():
            near[i].append((j, table))
            near[j].append((i, table.T))
        for _ in range(_SWEEPS):
            moved = False
            for i, terms in enumerate(near):
                total = unary[i] + sum(t[:, pick[j]] for j, t in terms) if terms else unary[i]
                best = int(np.argmin(total))
                if total[best] < total[pick[i]] * (1 - _TIE) - 1e-18:
                    pick[i], moved = best, True
            if not moved:
                break
        return {c: self.opts[c][pick[i]][0] for i, c in enumerate(order)}

    def _objective(self, chosen: dict[int, tuple]) -> float:
        """Op-costs plus resharding over every link, each class counted once per op, when
        every class cuts this axis as `chosen` says. A link is priced at both ends, so half
        at each; but carried state is read in one spec (gathered once after its update), so
        its readers' links count once, at the state, as their dearest."""
        pick = {c: next(n for n, (v, _, _) in enumerate(self.opts[c]) if v == u)
                for c, u in chosen.items()}
        total, cost, n_ops = 0.0, self._cost, len(self.g.ops)
        for c, n in pick.items():
            own = self.opts[c][n][1] + self.start[c][n]
            links, read = 0.0, 0.0
            carried = self.members[c][0] >= n_ops
            for lk in self.op_links[c]:
                price = cost(lk, self.dxs[lk.n][n], self.dys[lk.n][pick[self.classes[lk.other]]])
                if carried and lk.slot == (1, 0):
                    read = max(read, price)
                elif not (lk.other >= n_ops and lk.other_slot == (1, 0)):
                    links += price
            total += (own + 0.5 * links + read) * len(self.members[c])
        return total

    def _options(self, c: int) -> list[tuple[tuple, float, int]]:
        """Each way the axis can cut class c given its earlier decisions:
        (usage, op-cost, candidate), in the order the op's rule lists them."""
        key = (id(self.cands[c]), self.axis)
        if key not in self.usage_cache:
            self.usage_cache[key] = [s.usage(self.axis) for s in self.cands[c]]
        usage, scores = self.usage_cache[key], self.scores[c]
        best: dict[tuple, tuple[float, int]] = {}
        for i in self.alive[c]:
            u = usage[i]
            if u not in best or scores[i] < best[u][0]:
                best[u] = (scores[i], i)
        return [(u, op_cost, i) for u, (op_cost, i) in best.items()]

    def _vectors(self, order: list[int]) -> None:
        """Per link, the owner's cut dim for each of its class's options (`dxs`) and, for a
        link to another unit, the other end's cut in the owner's dims for each of the other
        class's options (`dys`); links grouped by the class at their other end."""
        self.dxs, self.dys, self.by_class = {}, {}, {}
        for c in order:
            slots = [u for u, _, _ in self.opts[c]]
            by: dict[int, list[Link]] = {}
            for lk in self.op_links[c] + self.fixed_links[c]:
                s0, s1 = lk.slot
                self.dxs[lk.n] = [u[s0][s1] for u in slots]
                if lk.other >= 0:
                    d = self.classes[lk.other]
                    o0, o1, inv = lk.other_slot[0], lk.other_slot[1], lk.inv
                    self.dys[lk.n] = [None if u[o0][o1] is None else inv.get(u[o0][o1])
                                      for u, _, _ in self.opts[d]]
                    by.setdefault(d, []).append(lk)
            self.by_class[c] = by

    def _decide(self, c: int, forced: tuple | None, lines: list[str]) -> list:
        """Price each cut of class c, choose (or take `forced`), and tell the neighbours."""
        rest = self._lookahead(c)
        rows = []
        for n, (u, op_cost, _) in enumerate(self.opts[c]):
            rows.append((op_cost + rest[n], _uncut(u), n, op_cost, rest[n], u))
        low = min(r[0] for r in rows)
        best = min((r for r in rows if r[0] <= low + _NEAR * abs(low)), key=lambda r: r[1:3])
        pick = best[2] if forced is None else \
            next(n for n, (u, _, _) in enumerate(self.opts[c]) if u == forced)
        self.decided[c] = pick
        self._log(c, rows, self.opts[c][pick][0], lines, forced is not None)
        n_ops = len(self.g.ops)
        for d, lk in self.rev.get(c, []):  # neighbours now see this decision
            if self.decided[d] is None:
                column = self._column(lk, self.dys[lk.n][pick])
                if lk.other >= n_ops and lk.other_slot == (1, 0):
                    # carried state is gathered once for its readers: the dearest counts
                    self.gather[d] = [max(a, b) for a, b in zip(self.gather[d], column,
                                                                strict=True)]
                    continue
                acc = self.acc[d]
                for n, b in enumerate(column):
                    acc[n] += b
        return rows

    def _seen(self, c: int) -> list[float]:
        """What class c's links to decided classes cost, for each of its cuts."""
        return [a + b for a, b in zip(self.acc[c], self.gather[c], strict=True)]

    def _lookahead(self, c: int) -> list[float]:
        """For each cut of class c: what its links cost, the links to decided classes
        (`_seen`), to its own class (its members answer with the same cut) and to undecided
        classes (the extra each pays for its best answer to the cut)."""
        total = self._seen(c)
        count = len(total)
        for d, lks in self.by_class[c].items():
            if d == c:
                for lk in lks:
                    for n, b in enumerate(self._diagonal(lk)):
                        total[n] += b
            elif self.decided[d] is None:
                own = [op_cost + a for (_, op_cost, _), a in zip(self.opts[d], self._seen(d),
                                                                   strict=True)]
                low, extra = min(own), {}
                keys = self._keys(c, d, lks)
                for n in range(count):
                    key = keys[n]
                    hit = extra.get(key)
                    if hit is None:  # cuts of c that look alike to d share its answer
                        answer = list(own)
                        for lk, dx in zip(lks, key, strict=True):
                            for m, b in enumerate(self._answers(lk, dx)):
                                answer[m] += b
                        hit = extra[key] = min(answer) - low
                    total[n] += hit
        return total

    def _answers(self, lk: Link, dx: int | None) -> list[float]:
        """The link's cost for each cut of its other end's class, the owner cutting dx."""
        key = (lk.n, dx)
        hit = self.vectors.get(key)
        if hit is None:
            dys = self.dys[lk.n]
            price = {dy: self._cost(lk, dx, dy) for dy in set(dys)}
            hit = self.vectors[key] = [price[dy] for dy in dys]
        return hit

    def _column(self, lk: Link, dy: int | None) -> list[float]:
        """The link's cost for each cut of its owner's class, the other end cutting dy."""
        key = (lk.n, "column", dy)
        hit = self.vectors.get(key)
        if hit is None:
            dxs = self.dxs[lk.n]
            price = {dx: self._cost(lk, dx, dy) for dx in set(dxs)}
            hit = self.vectors[key] = [price[dx] for dx in dxs]
        return hit

    def _diagonal(self, lk: Link) -> list[float]:
        """A link between ops of one class, for each cut of the class (both ends cut so)."""
        key = (lk.n, "diagonal")
        hit = self.vectors.get(key)
        if hit is None:
            pairs = list(zip(self.dxs[lk.n], self.dys[lk.n], strict=True))
            price = {p: self._cost(lk, *p) for p in set(pairs)}
            hit = self.vectors[key] = [price[p] for p in pairs]
        return hit

    def _keys(self, c: int, d: int, lks: list[Link]) -> list[tuple]:
        """For each cut of class c, what its links to class d carry (the cut dims)."""
        key = (c, d, "keys")
        hit = self.vectors.get(key)
        if hit is None:
            cols = [self.dxs[lk.n] for lk in lks]
            hit = self.vectors[key] = list(zip(*cols, strict=True))
        return hit

    @staticmethod
    def _dy(lk: Link, u: tuple) -> int | None:
        """Where the other end's cut u falls in the owner's dims (None: nowhere)."""
        e = u[lk.other_slot[0]][lk.other_slot[1]]
        return None if e is None else lk.inv.get(e)

    def _cost(self, lk: Link, dx: int | None, dy: int | None) -> float:
        """Resharding across a link over the axes decided so far, the owner cutting its dim dx
        and the other end the owner's dim dy on this axis."""
        key = (lk.n, dx, dy)
        hit = self.tab.get(key)
        if hit is None:
            shape = self.link_shapes.get(lk.n)
            if shape is None:
                mine = self._base(lk.owner, lk.slot)
                theirs = _project(lk.fixed, self.axes) if lk.other < 0 else \
                    mapped(self._base(lk.other, lk.other_slot), lk.dims)
                bases = (mine, theirs, lk.other < 0, lk.into, lk.nbytes)
                shape = self.link_shapes[lk.n] = self.shape_ids.setdefault(
                    bases, (len(self.shape_ids), bases))
            path = self.path[lk.n] / self.factor.get(lk.n, 1)
            if _carries(lk, dx, lk.fixed.dim_of(self.axis) if lk.other < 0 else dy):
                path /= self.mesh.axis_size(self.axis)
            hit = self.tab[key] = (self._geometry(shape, dx, dy) / self.divisor.get(lk.n, 1)
                                   + path) * lk.count
        return hit

    def _geometry(self, shape: tuple[int, tuple], dx: int | None, dy: int | None) -> float:
        """_cost for every link alike (same base specs, ends, direction and size: one
        `shape` number)."""
        key = (shape[0], dx, dy)
        if key not in self.geo:
            mine, theirs, fixed, into, nbytes = shape[1]
            mine = _add_axis(mine, dx, self.axis)
            theirs = theirs if fixed else _add_axis(theirs, dy, self.axis)
            src, dst = (theirs, mine) if into else (mine, theirs)
            self.geo[key] = 0.0 if src == dst else self._reshard(src, dst, nbytes)
        return self.geo[key]

    def _reshard(self, src: Spec, dst: Spec, nbytes: int) -> float:
        key = (src, dst, nbytes)
        if key not in self.scores_cache:
            self.scores_cache[key] = self.model.score(self.model.reshard_bytes(src, dst, nbytes))
        return self.scores_cache[key]

    def _base(self, x: int, slot: Slot) -> Spec:
        """A main op's slot spec over the axes decided before this one (every candidate
        left to its class agrees on those)."""
        c = self.classes[x]
        key = (c, slot)
        if key not in self.base:
            self.base[key] = _project(_slot(self.cands[c][self.alive[c][0]], slot), self.before)
        return self.base[key]

    def _log(self, c: int, rows: list, chosen: tuple, lines: list[str], forced: bool) -> None:
        if len(rows) < 2:
            return
        xs = self.members[c]
        info = self.units.info(xs[0])
        like = f" (and {len(xs) - 1} like it)" if len(xs) > 1 else ""
        head = f"{self.units.name(xs[0])}{like}, axis {self.axis}: "
        lines.extend(head + _price_line(info, u, op_cost, rest, total)
                     for total, _, _, op_cost, rest, u in rows)
        lines.append(head + _choose_line(info, chosen) + (" (to try the runner-up)" if forced
                                                          else ""))


def _project(spec: Spec, axes: frozenset) -> Spec:
    """The spec over some axes only (no partial: ops resolve their own)."""
    return Spec(tuple(tuple(a for a in d if a in axes) for d in spec.dims))


def _add_axis(spec: Spec, dim: int | None, axis: str) -> Spec:
    """spec with `axis` (later in mesh order than any it holds) also cutting `dim`."""
    if dim is None:
        return spec
    return Spec(tuple(d + (axis,) if i == dim else d for i, d in enumerate(spec.dims)))


def _carries(lk: Link, dx: int | None, dy: int | None) -> bool:
    """Whether a link carries a cut of the axis: the owner cuts a dim that reaches the
    other end, or the other end cuts one that reaches the owner."""
    return (dx is not None and lk.dims[dx] is not None) or dy is not None


def _uncut(u: tuple) -> bool:
    ins, outs, partial = u
    return not partial and all(d is None for d in ins + outs)


def _cut_name(info: OpInfo, u: tuple) -> str:
    """MindSpore's names for a matmul's cuts (I, J, K, batch); a dimension for other ops."""
    ins, outs, partial = u
    if info.primitive.name == "dot_general":
        (lc, _), (lb, _) = info.params["dimension_numbers"]
        p, q = ins[0], ins[1]
        lhs_free = [d for d in range(len(info.in_shapes[0])) if d not in lc and d not in lb]
        if p is not None and p in lb:
            name = "the batch axis" + (f" (lhs dim {p})" if len(lb) > 1 else "")
        elif p is not None and p in lc:
            name = "the K-axis" + (f" (lhs dim {p})" if len(lc) > 1 else "")
        elif p is not None:
            name = "the I-axis" + (f" (lhs dim {p})" if len(lhs_free) > 1 else "")
        else:
            name = f"the J-axis (rhs dim {q})" if len(info.in_shapes[1]) - len(lc) - len(lb) > 1 \
                else "the J-axis"
    else:
        i, d = next(((i, d) for i, d in enumerate(ins) if d is not None), (None, None))
        name = f"dim {d} of operand {i}" if i is not None else \
            f"dim {next(d for d in outs if d is not None)} of the result"
    if partial:
        name += " (all-reduce)" if all(d is None for d in outs) else \
            f" (reduce-scatter onto result dim {next(d for d in outs if d is not None)})"
    return name


def _price_line(info: OpInfo, u: tuple, op_cost: float, rest: float, total: float) -> str:
    what = "If do NOT cut the axis" if _uncut(u) else f"If {_cut_name(info, u)} is cut"
    return (f"{what}, the op-cost is {op_cost:.6g}, the rest-cost is {rest:.6g}, and the "
            f"total cost is {total:.6g}")


def _choose_line(info: OpInfo, u: tuple) -> str:
    return "Choose NOT to cut" if _uncut(u) else f"Choose to cut {_cut_name(info, u)}"
