"""Tracing and the op graph: inlined calls, region ops, parameter paths."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.ir import Lit, build_graph, trace
from jaxpar.ir.graph import scan_counts


def names(graph):
    return [op.name for op in graph.ops]


def test_nested_calls_are_inlined():
    @jax.custom_jvp
    def softplus(x):
        return jnp.log1p(jnp.exp(x))

    softplus.defjvp(lambda p, t: (softplus(p[0]), jax.nn.sigmoid(p[0]) * t[0]))

    @jax.custom_vjp
    def double(x):
        return 2 * x

    double.defvjp(lambda x: (2 * x, None), lambda _, g: (2 * g,))

    def f(x):
        y = jax.jit(lambda a: a + 1)(x)
        y = jax.checkpoint(jnp.tanh)(y)
        return softplus(y) + double(y)

    traced = trace(f, (jnp.ones((4, 2)),))
    top = [e.primitive.name for e in traced.closed_jaxpr.jaxpr.eqns]
    assert {"jit", "remat2", "custom_jvp_call", "custom_vjp_call"} <= set(top)
    graph = build_graph(traced.closed_jaxpr, traced.in_paths)
    assert not {"jit", "remat2", "custom_jvp_call", "custom_vjp_call"} & set(names(graph))
    assert {"add", "tanh", "exp", "log1p", "mul"} <= set(names(graph))
    # def-use edges: every op input is a graph input, a constant, a literal or an earlier output
    made = set(graph.inputs) | set(graph.consts)
    for op in graph.ops:
        assert all(isinstance(v, Lit) or v in made for v in op.inputs)
        made |= set(op.outputs)


def test_an_inner_jit_keeps_the_constants_it_closes_over():
    """jax 0.11 merged ClosedJaxpr into Jaxpr (a body carries its constants); wrapped again
    with none, an inner jit's constant became an operand with no value ("zip() argument 2 is
    shorter than argument 1"): jaxpar.shard(jax.jit(f)) over a closure failed."""
    import jaxpar

    w = jnp.asarray(np.arange(32 * 8).reshape(32, 8) / 256.0, jnp.float32)
    scale = jax.jit(lambda x: x * jnp.arange(1.0, 9.0))  # a constant array inside the jit
    g = jax.jit(lambda x: scale(jnp.tanh(x @ w)))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 32)), jnp.float32)
    graph = build_graph(trace(g, (x,)).closed_jaxpr)
    assert "jit" not in names(graph) and len(graph.consts) >= 1
    np.testing.assert_allclose(jaxpar.shard(g)(x), g(x), rtol=1e-5)


def test_regions_keep_their_bodies_once():
    def f(x, ws):
        x = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]
        x = jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x)
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x))[1]

    graph = build_graph(trace(f, (jnp.ones((4, 8)), jnp.ones((16, 8, 8)))).closed_jaxpr)
    regions = {op.name: op for op in graph.ops if op.regions}
    assert set(regions) == {"scan", "cond", "while"}
    scan_body = regions["scan"].regions[0]
    assert [op.name for op in scan_body.ops] == ["dot_general", "tanh"]  # once, not 16 times
    assert len(regions["cond"].regions) == 2 and len(regions["while"].regions) == 2
    paths = [p for p, _ in graph.walk()]
    assert any(len(p) == 3 for p in paths)  # (region op, region, op) paths reach the bodies


def test_scan_counts_read_both_jax_conventions():
    # jax 0.10 names a scan's leading inputs in params; jax 0.11 keeps a flat tree of the
    # inputs (consts, carries, xs) whose groups count their leaves with len().
    class Group(tuple):
        def unpack(self):
            return tuple(self)
    assert scan_counts({"num_consts": 2, "num_carry": 3}) == (2, 3)
    assert scan_counts({"ft_in": Group(((None, None), (None,) * 3, (None,)))}) == (2, 3)
    # and on the installed jax, whichever convention it has:
    f = lambda c, xs: jax.lax.scan(lambda c, x: (c + x, c), c, xs)  # noqa: E731
    graph = build_graph(trace(f, (jnp.ones(3), jnp.ones((5, 3)))).closed_jaxpr)
    assert scan_counts(graph.ops[-1].params) == (0, 1)


def test_parameter_paths_name_pytree_leaves():
    params = {"blocks": [{"wqkv": jnp.ones((4, 12))}, {"wqkv": jnp.ones((4, 12))}],
              "head": jnp.ones((4, 2))}

    def f(params, x):
        return x @ params["blocks"][0]["wqkv"]

    traced = trace(f, (params, jnp.ones((3, 4))))
    assert traced.in_paths == ("params/blocks/0/wqkv", "params/blocks/1/wqkv", "params/head", "x")
    graph = build_graph(traced.closed_jaxpr, traced.in_paths)
    assert [graph.values[v].name for v in graph.inputs] == list(traced.in_paths)


class _Box:  # a pytree registered without keys: its leaves' paths are FlattenedIndexKeys
    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_node(_Box, lambda b: ((b.a, b.b), None),
                                   lambda _, children: _Box(*children))


def test_pytrees_registered_without_keys_name_leaves_by_position():
    # jax 0.10's FlattenedIndexKey holds .key, not .idx: tracing raised AttributeError.
    traced = trace(lambda box, x: box.a * x + box.b, (_Box(jnp.ones(4), jnp.ones(4)),
                                                      jnp.ones(4)))
    assert traced.in_paths == ("box/0", "box/1", "x")
    partial = jax.tree_util.Partial(lambda w, x: x @ w, jnp.ones((4, 2)))
    assert trace(lambda f, x: f(x), (partial, jnp.ones((3, 4)))).in_paths == ("f/0/0", "x")


def test_flax_nnx_state_paths():
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    _, state = nnx.split(model)

    def f(state, x):
        return x @ state["kernel"][...] + state["bias"][...]

    traced = trace(f, (state, jnp.ones((2, 4))))
    assert traced.in_paths == ("state/bias/value", "state/kernel/value", "x")


def test_shape_dtype_structs_trace_without_data():
    spec = jax.ShapeDtypeStruct((8, 4), jnp.bfloat16)
    traced = trace(lambda x: x * 2, (spec,))
    graph = build_graph(traced.closed_jaxpr)
    assert graph.values[graph.inputs[0]].shape == (8, 4)
    assert graph.values[graph.inputs[0]].dtype == np.dtype(jnp.bfloat16)
    assert traced.fingerprint == trace(lambda x: x * 2, (spec,)).fingerprint
    assert traced.fingerprint != trace(lambda x: x * 3, (spec,)).fingerprint


def test_a_cond_without_matmuls_leaves_the_tail_going_on():
    """The tail (values after a step's last matmul, whose reductions XLA combines) stopped at
    any region op: under optax.apply_if_finite the gradients feed a cond, and their
    all-reduces were each priced a whole latency. A cond with a matmul inside, or a loop,
    still ends it."""
    def step(g, p, ok, heavy):
        scaled = g * 2.0
        update = (lambda: p @ scaled) if heavy else (lambda: p - scaled)
        return jax.lax.cond(ok, update, lambda: p)

    for heavy in (False, True):
        traced = trace(functools.partial(step, heavy=heavy),
                       (jnp.ones((4, 4)), jnp.ones((4, 4)), True))
        graph = build_graph(traced.closed_jaxpr)
        (mul,) = [op for op in graph.ops if op.name == "mul"]
        assert (mul.outputs[0] in graph.tail_values()) is not heavy
