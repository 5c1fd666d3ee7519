"""sharding_propagation: MindSpore's algorithm over an OpGraph.

Before: an OpGraph, the specs the user fixed (inputs and outputs), a CostModel. After: a
GraphPlan giving every value a spec and every op a chosen strategy (with its runner-up).

Ops are planned one at a time, outward from what is already known: the next op is the unplanned
neighbour of planned values joined to them by the largest tensor (big tensors decide first). Each
candidate strategy is priced as its op cost plus the resharding from the known specs of its
operands and into the specs its already-planned consumers (or fixed outputs) require; the
cheapest wins. When nothing is known yet, the most expensive unplanned op starts a new front.

Region ops (scan, while, cond) get a single candidate made by planning their bodies with the
operand specs known at that moment; a loop's carried values keep one spec across iterations.

`fixed_ops` (op index -> strategy) are ops whose strategy a caller decided already
(recursive_programming's main ops): they are planned first, in program order, with that single
candidate, and everything else propagates outward from them; ops reached only from replicated
values then come last (a replicated value does not say how its consumers should cut).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from jaxpar.cost.model import CostModel, OpCost, flops
from jaxpar.ir.graph import Lit, Op, OpGraph
from jaxpar.rules.registry import OpInfo, has_rule
from jaxpar.spec import OpStrategy, Spec


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
              ties: tuple[tuple[int, int], ...] = ()) -> GraphPlan:
    """Plan `graph` by sharding propagation; fixed_in maps value ids, fixed_out output positions,
    fixed_ops op indices to the strategy they must take (see the module docstring). classes:
    a class number per op (ir.repeat.op_classes): the ops of one class are planned together
    where the front first reaches the class, and those that see the same specs around them
    (the repeated layers of a deep model) take one choice, made once. ties: (input value,
    output position) pairs of carried state: whichever of the two gets a spec first, the
    other is asked for it too."""
    return _Propagation(graph, model, fixed_in or {}, fixed_out or {}, fixed_ops or {},
                        classes, ties).run()


class _Propagation:
    def __init__(self, graph, model, fixed_in, fixed_out, fixed_ops=None, classes=None,
                 ties=()):
        self.g, self.model = graph, model
        self.plan = GraphPlan(specs=dict(fixed_in))
        self.fixed_out = fixed_out
        self.fixed_ops = fixed_ops or {}
        self.producer = graph.producers()
        self.users = graph.users()
        self.heap: list = []
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
        self.shares = latency_shares(graph)
        self.sizes: dict[int, int] = {}
        self.flops: dict[int, float] = {}
        self.seen: dict = {}  # (candidates, latency share, context) -> Choice, with classes
        # Each op is planned as its class: `unit` maps an op to its class's first op.
        self.classed = classes is not None
        self.unit = list(range(len(graph.ops)))
        self.members = {i: [i] for i in self.unit}
        if classes is not None:
            first: dict[int, int] = {}
            self.unit = [first.setdefault(c, i) for i, c in enumerate(classes)]
            self.members = {}
            for i, u in enumerate(self.unit):
                self.members.setdefault(u, []).append(i)

    def run(self) -> GraphPlan:
        for v in self.plan.specs:
            self._push_neighbours(v)
        for pos, v in enumerate(self.g.outputs):
            if pos in self.fixed_out and isinstance(v, int) and v in self.producer:
                self._push(self.producer[v], self._nbytes(v))
        self.remaining = remaining = set(self.members)
        self._place_shared_inputs()
        for idx in sorted(self.fixed_ops):
            if self.unit[idx] in remaining:
                remaining.discard(self.unit[idx])
                self._plan_op(self.g.ops[self.unit[idx]])
        while remaining:
            op = self._next(remaining)
            remaining.discard(op.index)
            self._plan_op(op)
        for v in self.g.inputs:  # inputs no op reads keep the replicated default
            self.plan.specs.setdefault(v, Spec.replicated(len(self.g.values[v].shape)))
        return self.plan

    def _share(self, v: int) -> float:
        return self.shares(v)

    def _nbytes(self, v: int) -> int:
        if v not in self.sizes:
            self.sizes[v] = self.g.values[v].nbytes
        return self.sizes[v]

    def _op_share(self, op: Op) -> float:
        return max((self._share(v) for v in op.outputs), default=1.0)

    def _place_shared_inputs(self) -> None:
        """A free input (or constant) that fixed ops read takes the spec, among those they
        need and the replicated one, that costs least to reshard into all of them."""
        needs: dict[int, list[Spec]] = {}
        for idx in sorted(self.fixed_ops):
            op = self.g.ops[idx]
            for v, need in zip(op.inputs, self.fixed_ops[idx].ins, strict=True):
                if isinstance(v, int) and v not in self.plan.specs and v not in self.producer:
                    needs.setdefault(v, []).append(need.resolved())
        for v, specs in needs.items():
            info, share = self.g.values[v], self._share(v)
            options = list(dict.fromkeys(specs + [Spec.replicated(len(info.shape))]))
            self._set_input(v, min(options, key=lambda src: sum(
                self.model.score(self.model.reshard(src, need, info.shape, info.dtype, share))
                for need in specs)))

    def _set_input(self, v: int, spec: Spec) -> None:
        """A free input (or constant) takes `spec`; outputs carrying it on are asked for it."""
        self.plan.specs[v] = spec
        self._push_neighbours(v)
        for w in self.tied_in.get(v, []):
            self.out_needs.setdefault(w, []).append(spec)
            if w in self.producer:
                self._push(self.producer[w], self._nbytes(w))

    def _push(self, op: Op, weight: float, later: bool = False) -> None:
        if op.index not in self.plan.choices:
            heapq.heappush(self.heap, (later, -weight, next(self.tick), self.unit[op.index]))

    def _push_neighbours(self, v: int) -> None:
        weight = self._nbytes(v)
        if v in self.producer:
            self._push(self.producer[v], weight)
        # With decided ops to start from, a replicated value says nothing about how its
        # consumers should cut (any cut of it is free): they wait for better-informed fronts.
        later = bool(self.fixed_ops) and not any(self.plan.specs[v].axes())
        for op, _ in self.users.get(v, []):
            self._push(op, weight, later)

    def _next(self, remaining: set[int]) -> Op:
        while self.heap:
            *_, idx = heapq.heappop(self.heap)
            if idx in remaining:
                return self.g.ops[idx]
        # A new front: the most expensive op not yet planned.
        return max((self.g.ops[i] for i in remaining),
                   key=lambda op: (self._flops(op), -op.index))

    def _flops(self, op: Op) -> float:
        if op.index not in self.flops:
            self.flops[op.index] = flops(OpInfo.of(op, self.g))
        return self.flops[op.index]

    def _plan_op(self, op: Op) -> None:
        """Plan op's class: its ops that see the same specs around them take one choice. An
        op of the class that sees nothing yet (no sharded operand, no demand) leaves it, to
        be planned on its own when the front reaches it."""
        members = self.members[op.index]
        groups: dict = {}
        for i in members:
            m = self.g.ops[i]
            groups.setdefault(self._context(m) if self.classed else None, []).append(m)
        first = self._context(op) if self.classed else None
        for key, group in groups.items():
            if key != first and not _informed(key):
                for m in group:
                    self.unit[m.index], self.members[m.index] = m.index, [m.index]
                    self.remaining.add(m.index)
                continue
            choice = self._choice(group[0], key)
            for m in group:
                self._apply(m, choice)

    def _context(self, op: Op) -> tuple:
        """What a choice for op depends on: its fixed strategy, known operand specs, and the
        specs its planned consumers need."""
        return (self.fixed_ops.get(op.index),
                tuple(self.plan.specs.get(v) if isinstance(v, int) else None for v in op.inputs),
                tuple(tuple(self._demands(v)) for v in op.outputs))

    def _choice(self, op: Op, context: tuple | None = None) -> Choice:
        """op's choice; with classes, ops of one signature in one context share it."""
        info = OpInfo.of(op, self.g)
        if op.regions:
            return self._plan_region(op, info)
        share = self._op_share(op)
        if op.index in self.fixed_ops:
            s = self.fixed_ops[op.index]
            return self._choose(op, [s], [self.model.op(info, s, share)])
        cands, costs = self.model.options(info, share)
        if context is None:
            return self._choose(op, cands, costs)
        key = (id(cands), share, context)
        if key not in self.seen:
            self.seen[key] = self._choose(op, cands, costs)
        return self.seen[key]

    def _apply(self, op: Op, choice: Choice) -> None:
        """op takes `choice`; its unplanned neighbours join the front."""
        self.plan.choices[op.index] = choice
        s = choice.strategy
        for v, spec in zip(op.inputs, s.ins, strict=True):
            if isinstance(v, int) and v not in self.plan.specs and v not in self.producer:
                self._set_input(v, spec.resolved())  # a free input or constant takes this spec
        for v, spec in zip(op.outputs, s.outs, strict=True):
            self.plan.specs[v] = spec
            self._push_neighbours(v)
            for u in self.tied_out.get(v, []):  # the input it replaces, if still free
                if u not in self.plan.specs:
                    self._set_input(u, spec.resolved())
        for v in op.inputs:
            if isinstance(v, int) and v in self.producer:
                self._push(self.producer[v], self._nbytes(v))

    def _choose(self, op: Op, cands: list[OpStrategy], costs: list[OpCost]) -> Choice:
        """The candidate whose own cost plus edges to what is already planned is cheapest."""
        score, edges = self.model.score, self._edge_costs(op)
        priced = sorted(((score(own) + score(edges(s)), i)
                         for i, (s, own) in enumerate(zip(cands, costs, strict=True))))
        (best_score, best), runner = priced[0], (priced[1] if len(priced) > 1 else None)
        return Choice(cands[best], costs[best], best_score,
                      cands[runner[1]] if runner else None, runner[0] if runner else None,
                      len(cands), has_rule(op.primitive))

    def _edges(self, op: Op, s: OpStrategy) -> OpCost:
        return self._edge_costs(op)(s)

    def _edge_costs(self, op: Op):
        """strategy -> resharding from op's known operand specs and into the specs its planned
        consumers need; each (operand, spec) priced once."""
        ins = [(k, v, self.plan.specs[v]) for k, v in enumerate(op.inputs)
               if isinstance(v, int) and v in self.plan.specs]
        outs = [(k, v, self._demands(v)) for k, v in enumerate(op.outputs)]
        memo: dict = {}

        def price(key, v, src, dst):
            if key not in memo:
                info = self.g.values[v]
                memo[key] = self.model.reshard(src, dst, info.shape, info.dtype, self._share(v))
            return memo[key]

        def edges(s: OpStrategy) -> OpCost:
            cost = OpCost()
            for k, v, known in ins:
                cost = cost + price((0, k, s.ins[k]), v, known, s.ins[k])
            for k, v, needs in outs:
                for n, need in enumerate(needs):
                    cost = cost + price((1, k, n, s.outs[k]), v, s.outs[k], need)
            return cost
        return edges

    def _demands(self, v: int) -> list[Spec]:
        """Specs already required of value v by planned consumers and fixed outputs."""
        needs = [self.plan.choices[op.index].strategy.ins[i] for op, i in self.users.get(v, [])
                 if op.index in self.plan.choices]
        return needs + self.out_needs.get(v, [])

    def _known(self, v: int | Lit, rank: int) -> Spec | None:
        return self.plan.specs.get(v) if isinstance(v, int) else Spec.replicated(rank)

    def _plan_region(self, op: Op, info: OpInfo) -> Choice:
        from jaxpar.search.regions import plan_region

        known = [self._known(v, len(sh)) for v, sh in zip(op.inputs, info.in_shapes, strict=True)]
        s, regions, body_cost, trips = plan_region(op, info, known, self.model)
        edges = self._edges(op, s)
        return Choice(s, body_cost, self.model.score(body_cost + edges), None, None, 1, True,
                      regions, trips)


def _informed(context: tuple) -> bool:
    """Whether a context (see _Propagation._context) says anything about how to cut."""
    fixed, ins, demands = context
    return fixed is not None or any(s is not None and s.axes() for s in ins) or any(demands)


def out_spec(graph: OpGraph, plan: GraphPlan, v: int | Lit) -> Spec:
    return plan.specs[v] if isinstance(v, int) else Spec.replicated(len(v.shape))


def graph_cost(graph: OpGraph, plan: GraphPlan, model: CostModel,
               fixed_out: dict[int, Spec] | None = None) -> OpCost:
    """Total modeled cost of a planned graph: ops (regions times their trips), resharding of
    operands, and resharding of outputs into `fixed_out` (output position -> spec)."""
    share = latency_shares(graph)
    parts = []
    for pos, need in (fixed_out or {}).items():
        v = graph.outputs[pos]
        parts.append(model.reshard(out_spec(graph, plan, v), need, graph.shape(v),
                                   graph.dtype(v), share(v)))
    for op in graph.ops:
        choice = plan.choices[op.index]
        parts.append(choice.cost)
        for v, need in zip(op.inputs, choice.strategy.ins, strict=True):
            if isinstance(v, int):
                info = graph.values[v]
                parts.append(model.reshard(plan.specs[v], need, info.shape, info.dtype,
                                           share(v)))
    return _total(parts)


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
