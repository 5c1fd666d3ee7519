"""Refinement: a plan improved one op at a time with the exact objective.

Before: an OpGraph, a complete GraphPlan (from propagation, or a search's completion), the
fixed inputs and outputs, carried-state ties. After: a plan whose total (graph_cost) is no
higher; `Refiner` also keeps its state for more moves (`replan`: a region planned again with
some inputs and outputs in other specs, kept only if the total drops).
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np

from jaxpar.cost.model import CostModel
from jaxpar.ir.graph import Op, OpGraph
from jaxpar.search.propagation import Choice, GraphIndex, GraphPlan, _Graph, handed_back
from jaxpar.spec import Spec


def refine(graph: OpGraph, model: CostModel, plan: GraphPlan, fixed_in: dict[int, Spec],
           fixed_out: dict[int, Spec], classes: list[int] | None = None,
           ties: tuple[tuple[int, int], ...] = (), index: GraphIndex | None = None,
           pinned: frozenset[int] = frozenset(), chains: bool = False) -> GraphPlan:
    """`plan` improved one op at a time with the exact objective (iterated conditional modes).

    Every op without regions is visited (in program order, then again whenever something
    around it changed) and takes the strategy whose own cost plus resharding from its
    operands' specs and into what its consumers, fixed outputs and carried state need is least,
    everything else held; a free input takes the spec its readers (and, carried, the output
    replacing it) need at least cost. No step raises the plan's total (graph_cost), so a greedy
    front's mistake, such as an optimizer chain computed replicated because its consumer asked
    for that first and then gathered, is undone wherever moving one op at a time shows it. Ops
    of one class (ir.repeat.op_classes) in the same surroundings share one evaluation. ties:
    (input value, output position) pairs whose output comes back in the input's spec (an
    input in fixed_in: in the spec fixed for it); index: the graph's GraphIndex, when the
    caller has one. pinned: ops that keep how they read their operands and what they reduce
    over, only choosing where their results land (sharding propagation's ops reading a
    weight as the user laid it out). chains: then also plan again the chains of ops that
    make an operand its reader must reshard with communication (Refiner.unchain), and visit
    again what that moved.

    Example:
      >>> better = refine(graph, model, propagate(graph, model), {}, {})
    """
    refiner = Refiner(graph, model, plan, fixed_in, fixed_out, classes, ties, index, pinned)
    refiner.run()
    if chains and refiner.unchain(set()):
        refiner.run()
    return refiner.plan


class Refiner:
    """refine()'s state, kept for more moves: `run()` visits ops until no single change
    lowers the total; `replan(region, ...)` plans a set of ops again (from what their
    consumers need, from what their operands give, or from the plan as it is), with some
    inputs and outputs kept in other specs, and keeps the result only when the plan's total
    drops; `unchain` and the caller's moves are made of replans."""

    def __init__(self, graph: OpGraph, model: CostModel, plan: GraphPlan,
                 fixed_in: dict[int, Spec], fixed_out: dict[int, Spec],
                 classes: list[int] | None = None, ties: tuple[tuple[int, int], ...] = (),
                 index: GraphIndex | None = None, pinned: frozenset[int] = frozenset()):
        base = _Graph.of(graph, model, classes, index)
        self.b, self.g = base, base.g
        self.pinned = pinned  # ops that keep their operand specs and reductions (see refine)
        self.plan = GraphPlan(dict(plan.specs), dict(plan.choices))
        self.fixed_in = dict(fixed_in)
        self.out_needs: dict[int, list[Spec]] = {}
        for pos, spec in handed_back(graph, fixed_in, fixed_out, ties).items():
            if isinstance(self.g.outputs[pos], int):
                self.out_needs.setdefault(self.g.outputs[pos], []).append(spec)
        self.tied_in: dict[int, int] = {}   # carried input -> the output replacing it
        self.tied_out: dict[int, list[int]] = {}
        for v, pos in ties:
            w = self.g.outputs[pos]
            if isinstance(w, int) and pos not in fixed_out and v not in fixed_in:
                self.tied_in[v] = w
                self.tied_out.setdefault(w, []).append(v)
        self.memo: dict = {}
        self.settled = False  # run() last stopped with nothing left to move (not on budget)
        self.dirty: set[int] = set()  # ops around what kept replans changed since run()

    def run(self) -> GraphPlan:
        """Program order first, then whatever changed around; a budget of visits bounds it.
        Run again after kept replans (unchain), it starts from the ops those touched and their
        neighbours when the run before settled: every other op is where a full run would
        leave it (no move lowers the total with its surroundings unchanged), and the ops it
        visits, it visits in the same order (the first sweep in program order, then the
        queue), so the plan is the one a full run makes."""
        ops, readers, producer = self.g.ops, self.b.readers, self.b.producer
        budget = 8 * sum(not op.regions for op in ops) + 64
        start = range(len(ops)) if not self.settled else sorted(self.dirty)
        sweep = [x for x in start if not ops[x].regions]  # program order: a heap already
        later: deque[int] = deque()  # enqueued behind the sweep, or after it
        queued, at = set(sweep), -1
        free = [v for v in self.g.inputs if v not in self.fixed_in and v in readers]

        def enqueue(x: int) -> None:
            if x not in queued and not ops[x].regions:
                queued.add(x)
                if x > at and sweep:  # the sweep reaches it in program order
                    heapq.heappush(sweep, x)
                else:
                    later.append(x)
        while (sweep or later) and budget > 0:
            while (sweep or later) and budget > 0:
                if sweep:
                    x = at = heapq.heappop(sweep)
                else:
                    x = later.popleft()
                queued.discard(x)
                budget -= 1
                if self._visit(ops[x]):
                    for v in ops[x].inputs:
                        if isinstance(v, int) and v in producer:
                            enqueue(producer[v])
                    for v in ops[x].outputs:
                        for r, _ in readers.get(v, ()):
                            enqueue(r)
            for v in free:
                if self._place(v):
                    for r, _ in readers[v]:
                        enqueue(r)
                    if v in self.tied_in and self.tied_in[v] in producer:
                        enqueue(producer[self.tied_in[v]])
        self.settled, self.dirty = budget > 0, set()
        return self.plan

    def _demands(self, v: int) -> tuple:
        choices = self.plan.choices
        needs = [choices[x].strategy.ins[i] for x, i in self.b.readers.get(v, ())]
        extra = self.out_needs.get(v)
        if extra:
            needs += extra
        tied = self.tied_out.get(v)
        if tied:
            needs += [self.plan.specs[u] for u in tied]
        return tuple(needs)

    def _visit(self, op: Op) -> bool:
        specs, o = self.plan.specs, self.b.opts(op)
        ins = tuple(specs.get(v) if isinstance(v, int) else None for v in op.inputs)
        needs = tuple(self._demands(v) for v in op.outputs)
        current = self.plan.choices[op.index].strategy
        only = (current.ins, current.partial) if op.index in self.pinned else None
        key = (o.key, ins, needs, self.b.kinds_of(op), only, "visit")  # _take's: 5 long
        hit = self.memo.get(key)
        if hit is None:
            totals = _only(o, self.b.priced(op, o, ins, needs), only)
            hit = self.memo[key] = (self.b.choice(o, totals), totals)
        best, totals = hit
        k = o.index.get(current)
        if k is not None and best.score >= totals[k] - 1e-9 * abs(totals[k]):
            return False
        self.plan.choices[op.index] = best
        for v, spec in zip(op.outputs, best.strategy.outs, strict=True):
            specs[v] = spec
        return True

    def _place(self, v: int) -> bool:
        """A free input takes the spec, among those its readers need and the replicated one,
        that costs least to reshard into all of them (and, carried, to get back into)."""
        needs = self._demands(v)
        w = self.tied_in.get(v)
        made = (self.plan.specs[w],) if w is not None else ()
        price = self.b.price

        def cost(src: Spec) -> float:
            return sum(price(v, src, need) for need in needs) + \
                sum(price(w, m, src) for m in made)
        rank = len(self.g.values[v].shape)
        options = dict.fromkeys([n.resolved() for n in needs + made] + [Spec.replicated(rank)])
        best = min(options, key=cost)
        now = self.plan.specs.get(v)
        if now is not None and cost(best) >= cost(now) - 1e-9 * abs(cost(now)):
            return False
        self.plan.specs[v] = best
        return True

    def replan(self, region: list[int], inputs: dict[int, Spec], outputs: dict[int, Spec],
               keep: set[int], start: str = "needs") -> bool:
        """Plan the ops of `region` again with carried inputs `inputs` (value -> spec) and
        the outputs replacing them `outputs` (value -> spec) fixed anew; ops in `keep` only
        choose where their results land (their operands and reductions stay). start: where
        the new plan begins: "needs", from what consumers need (last op first, operands made
        in the region unknown); "operands", from what operands give (first op first, what
        consumers need unknown); "current", from the plan as it is. Then each op takes its
        best strategy with both known, in program order, until nothing moves (three passes
        at most). The free inputs the region reads are placed anew with it (unknown to a
        start from "needs"). Kept when the total drops (True); else everything goes back."""
        if start not in ("needs", "operands", "current"):
            raise ValueError(f"replan(start={start!r}): use 'needs', 'operands' or 'current'.")
        g, plan, b = self.g, self.plan, self.b
        ops, inside = g.ops, set(region)
        values = {v for x in region for v in ops[x].outputs}
        touched = inside | {r for v in values | set(inputs) for r, _ in b.readers.get(v, ())}
        free = b.index.free_reads(region, self.fixed_in) - set(inputs)
        touched |= {r for v in free for r, _ in b.readers.get(v, ())}
        saved = ({x: plan.choices[x] for x in touched},
                 {v: plan.specs.get(v) for v in values | set(inputs) | free},
                 {w: self.out_needs.get(w) for w in outputs})
        priced = values | {self.tied_in[v] for v in free if v in self.tied_in}
        before = self._local(touched, priced)
        for v, spec in inputs.items():
            plan.specs[v] = spec
        for w, spec in outputs.items():
            self.out_needs[w] = [spec]
        if start == "needs":  # free inputs are placed for the new plan afterwards
            unknown = free | values  # each op sees what ops before it make as unknown
            for x in sorted(region, reverse=True):
                unknown.difference_update(ops[x].outputs)
                self._take(ops[x], keep, unknown)
        elif start == "operands":
            for x in sorted(region):
                self._take(ops[x], keep, (), blind=True)
        for _ in range(3):
            for v in free:
                self._place(v)
            if not sum(self._take(ops[x], keep, ()) for x in sorted(region)):
                break
        if self._local(touched, priced) < before * (1 - 1e-9):
            self._changed(touched, set(inputs) | free)
            return True
        plan.choices.update(saved[0])
        for v, spec in saved[1].items():
            if spec is None:
                plan.specs.pop(v, None)
            else:
                plan.specs[v] = spec
        for w, needs in saved[2].items():
            if needs is None:
                self.out_needs.pop(w, None)
            else:
                self.out_needs[w] = needs
        return False

    def _changed(self, ops: set[int], inputs: set[int]) -> None:
        """A kept replan moved `ops` and placed `inputs` anew: they and the ops next to them
        (their operands' producers, their results' readers, the producers of what comes back
        in a moved carried input's spec) are where run() must look again."""
        b, near = self.b, set(ops)
        for x in ops:
            op = self.g.ops[x]
            near.update(b.producer[v] for v in op.inputs if isinstance(v, int) and v in b.producer)
            near.update(r for v in op.outputs for r, _ in b.readers.get(v, ()))
        near.update(b.producer[self.tied_in[v]] for v in inputs
                    if v in self.tied_in and self.tied_in[v] in b.producer)
        self.dirty |= near

    def unchain(self, fixed: set[int], longest: int = 8) -> int:
        """Chains of ops planned one at a time into a layout their consumer must gather: for
        each operand resharded with communication, the ops that make it (walked up through
        ops not in `fixed`, at most `longest`) are planned again from the consumer's need
        backwards (replan) and kept where the total drops. Returns how many were kept."""
        producer = self.b.producer
        kept, seen = 0, set()
        for op in self.g.ops:
            for v in self._moved_operands(op):
                if v not in producer:
                    continue
                region, keep = self._chain(producer[v], fixed, longest)
                key = tuple(region)
                if region and key not in seen:
                    seen.add(key)
                    kept += self.replan(region, {}, {}, keep)
        return kept

    def _moved_operands(self, op: Op) -> list[int]:
        """op's operands resharded with communication into the spec it reads them in."""
        plan, price = self.plan, self.b.price
        return [v for v, need in zip(op.inputs, plan.choices[op.index].strategy.ins, strict=True)
                if isinstance(v, int) and price(v, plan.specs[v], need) > 0.0]

    def _chain(self, x: int, fixed: set[int], longest: int) -> tuple[list[int], set[int]]:
        """Op x and the ops above it, without regions, at most `longest`: the walk goes up
        to an operand's producer and takes the operand's other readers along (they read it
        in whatever spec it gets: a loss's difference squared by one op and doubled for the
        gradient by another); a fixed op ends the walk and only chooses where its results
        land, and a reader is not walked further up."""
        g, b, region, keep, stack = self.g, self.b, set(), set(), [x]

        def add(y: int) -> bool:
            if g.ops[y].regions or y in region or len(region) >= longest:
                return False
            region.add(y)
            if y in fixed:
                keep.add(y)
                return False
            return True
        while stack:
            y = stack.pop()
            if not add(y):
                continue
            for v in g.ops[y].inputs:
                p = b.producer.get(v) if isinstance(v, int) else None
                if p is None:
                    continue
                for r, _ in b.readers[v]:
                    if r not in fixed:
                        add(r)
                stack.append(p)
        return sorted(region), keep

    def report(self, x: int) -> Choice:
        """Op x's strategy in the plan as a Choice: its score and its runner-up's, each its
        own cost plus resharding from the operands' specs and into what consumers need."""
        op, specs = self.g.ops[x], self.plan.specs
        o, current = self.b.opts(op), self.plan.choices[x].strategy
        ins = tuple(specs.get(v) if isinstance(v, int) else None for v in op.inputs)
        needs = tuple(self._demands(v) for v in op.outputs)
        key = (o.key, ins, needs, self.b.kinds_of(op), current, "report")
        hit = self.memo.get(key)
        if hit is None:
            totals = self.b.priced(op, o, ins, needs)
            k = o.index[current]
            others = sorted((t, i) for i, t in enumerate(totals) if i != k)
            runner = others[0] if others else None
            hit = self.memo[key] = Choice(current, o.costs[k], float(totals[k]),
                                          o.cands[runner[1]] if runner else None,
                                          float(runner[0]) if runner else None, len(o.cands),
                                          o.rule)
        return hit

    def _take(self, op: Op, keep: set[int], unknown, blind: bool = False) -> bool:
        """op takes its cheapest strategy given the operand specs (those in `unknown` not
        counted) and, unless `blind`, what its consumers need; an op in `keep` only moves
        its results."""
        specs, o = self.plan.specs, self.b.opts(op)
        ins = tuple(specs.get(v) if isinstance(v, int) and v not in unknown else None
                    for v in op.inputs)
        needs = tuple(() if blind else self._demands(v) for v in op.outputs)
        current = self.plan.choices[op.index].strategy
        only = (current.ins, current.partial) if op.index in keep or \
            op.index in self.pinned else None
        key = (o.key, ins, needs, self.b.kinds_of(op), only)
        best = self.memo.get(key)
        if best is None:
            totals = _only(o, self.b.priced(op, o, ins, needs), only)
            best = self.memo[key] = self.b.choice(o, totals)
        if best.strategy == current:
            return False
        self.plan.choices[op.index] = best
        for v, spec in zip(op.outputs, best.strategy.outs, strict=True):
            specs[v] = spec
        return True

    def _local(self, ops: set[int], values: set[int]) -> float:
        """The plan's total over some ops (own cost and resharding of their operands) and
        the fixed and carried outputs among `values`."""
        plan, b, total = self.plan, self.b, 0.0
        for x in ops:
            op, s = self.g.ops[x], plan.choices[x].strategy
            o = b.opts(op)
            k = o.index.get(s)
            total += o.scores[k] if k is not None else self.b.model.score(plan.choices[x].cost)
            for v, need in zip(op.inputs, s.ins, strict=True):
                if isinstance(v, int):
                    total += b.price(v, plan.specs[v], need)
        for w in values:
            for need in self.out_needs.get(w, ()):
                total += b.price(w, plan.specs[w], need)
            for u in self.tied_out.get(w, ()):
                total += b.price(w, plan.specs[w], plan.specs[u])
        return total


def _only(o, totals, only: tuple | None):
    """`totals` with every candidate of `o` that reads its operands otherwise than `only`
    (operand specs, reductions) priced infinite; `totals` itself when `only` is None."""
    if only is None:
        return totals
    return np.array([t if (s.ins, s.partial) == only else math.inf
                     for s, t in zip(o.cands, totals, strict=True)])
