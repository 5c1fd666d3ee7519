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
              fixed_out: dict[int, Spec] | None = None) -> GraphPlan:
    """Plan `graph` by sharding propagation; fixed_in maps value ids, fixed_out output positions."""
    return _Propagation(graph, model, fixed_in or {}, fixed_out or {}).run()


class _Propagation:
    def __init__(self, graph, model, fixed_in, fixed_out):
        self.g, self.model = graph, model
        self.plan = GraphPlan(specs=dict(fixed_in))
        self.fixed_out = fixed_out
        self.producer = graph.producers()
        self.users = graph.users()
        self.heap: list = []
        self.tick = itertools.count()

    def run(self) -> GraphPlan:
        for v in self.plan.specs:
            self._push_neighbours(v)
        for pos, v in enumerate(self.g.outputs):
            if pos in self.fixed_out and isinstance(v, int) and v in self.producer:
                self._push(self.producer[v], self.g.values[v].nbytes)
        remaining = {op.index for op in self.g.ops}
        while remaining:
            op = self._next(remaining)
            remaining.discard(op.index)
            self._plan_op(op)
        for v in self.g.inputs:  # inputs no op reads keep the replicated default
            self.plan.specs.setdefault(v, Spec.replicated(len(self.g.values[v].shape)))
        return self.plan

    def _push(self, op: Op, weight: float) -> None:
        if op.index not in self.plan.choices:
            heapq.heappush(self.heap, (-weight, next(self.tick), op.index))

    def _push_neighbours(self, v: int) -> None:
        weight = self.g.values[v].nbytes
        if v in self.producer:
            self._push(self.producer[v], weight)
        for op, _ in self.users.get(v, []):
            self._push(op, weight)

    def _next(self, remaining: set[int]) -> Op:
        while self.heap:
            _, _, idx = heapq.heappop(self.heap)
            if idx in remaining:
                return self.g.ops[idx]
        # A new front: the most expensive op not yet planned.
        return max((self.g.ops[i] for i in remaining),
                   key=lambda op: (flops(OpInfo.of(op, self.g)), -op.index))

    def _plan_op(self, op: Op) -> None:
        info = OpInfo.of(op, self.g)
        if op.regions:
            choice = self._plan_region(op, info)
        else:
            choice = self._choose(op, *self.model.options(info, self.g.op_latency_share(op)))
        self.plan.choices[op.index] = choice
        s = choice.strategy
        for v, spec in zip(op.inputs, s.ins, strict=True):
            if isinstance(v, int) and v not in self.plan.specs and v not in self.producer:
                self.plan.specs[v] = spec.resolved()  # a free input or constant takes this spec
                self._push_neighbours(v)
        for v, spec in zip(op.outputs, s.outs, strict=True):
            self.plan.specs[v] = spec
            self._push_neighbours(v)
        for v in op.inputs:
            if isinstance(v, int) and v in self.producer:
                self._push(self.producer[v], self.g.values[v].nbytes)

    def _choose(self, op: Op, cands: list[OpStrategy], costs: list[OpCost]) -> Choice:
        """The candidate whose own cost plus edges to what is already planned is cheapest."""
        score = self.model.score
        priced = sorted(((score(own) + score(self._edges(op, s)), i)
                         for i, (s, own) in enumerate(zip(cands, costs, strict=True))))
        (best_score, best), runner = priced[0], (priced[1] if len(priced) > 1 else None)
        return Choice(cands[best], costs[best], best_score,
                      cands[runner[1]] if runner else None, runner[0] if runner else None,
                      len(cands), has_rule(op.primitive))

    def _edges(self, op: Op, s: OpStrategy) -> OpCost:
        cost, share = OpCost(), self.g.latency_share
        for v, need in zip(op.inputs, s.ins, strict=True):
            if isinstance(v, int) and v in self.plan.specs:
                cost = cost + self.model.reshard(self.plan.specs[v], need, self.g.values[v].shape,
                                                 self.g.values[v].dtype, share(v))
        for v, have in zip(op.outputs, s.outs, strict=True):
            for need in self._demands(v):
                cost = cost + self.model.reshard(have, need, self.g.values[v].shape,
                                                 self.g.values[v].dtype, share(v))
        return cost

    def _demands(self, v: int) -> list[Spec]:
        """Specs already required of value v by planned consumers and fixed outputs."""
        needs = [self.plan.choices[op.index].strategy.ins[i] for op, i in self.users.get(v, [])
                 if op.index in self.plan.choices]
        needs += [spec for pos, spec in self.fixed_out.items() if self.g.outputs[pos] == v]
        return needs

    def _known(self, v: int | Lit, rank: int) -> Spec | None:
        return self.plan.specs.get(v) if isinstance(v, int) else Spec.replicated(rank)

    def _plan_region(self, op: Op, info: OpInfo) -> Choice:
        from jaxpar.search.regions import plan_region

        known = [self._known(v, len(sh)) for v, sh in zip(op.inputs, info.in_shapes, strict=True)]
        s, regions, body_cost, trips = plan_region(op, info, known, self.model)
        edges = self._edges(op, s)
        return Choice(s, body_cost, self.model.score(body_cost + edges), None, None, 1, True,
                      regions, trips)


def out_spec(graph: OpGraph, plan: GraphPlan, v: int | Lit) -> Spec:
    return plan.specs[v] if isinstance(v, int) else Spec.replicated(len(v.shape))


def graph_cost(graph: OpGraph, plan: GraphPlan, model: CostModel,
               fixed_out: dict[int, Spec] | None = None) -> OpCost:
    """Total modeled cost of a planned graph: ops (regions times their trips), resharding of
    operands, and resharding of outputs into `fixed_out` (output position -> spec)."""
    total, share = OpCost(), graph.latency_share
    for pos, need in (fixed_out or {}).items():
        v = graph.outputs[pos]
        total = total + model.reshard(out_spec(graph, plan, v), need, graph.shape(v),
                                      graph.dtype(v), share(v))
    for op in graph.ops:
        choice = plan.choices[op.index]
        total = total + choice.cost
        for v, need in zip(op.inputs, choice.strategy.ins, strict=True):
            if isinstance(v, int):
                info = graph.values[v]
                total = total + model.reshard(plan.specs[v], need, info.shape, info.dtype,
                                              share(v))
    return total
