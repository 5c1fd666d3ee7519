"""sharding_propagation: MindSpore's algorithm over an OpGraph.

Before: an OpGraph, the specs the user fixed (inputs and outputs), a CostModel. After: a
GraphPlan giving every value a spec and every op a chosen strategy (with its runner-up).

Ops are planned one at a time, outward from what is already known: the next op is the unplanned
neighbour of planned values joined to them by the largest tensor (big tensors decide first),
the readers of replicated values last (a replicated value does not say how to cut). Each
candidate strategy is priced as its op cost plus the resharding from the known specs of its
operands and into the specs its already-planned consumers (or fixed outputs) require; the
cheapest wins. When nothing is known yet, the most expensive unplanned op starts a new front.

With `wait`, an op reached by a value smaller than one of its operands still to be made waits
for that operand (behind the fronts still moving, ahead of the readers of replicated values):
planned at once, it chooses for the smaller values alone. In a training step a weight
gradient dW = dY^T X is reached from the activation X (forward) long before the backward pass
makes dY. Neither order is better everywhere, so the sharding_propagation mode plans both and
keeps the one of lower objective (semi.py):

| program (modelled objective, as propagated) | as reached | waiting |
|---|---:|---:|
| gpt_plans' data-parallel layout, carried outputs tied | 8.25 ms | 7.76 ms |
| optimizer_parallel.py's GPT, level1 (second plan) | 52.56 ms | 53.42 ms |

With `kept` (the sharding_propagation mode: semi_auto, and the user's strategies in general),
inputs the caller fixed are read as they are on the mesh axes `kept` names for them: in
MindSpore's semi-auto a parameter's layout is the strategy of the op using it, and a weight
pinned in Megatron's layout is pinned so that its matmul runs that way. The ops reading such
inputs are planned first, in program order, each with the cheapest of its strategies that read
them as fixed, less the axes not kept. Without it, an embedding lookup planned while only its
table was known resharded the table onto d_model, the cheapest move for that op alone, and
every activation after it was cut so (configs/gpt_small_semi_auto.yaml: 3.9 ms modelled,
1.6 ms with it). The caller (api._kept) names weights only (carried state), less the axes a
weight shares with the batch (FSDP, hsdp's level3): such a weight is stored cut and gathered
for use, so its readers read it whole on those axes, but for the ops of the step's tail (the
optimizer, OpGraph.tail_values), which update it as stored. Left free, an FSDP embedding
lookup resharded its table onto d_model (cheaper for that op alone than gathering it) and the
activations after it were cut so (gpt_plans' FSDP layout through jaxpar, refined: 2.93 ms
estimated from the compiled program, 1.48 with the rule; jit's own: 1.57).

Region ops (scan, while, cond) get a candidate made by planning their bodies with the operand
specs known at that moment (a cond also one with every operand and result replicated, see
regions.region_candidates); a loop's carried values keep one spec across iterations.

`fixed_ops` (op index -> strategy) are ops whose strategy a caller decided already
(recursive_programming's main ops): they are planned first, in program order, with that single
candidate, and everything else propagates outward from them; ops reached only from replicated
values then come last, one by one in reverse program order (a replicated value does not say
how its consumers should cut; planned after them, an op sees what they need). Ops of one class
(ir.repeat.op_classes) are planned together where something tells them how to cut.

`refine.refine` (a `refine.Refiner`) then improves any complete plan with the exact
objective: each op in turn takes the strategy cheapest against everything around it, until none
moves; `replan` plans a region again (from what consumers need, from what operands give, or
from the plan as it is) and keeps it only if the total drops. Neither raises the plan's total
(graph_cost). A `GraphIndex` (producers, readers, sizes) can be shared by both. The
sharding_propagation mode (semi.py) refines its plan so, then solves a training step's tail
again exactly (resolve.solve_tail).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from jaxpar.cost.comm import Collective
from jaxpar.cost.model import CostModel, OpCost, flops
from jaxpar.ir.graph import Lit, Op, OpGraph, itemsize
from jaxpar.rules.registry import OpInfo, has_rule
from jaxpar.spec import OpStrategy, Spec

_NOW, _WAITED, _LATER = 0, 1, 2  # the propagation front's tiers (_Propagation._push)


@dataclass
class Choice:
    """The strategy chosen for one op, its runner-up, and their modeled costs."""

    strategy: OpStrategy
    cost: OpCost
    score: float
    runner_up: OpStrategy | None = None
    runner_score: float | None = None
    n_candidates: int = 1
    has_rule: bool = True
    regions: tuple[GraphPlan, ...] = ()
    trips: int = 1


@dataclass
class GraphPlan:
    """Specs of every value and the choice for every op of one OpGraph."""

    specs: dict[int, Spec] = field(default_factory=dict)
    choices: dict[int, Choice] = field(default_factory=dict)


def propagate(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec] | None = None,
              fixed_out: dict[int, Spec] | None = None,
              fixed_ops: dict[int, OpStrategy] | None = None,
              classes: list[int] | None = None,
              ties: tuple[tuple[int, int], ...] = (),
              index: GraphIndex | None = None,
              kept: dict[int, frozenset[str]] | None = None, wait: bool = False) -> GraphPlan:
    """Plan `graph` by sharding propagation; fixed_in maps value ids, fixed_out output positions,
    fixed_ops op indices to the strategy they must take (see the module docstring). classes:
    a class number per op (ir.repeat.op_classes): the ops of one class are planned together
    where the front first reaches the class, and those that see the same specs around them
    (the repeated layers of a deep model) take one choice, made once. ties: (input value,
    output position) pairs of carried state: whichever of the two gets a spec first, the
    other is asked for it too. index: the graph's GraphIndex, when the caller has one.
    kept: {input of fixed_in: mesh axes} read as fixed, MindSpore's semi-auto rule (a
    parameter's layout is the strategy of the op using it): the ops reading them are planned
    first, in program order, each with the cheapest of its strategies that read them as
    fixed, less the axes not kept (any strategy, where none can); an input cut on no kept
    axis is read whole, but by the ops of the step's tail. wait: an op reached by a value
    smaller than an operand still to be made waits for it (_Propagation._waits). See the
    module docstring."""
    return _Propagation(_Graph.of(graph, model, classes, index), fixed_in or {},
                        fixed_out or {}, fixed_ops or {}, ties, kept or {}, wait).run()


class _Options:
    """One kind of op's candidates, their costs and scores, each slot's spec per candidate."""

    def __init__(self, key, cands: list[OpStrategy], costs: list[OpCost], model: CostModel,
                 rule: bool):
        self.key, self.cands, self.costs, self.rule = key, cands, costs, rule
        self.scores = [model.score(c) for c in costs]
        self.score_vec = np.array(self.scores, dtype=float)
        self.ins = list(zip(*(s.ins for s in cands), strict=True)) if cands else []
        self.outs = list(zip(*(s.outs for s in cands), strict=True)) if cands else []
        self._index: dict | None = None
        # (slot, value kind, spec or specs) -> resharding score per candidate (_Graph.priced);
        # slot i >= 0: operand i from a spec, ~j: result j into the specs its readers need
        self.columns: dict[tuple, np.ndarray] = {}

    @property
    def index(self) -> dict[OpStrategy, int]:
        """Candidate -> its position."""
        if self._index is None:
            self._index = {s: i for i, s in enumerate(self.cands)}
        return self._index


class GraphIndex:
    """What the planners read of one graph, found once and shared by them: each value's
    producer (op index, result position) and readers (op index, operand position), its bytes
    and latency share (latency_shares)."""

    def __init__(self, graph: OpGraph):
        self.g = graph
        self.producer: dict[int, int] = {}
        self.port: dict[int, int] = {}
        self.readers: dict[int, list[tuple[int, int]]] = {}
        for op in graph.ops:
            x = op.index
            for i, v in enumerate(op.inputs):
                if isinstance(v, int):
                    self.readers.setdefault(v, []).append((x, i))
            for j, v in enumerate(op.outputs):
                self.producer[v] = x
                self.port[v] = j
        self.shares = latency_shares(graph)
        self.sizes: dict[int, float] = {}
        self.priced: dict[tuple, _Graph] = {}  # (id(model), classes) -> _Graph.of()

    @staticmethod
    def of(graph: OpGraph, index: GraphIndex | None = None) -> GraphIndex:
        """`index` when it indexes `graph`, else a new GraphIndex of it."""
        return index if index is not None and index.g is graph else GraphIndex(graph)

    def nbytes(self, v: int) -> float:
        hit = self.sizes.get(v)
        if hit is None:
            info = self.g.values[v]
            hit = self.sizes[v] = float(math.prod(info.shape)) * itemsize(info.dtype)
        return hit

    def neighbourhood(self, seeds: set[int], hops: int | None,
                      walls: frozenset[int] = frozenset(), through=None) -> set[int]:
        """The ops at most `hops` def-use steps from `seeds` (None: any number), through
        operands and results that are arrays (not scalars: a step count or learning rate is
        read by every update) and that `through` (value -> bool; None: any) lets pass. An op
        in `walls` joins the neighbourhood but is not stepped through."""
        g, region, frontier = self.g, set(seeds), set(seeds)
        steps = 0
        while frontier and (hops is None or steps < hops):
            near = set()
            for y in frontier - walls:
                op = g.ops[y]
                for v in op.inputs + op.outputs:
                    if isinstance(v, int) and g.values[v].shape and \
                            (through is None or through(v)):
                        if v in self.producer:
                            near.add(self.producer[v])
                        near.update(r for r, _ in self.readers.get(v, ()))
            frontier = near - region
            region |= frontier
            steps += 1
        return region

    def free_reads(self, ops, fixed) -> set[int]:
        """The values the ops read that no op makes (inputs, constants), less those in
        `fixed` (the specs the user fixed)."""
        return {v for x in ops for v in self.g.ops[x].inputs
                if isinstance(v, int) and v not in self.producer and v not in fixed}


class _Graph:
    """A GraphIndex with one cost model: each kind of op's options, and resharding prices."""

    def __init__(self, graph: OpGraph, model: CostModel, classes: list[int] | None,
                 index: GraphIndex | None = None):
        index = GraphIndex.of(graph, index)
        self.g, self.model, self.classes, self.index = graph, model, classes, index
        self.producer, self.readers, self.shares = index.producer, index.readers, index.shares
        self.nbytes = index.nbytes
        self.splats = graph.splats(model.mesh.size)
        self.value_kind: dict[int, int] = {}
        self.kinds: dict = {}  # (shape, dtype, latency share, splat) -> kind
        self.prices: dict = {}
        self.options_of: dict = {}
        self.op_options: dict[int, _Options] = {}
        self.op_kinds: dict[int, tuple] = {}

    @staticmethod
    def of(graph: OpGraph, model: CostModel, classes: list[int] | None,
           index: GraphIndex | None = None) -> _Graph:
        """The _Graph of (graph, model, classes), shared through `index`: what it remembers
        (options, prices, value kinds) depends on nothing else, so the planners that run
        one after another on one graph (two propagations, a refinement) price each thing
        once. Without an index of `graph`, a _Graph of its own."""
        if index is None or index.g is not graph:
            return _Graph(graph, model, classes, index)
        key = (id(model), None if classes is None else tuple(classes))
        hit = index.priced.get(key)
        if hit is None or hit.model is not model:  # it holds the model: its id stays its own
            hit = index.priced[key] = _Graph(graph, model, classes, index)
        return hit

    def share(self, op: Op) -> float:
        return max((self.shares(v) for v in op.outputs), default=1.0)

    def opts(self, op: Op) -> _Options:
        """op's candidates and costs, found once per class (or per op without classes); ops
        the cost model prices alike share them."""
        hit = self.op_options.get(op.index)  # asked per visit: one lookup once known
        if hit is not None:
            return hit
        share = self.share(op)
        key = (self.classes[op.index] if self.classes is not None else op.index, share)
        hit = self.options_of.get(key)
        if hit is None:
            cands, costs = self.model.options(OpInfo.of(op, self.g), share)
            rule = has_rule(op.primitive)
            alike = (id(cands), id(costs), rule)
            hit = self.options_of.get(alike)
            if hit is None:
                hit = self.options_of[alike] = _Options(alike, cands, costs, self.model, rule)
            self.options_of[key] = hit
        self.op_options[op.index] = hit
        return hit

    def price(self, v: int, src: Spec, dst: Spec) -> float:
        """Score of resharding value v from src to dst."""
        if src is dst or src.placed_as(dst):
            return 0.0
        key = (self.kind(v), src, dst)
        hit = self.prices.get(key)
        if hit is None:  # the pair's line (CostModel.reshard_line) at the value's bytes
            per_byte, fixed = self.model.reshard_line(src, dst, self.shares(v),
                                                      v in self.splats)
            hit = self.prices[key] = per_byte * self.nbytes(v) + fixed
        return hit

    def kind(self, v: int) -> int:
        """What pricing a resharding of value v depends on (shape, dtype, latency share,
        whether it is a splat: OpGraph.splats), as a number: values of one kind cost
        alike."""
        k = self.value_kind.get(v)
        if k is None:
            info = self.g.values[v]
            k = self.value_kind[v] = self.kinds.setdefault(
                (info.shape, info.dtype, self.shares(v), v in self.splats), len(self.kinds))
        return k

    def kinds_of(self, op: Op) -> tuple:
        """kind() of each value op reads and makes (None: a literal): with its options, its
        operand specs and what its readers need, all that priced() depends on."""
        hit = self.op_kinds.get(op.index)
        if hit is None:
            hit = self.op_kinds[op.index] = tuple(
                self.kind(v) if isinstance(v, int) else None for v in op.inputs + op.outputs)
        return hit

    def priced(self, op: Op, o: _Options, ins: tuple, needs: tuple) -> np.ndarray:
        """Each candidate's own score plus resharding from the operand specs `ins` (None:
        unknown) and into the specs `needs` (per result) its consumers need. Each term is a
        vector over the candidates, priced once per slot, kind of value and spec(s) (ops of
        a repeated layer ask the same), and the terms are added in that order: the sums are
        those of adding candidate by candidate. Read-only (it may be `o.score_vec`)."""
        total, columns, price = o.score_vec, o.columns, self.price
        for i, (v, spec) in enumerate(zip(op.inputs, ins, strict=True)):
            if spec is not None:
                key = (i, self.kind(v), spec)
                col = columns.get(key)
                if col is None:
                    col = columns[key] = _column(o.ins[i], v, spec, None, price)
                total = total + col
        for j, (v, wants) in enumerate(zip(op.outputs, needs, strict=True)):
            if wants:
                key = (~j, self.kind(v), wants)
                col = columns.get(key)
                if col is None:
                    col = columns[key] = _column(o.outs[j], v, None, wants, price)
                total = total + col
        return total

    @staticmethod
    def choice(o: _Options, totals) -> Choice:
        """The cheapest candidate (the first of equals) and its runner-up (the first of the
        cheapest others)."""
        t = np.asarray(totals, dtype=float)
        best, runner = int(np.argmin(t)), None
        if len(t) > 1:
            rest = t.copy()
            rest[best] = math.inf
            runner = int(np.argmin(rest))
            if runner == best:  # every other is infinite: the first of them
                runner = 1 if best == 0 else 0
        return Choice(o.cands[best], o.costs[best], float(t[best]),
                      o.cands[runner] if runner is not None else None,
                      float(t[runner]) if runner is not None else None, len(o.cands), o.rule)

    def region(self, op: Op, known_specs: dict[int, Spec]) -> Choice:
        """A region op's choice: its bodies planned with the operand specs known
        (regions.region_candidates: by propagation, and for a loop in the automatic searches
        also solved exactly), the cheapest with the moves into its operand specs."""
        from jaxpar.search.regions import region_candidates

        info = OpInfo.of(op, self.g)
        known = [known_specs.get(v) if isinstance(v, int) else Spec.replicated(len(sh))
                 for v, sh in zip(op.inputs, info.in_shapes, strict=True)]
        found = region_candidates(op, info, known, self.model)
        totals = [self.model.score(cost) + sum(
            self.price(v, k, need) for v, k, need in zip(op.inputs, known, s.ins, strict=True)
            if isinstance(v, int) and k is not None) for s, _, cost, _ in found]
        order = sorted(range(len(found)), key=totals.__getitem__)  # stable: the first wins ties
        s, regions, body_cost, trips = found[order[0]]
        runner = found[order[1]][0] if len(order) > 1 else None
        return Choice(s, body_cost, totals[order[0]], runner,
                      totals[order[1]] if runner is not None else None, len(found), True,
                      regions, trips)


class _Propagation:
    def __init__(self, base: _Graph, fixed_in, fixed_out, fixed_ops, ties,
                 kept: dict[int, frozenset[str]] | None = None, wait: bool = False):
        self.b, self.g, self.model, self.wait = base, base.g, base.model, wait
        graph = self.g
        self.plan = GraphPlan(specs=dict(fixed_in))
        # inputs (and constants) read as fixed on some axes (see propagate): value -> the
        # dims they are read in (the fixed spec's, less the axes not kept)
        self.kept = _kept_dims(fixed_in, kept, base.producer)
        self.stored = {v for v, dims in self.kept.items() if not any(dims)}
        self.tail = graph.tail_values()
        self.fixed_out, self.fixed_ops = fixed_out, fixed_ops
        self.heap: list = []
        self.queued: dict[int, tuple] = {}  # unit -> the best priority it waits in the heap with
        self.tick = itertools.count()
        self.out_needs: dict[int, list[Spec]] = {}
        for pos, spec in fixed_out.items():
            self.out_needs.setdefault(graph.outputs[pos], []).append(spec)
        self.tied_in: dict[int, list[int]] = {}   # carried input -> the outputs replacing it
        self.tied_out: dict[int, list[int]] = {}  # and back
        for v, pos in ties:
            w = graph.outputs[pos]
            if isinstance(w, int) and pos not in fixed_out:
                self.tied_in.setdefault(v, []).append(w)
                self.tied_out.setdefault(w, []).append(v)
                if v in fixed_in:
                    self.out_needs.setdefault(w, []).append(fixed_in[v])
        self.flops: dict[int, float] = {}
        # (options, context (fixed strategy, operand specs, what readers need), value kinds)
        # -> Choice
        self.chosen: dict = {}
        # Each op is planned as its class: `unit` maps an op to its class's first op.
        self.unit = list(range(len(graph.ops)))
        self.members = {i: [i] for i in self.unit}
        if base.classes is not None:
            first: dict[int, int] = {}
            self.unit = [first.setdefault(c, i) for i, c in enumerate(base.classes)]
            self.members = {}
            for i, u in enumerate(self.unit):
                self.members.setdefault(u, []).append(i)

    def run(self) -> GraphPlan:
        for v in list(self.plan.specs):
            self._push_neighbours(v)
        for pos, v in enumerate(self.g.outputs):
            if pos in self.fixed_out and isinstance(v, int) and v in self.b.producer:
                self._push(self.b.producer[v], self.b.nbytes(v))
        self.remaining = remaining = set(self.members)
        self._place_shared_inputs()
        for idx in sorted(self.fixed_ops):
            if self.unit[idx] in remaining:
                remaining.discard(self.unit[idx])
                self._plan_op(self.g.ops[self.unit[idx]])
        readers = sorted({x for v in self.kept for x, _ in self.b.readers.get(v, ())
                          if self._pins(self.g.ops[x])})
        for x in readers:  # what reads a kept input decides first
            if self.unit[x] in remaining and x not in self.plan.choices:
                remaining.discard(self.unit[x])
                self._plan_op(self.g.ops[self.unit[x]])
        while remaining:
            op = self._next(remaining)
            if op is None:
                break
            remaining.discard(op.index)
            self._plan_op(op)
        for op in reversed(self.g.ops):  # what only replicated values reach, consumers first
            if op.index not in self.plan.choices:
                self._apply(op, self._choice(op))
        for v in self.g.inputs:  # inputs no op reads keep the replicated default
            self.plan.specs.setdefault(v, Spec.replicated(len(self.g.values[v].shape)))
        return self.plan

    def _place_shared_inputs(self) -> None:
        """A free input (or constant) that fixed ops read takes the spec, among those they
        need and the replicated one, that costs least to reshard into all of them."""
        needs: dict[int, list[Spec]] = {}
        for idx in sorted(self.fixed_ops):
            op = self.g.ops[idx]
            for v, need in zip(op.inputs, self.fixed_ops[idx].ins, strict=True):
                if isinstance(v, int) and v not in self.plan.specs and v not in self.b.producer:
                    needs.setdefault(v, []).append(need.resolved())
        for v, specs in needs.items():
            options = list(dict.fromkeys(specs + [Spec.replicated(len(self.g.values[v].shape))]))
            self._set_input(v, min(options, key=lambda src: sum(
                self.b.price(v, src, need) for need in specs)))

    def _set_input(self, v: int, spec: Spec) -> None:
        """A free input (or constant) takes `spec`; outputs carrying it on are asked for it."""
        self.plan.specs[v] = spec
        self._push_neighbours(v)
        for w in self.tied_in.get(v, []):
            self.out_needs.setdefault(w, []).append(spec)
            if w in self.b.producer:
                self._push(self.b.producer[w], self.b.nbytes(w))

    def _push(self, x: int, weight: float, tier: int = _NOW) -> None:
        if x in self.plan.choices:
            return
        unit = self.unit[x]
        key = (tier, -weight)
        best = self.queued.get(unit)
        if best is None or key < best:  # a unit waits once, with its best priority
            self.queued[unit] = key
            heapq.heappush(self.heap, (tier, -weight, next(self.tick), unit))

    def _push_neighbours(self, v: int) -> None:
        weight = self.b.nbytes(v)
        producer = self.b.producer.get(v)
        if producer is not None:
            self._push(producer, weight)
        # A replicated value says nothing about how its consumers should cut (any cut of it
        # is free): they wait for better-informed fronts. (A replicated embedding table, the
        # largest input, would otherwise decide first and cut its gather on the features.)
        tier = _NOW if self.plan.specs[v].axes() else _LATER
        for x, _ in self.b.readers.get(v, ()):
            self._push(x, weight, tier)

    def _next(self, remaining: set[int]) -> Op | None:
        """The next unit to plan; None when, with decided ops, only ops that replicated
        values reach are left (they are planned last, in reverse program order)."""
        while self.heap:
            if self.heap[0][0] == _LATER and self.fixed_ops:
                return None
            tier, weight, *_, idx = heapq.heappop(self.heap)
            self.queued.pop(idx, None)
            if idx not in remaining:
                continue
            if tier == _NOW and self.wait and self._waits(idx, -weight):
                self._push(idx, -weight, _WAITED)
                continue
            return self.g.ops[idx]
        if self.fixed_ops:
            return None
        # A new front: the most expensive op not yet planned.
        return max((self.g.ops[i] for i in remaining),
                   key=lambda op: (self._flops(op), -op.index))

    def _waits(self, x: int, weight: float) -> bool:
        """Whether op x, reached by a value of `weight` bytes, waits (behind the fronts still
        moving, ahead of what only replicated values reach) for a bigger operand still to
        be made: planned now, it would choose for the smaller values alone. A weight
        gradient dW = dY^T X reached from the activation X, or from the gradient its
        parameter's update asks for, before the backward pass made dY did so (gpt_plans'
        data-parallel layout through jaxpar: each layer's qkv gradient cut on two axes and
        gathered after, the tied output head's cut on the vocabulary, and every logit
        after it: 1.27 ms modelled where 1.10 is optimal for the layout). Its producer
        pushes it again once made."""
        specs, producer = self.plan.specs, self.b.producer
        return any(isinstance(v, int) and v not in specs and v in producer and
                   self.b.nbytes(v) > weight for v in self.g.ops[x].inputs)

    def _flops(self, op: Op) -> float:
        if op.index not in self.flops:
            self.flops[op.index] = flops(OpInfo.of(op, self.g))
        return self.flops[op.index]

    def _plan_op(self, op: Op) -> None:
        """Plan op's class: its ops that see the same specs around them take one choice. An
        op of the class that sees nothing yet (no sharded operand, no demand) leaves it, to
        be planned on its own when the front reaches it."""
        members = self.members[op.index]
        if len(members) == 1:
            self._apply(op, self._choice(op))
            return
        groups: dict = {}
        ops = self.g.ops
        for i in members:
            groups.setdefault(self._context(ops[i]), []).append(i)
        first = self._context(op)
        plan = {key for key in groups if _informed(key)} or {first}  # none: a new front
        for key, group in groups.items():
            if key not in plan:
                for i in group:
                    self.unit[i], self.members[i] = i, [i]
                    self.remaining.add(i)
                continue
            choice = self._choice(ops[group[0]], key)
            for i in group:
                self._apply(ops[i], choice)

    def _context(self, op: Op) -> tuple:
        """What a choice for op depends on: its fixed strategy, known operand specs, and the
        specs its planned consumers need."""
        specs = self.plan.specs
        return (self.fixed_ops.get(op.index),
                tuple(specs.get(v) if isinstance(v, int) else None for v in op.inputs),
                tuple(self._demands(v) for v in op.outputs))

    def _choice(self, op: Op, context: tuple | None = None) -> Choice:
        """op's choice. Ops alike (options, kinds of values) in one context (_context: fixed
        strategy, operand specs, what readers need) choose alike: priced once (the repeated
        layers of a deep model, a class planned together). context: op's, when known."""
        if op.regions:
            return self.b.region(op, self.plan.specs)
        o = self.b.opts(op)
        fixed, ins, needs = context = context or self._context(op)
        kept = self._pins(op)
        alike = (o.key, context, self.b.kinds_of(op), kept)
        choice = self.chosen.get(alike)
        if choice is not None:
            return choice
        if fixed is not None:
            k = o.index.get(fixed)
            cost = o.costs[k] if k is not None else \
                self.model.op(OpInfo.of(op, self.g), fixed, self.b.share(op))
            o = _Options(o.key, [fixed], [cost], self.model, o.rule)
        totals = self.b.priced(op, o, ins, needs)
        if kept and fixed is None:
            want = [(i, self.kept[op.inputs[i]]) for i in kept]
            reads = np.array([all(s.ins[i].dims == dims for i, dims in want)
                              for s in o.cands])
            if reads.any():  # else no strategy can: the cheapest of all, resharding included
                totals = np.where(reads, totals, math.inf)
        choice = self.chosen[alike] = self.b.choice(o, totals)
        return choice

    def _pins(self, op: Op) -> tuple[int, ...]:
        return _pins(op, self.kept, self.stored, self.tail)

    def _apply(self, op: Op, choice: Choice) -> None:
        """op takes `choice`; its unplanned neighbours join the front."""
        specs, producer = self.plan.specs, self.b.producer
        self.plan.choices[op.index] = choice
        s = choice.strategy
        for v, spec in zip(op.inputs, s.ins, strict=True):
            if isinstance(v, int) and v not in specs and v not in producer:
                self._set_input(v, spec.resolved())  # a free input or constant takes this spec
        for v, spec in zip(op.outputs, s.outs, strict=True):
            specs[v] = spec
            self._push_neighbours(v)
            for u in self.tied_out.get(v, ()):  # the input it replaces, if still free
                if u not in specs:
                    self._set_input(u, spec.resolved())
        for v in op.inputs:
            if isinstance(v, int) and v in producer:
                self._push(producer[v], self.b.nbytes(v))

    def _demands(self, v: int) -> tuple:
        """Specs already required of value v by planned consumers and fixed outputs."""
        choices = self.plan.choices
        needs = [choices[x].strategy.ins[i] for x, i in self.b.readers.get(v, ())
                 if x in choices]
        extra = self.out_needs.get(v)
        return tuple(needs + extra) if extra else tuple(needs)


def handed_back(graph: OpGraph, fixed_in: dict[int, Spec], fixed_out: dict[int, Spec],
                ties: Collection[tuple[int, int]]) -> dict[int, Spec]:
    """`fixed_out` and, for each carried (input, output position) pair whose input the user
    fixed, the output in that spec: it comes back as the input was fixed (a tie to a free
    input is the search's to price)."""
    back = dict(fixed_out)
    for v, pos in ties:
        if v in fixed_in and isinstance(graph.outputs[pos], int):
            back.setdefault(pos, fixed_in[v])
    return back


def _kept_dims(fixed_in: dict[int, Spec], kept: dict[int, frozenset[str]] | None,
               producer: dict) -> dict[int, tuple]:
    """{input: the dims it is read in}: its fixed spec less the axes not kept (all of them for
    a weight stored cut on the batch's axes alone: read whole), for each kept input that no
    op makes and that is read otherwise than replicated (see propagate)."""
    return {v: tuple(tuple(a for a in d if a in axes) for d in fixed_in[v].resolved().dims)
            for v, axes in (kept or {}).items()
            if v in fixed_in and v not in producer and (axes or fixed_in[v].axes())}


def _pins(op: Op, dims: dict[int, tuple], stored: set[int], tail: frozenset[int]
          ) -> tuple[int, ...]:
    """The operands op reads as kept (positions): kept inputs, less those stored cut on no
    kept axis (FSDP) where op is in the step's tail (the optimizer updates them as stored)."""
    late = bool(op.outputs) and all(w in tail for w in op.outputs)
    return tuple(i for i, v in enumerate(op.inputs) if isinstance(v, int) and v in dims
                 and not (late and v in stored))


def pinned_ops(graph: OpGraph, index: GraphIndex, fixed_in: dict[int, Spec],
               kept: dict[int, frozenset[str]] | None) -> frozenset[int]:
    """The ops propagate(..., kept=kept) lets read a kept input only as kept (refine keeps
    them so: `pinned`)."""
    dims = _kept_dims(fixed_in, kept, index.producer)
    stored = {v for v, d in dims.items() if not any(d)}
    tail = graph.tail_values()
    return frozenset(x for v in dims for x, _ in index.readers.get(v, ())
                     if _pins(graph.ops[x], dims, stored, tail))


def _column(specs: tuple[Spec, ...], v: int, src: Spec | None, wants: tuple | None,
            price) -> np.ndarray:
    """For each of `specs` (one per candidate), the score of resharding value v from `src`
    into it, or (src None) from it into every spec of `wants`; each distinct spec priced once
    (`price`: _Graph.price)."""
    seen: dict[Spec, float] = {}
    out = np.empty(len(specs))
    for n, spec in enumerate(specs):
        c = seen.get(spec)
        if c is None:
            c = seen[spec] = price(v, src, spec) if src is not None else \
                sum(price(v, spec, w) for w in wants)
        out[n] = c
    return out


def _informed(context: tuple) -> bool:
    """Whether a context (see _Propagation._context) says anything about how to cut."""
    fixed, ins, demands = context
    return fixed is not None or any(s is not None and s.axes() for s in ins) or any(demands)


def out_spec(graph: OpGraph, plan: GraphPlan, v: int | Lit) -> Spec:
    """The spec output value `v` has: its planned one; a literal, or a constant that no op
    reads (returned as traced, `lambda x: (x, w)` with `w` captured), is whole on every
    device."""
    if isinstance(v, int) and (v in plan.specs or v not in graph.consts):
        return plan.specs[v]
    return Spec.replicated(len(v.shape if isinstance(v, Lit) else graph.values[v].shape))


def graph_cost(graph: OpGraph, plan: GraphPlan, model: CostModel,
               fixed_out: dict[int, Spec] | None = None, shared: bool = False,
               trips: float = 1, invariant: Collection[int] = (),
               sliced: dict[int, OpCost] | None = None) -> OpCost:
    """Total modeled cost of a planned graph: ops (regions times their trips), resharding of
    operands, and resharding of outputs into `fixed_out` (output position -> spec).

    shared: a value's readers (ops, outputs) that reshard it by the same collectives share
    them, as XLA's CSE merges them (two readers needing it in one spec; or a gather of the
    whole, one reader slicing it after): what the compiled program moves, which Plan.cost and
    the predicted collectives report. False (the searches' objective, which prices every edge
    on its own so that it adds up over them) prices each reader's: never less.
    trips: a loop body's cost is this many times its own, but for what XLA moves out of the
    loop (its loop-invariant code motion), priced once: the resharding of the values in
    `invariant` (the body's constants) and of what is computed from them alone, and those
    ops themselves (effect-free, loops aside).
    sliced: shared, the ops' costs as sliced_reductions gives them for this plan and
    `fixed_out`, where the caller has them already (None: worked out here).
    """
    share, splats = latency_shares(graph), graph.splats(model.mesh.size)
    parts, hoisted = [], []
    done: set = set()  # shared: (value, its resharding's collectives) already priced
    # what the loop computes once: its constants (for the outputs' resharding, priced first)
    # and, for the ops' operands, what the hoisted ops make from them
    once, made_once = hoisted_ops(graph, invariant) if trips != 1 else (set(), set())
    constants = set(invariant) if trips != 1 else set()

    def reshard(v: int, have: Spec, need: Spec, shape, dtype, fixed: set[int]) -> None:
        cost = model.reshard(have, need, shape, dtype, share(v), splat=v in splats)
        if shared and cost.collectives:
            key = (v, cost.collectives)
            if key in done:
                return
            done.add(key)
        (hoisted if v in fixed else parts).append(cost)

    for pos, need in (fixed_out or {}).items():
        v = graph.outputs[pos]
        have = out_spec(graph, plan, v)
        if isinstance(v, int):
            reshard(v, have, need, graph.shape(v), graph.dtype(v), constants)
        else:
            parts.append(model.reshard(have, need, graph.shape(v), graph.dtype(v), share(v)))
    specs, values = plan.specs, graph.values
    costs = {} if not shared else sliced if sliced is not None else \
        sliced_reductions(graph, plan, model, fixed_out)
    for op in graph.ops:
        choice = plan.choices[op.index]
        (hoisted if op.index in once else parts).append(costs.get(op.index, choice.cost))
        for v, need in zip(op.inputs, choice.strategy.ins, strict=True):
            if isinstance(v, int):
                have = specs[v]
                if have is need or have.placed_as(need):
                    continue  # read as it is (CostModel.reshard's first test, before its
                              # call: the recursive search totals plans of 20k ops often)
                info = values[v]
                reshard(v, have, need, info.shape, info.dtype, made_once)
    total = _total(parts)
    if trips != 1:
        total = total.scaled(trips)
    return total + _total(hoisted) if hoisted else total


def sliced_reductions(graph: OpGraph, plan: GraphPlan, model: CostModel,
                      fixed_out: dict[int, Spec] | None = None) -> dict[int, OpCost]:
    """The ops whose own reductions XLA runs as reduce-scatters where their cost says
    all-reduces: op index -> its cost so. A partial sum all-reduced into its planned spec
    that every reader (an op, or an output handed back in `fixed_out`: position -> spec)
    reads cut further, over the all-reduced axes at least, is all-reduced and dynamic-sliced,
    which XLA's reduce-scatter creator makes one reduce-scatter over those axes (a ZeRO-1
    step's weight gradient, reduced into data parallel's layout, that only the optimizer
    reads, cut as its moments are). On CPU it stays an all-reduce with sliced users, which
    analysis.collective_stats counts as a reduce-scatter: the full buffer's bytes under
    either name. Those all-reduces are priced and named as reduce-scatters of the same bytes
    over the same axes; an op's other reductions, and results some reader reads whole (or a
    loop body's result, or an output not handed back otherwise), keep theirs."""
    made = {}  # value -> (op, result index): the results of ops that reduce partial sums
    for op in graph.ops:
        choice = plan.choices.get(op.index)
        if choice is not None and not op.regions:
            made.update((v, (op, j)) for j, (v, p) in
                        enumerate(zip(op.outputs, choice.strategy.partial, strict=True)) if p)
    if not made:
        return {}
    sliced: dict[int, set | None] = {}  # value -> the axes every use of it cuts further

    def use(v: int, need: Spec | None) -> None:
        have = plan.specs[v]
        if need is None or sliced.get(v, ()) is None or have.placed_as(need) or \
                need.partial or \
                model.reshard(have, need, graph.shape(v), graph.dtype(v)).collectives:
            sliced[v] = None  # read whole, or moved otherwise
            return
        more = set(need.axes()) - set(have.axes())
        sliced[v] = more if v not in sliced else sliced[v] & more
    for op in graph.ops:
        choice = plan.choices.get(op.index)
        for i, v in enumerate(op.inputs):
            if isinstance(v, int) and v in made:
                use(v, None if choice is None else choice.strategy.ins[i])
    for pos, v in enumerate(graph.outputs):
        if isinstance(v, int) and v in made:
            use(v, (fixed_out or {}).get(pos))
    share = latency_shares(graph)
    out: dict[int, OpCost] = {}
    for v, axes in sliced.items():
        if not axes:
            continue
        op, j = made[v]
        cost = out.get(op.index, plan.choices[op.index].cost)
        strategy = plan.choices[op.index].strategy
        info = OpInfo.of(op, graph)
        rate = max((share(w) for w in op.outputs), default=1.0)
        steps = model.reductions(info, strategy, rate)
        reduced = [c for k, _, dst, step in steps if k == j and dst is strategy.outs[j]
                   for c in step.collectives
                   if c.kind == "all-reduce" and set(c.axes) <= axes]
        held = list(cost.collectives)
        for c in reduced:
            if c not in held:  # priced otherwise (a cost from elsewhere): left as it is
                break
            held.remove(c)
        else:
            if not reduced:
                continue
            scattered = [Collective("reduce-scatter", c.axes, c.bytes, c.count)
                         for c in reduced]
            comm = cost.comm_s - model.collectives_cost(reduced, rate).comm_s + \
                model.collectives_cost(scattered, rate).comm_s
            out[op.index] = OpCost(cost.compute_s, comm, cost.comm_bytes, cost.memory_bytes,
                                   tuple(held + scattered))
    return out


def hoisted_ops(graph: OpGraph, invariant: Collection[int]) -> tuple[set[int], set[int]]:
    """(the ops, their results and `invariant`) a loop body computes once: XLA's loop-invariant
    code motion moves out of the loop the ops computed from the values in `invariant` (the
    body's constants) alone, loops and effects aside. Both empty without constants."""
    made, ops = set(invariant), set()
    if not made:
        return ops, made
    for op in graph.ops:
        if not op.regions and not op.effectful and \
                all(v in made for v in op.inputs if isinstance(v, int)):
            made.update(op.outputs)
            ops.add(op.index)
    return ops, made


def latency_shares(graph: OpGraph):
    """graph.latency_share as a function that computes it once: 1 outside the step's tail,
    one fraction for every value in it."""
    tail, fraction = graph.tail_values(), []

    def share(v: int) -> float:
        if v not in tail:
            return 1.0
        if not fraction:
            fraction.append(graph.latency_share(v))
        return fraction[0]
    return share


def _total(parts: list[OpCost]) -> OpCost:
    """OpCost() + parts[0] + parts[1] + ..., without copying the collectives each time."""
    compute = comm = comm_bytes = memory = 0.0
    collectives = []
    for c in parts:
        compute += c.compute_s
        comm += c.comm_s
        comm_bytes += c.comm_bytes
        memory += c.memory_bytes
        collectives.extend(c.collectives)
    return OpCost(compute, comm, comm_bytes, memory, tuple(collectives))
