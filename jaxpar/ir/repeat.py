"""Repeated structure in an OpGraph: which ops play the same part in identical layers.

Before: an OpGraph. After: a class number per op. Two ops share a class when they apply the same
primitive with the same params to the same shapes and dtypes, and so do their neighbours out to
`rounds` hops (Weisfeiler-Lehman refinement over the def-use edges: an op's operands in order,
and per result the multiset of (reader, operand position) plus whether it is a program output).
In an unrolled stack of identical layers, the ops of every layer away from the ends fall into
one class per position in the layer, so a search can decide each class once: a deep model costs
about as much to plan as a shallow one. Refinement stops after `rounds` hops on purpose: run to
a fixed point it would tell every layer apart by its distance from the ends.

Colours are 64-bit hashes refined with numpy over edge lists (a multiset hashes as the sum of
its members' hashes), so a round costs a few array passes whatever the depth.
"""

from __future__ import annotations

import numpy as np

from jaxpar.ir.graph import Lit, Op, OpGraph

_ODD = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9),
        np.uint64(0x94D049BB133111EB))


def op_signature(op: Op, graph: OpGraph):
    """A hashable description of what the op computes (not where it sits)."""
    if op.regions:  # bodies are never shared between region ops
        params = ("region", op.index)
    else:
        try:
            params = tuple(sorted(op.params.items()))
            hash(params)
        except TypeError:  # params holding arrays or lists: compare by their text
            params = repr(sorted(op.params.items(), key=lambda kv: kv[0]))
    values = graph.values
    shapes = tuple((values[v].shape, values[v].dtype) if isinstance(v, int) else
                   (v.shape, v.dtype) for v in op.inputs + op.outputs)
    return (op.primitive, params, shapes)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that scatters nearby inputs."""
    x = (x ^ (x >> np.uint64(30))) * _ODD[1]
    x = (x ^ (x >> np.uint64(27))) * _ODD[2]
    return x ^ (x >> np.uint64(31))


def _pair(a: np.ndarray, b) -> np.ndarray:
    """An order-sensitive hash of (a, b)."""
    return _mix(_mix(a) * _ODD[0] + np.asarray(b, dtype=np.uint64))


def _fixed(key) -> int:
    return hash(key) & 0xFFFFFFFFFFFFFFFF


def _source_key(v, graph: OpGraph, inputs: set[int]):
    """What an operand not made by an op looks like: a literal's value, an input's or a
    constant's shape and dtype."""
    if isinstance(v, Lit):
        value = v.value if isinstance(v.value, int | float | bool) else \
            np.asarray(v.value).tobytes()
        return ("lit", v.shape, v.dtype, value)
    kind = "input" if v in inputs else "const"
    return (kind, graph.shape(v), graph.dtype(v) if kind == "input" else "")


class _Edges:
    """Def-use edges as arrays: operand slots (reader, position, producer, port or a fixed
    hash) and the results that are program outputs."""

    def __init__(self, graph: OpGraph):
        producer = {v: (op.index, j) for op in graph.ops for j, v in enumerate(op.outputs)}
        inputs = set(graph.inputs)
        reader, pos, src, port, fixed = [], [], [], [], []
        sources: dict = {}  # a value no op makes -> its fixed hash
        none = (-1, 0)
        for op in graph.ops:
            x = op.index
            for i, v in enumerate(op.inputs):
                p, j = producer.get(v, none) if isinstance(v, int) else none
                reader.append(x)
                pos.append(i)
                src.append(p)
                port.append(j)
                if p >= 0:
                    fixed.append(0)
                    continue
                key = v if isinstance(v, int) else id(v)
                h = sources.get(key)
                if h is None:
                    h = sources[key] = _fixed(_source_key(v, graph, inputs))
                fixed.append(h)
        self.reader, self.pos = np.array(reader, np.int64), np.array(pos, np.uint64)
        self.src, self.port = np.array(src, np.int64), np.array(port, np.uint64)
        self.fixed = np.array(fixed, np.uint64)
        self.made = self.src >= 0
        outputs = {v for v in graph.outputs if isinstance(v, int)}
        out_ops = [(op.index, j) for op in graph.ops for j, v in enumerate(op.outputs)
                   if v in outputs]
        self.out_op = np.array([i for i, _ in out_ops], np.int64)
        self.out_port = np.array([j for _, j in out_ops], np.uint64)


def _refine(colour: np.ndarray, e: _Edges) -> np.ndarray:
    """One Weisfeiler-Lehman round: an op's colour with its operands' and readers'."""
    n = len(colour)
    source = e.fixed.copy()
    source[e.made] = _pair(colour[e.src[e.made]], e.port[e.made])
    operands = np.zeros(n, np.uint64)
    np.add.at(operands, e.reader, _pair(source, e.pos))
    readers = np.zeros(n, np.uint64)  # per result port: the multiset of (reader, position)
    made = np.flatnonzero(e.made)
    np.add.at(readers, e.src[made],
              _pair(_pair(colour[e.reader[made]], e.pos[made]), e.port[made]))
    np.add.at(readers, e.out_op, _pair(np.full(len(e.out_op), 7, np.uint64), e.out_port))
    return _pair(_pair(colour, operands), readers)


ROUNDS = 8  # op_classes' hops by default


def op_classes(graph: OpGraph, rounds: int = ROUNDS) -> list[int]:
    """Class number of each op (by op index), numbered in order of first appearance; see the
    module docstring. Remembered on the graph (the searches ask more than once, and for more
    than one number of rounds: the signatures and edges are worked out once)."""
    memo = graph.__dict__.setdefault("_op_classes", {})
    if rounds not in memo:
        memo[rounds] = _op_classes(graph, rounds)
    return list(memo[rounds])


def _start(graph: OpGraph) -> tuple[np.ndarray, _Edges]:
    """Each op's colour before refinement (its signature's number) and the graph's edges,
    remembered on the graph (as op_classes' answers are: OpGraph is not changed once built)."""
    hit = graph.__dict__.get("_op_colours")
    if hit is None:
        signatures: dict = {}
        colour = np.array([signatures.setdefault(op_signature(op, graph), len(signatures))
                           for op in graph.ops], dtype=np.uint64)
        hit = graph.__dict__["_op_colours"] = (colour, _Edges(graph))
    return hit


def _op_classes(graph: OpGraph, rounds: int) -> list[int]:
    if not graph.ops:
        return []
    colour, edges = _start(graph)
    with np.errstate(over="ignore"):
        for _ in range(rounds):
            colour = _refine(colour, edges)
    _, first, inverse = np.unique(colour, return_index=True, return_inverse=True)
    rank = np.empty(len(first), np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank[inverse.ravel()].tolist()
