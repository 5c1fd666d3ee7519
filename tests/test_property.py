"""Property test: random programs over the covered primitives, random valid in_strategies.

Each example builds a small program (elementwise ops, dot_general, reductions, broadcasts,
transposes, reshapes, concatenation, slicing, cumulative sums), picks split counts for every
input that the 2 x 2 x 2 mesh can express, and checks jaxpar.shard against unsharded jax.jit.
The examples are derandomized so every CI run checks the same 200 programs.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxpar

MESH = None
UNARY = [jnp.tanh, jnp.exp, jnp.negative, jnp.abs, jnp.sin, jax.nn.relu, jax.nn.sigmoid]
BINARY = [jnp.add, jnp.multiply, jnp.maximum, jnp.subtract, jnp.minimum]
SIZES = (2, 4, 8)


def _mesh():
    global MESH
    MESH = MESH or jaxpar.make_mesh(8)
    return MESH


class _Choices:
    """Drawn integers consumed in order: every program decision comes from here."""

    def __init__(self, values: list[int]):
        self.values, self.i = values, 0

    def pick(self, options):
        value = self.values[self.i % len(self.values)]
        self.i += 1
        return options[value % len(options)]


def _step(c: _Choices, pool):
    """Apply one op chosen by `c` to values in `pool` (a list of arrays)."""
    x = c.pick(pool)
    kind = c.pick(["unary", "binary", "dot", "reduce", "transpose", "reshape", "concat",
                   "slice", "cumsum", "broadcast"])
    same = [y for y in pool if y.shape == x.shape]
    if kind == "unary":
        return c.pick(UNARY)(x)
    if kind == "binary":
        return c.pick(BINARY)(x, c.pick(same))
    if kind == "dot":
        rhs = [y for y in pool if y.ndim == 2 and x.ndim >= 1 and y.shape[0] == x.shape[-1]]
        return x @ c.pick(rhs) / x.shape[-1] if rhs else jnp.tanh(x)
    if kind == "reduce" and x.ndim > 1:
        return jnp.sum(x, axis=c.pick(range(x.ndim)))
    if kind == "transpose" and x.ndim > 1:
        return jnp.swapaxes(x, 0, x.ndim - 1)
    if kind == "reshape" and x.ndim > 1:
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    if kind == "concat":
        return jnp.concatenate([x, c.pick(same)], axis=x.ndim - 1)
    if kind == "slice" and x.shape[-1] > 1:
        return x[..., : x.shape[-1] // 2]
    if kind == "cumsum":
        return jnp.cumsum(x, axis=0)
    if kind == "broadcast" and x.ndim < 3:
        return jnp.broadcast_to(x[None], (2, *x.shape)) * 0.5
    return x * 2.0


def _counts(draw, shape):
    """Split counts per dim (powers of two dividing the dim) whose product the mesh holds."""
    counts, left = [], 8
    for n in shape:
        c = draw(st.sampled_from([c for c in (1, 2, 4, 8) if n % c == 0 and c <= left]))
        counts.append(c)
        left //= c
    return tuple(counts)


@st.composite
def programs(draw):
    shapes = [tuple(draw(st.sampled_from(SIZES)) for _ in range(draw(st.integers(1, 3))))
              for _ in range(draw(st.integers(1, 3)))]
    strategy = tuple(_counts(draw, s) if draw(st.booleans()) else None for s in shapes)
    n_ops = draw(st.integers(1, 5))
    choices = draw(st.lists(st.integers(0, 999), min_size=4 * n_ops, max_size=4 * n_ops))
    return n_ops, choices, shapes, strategy, draw(st.integers(0, 2 ** 16))


def build(n_ops: int, choices: list[int]):
    def fn(*xs):
        c, pool = _Choices(choices), list(xs)
        for _ in range(n_ops):
            pool.append(_step(c, pool))
        return pool[-1]
    return fn


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs())
def test_random_programs_match_jax_jit(program):
    n_ops, choices, shapes, strategy, seed = program
    rng = np.random.default_rng(seed)
    args = tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)
    fn = build(n_ops, choices)
    want = jax.jit(fn)(*args)
    got = jaxpar.shard(fn, in_strategy=strategy, mesh=_mesh())(*args)
    scale = max(1.0, float(np.max(np.abs(np.asarray(want)))) if want.size else 1.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4,
                               atol=1e-4 * scale * math.sqrt(max(1, want.size)))
