"""A jax.shard_map inside the user's function (rules/manual.py, cost/manual.py): planned in its
own specs, priced by its body's collectives, and the program still computes what jit does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.cost.manual import body_work

MODES = ["sharding_propagation", "recursive_programming", "dynamic_programming"]


def _every_collective(mesh):
    def inner(xb, w):
        # y varies along d0 alone: jax 0.11 refuses a pmax over d1 until pcast says it varies
        y = xb @ w
        return (jax.lax.psum(y, "d0"), jax.lax.all_gather(y, "d1", axis=0, tiled=True),
                jax.lax.ppermute(y, "d2", [(0, 1), (1, 0)]),
                jax.lax.psum_scatter(y, "d1", scatter_dimension=0, tiled=True),
                jax.lax.pmax(jax.lax.pcast(y, "d1", to="varying"), ("d0", "d1")),
                jax.lax.all_to_all(y, "d2", 0, 1, tiled=True))

    def f(x, w):
        return jax.shard_map(inner, mesh=mesh, in_specs=(P("d0", None), P()),
                             out_specs=(P(), P(("d0", "d1")), P(("d0", "d2")), P(("d0", "d1")),
                                        P(), P(("d0", "d2"))))(x, w)
    return f


def _data():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((16, 32)), jnp.float32),
            jnp.asarray(rng.standard_normal((32, 8)), jnp.float32))


def _check(f, sf, *args):
    for g, r in zip(jax.tree_util.tree_leaves(sf(*args)), jax.tree_util.tree_leaves(f(*args)),
                    strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_a_shard_map_is_planned_in_its_specs_and_its_collectives_predicted(mode):
    """It was planned replicated: its operand gathered for nothing, its results gathered
    after it, and the collectives its body runs left out of the prediction (0 bytes planned,
    1,536 moved)."""
    mesh = jaxpar.make_mesh(8)
    f = _every_collective(mesh)
    x, w = _data()
    sf = jaxpar.shard(f, mesh=mesh, search_mode=mode)
    _check(jax.jit(f), sf, x, w)
    plan = sf.plan(x, w)
    assert plan.graph_plan.choices[0].strategy.name == "shard_map's specs"
    assert plan.flat_out_specs[1].to_pspec() == P(("d0", "d1"))  # its out_spec: nothing gathered
    check = plan.verify(sf.lower(x, w).compile())
    assert check.ok, str(check)
    assert check.predicted == check.measured  # each kind, exactly
    assert set(check.predicted) == {"all-reduce", "all-gather", "reduce-scatter",
                                    "collective-permute", "all-to-all"}


@pytest.mark.parametrize("mode", MODES)
def test_a_training_step_through_a_shard_map_matches_jit(mode):
    """A hand-written data parallel loss (shard_map, psum of the local losses) under
    jax.grad: its transpose is a second shard_map, and the plan around both predicts what the
    compiled step moves."""
    mesh = jaxpar.make_mesh(8)

    def local_loss(xb, w):
        return jax.lax.psum(jnp.sum(jnp.tanh(xb @ w) ** 2), ("d0", "d1", "d2"))

    def step(w, x):
        loss = lambda w: jax.shard_map(local_loss, mesh=mesh, in_specs=(P(("d0", "d1", "d2")),  # noqa: E731
                                                                        P()), out_specs=P())(x, w)
        value, grad = jax.value_and_grad(loss)(w)
        return w - 0.01 * grad, value

    x, w = _data()
    sf = jaxpar.shard(step, mesh=mesh, search_mode=mode)
    _check(jax.jit(step), sf, w, x)
    check = sf.plan(w, x).verify(sf.lower(w, x).compile())
    assert check.ok and check.measured_bytes > 0, str(check)


def test_a_shard_map_over_other_axes_stays_replicated():
    """Its mesh's axis names are not the plan's: no candidate but the replicated one, the
    program still matches jit, and the plan says that what it moves is not predicted."""
    other = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))

    def f(x, w):
        return jax.shard_map(lambda xb, w: jax.lax.psum(xb @ w, "batch"), mesh=other,
                             in_specs=(P("batch"), P()), out_specs=P())(x, w)

    x, w = _data()
    sf = jaxpar.shard(f, mesh=jaxpar.make_mesh(8))
    _check(jax.jit(f), sf, x, w)
    plan = sf.plan(x, w)
    assert plan.flat_in_specs[0].to_pspec() == P()
    (note,) = [n for n in plan.notes if "shard_map over another mesh" in n]
    assert "batch=8" in note and "not in the predicted collectives" in note


@pytest.mark.parametrize("devices", ["reversed", "half"])
def test_a_mesh_of_other_devices_or_another_order_inside_is_refused_in_words(devices):
    """A shard_map or with_sharding_constraint over the same devices in another order, or over
    some of them, failed inside JAX ("Received incompatible devices for jitted computation",
    naming jaxpar's internals): one program runs over one list of devices, the plan's."""
    from jax.sharding import AxisType, Mesh, NamedSharding

    ids = np.array(jax.devices())[::-1] if devices == "reversed" else np.array(jax.devices()[:4])
    other = Mesh(ids, ("x",), axis_types=(AxisType.Auto,))
    shown = r"\[7, 6, 5, 4, 3, 2, 1, 0\]" if devices == "reversed" else r"\[0, 1, 2, 3\]"

    def mapped(x):
        return jax.shard_map(lambda b: b * 2, mesh=other, in_specs=P("x"), out_specs=P("x"))(x)

    def constrained(x):
        return jnp.tanh(jax.lax.with_sharding_constraint(x, NamedSharding(other, P("x"))))

    x, _ = _data()
    for f, what in ((mapped, "jax.shard_map"), (constrained, "with_sharding_constraint")):
        with pytest.raises(ValueError, match=f"{f.__name__}: its {what} is over a mesh of "
                           f"devices {shown}, in that order; the plan's mesh runs on devices "
                           r"\[0, 1, 2, 3, 4, 5, 6, 7\]"):
            jaxpar.shard(f)(x)
    same = Mesh(np.array(jax.devices()), ("x",), axis_types=(AxisType.Auto,))
    np.testing.assert_allclose(jaxpar.shard(lambda x: jax.shard_map(
        lambda b: b * 2, mesh=same, in_specs=P("x"), out_specs=P("x"))(x))(x), 2 * x)


def test_a_pmap_over_some_of_the_devices_is_refused_naming_the_pmap():
    """JAX makes a jax.pmap a shard_map over an internal axis; over 2 of the 8 devices the
    refusal spoke of a jax.shard_map the user never wrote, and advised building a Mesh. Over
    all 8 it runs."""
    def doubled(x):
        return jax.pmap(lambda a: a * 2)(x)

    with pytest.raises(ValueError, match=r"doubled: its jax.pmap maps over 2 devices \[0, 1\]"
                       r".* Map over all 8"):
        jaxpar.shard(doubled)(jnp.ones((2, 6)))
    x = jnp.arange(48.0).reshape(8, 6)
    np.testing.assert_allclose(jaxpar.shard(doubled)(x), 2 * x)


def test_body_work_counts_flops_collectives_and_scan_trips():
    mesh = jaxpar.make_mesh(8)

    def inner(xb, w):
        def body(h, _):
            return jax.lax.psum(h @ w, "d0"), None
        return jax.lax.scan(body, xb, None, length=3)[0]

    x = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    jaxpr = jax.make_jaxpr(jax.shard_map(inner, mesh=mesh, in_specs=(P("d0"), P()),
                                         out_specs=P("d0"), check_vma=False))(x, w)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    work = body_work(eqn.params["jaxpr"])
    assert work.flops == 3 * 2 * 8 * 8 * 8  # three local (8, 8) @ (8, 8) matmuls
    (c,) = work.collectives
    assert (c.kind, c.axes, c.bytes, c.count) == ("all-reduce", ("d0",), 3 * 8 * 8 * 4, 3)


@pytest.mark.parametrize("mode", MODES)
def test_a_shard_map_has_no_replicated_candidate_to_be_priced_as(mode):
    """Beside its own specs a shard_map was offered the replicated strategy at the same cost;
    XLA runs its body in its specs all the same, and the gather of its result a search chose
    so was left out of the prediction (0 bytes gathered where 1,024 were)."""
    mesh = jaxpar.make_mesh(8)

    def f(x, w):
        h = jax.shard_map(lambda h, w: jax.lax.psum(jnp.tanh(h @ w), "d1"), mesh=mesh,
                          in_specs=(P("d0", "d1"), P("d1", None)), out_specs=P("d0", None))(x, w)
        return jnp.sum(h), jnp.max(h)

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((16, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 16)) * 0.2, jnp.float32)
    sf = jaxpar.shard(f, mesh=mesh, search_mode=mode)
    _check(jax.jit(f), sf, x, w)
    plan = sf.plan(x, w)
    assert plan.graph_plan.choices[0].runner_up is None  # one candidate: its own specs
    check = plan.verify(sf.lower(x, w).compile())
    assert check.ok, str(check)


def test_a_shard_map_drawing_random_numbers_is_planned():
    """A PRNG key in its body (a key-typed value) crashed its pricing: numpy has no dtype for
    key<fry>."""
    mesh = jaxpar.make_mesh(8)

    def f(x):
        return jax.shard_map(lambda xb: xb + jax.random.uniform(jax.random.key(1), xb.shape),
                             mesh=mesh, in_specs=P("d1"), out_specs=P("d1"))(x)

    x = _data()[0]
    sf = jaxpar.shard(f, mesh=mesh, search_mode="dynamic_programming")
    _check(jax.jit(f), sf, x)
    assert sf.plan(x).verify(sf.lower(x).compile()).ok


@pytest.mark.parametrize("order", [("d2", "d0"), ("d0", "d2")])
def test_a_shard_map_cutting_over_axes_out_of_mesh_order_predicts_the_permutes(order):
    """P(("d2", "d0")) lays the pieces out in another order than the plan's specs can say
    (mesh order): XLA permutes the operand in and the result out, 128 bytes each here."""
    mesh = jaxpar.make_mesh(8)

    def f(x):
        return jax.shard_map(jnp.tanh, mesh=mesh, in_specs=P(order), out_specs=P(order))(x * 2) + 1

    x = _data()[0][:, :8]
    sf = jaxpar.shard(f, mesh=mesh, search_mode="recursive_programming")
    _check(jax.jit(f), sf, x)
    check = sf.plan(x).verify(sf.lower(x).compile())
    assert check.ok and check.predicted == check.measured, str(check)
    assert check.measured_bytes == (256 if order == ("d2", "d0") else 0)


def test_a_cond_in_a_body_counts_the_branch_that_communicates_most():
    """A cond runs one branch; its branches' collectives were all counted (a permute of 64 B
    predicted beside the all-gather, which analysis.collective_stats alone counts)."""
    mesh = jaxpar.make_mesh(8)

    def inner(xb, flag):
        return jax.lax.cond(flag, lambda y: jax.lax.ppermute(y, "d0", [(0, 1), (1, 0)]),
                            lambda y: jax.lax.all_gather(y, "d0", axis=0, tiled=True)[:8], xb)

    def f(x, flag):
        return jax.shard_map(inner, mesh=mesh, in_specs=(P("d0"), P()), out_specs=P("d0"))(x, flag)

    x = jnp.arange(32.0).reshape(16, 2)
    sf = jaxpar.shard(f, mesh=mesh)
    for flag in (True, False):
        _check(jax.jit(f), sf, x, jnp.asarray(flag))
    check = sf.plan(x, jnp.asarray(True)).verify(sf.lower(x, jnp.asarray(True)).compile())
    assert check.ok, str(check)
    assert check.predicted == check.measured and set(check.predicted) == {"all-gather"}


def test_a_while_loop_in_a_body_runs_its_collectives_per_known_trip():
    """A counter from 0 to 3 by 1: XLA knows the trip count and runs the permute three times,
    where one was predicted."""
    mesh = jaxpar.make_mesh(8)

    def inner(xb):
        def body(carry):
            i, y = carry
            return i + 1, jax.lax.ppermute(y, "d0", [(0, 1), (1, 0)]) * 0.5
        return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, xb))[1]

    def f(x):
        return jax.shard_map(inner, mesh=mesh, in_specs=P("d0"), out_specs=P("d0"))(x)

    x = jnp.arange(32.0).reshape(16, 2)
    sf = jaxpar.shard(f, mesh=mesh)
    _check(jax.jit(f), sf, x)
    check = sf.plan(x).verify(sf.lower(x).compile())
    assert check.ok, str(check)
    assert check.predicted == check.measured
    assert check.measured["collective-permute"]["count"] == 3
