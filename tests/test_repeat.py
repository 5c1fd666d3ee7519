"""op_classes: ops that play the same part in identical layers share a class."""

import jax
import jax.numpy as jnp
import pytest

from jaxpar.ir import Lit, build_graph, trace
from jaxpar.ir.repeat import op_classes, op_signature
from jaxpar.models.gpt import GPTConfig, abstract_train_step


def _mlp(layers: int):
    def f(x, ws):
        for w in ws:
            x = jnp.tanh(x @ w) * 2.0
        return jnp.sum(x)

    args = (jnp.ones((8, 16)), [jnp.ones((16, 16))] * layers)
    return build_graph(trace(f, args).closed_jaxpr)


def _gpt(layers: int):
    step, args = abstract_train_step(GPTConfig(layers=layers, d_model=32, heads=2, vocab=64,
                                               seq=8), 4)
    return build_graph(trace(step, args).closed_jaxpr)


def _reference(graph, rounds: int) -> list[int]:
    """Weisfeiler-Lehman refinement spelled out with tuples (slow, obviously right)."""
    producer = {v: (op.index, j) for op in graph.ops for j, v in enumerate(op.outputs)}
    users = graph.users()
    outputs = {v for v in graph.outputs if isinstance(v, int)}
    colour = [op_signature(op, graph) for op in graph.ops]

    def source(v):
        if isinstance(v, Lit):
            return ("lit", v.shape, str(v.dtype), repr(v.value))
        if v in producer:
            return (colour[producer[v][0]], producer[v][1])
        kind = "input" if v in graph.inputs else "const"
        return (kind, graph.shape(v), str(graph.dtype(v)) if kind == "input" else "")

    def renumber(colours):
        numbering: dict = {}
        return [numbering.setdefault(c, len(numbering)) for c in colours]

    colour = renumber(colour)
    for _ in range(rounds):
        colour = renumber([(colour[op.index], tuple(source(v) for v in op.inputs),
                            tuple((tuple(sorted((colour[u.index], i) for u, i in
                                                users.get(v, []))), v in outputs)
                                  for v in op.outputs)) for op in graph.ops])
    return colour


@pytest.mark.parametrize("rounds", [0, 1, 3, 8])
@pytest.mark.parametrize("build", [lambda: _mlp(5), lambda: _gpt(2)], ids=["mlp", "gpt"])
def test_classes_match_the_plain_refinement(build, rounds):
    graph = build()
    assert op_classes(graph, rounds) == _reference(graph, rounds)


def test_middle_layers_share_classes_and_the_count_saturates():
    graph = _mlp(12)
    cls = op_classes(graph, rounds=2)
    per_layer = 3  # dot_general, tanh, mul
    layer = [cls[i * per_layer:(i + 1) * per_layer] for i in range(12)]
    assert all(layer[i] == layer[4] for i in range(3, 9))  # away from the ends: one class each
    assert layer[0] != layer[4] and layer[11] != layer[4]  # the ends are told apart
    assert len(set(layer[4])) == per_layer
    assert len(set(op_classes(_mlp(20), rounds=2))) == len(set(cls))


def test_zero_rounds_is_the_signature_and_literals_tell_ops_apart():
    def f(x):
        return jnp.sum(x * 2.0) + jnp.sum(x * 3.0)

    graph = build_graph(trace(f, (jnp.ones(4),)).closed_jaxpr)
    muls = [op.index for op in graph.ops if op.name == "mul"]
    assert len(muls) == 2
    assert op_classes(graph, 0)[muls[0]] == op_classes(graph, 0)[muls[1]]
    assert op_classes(graph, 1)[muls[0]] != op_classes(graph, 1)[muls[1]]


def test_numbered_in_order_of_first_appearance():
    cls = op_classes(_gpt(2))
    seen = -1
    for c in cls:
        assert c <= seen + 1
        seen = max(seen, c)


def test_empty_graph_has_no_classes():
    graph = build_graph(jax.make_jaxpr(lambda x: x)(jnp.ones(3)))
    assert op_classes(graph) == []


def test_classes_are_remembered_per_graph_and_handed_out_as_copies():
    graph = _mlp(4)
    first = op_classes(graph)
    first[0] = -1  # a caller's edit does not reach the next caller
    again = op_classes(graph)
    assert again[0] != -1 and again == op_classes(graph, 8)
    assert op_classes(graph, 0) == _reference(graph, 0)


def test_rounds_asked_in_turn_of_one_graph_match_the_plain_refinement():
    # the signatures and edges are worked out once per graph and shared by every rounds
    graph = _gpt(2)
    for rounds in (8, 2, 0, 3):
        assert op_classes(graph, rounds) == _reference(graph, rounds)


def test_two_hops_tie_the_end_layers_to_the_rest():
    # eight hops tell apart the layers nearest each end, so a deeper step has more classes;
    # two tie them to the middle ones (what a deep step's solves again tie by, resolve._tying)
    four, six = _gpt(4), _gpt(6)
    assert len(set(op_classes(four, 8))) < len(set(op_classes(six, 8)))
    assert len(set(op_classes(four, 2))) == len(set(op_classes(six, 2)))
