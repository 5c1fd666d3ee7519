"""OpGraph -> cost tables for the exact search: one node per op and per free input.

Before: an OpGraph, the specs the user fixed, a CostModel. After: `Tables`, holding what a solver
`Problem` needs (node costs, edge cost matrices, per-node memory) and what each node and candidate
stands for, so a solution maps back to a GraphPlan.

Edge costs depend only on the producer's output spec and the consumer's input spec, and a tensor
has far fewer distinct specs than its ops have strategies, so every edge is priced over spec
*classes*: `row[s]` / `col[t]` give the class of producer candidate s / consumer candidate t.
Fixed inputs are no nodes: resharding from their spec is added to their consumers' node costs,
and resharding into a fixed output spec to its producer's.

Everything is priced once per distinct thing: ops with one signature share one candidate list
(CostModel.options caches it), so their cost vectors, spec classes and the resharding matrices
between them are computed once and shared by identity (a deep model's layers all reuse them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from jaxpar.cost.model import CostModel, nbytes
from jaxpar.ir.graph import Lit, OpGraph
from jaxpar.rules.registry import OpInfo
from jaxpar.search.regions import plan_region
from jaxpar.spec import Spec


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
    regions: dict[int, tuple] = field(default_factory=dict)    # op index -> (plans, trips, cost)
    count: list[int] = field(default_factory=list)  # ops and inputs per node, once folded
                                                    # (exact.fold; empty: one each)


def build_tables(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
                 fixed_out: dict[int, Spec], ties: tuple[tuple[int, int], ...] = (),
                 allow: Allow | None = None) -> Tables:
    """ties: (free input value, output position) pairs of carried state: the output is handed
    back in the input's spec, so the resharding from its producer into that spec is an edge
    between the producer and the input node, priced with everything else. allow: only the
    candidates it keeps become choices (None: all)."""
    b = _Builder(graph, model, allow)
    for op in graph.ops:
        b.t.op_nodes[op.index] = b.op_node(op)
    producer = {v: (op, j) for op in graph.ops for j, v in enumerate(op.outputs)}
    for op in graph.ops:
        for i, v in enumerate(op.inputs):
            if isinstance(v, Lit):
                continue
            if v in fixed_in:
                b.charge_fixed_input(op, i, fixed_in[v])
            elif v in producer:
                b.edge(producer[v], op, i)
            else:
                b.input_edge(v, op, i)
    for pos, spec in fixed_out.items():
        v = graph.outputs[pos]
        if isinstance(v, int) and v in producer:
            b.charge_fixed_output(producer[v], spec)
    for v_in, pos in ties:
        v = graph.outputs[pos]
        if v_in not in fixed_in and pos not in fixed_out and isinstance(v, int) and \
                v in producer:
            b.tie(v_in, producer[v])
    return b.t


def latency_shares(graph: OpGraph) -> Callable[[int], float]:
    """graph.latency_share as a constant-time lookup. It takes two values only (1 outside the
    step's tail, one shared fraction inside), and each call of it counts the outputs anew."""
    tail = graph.tail_values()
    inside = graph.latency_share(next(iter(tail))) if tail else 1.0
    return lambda v: inside if v in tail else 1.0


def _classes(specs) -> tuple[tuple[Spec, ...], np.ndarray]:
    distinct: dict[Spec, int] = {}
    idx = [distinct.setdefault(s.resolved(), len(distinct)) for s in specs]
    return tuple(distinct), np.asarray(idx, dtype=np.int64)


class _Builder:
    """Builds Tables, pricing each distinct candidate list, spec class list and resharding
    matrix once (caches keyed by object identity hold the object, so its id stays valid)."""

    def __init__(self, graph: OpGraph, model: CostModel, allow: Allow | None = None):
        self.graph, self.model, self.t, self.allow = graph, model, Tables(), allow
        self._kept: dict[tuple, tuple] = {}    # (id(list), indices kept) -> (list, costs)
        self._kept_specs: dict[tuple, tuple] = {}  # an input's allowed specs, one object each
        self.share = latency_shares(graph)
        self._nodes: dict[int, tuple] = {}     # id(candidate list) -> (list, cost, mem)
        self._ports: dict[tuple, tuple] = {}   # (id(list), side, i) -> (list, classes)
        self._classes: dict[tuple, tuple] = {}  # distinct specs -> (specs, spec ids)
        self._spec_id: dict[Spec, int] = {}
        self._matrices: dict[tuple, np.ndarray] = {}  # (spec lists' ids, share), bytes -> K
        self._pairs: dict[tuple, tuple] = {}   # (spec id, spec id, share) -> reshard_line
        self._lines: dict[tuple, tuple] = {}   # spec lists' ids, share -> (lists, per byte,
                                               # fixed): every K between them is a line

    def _add_node(self, cands, own, cost: np.ndarray, mem: np.ndarray) -> int:
        t = self.t
        t.cands.append(cands)
        t.own.append(own)
        t.node_cost.append(cost)
        t.node_mem.append(mem)
        return len(t.cands) - 1

    def op_node(self, op) -> int:
        graph, model = self.graph, self.model
        info = OpInfo.of(op, graph)
        share = max((self.share(v) for v in op.outputs), default=1.0)
        if op.regions:  # bodies planned by propagation from free operands; one candidate
            s, plans, cost, trips = plan_region(op, info, [None] * len(op.inputs), model)
            self.t.regions[op.index] = (plans, trips, cost)
            return self._add_node([s], [cost], np.array([model.score(cost)]),
                                  np.array([float(cost.memory_bytes)]))
        cands, own = model.options(info, share)
        if self.allow is not None:
            cands, own = self._subset(cands, own, self.allow.op(op.index, cands))
        hit = self._nodes.get(id(cands))
        if hit is None:
            # Memory a node holds: its results, per device (operands belong to their producers).
            mem = [sum(nbytes(sh, dt) / sp.shards(model.mesh) for sh, dt, sp in
                       zip(info.out_shapes, info.out_dtypes, s.outs, strict=True)) for s in cands]
            hit = self._nodes[id(cands)] = (cands, np.array([model.score(c) for c in own]),
                                            np.array(mem, dtype=float))
        return self._add_node(cands, own, hit[1], hit[2])

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

    def _input_node(self, v: int, specs: tuple[Spec, ...]) -> int:
        """A free input (or constant) that takes any of `specs`."""
        if self.allow is not None:  # one object per distinct tuple: inputs alike stay alike
            specs = self.allow.specs(v, specs)
            specs = self._kept_specs.setdefault(specs, specs)
        size = self.graph.values[v].nbytes
        mem = np.array([size / s.shards(self.model.mesh) for s in specs], dtype=float)
        return self._add_node(specs, None, np.zeros(len(specs)), mem)

    def _intern(self, specs: tuple[Spec, ...]) -> tuple[tuple[Spec, ...], list[int]]:
        hit = self._classes.get(specs)
        if hit is None:
            ids = [self._spec_id.setdefault(s, len(self._spec_id)) for s in specs]
            hit = self._classes[specs] = (specs, ids)
        return hit

    def _port(self, node: int, side: str, i: int) -> tuple[tuple, np.ndarray]:
        """(distinct specs with their ids, class per candidate) of node's operand i ("in"),
        result i ("out") or own spec ("spec")."""
        cands = self.t.cands[node]
        key = (id(cands), side, i)
        hit = self._ports.get(key)
        if hit is None:
            specs = cands if side == "spec" else [s.ins[i] if side == "in" else s.outs[i]
                                                  for s in cands]
            distinct, idx = _classes(specs)
            hit = self._ports[key] = (cands, self._intern(distinct), idx)
        return hit[1], hit[2]

    def _matrix(self, v: int, src: tuple, dst: tuple) -> np.ndarray:
        """K[p, q]: the score of resharding value v from src's p-th spec to dst's q-th: a
        line in v's bytes (CostModel.reshard_line), priced once per spec lists and share."""
        share, size = self.share(v), self.graph.values[v].nbytes
        lists = (id(src[0]), id(dst[0]), share)
        hit = self._matrices.get((lists, size))
        if hit is None:
            lines = self._lines.get(lists)
            if lines is None:
                pairs = np.array([[self._line(a, b, share) for b in zip(*dst, strict=True)]
                                  for a in zip(*src, strict=True)],
                                 dtype=float).reshape(len(src[0]), len(dst[0]), 2)
                lines = self._lines[lists] = (src, dst, pairs[..., 0], pairs[..., 1])
            hit = self._matrices[(lists, size)] = lines[2] * size + lines[3]
        return hit

    def _line(self, a: tuple[Spec, int], b: tuple[Spec, int], share: float) -> tuple:
        """CostModel.reshard_line of (spec, id) a to b, remembered by the ids."""
        key = (a[1], b[1], share)
        hit = self._pairs.get(key)
        if hit is None:
            hit = self._pairs[key] = self.model.reshard_line(a[0], b[0], share)
        return hit

    def _link(self, u: int, src_side: str, j: int, w: int, dst_side: str, i: int, v: int,
              port: int) -> None:
        src, row = self._port(u, src_side, j)
        dst, col = self._port(w, dst_side, i)
        self.t.edges.append(Edge(u, w, self._matrix(v, src, dst), row, col, port))

    def edge(self, prod, cop, i: int) -> None:
        pop, j = prod
        self._link(self.t.op_nodes[pop.index], "out", j, self.t.op_nodes[cop.index], "in", i,
                   cop.inputs[i], i)

    def input_edge(self, v: int, op, i: int) -> None:
        w = self.t.op_nodes[op.index]
        if v not in self.t.input_nodes:  # a free input takes any spec its first consumer reads
            self.t.input_nodes[v] = self._input_node(v, self._port(w, "in", i)[0][0])
        self._link(self.t.input_nodes[v], "spec", 0, w, "in", i, v, i)

    def tie(self, v_in: int, prod) -> None:
        op, j = prod
        u = self.t.op_nodes[op.index]
        if v_in not in self.t.input_nodes:  # read by no op: any spec the output can come in
            self.t.input_nodes[v_in] = self._input_node(v_in, self._port(u, "out", j)[0][0])
        self._link(u, "out", j, self.t.input_nodes[v_in], "spec", 0, op.outputs[j], -1)

    def charge_fixed_input(self, op, i: int, spec: Spec) -> None:
        w = self.t.op_nodes[op.index]
        dst, col = self._port(w, "in", i)
        k = self._matrix(op.inputs[i], self._intern((spec,)), dst)
        self.t.node_cost[w] = self.t.node_cost[w] + k[0][col]

    def charge_fixed_output(self, prod, spec: Spec) -> None:
        op, j = prod
        u = self.t.op_nodes[op.index]
        src, row = self._port(u, "out", j)
        k = self._matrix(op.outputs[j], src, self._intern((spec,)))
        self.t.node_cost[u] = self.t.node_cost[u] + k[:, 0][row]
