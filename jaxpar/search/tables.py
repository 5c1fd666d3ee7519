"""OpGraph -> cost tables for the exact search: one node per op and per free input (or per
class of them, repeated layers folded; or for a region's alone, the rest of a plan held).

Before: an OpGraph, the specs the user fixed, a CostModel. After: `Tables`, holding what a solver
`Problem` needs (node costs, edge cost matrices, per-node memory) and what each node and candidate
stands for, so a solution maps back to a GraphPlan.

Edge costs depend only on the producer's output spec and the consumer's input spec, and a tensor
has far fewer distinct specs than its ops have strategies, so every edge is priced over spec
*classes*: `row[s]` / `col[t]` give the class of producer candidate s / consumer candidate t.
Fixed inputs are no nodes: resharding from their spec is added to their consumers' node costs,
and resharding into a fixed output spec to its producer's (so is what crosses a region's border:
Region).

Everything is priced once per distinct thing: ops with one signature share one candidate list
(CostModel.options caches it), so their cost vectors, spec classes and the resharding matrices
between them are computed once and shared by identity (a deep model's layers all reuse them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from jaxpar.cost.model import CostModel, nbytes
from jaxpar.ir.graph import Lit, OpGraph
from jaxpar.rules.registry import OpInfo
from jaxpar.search.propagation import Choice, GraphPlan, handed_back
from jaxpar.search.regions import covers, held_candidate, region_candidates
from jaxpar.spec import Spec, spec_classes


@dataclass
class Edge:
    """Consumer node `v` reads a value made by node `u`; cost[row[s], col[t]]. `port` is the
    consumer's operand index (-1: a carried-state tie into an input node)."""

    u: int
    v: int
    cost: np.ndarray
    row: np.ndarray
    col: np.ndarray
    port: int = -1


class Allow(Protocol):
    """Which candidates a search may use (build_tables' `allow`): the optimum is then over
    the plans made of those only (recursive_programming solves one mesh axis again so)."""

    def op(self, x: int, cands: list) -> tuple[int, ...]:
        """The indices in `cands`, op x's candidate list, of the strategies it may take."""

    def specs(self, v: int, specs: tuple[Spec, ...]) -> tuple[Spec, ...]:
        """The specs free input v may take, from `specs` (those its first reader reads)."""

    # An Allow may also name the plans it searches around as `plans` (GraphPlans: resolve's
    # _OtherAxes, one; _OtherAxesOfAny, several); build_tables then offers each loop and cond
    # its choice in each of them. And it may have `op_key(x)`: a hashable such that ops given
    # one candidate list and equal keys are allowed the same indices (folded tables then ask
    # `op` once per class and key: a 48-layer step's ops ask it 16k times per solve).


@dataclass(frozen=True)
class Region:
    """Search only `ops` and the free `inputs` (build_tables' `region`): every other op keeps
    its choice in `plan` and every other value its spec there. What crosses the border is
    priced on the searched side: reading a held value from its spec, a held op reading a
    searched one into the operand spec its choice reads. The tables are then as small as the
    region, and price any choice of it as the whole graph's tables would with the rest held
    (less a constant: the held ops among themselves)."""

    plan: GraphPlan
    ops: frozenset[int]
    inputs: frozenset[int]


@dataclass
class Tables:
    """Everything the exact search needs, and how to read its answer back."""

    op_nodes: dict[int, int] = field(default_factory=dict)     # op index -> node
    input_nodes: dict[int, int] = field(default_factory=dict)  # free value id -> node
    cands: list = field(default_factory=list)   # OpStrategy (ops) or Spec (inputs), per node
    own: list = field(default_factory=list)     # OpCost per candidate (ops), or None (inputs)
    node_cost: list[np.ndarray] = field(default_factory=list)
    node_mem: list[np.ndarray] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    regions: dict[int, dict] = field(default_factory=dict)  # op index -> {id(candidate):
                                                            # (plans, trips, cost)}
    count: list[int] = field(default_factory=list)  # ops and inputs per node, built folded
                                                    # (build_tables' classes; else empty)
    tied: tuple[tuple[int, ...], ...] = ()  # built not folded: the nodes that folding would
                                            # make one (with classes; groups of two or more),
                                            # and each op's node with its running nodes
    running: dict[int, int] = field(default_factory=dict)  # not folded: node -> the op whose
                                        # bodies' memory or partial sums before their
                                        # reduce-scatter it holds while it runs (len(graph.ops):
                                        # the second copies of outputs at the end,
                                        # returned_copies)
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # not folded: the nodes
                                        # of an op whose results die at different points (its
                                        # own and those tied to it), each holding the results
                                        # that die at one point: (op index, that point)


def build_tables(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
                 fixed_out: dict[int, Spec], ties: tuple[tuple[int, int], ...] = (),
                 allow: Allow | None = None, classes: Sequence[int] | None = None,
                 region: Region | None = None, fold: bool = True,
                 region_seeds: dict[int, list] | None = None) -> Tables:
    """ties: (input value, output position) pairs of carried state: the output is handed
    back in the input's spec, so the resharding from its producer into that spec is an edge
    between the producer and the input node, priced with everything else (an input in
    fixed_in: a charge on the producer, as for a fixed output). allow: only the
    candidates it keeps become choices (None: all).

    classes: a class number per op (ir.repeat.op_classes) to fold repeated layers while
    building: the ops of one class left one candidate list become one node, the free inputs
    alike (one spec list, shape and dtype, read at the same operands of the same nodes) one
    node, and edges between the same operands of the same two nodes one edge with their
    matrix times their number (an edge inside a node adds its diagonal to the node's cost).
    `Tables.count` holds each node's members. Any choice is then priced as on the unfolded
    tables with every member taking its node's candidate, and a 48-layer model's tables cost
    about what a few layers' do. None: one node per op and per free input.
    fold: False keeps one node per op and per free input even with classes, and lists in
    `Tables.tied` the nodes that folding would make one (a search with a memory budget ties
    them: its live sets count the layers apart).

    region: only its ops and free inputs become nodes (Region); None: the whole graph.
    region_seeds: {region op index: [(operand specs, result specs or None)]} (a spec None:
    free): the op also takes the candidates regions.region_candidates plans from each pair
    (dynamic_programming seeds them from a first solution, so that a loop's body can be
    solved for its neighbours).

    A loop or cond also takes its choice in the plans searched around (the region's, or
    `allow.plans` where allow has them), body plans and all, unless a candidate covers it:
    the bodies are otherwise planned anew from operand specs, and none of those plans need be
    the held one, so the search could end above the plan it started from (a Linen nn.scan step's
    mesh axis solved again: 13x its objective, the scans' bodies planned for free operands).
    """
    helds = [region.plan] if region is not None else getattr(allow, "plans", ())
    b = _Builder(graph, model, allow, classes, fold, region_seeds or {},
                 [p.choices for p in helds])
    inside = range(len(graph.ops)) if region is None else region.ops
    ops = graph.ops if region is None else [op for op in graph.ops if op.index in inside]
    for op in ops:
        b.t.op_nodes[op.index] = b.op_node(op)
    producer = made_by(graph)  # value -> (op, result index)
    held = {} if region is None else region.plan.specs
    free = (lambda v: True) if region is None else \
        (lambda v: v in region.inputs or v not in held)  # no spec to hold: free
    if region is None:  # every op a node: what one op reads from another, as arrays
        b.op_edges(fixed_in)
        reads = _OpEdges.of(graph).sources
    else:
        reads = ((op, i, v) for op in ops for i, v in enumerate(op.inputs))
    for op, i, v in reads:
        if isinstance(v, Lit):
            continue
        b.at = (op.index, i)
        if v in fixed_in:
            b.charge_fixed_input(op, i, fixed_in[v])
        elif v in producer and producer[v][0].index in inside:
            b.edge(producer[v], op, i)
        elif v in producer or not free(v):  # held by the region's plan
            b.charge_fixed_input(op, i, held[v].resolved())
        else:
            b.input_edge(v, op, i)
    b.at = (len(graph.ops), 0)  # links made below come after every op's
    back = handed_back(graph, fixed_in, fixed_out, ties)
    if region is None and not fold:  # a budget's live sets: held at the end
        b.returned = (back, fixed_in, {pos for v_in, pos in ties
                                       if pos not in back and graph.outputs[pos] != v_in},
                      producer)
    for pos, spec in back.items():
        v = graph.outputs[pos]
        if isinstance(v, int) and v in producer and producer[v][0].index in inside:
            b.charge_fixed_output(producer[v], spec)
    for v_in, pos in ties:
        v = graph.outputs[pos]
        if v_in not in fixed_in and pos not in fixed_out and isinstance(v, int) and \
                v in producer:
            b.tie(v_in, producer[v], producer[v][0].index in inside, free(v_in), held)
    if region is not None:
        b.held_readers(region, producer)
    return b.finish()


def latency_shares(graph: OpGraph) -> Callable[[int], float]:
    """graph.latency_share as a constant-time lookup. It takes two values only (1 outside the
    step's tail, one shared fraction inside), and each call of it counts the outputs anew."""
    tail = graph.tail_values()
    inside = graph.latency_share(next(iter(tail))) if tail else 1.0
    return lambda v: inside if v in tail else 1.0


_KEY_LIMIT = 2**63  # _Builder.op_edges: keys whose codes' product reaches this (int64's
                   # end) are compared column by column instead


class _OpEdges:
    """A graph's def-use edges between ops as arrays, one row per operand an op reads from
    another op's result (in program order: op, then operand), and the operands made by no op
    (inputs, constants, literals) as (op, operand index, value), in that order too. Worked out
    once per graph (OpGraph is not changed once built): build_tables runs many times over one
    graph (each mesh axis solved again), and a 48-layer step has 20k such edges."""

    def __init__(self, graph: OpGraph):
        self.made_by = {v: (op, j) for op in graph.ops for j, v in enumerate(op.outputs)}
        made = {v: (op.index, j) for v, (op, j) in self.made_by.items()}
        share = latency_shares(graph)
        self.op_share = [max((share(v) for v in op.outputs), default=1.0) for op in graph.ops]
        rows, self.sources = [], []
        for op in graph.ops:
            for i, v in enumerate(op.inputs):
                if isinstance(v, int) and v in made:
                    rows.append((op.index, i, *made[v], v, graph.values[v].nbytes))
                else:
                    self.sources.append((op, i, v))
        table = np.array(rows, dtype=np.int64).reshape(-1, 6)
        self.op, self.port, self.producer, self.result, self.value, nbytes = table.T
        # each value's bytes and latency share as a code (equal codes: equal bytes, shares)
        self.size_code = np.unique(nbytes, return_inverse=True)[1].reshape(-1)
        self.share_code = np.unique([share(int(v)) for v in self.value],
                                    return_inverse=True)[1].reshape(-1).astype(np.int64)

    @staticmethod
    def of(graph: OpGraph) -> _OpEdges:
        memo = graph.__dict__.get("_op_edges")
        if memo is None or memo[0] != (len(graph.ops), len(graph.values)):
            memo = graph.__dict__["_op_edges"] = ((len(graph.ops), len(graph.values)),
                                                 _OpEdges(graph))
        return memo[1]


class _Builder:
    """Builds Tables, pricing each distinct candidate list, spec class list and resharding
    matrix once (caches keyed by object identity hold the object, so its id stays valid).

    Nodes are made as the ops are met (free inputs once every reader is known: folded, their
    readers tell them apart); node costs, fixed-spec charges and edges are gathered by node
    and made into the tables by finish()."""

    def __init__(self, graph: OpGraph, model: CostModel, allow: Allow | None = None,
                 classes: Sequence[int] | None = None, fold: bool = True,
                 region_seeds: dict[int, list] | None = None,
                 held: Sequence[dict[int, Choice]] = ()):
        self.graph, self.model, self.t, self.allow = graph, model, Tables(), allow
        self.region_seeds = region_seeds or {}
        self.held = held  # op -> its choice in each plan searched around (a region's, or
                          # allow.plans): a loop's or cond's is one of its candidates
        self.classes, self.fold = classes, fold
        self._kept: dict[tuple, tuple] = {}    # (id(list), indices kept) -> (list, costs)
        self._kept_specs: dict[tuple, tuple] = {}  # an input's allowed specs, one object each
        self.share, self.splats = latency_shares(graph), graph.splats(model.mesh.size)
        self._op_share = _OpEdges.of(graph).op_share  # per op: its results' largest share
        self._nodes: dict[int, tuple] = {}     # id(candidate list) -> (list, cost, mem)
        self._ports: dict[tuple, tuple] = {}   # (id(list), side, i) -> (list, classes)
        self._classes: dict[tuple, tuple] = {}  # distinct specs -> the one tuple of them
        self._matrices: dict[tuple, np.ndarray] = {}  # (spec lists' ids, share, splat),
                                                      # bytes -> K
        self._lines: dict[tuple, tuple] = {}   # spec lists' ids, share, splat -> (lists, per
                                               # byte, fixed): every K between them is a line
        self._options: dict[tuple, tuple] = {}  # (class, share) -> model.options
        # folded: (class, share, the Allow's op_key) -> node; no Allow: every key one
        self._op_key = (lambda x: None) if allow is None else getattr(allow, "op_key", None)
        self._quick: dict[tuple, int] = {}
        self._groups: dict[tuple, int] = {}    # what makes nodes one -> node (its first)
        self._group: dict[int, int] = {}       # node -> its group's first node (grouped ones)
        self._count: list[int] = []            # members per node
        self._extra: dict[int, np.ndarray] = {}  # node -> fixed-spec charges and diagonals
        self._reads: dict[int, list] = {}      # free input -> [(node, port)] (-1: a tie)
        self._first: dict[int, tuple] = {}     # free input -> (node, side, i) its specs
                                               # come from (its first reader's operand)
        self._links: list[tuple] = []          # _link's arguments, in order
        self._at: list[tuple] = []             # where each of them was made: (op, operand)
        self.at = (0, 0)                       # where the links made now are
        self._op_links: list[tuple] = []       # op_edges' links, each made first at `at`,
                                               # with its number: (at, link, number)
        self._last: dict[int, int] | None = None  # value -> its last program point
        self._parts: dict[tuple, np.ndarray] = {}  # (id(list), results) -> their bytes
        self._scatter: dict[int, np.ndarray] = {}  # id(list) -> OpStrategy.scatter_bytes
        self._splits: list[tuple] = []         # (op, its node) for _split_results, in order
        self._scatters: list[tuple] = []       # (op, its node) for _scatter_node, in order
        self.returned: tuple | None = None     # returned_copies' arguments; None: the copies
                                               # are not counted (no budget)
        # Not folded (live sets): the values that hold nothing of their own: those ops make
        # in a donated argument's buffer (graph.in_place; assumed made in the argument's
        # spec, as plan.in_place asks: the plan's check is exact) and the broadcasts XLA
        # sinks into loops (graph.sunk).
        self._mine = frozenset() if fold else graph.sunk().union(graph.in_place())

    def _add_node(self, cands, own, cost: np.ndarray, mem: np.ndarray, key=None) -> int:
        """A node for one op or free input; folded, the node of its kind (`key`) when there
        is one already (not folded, a node of its own in that kind's group)."""
        first = None if key is None else self._groups.get(key)
        if first is not None and self.fold:
            self._count[first] += 1
            return first
        t = self.t
        t.cands.append(cands)
        t.own.append(own)
        t.node_cost.append(cost)
        t.node_mem.append(mem)
        self._count.append(1)
        node = len(t.cands) - 1
        if key is not None:
            self._group[node] = self._groups.setdefault(key, node)
        return node

    def _candidates(self, op, share: float) -> tuple[list, list]:
        """model.options, asked once per class when there are classes (a class is one
        signature)."""
        if self.classes is None:
            return self.model.options(OpInfo.of(op, self.graph), share)
        key = (self.classes[op.index], share)
        hit = self._options.get(key)
        if hit is None:
            hit = self._options[key] = self.model.options(OpInfo.of(op, self.graph), share)
        return hit

    def op_node(self, op) -> int:
        model = self.model
        share = self._op_share[op.index]
        if op.regions:  # bodies planned from free operands (regions.region_candidates)
            from jaxpar.plan import body_memory

            info = OpInfo.of(op, self.graph)
            found = list(region_candidates(op, info, [None] * len(op.inputs), model))
            for known, outs in self.region_seeds.get(op.index, ()):  # (copied: cached)
                found += [f for f in region_candidates(op, info, known, model, outs)
                          if not any(f[0] == g[0] for g in found)]
            for choices in self.held:
                held = choices.get(op.index)
                if held is not None and held.regions:
                    mine = held_candidate(held)
                    if not any(covers(f, mine, op, model) for f in found):
                        found.append(mine)
            self.t.regions[op.index] = {id(s): (plans, trips, cost)
                                        for s, plans, cost, trips in found}
            cands, own = [f[0] for f in found], [f[2] for f in found]
            js = self._held(op, range(len(op.outputs)))
            results = np.array([self._results_memory(info, f[0], js) for f in found])
            bodies = np.array([body_memory(op, f[1], model.mesh) for f in found])
            node = self._add_node(cands, own, np.array([model.score(c) for c in own]),
                                  results if not self.fold else results + bodies)
            if not self.fold:  # the bodies' memory, held while the op runs only
                self._while_running(node, op.index, bodies)
                if len(op.outputs) > 1:
                    self._splits.append((op, node))
            return node
        quick = None
        if self.fold and self.classes is not None and self._op_key is not None:
            # folded: ops of one class (one candidate list) with equal keys make one node
            quick = (self.classes[op.index], share, self._op_key(op.index))
            first = self._quick.get(quick)
            if first is not None:
                self._count[first] += 1
                return first
        cands, own = self._candidates(op, share)
        if self.allow is not None:
            cands, own = self._subset(cands, own, self.allow.op(op.index, cands))
        if self.fold and self.classes is not None:  # folded: the node of its kind, if made
            first = self._groups.get((self.classes[op.index], id(cands)))
            if first is not None:
                self._count[first] += 1
                if quick is not None:
                    self._quick[quick] = first
                return first
        hit = self._nodes.get(id(cands))
        if hit is None:
            # Memory a node holds: its results, per device (operands belong to their producers).
            info = OpInfo.of(op, self.graph)
            hit = self._nodes[id(cands)] = (
                cands, np.array([model.score(c) for c in own]),
                np.array([self._results_memory(info, s) for s in cands], dtype=float))
        mem = hit[2]
        if any(v in self._mine for v in op.outputs):
            info, js = OpInfo.of(op, self.graph), self._held(op, range(len(op.outputs)))
            mem = np.array([self._results_memory(info, s, js) for s in cands], dtype=float)
        key = None if self.classes is None else (self.classes[op.index], id(cands))
        node = self._add_node(cands, own, hit[1], mem, key)
        if quick is not None:
            self._quick[quick] = node
        if not self.fold:
            if len(op.outputs) > 1:
                self._splits.append((op, node))
            self._scatters.append((op, node))
        return node

    def _scatter_node(self, op, node: int) -> None:
        """Not folded: a node tied to op `node`'s, live at its point only, holding the partial
        sums its candidates make whole before reduce-scattering them (scatter_bytes), for an
        op with such a candidate. Made by finish(), as _split_results' nodes are."""
        cands = self.t.cands[node]
        scatter = self._scatter.get(id(cands))
        if scatter is None:
            info = OpInfo.of(op, self.graph)
            sizes = [nbytes(shape, dtype) for shape, dtype in
                     zip(info.out_shapes, info.out_dtypes, strict=True)]
            scatter = self._scatter[id(cands)] = np.array(
                [s.scatter_bytes(sizes, self.model.mesh) for s in cands], dtype=float)
        if scatter.any():
            self._while_running(node, op.index, scatter)

    def _split_results(self, op, node: int) -> None:
        """Not folded (a budget's live sets count memory): an op whose results die at
        different program points holds the results that die at each point in a node of its
        own, tied to the op's (same candidates, no cost; Tables.spans), so that each counts
        until its own last reader, as plan.peak_memory counts it (a scan's final carry, read
        once, is not held while the stacked residuals it made wait for the backward pass).
        Made by finish(), after the ops' and free inputs' nodes, which keep their numbers."""
        if self._last is None:
            self._last = self.graph.last_points()
        by_end: dict[int, list[int]] = {}
        for j, v in enumerate(op.outputs):
            by_end.setdefault(self._last[v], []).append(j)
        if len(by_end) < 2:
            return
        t = self.t
        info = OpInfo.of(op, self.graph)
        cands, own = t.cands[node], t.own[node]
        for n, (end, js) in enumerate(sorted(by_end.items())):
            js = self._held(op, js)
            key = (id(cands), tuple(js))
            mem = self._parts.get(key)
            if mem is None:
                mem = self._parts[key] = np.array(
                    [self._results_memory(info, s, js) for s in cands], dtype=float)
            if n == 0:
                t.node_mem[node] = mem
                t.spans[node] = (op.index, end)
                continue
            extra = self._add_node(cands, own, np.zeros(len(cands)), mem)
            self._group.setdefault(node, node)
            self._group[extra] = self._group[node]
            t.spans[extra] = (op.index, end)

    def _held(self, op, results) -> list[int]:
        """Of an op's results at `results`, those holding bytes of their own (not made in a
        donated argument's buffer, nor sunk into the loops reading them: self._mine)."""
        return [j for j in results if op.outputs[j] not in self._mine]

    def _results_memory(self, info: OpInfo, s, results: Sequence[int] | None = None) -> float:
        """Per device bytes of an op's results (those at `results`; None: all) under
        strategy s."""
        js = range(len(s.outs)) if results is None else results
        return sum(nbytes(info.out_shapes[j], info.out_dtypes[j]) /
                   s.outs[j].shards(self.model.mesh) for j in js)

    def _while_running(self, node: int, index: int, memory: np.ndarray) -> None:
        """A node tied to op `node` (same candidates) holding `memory`, live at program point
        `index` only (t.running): what a region op's bodies add while it runs (their peak
        less their arguments, which the operands' producers hold already), the partial sums
        an op makes whole before reduce-scattering them (OpStrategy.scatter_bytes), an
        output's second copy at the end (returned_copies)."""
        t = self.t
        extra = self._add_node(t.cands[node], t.own[node], np.zeros(len(memory)), memory)
        self._group.setdefault(node, node)
        self._group[extra] = self._group[node]
        t.running[extra] = index

    def returned_copies(self, back: dict[int, Spec], fixed_in: dict[int, Spec],
                        apart: set[int], producer: dict[int, tuple]) -> None:
        """plan.returned_copies's second copies of outputs, each in a node live at the end
        only (t.running): an output made in another spec than it is handed back in (`back`),
        tied to its producer's node; an argument or constant returned unchanged, at the spec
        it is handed back in, else at its own (tied to its node, a free one's). Not counted:
        the outputs at `apart`, carried state tied to a free input it is not (its copy
        depends on two nodes' choices, the producer's and the input's; a node's memory on its
        own alone), and the outputs returned in a donated argument's buffer (graph.aliases;
        assumed in its spec, as plan.in_place asks). producer: value -> (op, result index),
        build_tables's."""
        graph, t, end, mesh = self.graph, self.t, len(self.graph.ops), self.model.mesh
        donated = graph.aliases()
        for pos, v in enumerate(graph.outputs):
            spec = back.get(pos)
            if not isinstance(v, int) or pos in apart or pos in donated or (
                    v in producer and spec is None):
                continue
            size = graph.values[v].nbytes
            if v in producer:
                op, j = producer[v]
                node = t.op_nodes[op.index]
                self._while_running(node, end, np.array(
                    [0.0 if s.outs[j] is spec else size / spec.shards(mesh)
                     for s in t.cands[node]]))
            elif spec is None and v not in fixed_in and v in t.input_nodes:
                node = t.input_nodes[v]
                self._while_running(node, end, t.node_mem[node])
            else:  # held in a spec the search does not choose
                spec = spec or fixed_in.get(v) or Spec.replicated(len(graph.values[v].shape))
                extra = self._add_node([spec], None, np.zeros(1),
                                       np.array([size / spec.shards(mesh)]))
                t.running[extra] = end

    def _subset(self, cands: list, own: list, kept: tuple[int, ...]) -> tuple[list, list]:
        """The candidates at `kept` as a list of their own, one per (list, indices): ops alike
        keeping alike share it (and so its costs and resharding matrices)."""
        if len(kept) == len(cands):
            return cands, own
        key = (id(cands), kept)
        hit = self._kept.get(key)
        if hit is None:
            hit = self._kept[key] = ([cands[i] for i in kept], [own[i] for i in kept], cands)
        return hit[0], hit[1]

    def _input_node(self, v: int) -> int:
        """Free input (or constant) v's node: it takes any spec its first reader reads (or,
        read by none, its tied output comes in)."""
        node, side, i = self._first[v]
        specs = self._port(node, side, i)[0]
        if self.allow is not None:  # one object per distinct tuple: inputs alike stay alike
            specs = self.allow.specs(v, specs)
            specs = self._kept_specs.setdefault(specs, specs)
        info = self.graph.values[v]
        key = None if self.classes is None else \
            (id(specs), info.shape, str(info.dtype),
             tuple(sorted((self._group.get(n, n), port) for n, port in self._reads[v])))
        mem = np.array([info.nbytes / s.shards(self.model.mesh) for s in specs], dtype=float)
        return self._add_node(specs, None, np.zeros(len(specs)), mem, key)

    def _intern(self, specs: tuple[Spec, ...]) -> tuple[Spec, ...]:
        """One tuple object per distinct spec list (caches below key on its id)."""
        return self._classes.setdefault(specs, specs)

    def _port(self, node: int, side: str, i: int) -> tuple[tuple, np.ndarray]:
        """(distinct specs, class per candidate) of node's operand i ("in"), result i ("out")
        or own spec ("spec")."""
        cands = self.t.cands[node]
        key = (id(cands), side, i)
        hit = self._ports.get(key)
        if hit is None:
            specs = cands if side == "spec" else [s.ins[i] if side == "in" else s.outs[i]
                                                  for s in cands]
            distinct, idx = spec_classes(specs)
            hit = self._ports[key] = (cands, self._intern(distinct), idx)
        return hit[1], hit[2]

    def _matrix(self, v: int, src: tuple, dst: tuple) -> np.ndarray:
        """K[p, q]: the score of resharding value v from src's p-th spec to dst's q-th: a
        line in v's bytes (CostModel.reshard_lines), priced once per spec lists, share and
        whether v is a splat (OpGraph.splats)."""
        share, size, splat = self.share(v), self.graph.values[v].nbytes, v in self.splats
        lists = (id(src), id(dst), share, splat)
        hit = self._matrices.get((lists, size))
        if hit is None:
            lines = self._lines.get(lists)
            if lines is None:
                lines = self._lines[lists] = (src, dst) + self.model.reshard_lines(
                    src, dst, share, splat)
            hit = self._matrices[(lists, size)] = lines[2] * size + lines[3]
        return hit

    def _link(self, u, src_side: str, j: int, w, dst_side: str, i: int, v: int,
              port: int) -> None:
        """An edge from u's `src_side` j to w's `dst_side` i carrying value v, made by
        finish(); u or w may be ("in", value): a free input, whose node is made last, or a
        Spec: a fixed end, whose resharding is charged to the other end's node."""
        self._links.append((u, src_side, j, w, dst_side, i, v, port))
        self._at.append(self.at)

    def op_edges(self, fixed_in: dict[int, Spec]) -> None:
        """The links of every op reading another op's result (the whole graph searched, each
        op a node), made at once: the edges' rows (_OpEdges) with one key as finish() merges
        them become one link, made where its first row is, times their number."""
        e, n = _OpEdges.of(self.graph), len(self.graph.ops)
        if not len(e.op):
            return
        node = np.fromiter((self.t.op_nodes[x] for x in range(n)), dtype=np.int64, count=n)
        keep = ~np.isin(e.value, np.fromiter(fixed_in, dtype=np.int64, count=len(fixed_in)))
        for r in np.flatnonzero(~keep).tolist():  # a result the caller fixed: a charge
            x, i = int(e.op[r]), int(e.port[r])
            self.at = (x, i)
            self.charge_fixed_input(self.graph.ops[x], i, fixed_in[int(e.value[r])])
        rows = np.flatnonzero(keep)
        if not len(rows):
            return
        columns = np.stack([node[e.producer[rows]], e.result[rows], node[e.op[rows]],
                            e.port[rows], e.size_code[rows], e.share_code[rows]])
        radix = [int(c.max()) + 1 for c in columns]
        if math.prod(radix) < _KEY_LIMIT:  # the columns' codes in mixed radix: one number
            key = np.zeros(len(rows), dtype=np.int64)
            for column, base in zip(columns, radix, strict=True):
                key = key * base + column
            _, first, number = np.unique(key, return_index=True, return_counts=True)
        else:
            _, first, number = np.unique(columns.T, axis=0, return_index=True,
                                         return_counts=True)
        for f, k in zip(first.tolist(), number.tolist(), strict=True):
            r = rows[f]
            x, i, v = int(e.op[r]), int(e.port[r]), int(e.value[r])
            self._op_links.append(((x, i), (self.t.op_nodes[int(e.producer[r])], "out",
                                            int(e.result[r]), self.t.op_nodes[x], "in", i, v,
                                            i), k))

    def _end(self, x, side: str, i: int) -> tuple[tuple, np.ndarray | None]:
        """_port of a node, or a fixed spec's own class."""
        return (self._intern((x,)), None) if isinstance(x, Spec) else self._port(x, side, i)

    def edge(self, prod, cop, i: int) -> None:
        pop, j = prod
        self._link(self.t.op_nodes[pop.index], "out", j, self.t.op_nodes[cop.index], "in", i,
                   cop.inputs[i], i)

    def input_edge(self, v: int, op, i: int) -> None:
        w = self.t.op_nodes[op.index]
        self._first.setdefault(v, (w, "in", i))
        self._reads.setdefault(v, []).append((w, i))
        self._link(("in", v), "spec", 0, w, "in", i, v, i)

    def tie(self, v_in: int, prod, searched: bool = True, free: bool = True,
            held: dict | None = None) -> None:
        """Carried output `prod` comes back in input v_in's spec; `searched`: its producer is
        a node, `free`: v_in is (else each is held at its spec in `held`)."""
        op, j = prod
        if searched and free:
            u = self.t.op_nodes[op.index]
            self._first.setdefault(v_in, (u, "out", j))  # read by no op: any spec it comes in
            self._reads.setdefault(v_in, []).append((u, -1))
            self._link(u, "out", j, ("in", v_in), "spec", 0, op.outputs[j], -1)
        elif searched:
            self.charge_fixed_output(prod, held[v_in].resolved())
        elif free and v_in in self._first:
            self._link(held[op.outputs[j]].resolved(), "out", j, ("in", v_in), "spec", 0,
                       op.outputs[j], -1)

    def held_readers(self, region: Region, producer: dict) -> None:
        """Held ops reading a searched op's result or a free input: each reads it into the
        operand spec its choice in the region's plan reads, charged to the searched node."""
        for op in self.graph.ops:
            if op.index in region.ops:
                continue
            ins = region.plan.choices[op.index].strategy.ins
            for i, v in enumerate(op.inputs):
                if isinstance(v, Lit):
                    continue
                if v in producer:
                    p, j = producer[v]
                    if p.index in region.ops:
                        self._link(self.t.op_nodes[p.index], "out", j, ins[i].resolved(),
                                   "spec", 0, v, i)
                elif v in self._first:  # a free input that a searched op reads
                    self._link(("in", v), "spec", 0, ins[i].resolved(), "spec", 0, v, i)

    def _charge(self, node: int, cost: np.ndarray) -> None:
        self._extra[node] = self._extra[node] + cost if node in self._extra else cost

    def charge_fixed_input(self, op, i: int, spec: Spec) -> None:
        self._link(spec, "spec", 0, self.t.op_nodes[op.index], "in", i, op.inputs[i], i)

    def charge_fixed_output(self, prod, spec: Spec) -> None:
        op, j = prod
        self._link(self.t.op_nodes[op.index], "out", j, spec, "spec", 0, op.outputs[j], -1)

    def finish(self) -> Tables:
        """The free inputs' nodes, the edges, and each node's cost and memory times its
        members plus its charges."""
        t = self.t
        for v in self._first:
            t.input_nodes[v] = self._input_node(v)
        for op, node in self._splits:
            self._split_results(op, node)
        for op, node in self._scatters:
            self._scatter_node(op, node)
        if self.returned is not None:
            self.returned_copies(*self.returned)
        scaled: dict[tuple, np.ndarray] = {}
        merged: dict[tuple, list] = {}  # links with one key (one matrix between the same
                                        # two nodes' ports) become one, times their number,
                                        # where the first was made
        for (u, src_side, j, w, dst_side, i, v, port), at in zip(self._links, self._at,
                                                                 strict=True):
            u, w = (t.input_nodes[x[1]] if isinstance(x, tuple) else x for x in (u, w))
            key = (u, src_side, j, w, dst_side, i, self.graph.values[v].nbytes, self.share(v),
                   v in self.splats)
            hit = merged.get(key)
            if hit is None:
                merged[key] = [(u, src_side, j, w, dst_side, i, v, port), 1, at]
            else:
                hit[1] += 1
                hit[2] = min(hit[2], at)
        links = list(merged.values())
        if self._op_links:  # (their keys are no other link's: both ends are op nodes)
            links += [[link, k, at] for at, link, k in self._op_links]
            links.sort(key=lambda m: m[2])  # in the order they were made (a stable sort)
        for (u, src_side, j, w, dst_side, i, v, port), k, _ in links:
            src, row = self._end(u, src_side, j)
            dst, col = self._end(w, dst_side, i)
            cost = self._matrix(v, src, dst)
            if isinstance(u, Spec):  # from a fixed spec: charged to the reader
                self._charge(w, k * cost[0][col])
            elif isinstance(w, Spec):  # into a fixed spec: charged to the producer
                self._charge(u, k * cost[:, 0][row])
            elif u == w:  # both ends in one node: they take one candidate
                self._charge(u, k * cost[row, col])
            else:
                if k > 1:
                    cost = scaled.setdefault((id(cost), k), k * cost)
                t.edges.append(Edge(u, w, cost, row, col, port))
        for node, k in enumerate(self._count):
            if k > 1:
                t.node_cost[node] = k * t.node_cost[node]
                t.node_mem[node] = k * t.node_mem[node]
        for node, extra in self._extra.items():
            t.node_cost[node] = t.node_cost[node] + extra
        if self.classes is not None and self.fold:
            t.count = list(self._count)
        else:
            groups: dict[int, list[int]] = {}
            for node, first in self._group.items():
                groups.setdefault(first, []).append(node)
            t.tied = tuple(tuple(g) for g in groups.values() if len(g) > 1)
        return t


def made_by(graph: OpGraph) -> dict[int, tuple]:
    """value -> (the op that makes it, its result index): the graph's map, worked out once
    per graph (_OpEdges) and shared by every caller."""
    return _OpEdges.of(graph).made_by


def touching_edges(t: Tables) -> dict[int, list[Edge]]:
    """node -> the edges it is an end of."""
    out: dict[int, list[Edge]] = {}
    for e in t.edges:
        out.setdefault(e.u, []).append(e)
        out.setdefault(e.v, []).append(e)
    return out


def local_costs(t: Tables, choice: np.ndarray, node: int, touching: Sequence[Edge]
                ) -> np.ndarray:
    """Cost of each candidate of `node` with every other node kept at its choice
    (`touching`: its edges)."""
    cost = t.node_cost[node].copy()
    for e in touching:
        if e.u == node:
            cost += e.cost[e.row, e.col[choice[e.v]]]
        elif e.v == node:
            cost += e.cost[e.row[choice[e.u]], e.col]
    return cost
