"""Repeated structure in an OpGraph: which ops play the same part in identical layers.

Before: an OpGraph. After: a class number per op. Two ops share a class when they apply the same
primitive with the same params to the same shapes and dtypes, and so do their neighbours out to
`rounds` hops (Weisfeiler-Lehman refinement over the def-use edges). In an unrolled stack of
identical layers, the ops of every layer away from the ends fall into one class per position in
the layer, so a search can decide each class once: a deep model costs about as much to plan as
a shallow one. Refinement stops after `rounds` hops on purpose: run to a fixed point it would
tell every layer apart by its distance from the ends.
"""

from __future__ import annotations

from jaxpar.ir.graph import Lit, Op, OpGraph


def op_signature(op: Op, graph: OpGraph):
    """A hashable description of what the op computes (not where it sits)."""
    try:
        params = tuple(sorted(op.params.items()))
        hash(params)
    except TypeError:  # params holding arrays or lists: compare by their text
        params = repr(sorted(op.params.items(), key=lambda kv: kv[0]))
    if op.regions:  # bodies are never shared between region ops
        params = ("region", op.index)
    shapes = tuple((graph.shape(v), str(graph.dtype(v))) for v in op.inputs + op.outputs)
    return (op.name, params, shapes)


def op_classes(graph: OpGraph, rounds: int = 8) -> list[int]:
    """Class number of each op (by op index); see the module docstring."""
    colour = [hash(op_signature(op, graph)) for op in graph.ops]
    producer = {v: (op.index, j) for op in graph.ops for j, v in enumerate(op.outputs)}
    users = graph.users()
    fixed_in = {v: hash(("input", graph.shape(v), str(graph.dtype(v)))) for v in graph.inputs}
    outputs = {v for v in graph.outputs if isinstance(v, int)}

    def source(v) -> int:
        if isinstance(v, Lit):
            return hash(("lit", repr(v.value)))
        if v in producer:
            i, j = producer[v]
            return hash((colour[i], j))
        return fixed_in.get(v, hash(("const", graph.shape(v))))

    for _ in range(rounds):
        colour = [hash((colour[op.index],
                        tuple(source(v) for v in op.inputs),
                        tuple(tuple(sorted((colour[u.index], i) for u, i in users.get(v, [])))
                              + (v in outputs,) for v in op.outputs)))
                  for op in graph.ops]
    numbering: dict[int, int] = {}
    return [numbering.setdefault(c, len(numbering)) for c in colour]
