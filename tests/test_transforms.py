"""jaxpar.shard functions inside JAX transformations: values fn closes over that the caller
differentiates or batches, arrays placed elsewhere under jax.vmap, keyword arguments and
meshes set by the caller, donated arrays. Each checked against jax.jit."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar

MODES = ["sharding_propagation", "dynamic_programming", "recursive_programming"]
X = jnp.zeros((8, 16)).at[:4].set(1.0)  # half the rows 0: relu at exactly 0 below
W = jnp.ones((16, 8))


@jax.custom_vjp
def clip_gradient(x):
    return x


clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))


@jax.custom_vjp
def ste_round(x):  # a straight-through estimator (quantization-aware training)
    return jnp.round(x)


ste_round.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))

BODIES = {
    "custom_vjp clip": lambda x, w: jnp.sum(3.0 * clip_gradient(x @ w)),
    "custom_jvp relu at 0": lambda x, w: jnp.sum(jax.nn.relu(x @ w - x @ jnp.ones((16, 8)))
                                                 + x @ w),
    "custom_vjp round": lambda x, w: jnp.sum(ste_round(x @ w * 0.3) ** 2),
}


def close(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("mode", MODES)
def test_a_differentiated_value_fn_closes_over_keeps_custom_derivatives(mode, body):
    """fn closing over the value the caller differentiates, with concrete arguments: the call
    took the direct path, whose program had no custom rule, and jax.grad got the primal's
    derivative (a clip's identity: 1536 where 51.2; relu's at 0; round's 0), silently."""
    def outer(wrap, w):
        return wrap(lambda x: BODIES[body](x, w))(X)

    close(jax.grad(lambda w: outer(lambda f: jaxpar.shard(f, search_mode=mode), w))(W),
          jax.grad(lambda w: outer(jax.jit, w))(W))


@pytest.mark.parametrize("mode", MODES)
def test_a_value_fn_closes_over_is_batched_and_differentiated_as_under_jit(mode):
    relu, ws = BODIES["custom_jvp relu at 0"], jnp.stack([W, -W])
    for transform in (lambda f: jax.jvp(f, (W,), (W,)), lambda f: jax.vmap(f)(ws),
                      lambda f: jax.vmap(jax.grad(f))(ws), lambda f: jax.jit(jax.grad(f))(W)):
        close(transform(lambda w: jaxpar.shard(lambda x: relu(x, w), search_mode=mode)(X)),
              transform(lambda w: jax.jit(lambda x: relu(x, w))(X)))


@pytest.mark.parametrize("mode", MODES)
def test_a_differentiated_value_fn_closes_over_beside_traced_arguments(mode):
    """The same with an argument traced too: the traced program, wrapped in its custom rule,
    held the caller's tracer as a constant ("No constant handler for type
    LinearizeTracer")."""
    body = BODIES["custom_vjp clip"]

    def outer(wrap, w):
        return wrap(lambda x: body(x, w))(X * jnp.ones(()) + 0 * jnp.sum(w))

    want = jax.grad(lambda w: outer(jax.jit, w))(W)
    close(jax.grad(lambda w: outer(lambda f: jaxpar.shard(f, search_mode=mode), w))(W), want)
    w_on_one = jax.device_put(W, jax.devices()[3])  # moved onto the mesh as arguments are
    close(jax.grad(lambda w: outer(jaxpar.shard, w))(w_on_one), want)


def _update(w, x):
    return w - 0.1 * (x.T @ jnp.tanh(x @ w))


@pytest.mark.parametrize("mode", MODES)
def test_vmap_moves_arrays_committed_to_one_device_onto_the_mesh(mode):
    """jax.vmap over arrays committed to one device failed inside JAX (devices [0] against
    the plan's eight): batched tracers were passed on unmoved."""
    f = jaxpar.shard(_update, search_mode=mode)
    ws, xs = jnp.stack([W, 2 * W]), jnp.stack([X, X + 1.0])
    on_one = [jax.device_put(a, jax.devices()[0]) for a in (ws, xs)]
    close(jax.vmap(f)(*on_one), jax.vmap(jax.jit(_update))(ws, xs))
    close(jax.vmap(f, in_axes=(None, 0))(W, on_one[1]),
          jax.vmap(jax.jit(_update), in_axes=(None, 0))(W, xs))
    close(jax.vmap(jax.grad(lambda w, x: jnp.sum(f(w, x))))(*on_one),
          jax.vmap(jax.grad(lambda w, x: jnp.sum(_update(w, x))))(ws, xs))


@pytest.mark.parametrize("set_mesh", [False, True])
@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_vmap_moves_arrays_placed_on_another_mesh_onto_the_plans(axis_type, set_mesh):
    """Arrays on jax.make_mesh's Explicit axes under jax.vmap, with or without the caller's
    jax.set_mesh over that mesh: "Resource axis: a ... not found in mesh (d0, d1, d2)". A
    mapped dim cut on such an axis cannot be moved (vmap lays it out on that axis in every
    op): it is refused in words."""
    f = jaxpar.shard(_update)
    xs = jnp.stack([X, X + 1.0])
    want = jax.vmap(jax.jit(_update), in_axes=(None, 0))(W, xs)
    theirs = jax.make_mesh((4, 2), ("a", "b"), axis_types=(getattr(AxisType, axis_type),) * 2)
    with jax.set_mesh(theirs) if set_mesh else contextlib.nullcontext():
        for spec in (P(None, "a"), P()):
            placed = jax.device_put(xs, NamedSharding(theirs, spec))
            close(jax.vmap(f, in_axes=(None, 0))(W, placed), want)
        cut = jax.device_put(xs, NamedSharding(theirs, P("b")))
        if axis_type == "Auto":
            close(jax.vmap(f, in_axes=(None, 0))(W, cut), want)
            return
        with pytest.raises(ValueError, match=r"jax.vmap over a dim laid out on the Explicit "
                           r"mesh axes \['b'\].*jaxpar.shard\(jax.vmap\(fn\)\)"):
            jax.vmap(f, in_axes=(None, 0))(W, cut)


@pytest.mark.parametrize("mode", MODES)
def test_keyword_arguments_under_a_callers_set_mesh_are_typed_as_positional_ones(mode):
    """Under jax.set_mesh over another (Explicit) mesh, a gradient taken through a keyword
    argument came back typed on the plan's mesh, and the caller's next op refused it
    ("context mesh ... should match the aval mesh"): only positional arguments were typed on
    the caller's mesh first."""
    def loss(x, w, b):
        return jnp.sum(jnp.tanh(x @ w + b) ** 2)

    f, b = jaxpar.shard(loss, search_mode=mode), jnp.ones((8,))
    want = 2.0 * jax.grad(loss, argnums=1)(X, W, b)
    with jax.set_mesh(jax.make_mesh((2, 4), ("a", "b"))):
        for call in (lambda w: f(X, w, b), lambda w: f(X, w=w, b=b)):
            close(jax.jit(lambda w, call=call: jax.grad(call)(w) * 2.0)(W), want)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_a_callers_set_mesh_over_the_devices_in_another_order(axis_type):
    """Under jax.set_mesh over the plan's devices in another order a direct call failed
    inside JAX (jit's context mesh [7, ..., 0] against the arguments' [0, ..., 7]): only the
    axes were switched. It now runs on the plan's mesh; inside a transformation, where JAX
    cannot switch devices, it is refused in words before anything is traced."""
    def fn(x, w):
        return jnp.sum(jnp.tanh(x @ w))

    f = jaxpar.shard(fn)
    theirs = jax.make_mesh((4, 2), ("a", "b"), devices=jax.devices()[::-1],
                           axis_types=(getattr(AxisType, axis_type),) * 2)
    with jax.set_mesh(theirs):
        for x in (X, jax.device_put(X, NamedSharding(theirs, P("a")))):
            close(f(x, W), jax.jit(fn)(X, W))
        for transform in (jax.jit, jax.grad):
            with pytest.raises(ValueError, match=r"devices \[0, 1, .*\] called inside a "
                               r"transformation under jax.set_mesh over devices \[7, 6, .*"
                               r"in that order"):
                transform(f)(X, W)


def test_a_donated_array_passed_again_is_refused_in_words():
    """An array donated to a call and passed to the same donating program again crashed the
    process (a segmentation fault inside XLA, as under jax.jit)."""
    def update(params, x):
        return {"w": _update(params["w"], x)}

    f = jaxpar.shard(update, donate_argnums=0)
    first = f({"w": W}, X)
    f(first, X)
    assert first["w"].is_deleted()
    with pytest.raises(RuntimeError, match=r"update\(params/w=\.\.\.\): the array "
                       r"\(float32\[16, 8\]\) has been deleted: it was donated"):
        f(first, X)
