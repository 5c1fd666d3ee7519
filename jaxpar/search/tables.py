"""OpGraph -> cost tables for the exact search: one node per op and per free input.

Before: an OpGraph, the specs the user fixed, a CostModel. After: `Tables`, holding a solver
`Problem` (node costs, edge cost matrices, per-node memory) and what each node and candidate
stands for, so a solution maps back to a GraphPlan.

Edge costs depend only on the producer's output spec and the consumer's input spec, and a tensor
has far fewer distinct specs than its ops have strategies, so every edge is priced over spec
*classes*: `row[s]` / `col[t]` give the class of producer candidate s / consumer candidate t.
Fixed inputs are no nodes: resharding from their spec is added to their consumers' node costs,
and resharding into a fixed output spec to its producer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxpar.cost.model import CostModel, nbytes
from jaxpar.ir.graph import Lit, OpGraph
from jaxpar.rules.registry import OpInfo
from jaxpar.search.regions import plan_region
from jaxpar.spec import Spec


@dataclass
class Edge:
    """Consumer node `v` reads a value made by node `u`; cost[row[s], col[t]]."""

    u: int
    v: int
    cost: np.ndarray
    row: np.ndarray
    col: np.ndarray


@dataclass
class Tables:
    """Everything the exact search needs, and how to read its answer back."""

    op_nodes: dict[int, int] = field(default_factory=dict)     # op index -> node
    input_nodes: dict[int, int] = field(default_factory=dict)  # free value id -> node
    cands: list[list] = field(default_factory=list)   # OpStrategy (ops) or Spec (inputs)
    node_cost: list[np.ndarray] = field(default_factory=list)
    node_mem: list[np.ndarray] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    regions: dict[int, tuple] = field(default_factory=dict)    # op index -> (plans, trips)


def build_tables(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
                 fixed_out: dict[int, Spec], ties: tuple[tuple[int, int], ...] = ()) -> Tables:
    """ties: (free input value, output position) pairs of carried state: the output is handed
    back in the input's spec, so the resharding from its producer into that spec is an edge
    between the producer and the input node, priced with everything else."""
    t = Tables()
    for op in graph.ops:
        t.op_nodes[op.index] = _add_op(t, graph, model, op)
    producer = {v: (op, j) for op in graph.ops for j, v in enumerate(op.outputs)}
    for op in graph.ops:
        for i, v in enumerate(op.inputs):
            if isinstance(v, Lit):
                continue
            if v in fixed_in:
                _charge_fixed_input(t, graph, model, op, i, fixed_in[v])
            elif v in producer:
                _add_edge(t, graph, model, producer[v], (op, i))
            else:
                _add_input_edge(t, graph, model, v, op, i)
    for pos, spec in fixed_out.items():
        v = graph.outputs[pos]
        if isinstance(v, int) and v in producer:
            _charge_fixed_output(t, graph, model, producer[v], spec)
    for v_in, pos in ties:
        v = graph.outputs[pos]
        if v_in not in fixed_in and pos not in fixed_out and isinstance(v, int) and \
                v in producer:
            _add_tie(t, graph, model, v_in, producer[v])
    return t


def _add_tie(t: Tables, graph, model, v_in: int, prod) -> None:
    op, j = prod
    u = t.op_nodes[op.index]
    src, row = _classes([s.outs[j] for s in t.cands[u]])
    if v_in not in t.input_nodes:  # read by no op: any spec the output can come in
        info = graph.values[v_in]
        t.input_nodes[v_in] = _add_node(t, list(src), np.zeros(len(src)),
                                        [info.nbytes / s.shards(model.mesh) for s in src])
    w = t.input_nodes[v_in]
    dst, col = _classes(t.cands[w])
    t.edges.append(Edge(u, w, _matrix(model, graph, op.outputs[j], src, dst), row, col))


def _add_node(t: Tables, cands: list, cost, mem) -> int:
    t.cands.append(cands)
    t.node_cost.append(np.asarray(cost, dtype=float))
    t.node_mem.append(np.asarray(mem, dtype=float))
    return len(t.cands) - 1


def _add_op(t: Tables, graph: OpGraph, model: CostModel, op) -> int:
    info = OpInfo.of(op, graph)
    if op.regions:  # bodies planned by propagation from free operands; one candidate
        s, plans, cost, trips = plan_region(op, info, [None] * len(op.inputs), model)
        t.regions[op.index] = (plans, trips, cost)
        return _add_node(t, [s], [model.score(cost)], [cost.memory_bytes])
    cands, own = model.options(info, graph.op_latency_share(op))
    costs = [model.score(c) for c in own]
    # Memory a node holds: its results, per device (operands belong to their producers).
    mem = [sum(nbytes(sh, dt) / sp.shards(model.mesh) for sh, dt, sp in
               zip(info.out_shapes, info.out_dtypes, s.outs, strict=True)) for s in cands]
    return _add_node(t, cands, costs, mem)


def _classes(specs: list[Spec]) -> tuple[list[Spec], np.ndarray]:
    distinct: dict[Spec, int] = {}
    idx = [distinct.setdefault(s.resolved(), len(distinct)) for s in specs]
    return list(distinct), np.asarray(idx)


def _matrix(model: CostModel, graph: OpGraph, v: int, src: list[Spec], dst: list[Spec]):
    info, share = graph.values[v], graph.latency_share(v)
    return np.array([[model.score(model.reshard(a, b, info.shape, info.dtype, share))
                      for b in dst] for a in src])


def _add_edge(t: Tables, graph, model, prod, cons) -> None:
    (pop, j), (cop, i) = prod, cons
    u, w = t.op_nodes[pop.index], t.op_nodes[cop.index]
    src, row = _classes([s.outs[j] for s in t.cands[u]])
    dst, col = _classes([s.ins[i] for s in t.cands[w]])
    t.edges.append(Edge(u, w, _matrix(model, graph, cop.inputs[i], src, dst), row, col))


def _add_input_edge(t: Tables, graph, model, v: int, op, i: int) -> None:
    w = t.op_nodes[op.index]
    dst, col = _classes([s.ins[i] for s in t.cands[w]])
    if v not in t.input_nodes:  # a free input (or constant) takes any spec a consumer needs
        info = graph.values[v]
        mem = [info.nbytes / s.shards(model.mesh) for s in dst]
        t.input_nodes[v] = _add_node(t, list(dst), np.zeros(len(dst)), mem)
    u = t.input_nodes[v]
    src, row = _classes(t.cands[u])
    t.edges.append(Edge(u, w, _matrix(model, graph, v, src, dst), row, col))


def _charge_fixed_input(t: Tables, graph, model, op, i: int, spec: Spec) -> None:
    w = t.op_nodes[op.index]
    dst, col = _classes([s.ins[i] for s in t.cands[w]])
    t.node_cost[w] = t.node_cost[w] + _matrix(model, graph, op.inputs[i], [spec], dst)[0][col]


def _charge_fixed_output(t: Tables, graph, model, prod, spec: Spec) -> None:
    op, j = prod
    u = t.op_nodes[op.index]
    src, row = _classes([s.outs[j] for s in t.cands[u]])
    t.node_cost[u] = t.node_cost[u] + _matrix(model, graph, op.outputs[j], src, [spec])[:, 0][row]

