"""jaxpar.shard end to end: the reference examples, plans, save/load, and malformed input."""

import functools
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.demo import dense_relu, three_blocks
from jaxpar.ir import build_graph, trace

AUTO = AxisType.Auto

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.uniform(0, 1, (32, 128)), jnp.float32)
W = jnp.asarray(RNG.uniform(0, 1, (128, 10)), jnp.float32)
B = jnp.asarray(RNG.uniform(0, 1, (10,)), jnp.float32)


def blocks_params(d=32):
    def dense():
        return {"weight": jnp.asarray(RNG.standard_normal((d, d)) / d ** 0.5, jnp.float32),
                "bias": jnp.asarray(RNG.standard_normal(d) * 0.1, jnp.float32)}
    return {b: {"dense1": dense(), "dense2": dense()} for b in ("block1", "block2", "block3")}


def test_reference_dense_relu():
    f = jaxpar.shard(dense_relu, in_strategy=((4, 2), None, None))
    y = f(X, W, B)
    np.testing.assert_allclose(y, jax.jit(dense_relu)(X, W, B), rtol=1e-5, atol=1e-5)
    assert isinstance(y.sharding, NamedSharding)
    plan = f.plan(X, W, B)
    assert plan.flat_in_specs[0].to_pspec() == P(("d0", "d1"), "d2")
    assert plan.in_specs[0] == P(("d0", "d1"), "d2")
    assert y.sharding.spec == plan.out_specs  # one array out: one PartitionSpec


def test_plan_specs_are_partition_specs_in_the_arguments_structure(tmp_path):
    # DESIGN's contract: plan.in_specs / out_specs are PartitionSpecs in pytrees matching the
    # arguments and outputs (they were flat lists of jaxpar Specs), usable as jax shardings.
    params, x = blocks_params(), jnp.asarray(RNG.standard_normal((64, 32)), jnp.float32)
    f = jaxpar.shard(lambda p, x: (three_blocks(p, x), {"sum": x.sum()}),
                     in_strategy=(None, (8, 1)),
                     parameter_plan={"block1/dense2/weight": (8, 1)})
    plan = f.plan(params, x)
    ins, outs = plan.in_specs, plan.out_specs
    assert jax.tree.structure(ins, is_leaf=lambda s: isinstance(s, P)) == \
        jax.tree.structure((params, x))
    assert ins[0]["block1"]["dense2"]["weight"] == P(("d0", "d1", "d2")) == ins[1]
    assert isinstance(outs, tuple) and isinstance(outs[1]["sum"], P)
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(f.mesh, s)),
                          (params, x), ins,
                          is_leaf=lambda s: isinstance(s, P))
    np.testing.assert_allclose(f(*placed)[0], jax.jit(three_blocks)(params, x), rtol=1e-5,
                               atol=1e-5)
    plan.save(tmp_path / "plan.json")
    loaded = jaxpar.Plan.load(tmp_path / "plan.json")
    assert loaded.in_specs == ins  # the file holds the tree (dicts, tuples)
    assert f.with_plan(loaded).plan(params, x).in_specs == ins  # bound to the arguments: the tree


def test_reference_three_blocks_with_parameter_plan():
    params, x = blocks_params(), jnp.asarray(RNG.standard_normal((64, 32)), jnp.float32)
    f = jaxpar.shard(three_blocks, in_strategy=(None, (8, 1)),
                     parameter_plan={"block1/dense2/weight": (8, 1)})
    np.testing.assert_allclose(f(params, x), jax.jit(three_blocks)(params, x),
                               rtol=1e-5, atol=1e-5)
    plan = f.plan(params, x)
    assert plan.in_specs[0]["block1"]["dense2"]["weight"] == P(("d0", "d1", "d2"))


def test_plan_from_shape_dtype_structs_matches_plan_from_arrays():
    f = jaxpar.shard(dense_relu, in_strategy=((4, 2), None, None))
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (X, W, B)]
    p1, p2 = f.plan(*abstract), f.plan(X, W, B)
    assert p1.fingerprint == p2.fingerprint and p1.flat_in_specs == p2.flat_in_specs


def test_explain_shows_every_op_and_totals():
    f = jaxpar.shard(dense_relu, in_strategy=((4, 2), None, None))
    text = f.plan(X, W, B).explain()
    for word in ("dot_general", "add", "max", "runner-up", "modeled per device",
                 "predicted collectives", "[d0+d1, d2]"):
        assert word in text
    cost = f.plan(X, W, B).cost
    assert cost.total_s == pytest.approx(cost.compute_s + cost.comm_s)
    assert cost.peak_memory_bytes > 0


def test_primitive_without_rule_is_replicated_and_marked():
    def fn(x):  # random_gamma: cut, its rejection loop all-reduces; jaxpar has no rule for it
        return jax.random.gamma(jax.random.key(0), x)

    x = jnp.asarray(np.abs(RNG.standard_normal((8, 8))) + 0.5, jnp.float32)
    f = jaxpar.shard(fn, in_strategy=((8, 1),))
    np.testing.assert_allclose(f(x), jax.jit(fn)(x), rtol=1e-4, atol=1e-4)
    assert "no rule: replicated" in f.plan(x).explain()


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming",
                                  "dynamic_programming"])
def test_user_sharding_constraint_is_kept(mode):
    # recursive_programming prices its links on a one-axis mesh of its own, where a
    # constraint's axes are unknown: the constraint's rule raised there.
    mesh = jaxpar.make_mesh(8)

    def fn(x, w):
        h = jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P(None, "d1")))
        return jnp.tanh(h)

    f = jaxpar.shard(fn, in_strategy=((8, 1), None), mesh=mesh, search_mode=mode)
    np.testing.assert_allclose(f(X, W[:, :8]), jax.jit(fn)(X, W[:, :8]), rtol=1e-5, atol=1e-5)
    rows = {r.op: r for r in f.plan(X, W[:, :8]).rows}
    assert rows["sharding_constraint"].chosen == "user constraint"
    choice = next(c for c in f.plan(X, W[:, :8]).graph_plan.choices.values()
                  if c.strategy.name == "user constraint")
    assert choice.strategy.outs[0].to_pspec() == P(None, "d1")


def test_a_bare_partition_spec_constraint_reads_the_plans_mesh():
    """`with_sharding_constraint(x, P(...))` without a NamedSharding names axes of the mesh in
    context: jaxpar traces, compiles and runs on its own mesh, so the constraint reads that one
    as it would under the user's jax.set_mesh. With no mesh set JAX raised a RuntimeError from
    the trace; under jax.jit and jax.grad too (an abstract mesh is set inside a trace)."""
    mesh = jaxpar.make_mesh(8)

    def fn(x, w):
        return jnp.tanh(jax.lax.with_sharding_constraint(x @ w, P(None, "d1"))).sum()

    f = jaxpar.shard(fn, in_strategy=((8, 1), None), mesh=mesh)
    w = W[:, :8]
    got = f(X, w), jax.jit(f)(X, w), jax.grad(f)(X, w)  # first: jit caches traces
    with jax.set_mesh(mesh):
        want, grad = jax.jit(fn)(X, w), jax.jit(jax.grad(fn))(X, w)
    np.testing.assert_allclose(got[0], want, rtol=1e-5)
    np.testing.assert_allclose(got[1], want, rtol=1e-5)
    np.testing.assert_allclose(got[2], grad, rtol=1e-5, atol=1e-6)
    choice = next(c for c in f.plan(X, w).graph_plan.choices.values()
                  if c.strategy.name == "user constraint")
    assert choice.strategy.outs[0].to_pspec() == P(None, "d1")
    assert jax.sharding.get_abstract_mesh().empty  # nothing left set after the calls

    def other(x):
        return jax.lax.with_sharding_constraint(x * 2, P("dp"))

    with pytest.raises(ValueError, match=r"other: .*bare PartitionSpec.*\('d0', 'd1', 'd2'\)"
                       r".*make_mesh\(shape, names\)"):
        jaxpar.shard(other, mesh=mesh)(X)

    # Under the user's jax.set_mesh over other axis names, a bare PartitionSpec in a
    # constraint or a shard_map without mesh= failed with JAX's words, naming only jaxpar's
    # axes; jax.sharding.reshard (Explicit axes only) with JAX's too
    def mapped(x):
        return jax.shard_map(lambda a: jax.lax.psum(a, "dp"), in_specs=(P("dp"),),
                             out_specs=P())(x)

    def resharded(x):
        return jax.sharding.reshard(x * 2, P("d0"))
    theirs = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    for fn in (other, mapped):
        with jax.set_mesh(theirs), pytest.raises(
                ValueError, match=rf"{fn.__name__}: a bare PartitionSpec .* whose axes are "
                r"\('d0', 'd1', 'd2'\), whatever mesh a jax.set_mesh around the call holds"):
            jaxpar.shard(fn)(X)
        with jax.set_mesh(theirs):  # given that mesh, it runs as jax.jit does
            np.testing.assert_allclose(jaxpar.shard(fn, mesh=theirs)(X), jax.jit(fn)(X),
                                       rtol=1e-6)
    with pytest.raises(ValueError, match=r"resharded: jax.sharding.reshard .* takes a mesh with "
                       r"Explicit axes.*use jax.lax.with_sharding_constraint"):
        jaxpar.shard(resharded)(X)


def test_a_constraint_is_kept_where_gathering_looks_cheaper():
    """A replicated candidate was offered beside the user's constraint and chosen here, though
    XLA keeps the constraint: the plan predicted two gathers (3 KB) of a program that moved
    its input into the constraint's layout and back (four gathers, 5.6 KB)."""
    mesh = jaxpar.make_mesh((4, 2), ("dp", "tp"))

    def fn(x):
        return jax.lax.with_sharding_constraint(jnp.sin(x), NamedSharding(mesh, P("dp", "tp"))) * 2

    f = jaxpar.shard(fn, mesh=mesh, in_strategy=((2, 4),), search_mode="sharding_propagation")
    np.testing.assert_allclose(f(X[:, :32]), jax.jit(fn)(X[:, :32]), rtol=1e-6)
    plan = f.plan(X[:, :32])
    assert {r.op: r for r in plan.rows}["sharding_constraint"].chosen == "user constraint"
    check = plan.verify(f.lower(X[:, :32]).compile())
    assert check.ok, str(check)
    assert check.predicted == check.measured
    assert "all-to-all" in check.measured  # x moved into the constraint's [dp, tp]


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming",
                                  "dynamic_programming"])
@pytest.mark.parametrize("out_strategy", [None, (None, (8, 1))])
def test_a_captured_constant_returned_unread(mode, out_strategy, tmp_path):
    # Before: KeyError in out_spec (no op reads W, so no search gave it a spec).
    def fn(x):
        return x * 2, W

    mesh = jaxpar.make_mesh(8)
    f = jaxpar.shard(fn, mesh=mesh, search_mode=mode, out_strategy=out_strategy)
    y, w = f(X)
    np.testing.assert_array_equal(w, W)
    np.testing.assert_allclose(y, X * 2, rtol=1e-6)
    want = P() if out_strategy is None else P(("d0", "d1", "d2"))
    assert w.sharding.spec == want
    plan = f.plan(X)
    check = plan.verify(f.lower(X).compile())
    assert check.ok, str(check)
    plan.save(tmp_path / "plan.json")
    again = f.with_plan(jaxpar.Plan.load(tmp_path / "plan.json"))
    np.testing.assert_array_equal(again(X)[1], W)


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming",
                                  "dynamic_programming"])
def test_a_constraint_on_another_meshs_axes_is_planned_freely(mode):
    other = jaxpar.make_mesh((2, 4), ("dp", "tp"))

    def fn(x, w):
        return jnp.tanh(jax.lax.with_sharding_constraint(x @ w, NamedSharding(other,
                                                                              P("dp", "tp"))))

    f = jaxpar.shard(fn, mesh=jaxpar.make_mesh(8), search_mode=mode)
    np.testing.assert_allclose(f(X, W[:, :8]), jax.jit(fn)(X, W[:, :8]), rtol=1e-5, atol=1e-5)
    assert all(c.strategy.name != "user constraint"
               for c in f.plan(X, W[:, :8]).graph_plan.choices.values())


def test_a_loaded_plan_keeps_the_structure_of_arguments_and_outputs(tmp_path):
    """Plan.load gave in_specs and out_specs as flat lists (DESIGN: pytrees matching the
    arguments and outputs). The file holds the structure where it is made of tuples, lists,
    dicts with string keys and None; a NamedTuple's is not written (flat, as before), and a
    file whose structure disagrees with its specs is refused."""
    import collections
    import json

    def fn(params, x):
        return {"y": x @ params["w"] + params["b"], "n": (jnp.sum(x), None)}

    f = jaxpar.shard(fn, in_strategy=({"w": (1, 2), "b": (2,)}, (4, 2)))
    plan = f.plan({"w": W, "b": B}, X)
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = jaxpar.Plan.load(path)
    assert loaded.in_specs == plan.in_specs and isinstance(loaded.in_specs[0], dict)
    assert loaded.out_specs == plan.out_specs and isinstance(loaded.out_specs["n"], tuple)
    g = jaxpar.shard(fn).with_plan(loaded)  # bound to arguments as before
    np.testing.assert_allclose(g({"w": W, "b": B}, X)["y"], f({"w": W, "b": B}, X)["y"],
                               rtol=1e-6)
    data = json.loads(path.read_text())
    data["in_tree"] = {"tuple": ["*"]}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="field in_tree: 1 leaves where the file has 3 specs"):
        jaxpar.Plan.load(path)
    Pair = collections.namedtuple("Pair", "w b")
    named = jaxpar.shard(lambda p, x: x @ p.w + p.b).plan(Pair(W, B), X)
    named.save(path)
    flat = jaxpar.Plan.load(path).in_specs
    assert isinstance(flat, list) and flat == [s.to_pspec() for s in named.flat_in_specs]


def test_a_pinned_plan_refuses_arguments_of_another_structure(tmp_path):
    # The fingerprint hashes the jaxpr alone: a plan made over {"a", "b"} passed for {"v",
    # "w"} (or {"b", "c"}) and the results came back under the plan's keys: out["b"] held
    # c's result. Now the structure is checked; the plan's own still runs, and a loaded plan
    # equals the one it was saved from (PyTreeDef == None raised a TypeError).
    def decay(params):
        return jax.tree_util.tree_map(lambda p: p * 0.9, params)

    f = jaxpar.shard(decay)
    plan = f.plan({"a": X, "b": X})
    plan.save(tmp_path / "plan.json")
    loaded = jaxpar.Plan.load(tmp_path / "plan.json")
    assert loaded == plan and plan == loaded
    for pinned in (plan, loaded):
        g = jaxpar.shard(decay).with_plan(pinned)
        for other in ({"b": X, "c": 2 * X}, [X, X]):
            with pytest.raises(ValueError, match=r"arguments of pytree structure .*'a'.*not "):
                g(other)
        out = g({"a": X, "b": 2 * X})
        assert sorted(out) == ["a", "b"]
        np.testing.assert_allclose(out["b"], 1.8 * X, rtol=1e-6)


def test_save_load_round_trip_and_refusals(tmp_path):
    f = jaxpar.shard(dense_relu, in_strategy=((4, 2), None, None))
    plan = f.plan(X, W, B)
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = jaxpar.Plan.load(path)
    assert loaded.flat_in_specs == plan.flat_in_specs
    assert loaded.flat_out_specs == plan.flat_out_specs
    assert loaded.explain() == plan.explain()
    g = jaxpar.shard(dense_relu).with_plan(loaded)
    np.testing.assert_allclose(g(X, W, B), f(X, W, B), rtol=1e-6)
    assert g.lower(X, W, B).as_text() == f.lower(X, W, B).as_text()
    other = jaxpar.shard(lambda x, w, b: dense_relu(x, w, b) * 2).with_plan(loaded)
    with pytest.raises(ValueError, match="another program"):
        other(X, W, B)
    small = jaxpar.shard(dense_relu, mesh=jaxpar.make_mesh((2, 2))).with_plan(loaded)
    with pytest.raises(ValueError, match="made for mesh"):
        small(X, W, B)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        jaxpar.Plan.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"format": "something"}')
    with pytest.raises(ValueError, match="not a jaxpar plan"):
        jaxpar.Plan.load(tmp_path / "other.json")


def test_out_strategy_places_outputs():
    f = jaxpar.shard(dense_relu, in_strategy=((8, 1), None, None), out_strategy=((1, 2),))
    y = f(X, W, B)
    assert y.sharding.spec == P(None, "d0")
    np.testing.assert_allclose(y, jax.jit(dense_relu)(X, W, B), rtol=1e-5, atol=1e-5)


def test_verify_reports_predicted_and_measured():
    f = jaxpar.shard(dense_relu, in_strategy=((4, 2), None, None))
    v = f.plan(X, W, B).verify(f.lower(X, W, B).compile())
    assert v.ok, str(v)
    assert v.measured_bytes > 0 and "total bytes" in str(v)


def test_donation_and_cache():
    f = jaxpar.shard(lambda x: x * 2, in_strategy=((8, 1),), donate_argnums=0)
    spec = f.plan(jnp.ones((16, 4))).flat_in_specs[0].to_pspec()
    x = jax.device_put(jnp.ones((16, 4)), NamedSharding(f.mesh, spec))  # already placed
    f(x)
    assert x.is_deleted()  # its buffer was reused
    f(jnp.ones((16, 4)))
    assert len(f._cache) == 1
    f(jnp.ones((32, 4)))
    assert len(f._cache) == 2  # a new shape plans again
    # a numpy float64 array is float32 to JAX (x64 off): the same program, not a new plan
    f(np.ones((16, 4), np.float64))
    assert len(f._cache) == 2


def test_a_negative_donation_counts_from_the_end():
    f = jaxpar.shard(lambda s, x: (s * 0.5, x + 1), in_strategy=((8, 1), (8, 1)),
                     donate_argnums=-1)
    s, x = (jax.device_put(jnp.ones((16, 4)), NamedSharding(f.mesh, P(("d0", "d1", "d2"))))
            for _ in range(2))
    f(s, x)
    assert x.is_deleted() and not s.is_deleted()


def test_one_array_in_two_donated_leaves_is_copied_not_donated_twice():
    # Tied weights ({"a": w, "b": w}) already in place: one buffer donated twice made XLA
    # abort the process on the second call. The copy keeps a caller's other reference intact
    # (x, fixed cut as the plan lays out out["a"], reads it in place).
    f = jaxpar.shard(lambda p, x: ({"a": p["a"] * 2, "b": p["b"] + x}, x.sum()),
                     in_strategy=(None, (8, 1)), donate_argnums=0)
    w, x = jnp.ones((64, 32)), jnp.ones((64, 32))
    out, _ = f({"a": w, "b": w}, x)
    for _ in range(2):  # out["a"] now lies where the plan wants it
        tied = out["a"]
        out, _ = f({"a": tied, "b": tied}, tied)
        assert not tied.is_deleted()  # read as x too: both donated leaves got copies
    np.testing.assert_allclose(out["b"], jnp.full((64, 32), 8.0))
    np.testing.assert_allclose(out["a"], jnp.full((64, 32), 8.0))


def test_tied_weights_fresh_from_one_device_are_copied_before_being_placed():
    # {"emb": e, "unemb": e} with e made by jax.random (on one device, uncommitted) and planned
    # replicated: each leaf placed on the mesh shared e's buffer on that device, the copy came
    # after the placing (by identity, which two placed arrays do not share), and XLA was asked
    # to donate one buffer twice: the process died (SIGSEGV).
    def step(p, x):
        return {k: v - 0.1 * (x @ v.T).mean() for k, v in p.items()}, x.sum()

    e = jax.random.normal(jax.random.key(0), (32, 16))
    f = jaxpar.shard(step, in_strategy=({"emb": (1, 1), "unemb": (1, 1)}, (8, 1)),
                     donate_argnums=0)
    x = jnp.ones((64, 16))
    want = jax.jit(step)({"emb": e, "unemb": e}, x)
    out, total = f({"emb": e, "unemb": e}, x)
    np.testing.assert_allclose(out["emb"], want[0]["emb"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["unemb"], want[0]["unemb"], rtol=1e-5, atol=1e-6)


def test_a_steps_outputs_go_back_in_without_being_moved(monkeypatch):
    # A training loop feeds each step's outputs back: they already lie where the plan wants
    # them, so the call neither moves them nor runs the slower equivalence check.
    f = jaxpar.shard(lambda w, x: (w - 0.01 * x.T @ (x @ w), x), in_strategy=(None, (8, 1)))
    w, x = f(jnp.ones((4, 4)), jnp.ones((16, 4)))
    moved = []
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: moved.append(a))
    monkeypatch.setattr(NamedSharding, "is_equivalent_to", lambda *a: moved.append(a))
    w2, _ = f(w, x)
    assert moved == []
    w, x = np.asarray(w), np.asarray(x)
    np.testing.assert_allclose(w2, w - 0.01 * x.T @ (x @ w), rtol=1e-5)


BAD_CALLS = [
    # (shard kwargs, call args, exception, regex the message must match)
    ({"in_strategy": ((4, 2), None)}, (X, W, B), ValueError, r"in_strategy.*3"),
    ({"in_strategy": ((4, 2, 1), None, None)}, (X, W, B), ValueError, r"in_strategy\[0\]"),
    ({"in_strategy": ((3, 1), None, None)}, (X, W, B), ValueError, r"in_strategy\[0\]"),
    ({"in_strategy": ((0, 1), None, None)}, (X, W, B), ValueError, r"in_strategy\[0\]"),
    ({"in_strategy": ((4.0, 2), None, None)}, (X, W, B), TypeError, r"in_strategy\[0\]"),
    ({"in_strategy": ((16, 1), None, None)}, (X, W, B), ValueError, r"in_strategy\[0\]"),
    ({"in_strategy": (None, None, (4,))}, (X, W, B), ValueError, r"in_strategy\[2\].*10"),
    ({"in_strategy": (P("tp"), None, None)}, (X, W, B), ValueError, r"in_strategy\[0\].*tp"),
    ({"in_strategy": "dp"}, (X, W, B), TypeError, r"in_strategy"),
    ({"out_strategy": ((3, 1),)}, (X, W, B), ValueError, r"out_strategy\[0\]"),
    ({"parameter_plan": {"wieght": (2, 1)}}, (X, W, B), ValueError, r"wieght.*weight"),
    ({"parameter_plan": {"weight": (2, 1, 1)}}, (X, W, B), ValueError, r"parameter_plan"),
    ({"donate_argnums": (0, 5)}, (X, W, B), ValueError,
     r"donate_argnums=\(0, 5\).*3 positional argument.*\[5\]"),
    ({"donate_argnums": -4}, (X, W, B), ValueError, r"donate_argnums=\(-4,\)"),
]


@pytest.mark.parametrize("kwargs,args,exc,match", BAD_CALLS,
                         ids=[str(i) for i in range(len(BAD_CALLS))])
def test_malformed_calls_fail_before_tracing(kwargs, args, exc, match):
    traced = []

    def fn(x, weight, bias):
        traced.append(1)
        return dense_relu(x, weight, bias)

    with pytest.raises(exc, match=match):
        jaxpar.shard(fn, **kwargs)(*args)
    if "out_strategy" not in kwargs:
        assert not traced, "validation must come before tracing"


BAD_OPTIONS = [
    ({"level": 3}, ValueError, r"level=3.*0.*1.*2"),
    ({"level": True}, ValueError, r"level=True"),
    # numpy values: `np.array(1) in (0, 1, 2)` is True and crashed in the search (unhashable);
    # an array of several made numpy's "truth value ... ambiguous" error
    pytest.param({"level": np.array(1)}, ValueError, r"level=array\(1\).*the int 0",
                 id="level=np.array(1)"),
    pytest.param({"level": np.array([0, 1])}, ValueError, r"level=array", id="level=array"),
    ({"level": 1.0}, ValueError, r"level=1.0.*the int"),
    pytest.param({"memory_budget": np.array([1e9, 2e9])}, TypeError, r"memory_budget=array",
                 id="memory_budget=array"),
    # the wrong type is a TypeError, as set_auto_parallel_context raises it (was ValueError)
    ({"memory_budget": True}, TypeError, r"memory_budget=True.*number of bytes"),
    ({"memory_budget": [1e9]}, TypeError, r"memory_budget=\[1000000000.0\]"),
    ({"mem_coeff": "0.1"}, TypeError, r"mem_coeff='0.1'.*finite number"),
    ({"search_mode": "magic"}, ValueError, r"search_mode='magic'"),
    ({"device": "Ascend"}, ValueError, r"device='Ascend'"),
    ({"mesh": "8"}, TypeError, r"mesh='8'.*Mesh"),
    ({"hardware": "h900"}, ValueError, r"hardware='h900'.*h100-nvlink"),
    ({"memory_budget": -1}, ValueError, r"memory_budget=-1"),
    ({"mem_coeff": -0.5}, ValueError, r"mem_coeff=-0.5"),
    ({"mem_coeff": float("nan")}, ValueError, r"mem_coeff=nan.*finite"),
    ({"memory_budget": float("nan")}, ValueError, r"memory_budget=nan"),
    # an int past float's range: OverflowError from math.isfinite, naming nothing
    pytest.param({"memory_budget": 10 ** 400}, ValueError,
                 r"memory_budget=1000.*number of bytes per device, at least 1",
                 id="memory_budget=10**400"),
    # below a byte: every budget-error message then printed it as "0 bytes"
    pytest.param({"memory_budget": 1e-300}, ValueError, r"memory_budget=1e-300.*at least 1",
                 id="memory_budget=1e-300"),
    pytest.param({"mem_coeff": 10 ** 400}, ValueError, r"mem_coeff=1000.*finite number",
                 id="mem_coeff=10**400"),
    ({"parameter_plan": [("w", (1, 8))]}, TypeError, r"parameter_plan.*dict"),
    ({"donate_argnums": "x"}, TypeError, r"donate_argnums='x'.*int"),
    ({"donate_argnums": (0, 1.0)}, TypeError, r"donate_argnums=\(0, 1.0\)"),
    ({"donate_argnums": True}, TypeError, r"donate_argnums=True"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_OPTIONS, ids=[str(k) for k, _, _ in BAD_OPTIONS])
def test_malformed_options(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        jaxpar.shard(dense_relu, **kwargs)


def test_donate_argnums_takes_numpy_ints_as_level_does():
    """np.int64(0) was refused ("give an int or a tuple of ints") where level took one."""
    assert jaxpar.shard(dense_relu, donate_argnums=np.int64(0)).opts.donate_argnums == (0,)
    opts = jaxpar.shard(dense_relu, donate_argnums=(np.int32(1), 2)).opts
    assert opts.donate_argnums == (1, 2) and all(type(i) is int for i in opts.donate_argnums)
    with pytest.raises(TypeError, match=r"donate_argnums=\(np.True_,\)"):
        jaxpar.shard(dense_relu, donate_argnums=(np.True_,))


@pytest.mark.parametrize("key,value", [("memory_budget", "1e9"), ("memory_budget", True),
                                       ("memory_budget", 0.5), ("mem_coeff", "0.1"),
                                       ("mem_coeff", float("inf"))])
def test_shard_and_the_context_refuse_a_budget_or_mem_coeff_alike(key, value):
    # One rule for both (shard() had its own copy, with another wording and, for a number
    # given as text, no word of it).
    errors = []
    for call in (lambda: jaxpar.shard(dense_relu, **{key: value}),
                 lambda: jaxpar.set_auto_parallel_context(**{key: value})):
        with pytest.raises((TypeError, ValueError)) as err:
            call()
        errors.append(err)
    shard_err, context_err = errors
    assert type(shard_err.value) is type(context_err.value)
    assert str(shard_err.value).startswith(f"shard({key}={value!r}): ")
    assert str(shard_err.value).removeprefix("shard") == \
        str(context_err.value).removeprefix("set_auto_parallel_context")
    jaxpar.reset_auto_parallel_context()


def test_a_mesh_with_explicit_axes_is_refused_and_its_arrays_are_taken():
    # jax.make_mesh's default axes are Explicit: jaxpar's constraints failed deep inside JAX.
    explicit = jax.make_mesh((2, 4), ("a", "b"))
    with pytest.raises(ValueError, match=r"\('a', 'b'\) are \('Explicit', 'Explicit'\).*Auto"):
        jaxpar.shard(dense_relu, mesh=explicit)
    with pytest.raises(ValueError, match="AutoParallel.*Auto axes"):
        jaxpar.AutoParallel(dense_relu, mesh=explicit)
    # An argument placed on such a mesh is traced by its shape and placed on the plan's.
    x = jax.device_put(X, NamedSharding(explicit, P("a", "b")))
    f = jaxpar.shard(dense_relu, in_strategy=((2, 4), None, None))
    for _ in range(2):  # planned from it, then called again once planned
        np.testing.assert_allclose(f(x, W, B), dense_relu(X, W, B), rtol=1e-6)


@pytest.mark.parametrize("make,error,match", [
    # Each got past shard() before: a ZeroDivisionError in the rules, a Spec error naming no
    # argument after tracing, or JAX's bare AssertionError when the program was placed.
    (lambda d: jax.sharding.AbstractMesh((4, 0), ("a", "b"), axis_types=(AUTO, AUTO)),
     ValueError, r"axes \{'a': 4, 'b': 0\} hold no devices along 'b'"),
    (lambda d: jax.sharding.Mesh(np.array(d).reshape(4, 2), ("a", "a"), axis_types=(AUTO, AUTO)),
     ValueError, r"axis names \('a', 'a'\) repeat 'a'.*make_mesh\(\(4, 2\), \('d0', 'd1'\)\)"),
    (lambda d: jax.sharding.Mesh(np.array(d).reshape(4, 2), (1, 2), axis_types=(AUTO, AUTO)),
     TypeError, r"axis names \(1, 2\) must be strings"),
    (lambda d: jax.sharding.Mesh(np.array([d[0], d[0]]), ("a",), axis_types=(AUTO,)),
     ValueError, r"lists device cpu:0 more than once"),
])
def test_a_mesh_built_by_hand_that_cannot_be_planned_on_is_refused_at_once(make, error, match):
    mesh = make(jax.devices())
    for build, who in ((lambda: jaxpar.shard(dense_relu, mesh=mesh), "shard"),
                       (lambda: jaxpar.AutoParallel(dense_relu, mesh=mesh), "AutoParallel")):
        with pytest.raises(error, match=rf"^{who}\(mesh=\.\.\.\): .*{match}"):
            build()


def test_calls_that_cannot_run_say_why_before_planning():
    # A ShapeDtypeStruct given to a call: JAX's error came after planning, naming 'flat[0]'.
    f = jaxpar.shard(dense_relu)
    with pytest.raises(TypeError, match=r"x=ShapeDtypeStruct.*\.plan"):
        f(jax.ShapeDtypeStruct(X.shape, X.dtype), W, B)
    assert not f._cache, "refused before planning"
    # A jitted function's static argument, traced by jaxpar: the advice to bind it.
    jitted = jax.jit(lambda x, w, n: (x @ w) * n, static_argnums=2)
    with pytest.raises(TypeError, match="functools.partial"):
        jaxpar.shard(jitted)(X, W, 3)


def test_a_pinned_plan_refuses_a_strategy_it_does_not_follow():
    plan = jaxpar.shard(dense_relu, in_strategy=((2, 4), None, None)).plan(X, W, B)
    same = jaxpar.shard(dense_relu, in_strategy=((2, 4), None, None)).with_plan(plan)
    np.testing.assert_allclose(same(X, W, B), dense_relu(X, W, B), rtol=1e-6)
    other = jaxpar.shard(dense_relu, in_strategy=((8, 1), None, None)).with_plan(plan)
    with pytest.raises(ValueError, match=r"with_plan: the plan lays out input x as \[d0, d1\+d2\]"):
        other(X, W, B)


def test_not_callable():
    with pytest.raises(TypeError, match="callable"):
        jaxpar.shard("dense_relu")


def test_a_platform_this_machine_lacks_is_a_clear_error():
    # JAX's own RuntimeError ("Unknown backend") came through before.
    from jaxpar.mesh import available_platforms

    missing = next(p for p in ("GPU", "TPU", "CPU") if p not in available_platforms())
    with pytest.raises(ValueError, match=f"device='{missing}': no {missing} devices"):
        jaxpar.shard(dense_relu, device=missing)


def test_memory_budget_too_small_is_a_clear_error():
    # Below what any plan can hold: said so by every mode (sharding_propagation suggested
    # the other modes, which could not meet it either).
    for mode in ("sharding_propagation", "recursive_programming"):
        with pytest.raises(ValueError, match=r"memory_budget=100 bytes per device cannot be met: "
                                             r"no plan holds less than \d+ bytes"):
            jaxpar.shard(dense_relu, memory_budget=100, search_mode=mode).plan(X, W, B)
    with pytest.raises(ValueError, match=r"memory_budget=100 bytes.*smallest possible peak.*"
                                         r"\. Cut more dimensions in in_strategy/parameter_plan, "
                                         r"use a larger mesh, or raise the budget\.$"):
        jaxpar.shard(dense_relu, memory_budget=100,
                     search_mode="dynamic_programming").plan(X, W, B)


def test_a_saved_plan_answers_to_the_memory_budget_too(tmp_path):
    # with_plan ran a saved plan needing 4x the budget that a fresh plan was refused under.
    plan = jaxpar.shard(dense_relu).plan(X, W, B)
    plan.save(tmp_path / "plan.json")
    budget = plan.cost.peak_memory_bytes / 4
    pinned = jaxpar.shard(dense_relu, memory_budget=budget).with_plan(
        jaxpar.Plan.load(tmp_path / "plan.json"))
    with pytest.raises(ValueError, match="memory_budget=.*given to with_plan.*needs"):
        pinned(X, W, B)
    # a budget beyond int64 is a number like any other (dynamic_programming's check took it
    # for a numpy integer and failed inside numpy)
    huge = jaxpar.shard(dense_relu, memory_budget=2 ** 64, search_mode="dynamic_programming")
    np.testing.assert_allclose(huge(X, W, B), dense_relu(X, W, B), rtol=1e-6)


def test_a_compiled_program_over_the_memory_budget_warns_on_its_first_call():
    # The budget bounds the modelled peak of live values; the matmul's partial sum before its
    # reduce-scatter (1 MB, a temporary of XLA's) is not among them. Before, nothing said so.
    x, w = jnp.ones((1024, 256)), jnp.ones((256, 1024))

    def matmul(x, w):
        return x @ w

    def sharded(budget):
        return jaxpar.shard(matmul, mesh=jaxpar.make_mesh(8), in_strategy=((1, 8), (8, 1)),
                            out_strategy=((8, 1),), memory_budget=budget)

    f = sharded(1e6)
    assert f.plan(x, w).cost.peak_memory_bytes <= 1e6  # the plan keeps to the budget
    with pytest.warns(UserWarning, match=r"matmul: the compiled program holds \d+ bytes per "
                                         r"device .*x memory_budget=1000000\b") as caught:
        np.testing.assert_allclose(f(x, w), x @ w, rtol=1e-6)
    assert caught[0].filename == __file__  # points at the call
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(x, w)  # warned once, on the first call
        sharded(16e6)(x, w)  # fits: no warning


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming"])
def test_python_scalars_are_arguments_as_under_jit(mode):
    def fn(x, scale, shift, flip):
        y = x * scale + shift
        return jnp.where(flip, -y, y)

    x = jnp.asarray(RNG.standard_normal((16, 8)), jnp.bfloat16)
    f = jaxpar.shard(fn, search_mode=mode)
    for scale, shift, flip in [(2.0, 3, True), (0.5, -1, False)]:
        got, want = f(x, scale, shift, flip), jax.jit(fn)(x, scale, shift, flip)
        assert got.dtype == want.dtype == jnp.bfloat16  # weakly typed, as jit traces them
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert len(f._cache) == 1  # new values, one program
    plan = f.plan(x, 2.0, 3, True)
    assert [s.dims for s in plan.flat_in_specs[1:]] == [(), (), ()]
    assert f.lower(x, 2.0, 3, True).compile() is not None


def test_a_weak_scalar_and_a_float32_one_plan_apart():
    x = jnp.ones((16, 8), jnp.bfloat16)
    f = jaxpar.shard(lambda x, s: x * s)
    assert f(x, 2.0).dtype == jnp.bfloat16
    assert f(x, np.float32(2.0)).dtype == jnp.float32  # promotes, as under jit
    assert len(f._cache) == 2


@pytest.mark.parametrize("bad,exc,match", [
    ("fast", TypeError, r"argument options/mode='fast' \(a str\).*functools.partial"),
    (2 ** 40, ValueError, r"argument options/mode=1099511627776.*too large"),
])
def test_a_leaf_that_is_no_array_is_named_before_tracing(bad, exc, match):
    traced = []

    def fn(x, options):
        traced.append(1)
        return x

    f = jaxpar.shard(fn)
    for call in (f, f.plan, f.lower):
        with pytest.raises(exc, match=match):
            call(X, {"mode": bad})
    assert not traced


def test_keyword_arguments_are_placed_by_the_signature():
    f = jaxpar.shard(dense_relu, in_strategy=((4, 2), None, None))
    want = jax.jit(dense_relu)(X, W, B)
    np.testing.assert_allclose(f(X, bias=B, weight=W), want, rtol=1e-6)
    np.testing.assert_allclose(f(x=X, weight=W, bias=B), want, rtol=1e-6)
    assert len(f._cache) == 1  # the same program as f(X, W, B)
    assert f.plan(X, W, bias=B) is f.plan(X, W, B)
    assert "dot" in f.lower(X, weight=W, bias=B).as_text()


def _scaled(x, w=None, *, scale=1.0):
    return x @ w * scale


def _gapped(x, w=None, scale=1.0):
    return x @ w * scale


def _chunked(x, n_chunks, w, b):
    return sum(jnp.sum(c @ w + b) for c in jnp.split(x, n_chunks))


@pytest.mark.parametrize("call,match", [
    (lambda f: f(X, W, weight=W), r"multiple values for argument 'weight'"),
    (lambda f: f(X, W, bais=B), r"dense_relu\(\.\.\.\) got unexpected keyword argument\(s\) "
     r"\['bais'\] \(did you mean 'bias'\?\)"),  # named before the missing one, as Python does
    (lambda f: f(X, W, B, bais=B), r"unexpected keyword argument\(s\) \['bais'\]"),
    (lambda f: jaxpar.shard(_scaled)(X, W, scale=2.0), r"\['scale'\].*functools.partial"),
    (lambda f: jaxpar.shard(_scaled)(X, scale=2.0), r"\['scale'\] are keyword-only"),
    (lambda f: jaxpar.shard(_gapped)(X, scale=2.0),
     r"\['scale'\] follow parameters not given \(\['w'\]\).*give every parameter"),
    # a partial binding a middle parameter by keyword makes those after it keyword-only: the
    # advice was to use functools.partial
    (lambda f: jaxpar.shard(functools.partial(_chunked, n_chunks=4))(X, w=W, b=B),
     r"\['b', 'w'\] are keyword-only.*functools.partial bound \['n_chunks'\] by keyword.*"
     r"`lambda x, w, b: _chunked\(x, 4, w, b\)`"),
    (lambda f: jaxpar.shard(lambda x, **kw: x @ kw["w"])(X, w=W),
     r"\['w'\] go to \*\*kw in <lambda>'s signature.*give the function parameters"),
])
def test_keyword_arguments_that_cannot_be_placed_are_named(call, match):
    with pytest.raises(TypeError, match=match):
        call(jaxpar.shard(dense_relu))


def test_a_sharded_function_composes_with_jit_grad_and_vmap():
    def loss(x, w, b):
        return jnp.sum(dense_relu(x, w, b) ** 2)

    f = jaxpar.shard(loss, in_strategy=((4, 2), None, None))
    xs = jnp.stack([X, 2 * X])
    committed = jax.device_put(X, NamedSharding(f.mesh, P(None, ("d0", "d1", "d2"))))
    cases = [
        (jax.jit(f)(X, W, B), jax.jit(loss)(X, W, B)),
        (jax.grad(f, argnums=(1, 2))(X, W, B), jax.grad(loss, argnums=(1, 2))(X, W, B)),
        (jax.grad(f, argnums=1)(committed, W, B), jax.grad(loss, argnums=1)(X, W, B)),
        (jax.vmap(f, in_axes=(0, None, None))(xs, W, B),
         jax.vmap(loss, in_axes=(0, None, None))(xs, W, B)),
    ]
    for got, want in cases:
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                        strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5)
    # Inside another jit the plan still places the program: the same collectives.
    inside = jaxpar.collective_stats(jax.jit(f).lower(X, W, B).compile())
    assert inside and inside == jaxpar.collective_stats(f.lower(X, W, B).compile())


def test_arguments_from_elsewhere_compose_with_jit_and_grad():
    # Inside a caller's jax.jit or grad, arrays on another mesh's Explicit axes or committed
    # to one device (a checkpoint just loaded) failed in the sharding constraints (another
    # mesh's axis, devices [0] against [0..7]); they are moved onto the plan's mesh there too.
    def loss(x, w, b):
        return jnp.sum(dense_relu(x, w, b) ** 2)

    f = jaxpar.shard(loss)
    explicit = jax.make_mesh((8,), ("a",))
    x_elsewhere = jax.device_put(X, NamedSharding(explicit, P("a", None)))
    w_on_one = jax.device_put(W, jax.devices()[0])
    want = jax.grad(loss, argnums=(0, 1))(X, W, B)
    for x, w in ((x_elsewhere, W), (X, w_on_one)):
        got = jax.grad(f, argnums=(0, 1))(x, w, B)
        for g, v in zip(got, want, strict=True):
            np.testing.assert_allclose(g, v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(x_elsewhere, W, B), loss(X, W, B), rtol=1e-5)


def test_a_captured_array_on_explicit_axes_is_refused_in_words():
    """A function closing over an array placed on jax.make_mesh's Explicit axes failed inside
    JAX: "Resource axis: a ... not found in mesh" when the plan was replayed, or, under the
    caller's jax.set_mesh over that mesh, "context mesh ... should match the aval mesh" while
    tracing. Its sharding is part of its type there, so jaxpar names it and the fix; captured
    arrays elsewhere (another Auto mesh, one device) still run, and so does the same array
    passed as an argument."""
    from jax.sharding import AxisType

    def closing_over(w):
        return lambda x: dense_relu(x, w, B)

    theirs = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    w_theirs = jax.device_put(W, NamedSharding(theirs, P("b")))
    said = (r"could not trace <lambda>: it captures w \(float32\[128, 10\] on a mesh with "
            r"Explicit axes: a=2, b=4\).*Pass it as an argument")
    with pytest.raises(ValueError, match=said):
        jaxpar.shard(closing_over(w_theirs))(X)
    with jax.set_mesh(theirs), pytest.raises(ValueError, match=said + r".*JAX said: "):
        jaxpar.shard(closing_over(w_theirs))(X)
    with pytest.raises(ValueError, match=r"captures the partial's argument b= \(float32\[10\]"):
        jaxpar.shard(functools.partial(dense_relu, b=jax.device_put(B, NamedSharding(theirs, P()))
                                       ))(X, W)
    np.testing.assert_allclose(jaxpar.shard(dense_relu)(X, w_theirs, B), dense_relu(X, W, B),
                               rtol=1e-5)
    auto = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    for elsewhere in (jax.device_put(W, jax.devices()[3]),
                      jax.device_put(W, NamedSharding(auto, P("b")))):
        np.testing.assert_allclose(jaxpar.shard(closing_over(elsewhere))(X),
                                   dense_relu(X, W, B), rtol=1e-5)


def test_a_sharded_method_takes_its_instance_as_the_first_argument():
    """Used as a method, the sharded function was not bound: `model.apply(x)` put x in `self`
    and raised "missing 1 required positional argument: 'x'". It also had neither the
    function's name nor its docstring."""
    import dataclasses

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Dense:
        w: jax.Array

        @jaxpar.shard
        def apply(self, x):
            """x times the weights."""
            return x @ self.w

    class Settings:
        @jaxpar.shard
        def apply(self, x):
            return 2 * x

    np.testing.assert_allclose(Dense(W).apply(X), X @ W, rtol=1e-5)
    assert Dense.apply.__name__ == "apply" and Dense.apply.__doc__ == "x times the weights."
    assert Dense.apply.plan(Dense(W), X).in_paths[0] == "self/w"
    with pytest.raises(TypeError, match=r"argument self=.*\(a Settings\).*functools.partial"):
        Settings().apply(X)


@pytest.mark.parametrize("loop", ["scan", "cond", "fori_loop"])
def test_eager_grad_through_a_loop_calling_a_sharded_function(loop):
    """Eager jax.grad of a scan, cond or fori_loop whose body calls a sharded function, with
    ordinary (uncommitted) arrays: the argument was device_put onto the mesh inside the body,
    and its transpose put the cotangent back on one device inside the loop, beside operands on
    eight ("Received incompatible devices")."""
    f = jaxpar.shard(dense_relu)

    def loss(fn, w):
        if loop == "scan":
            return jax.lax.scan(lambda c, _: (c + jnp.sum(fn(X, w, B)), None), 0.0, None,
                                length=2)[0]
        if loop == "cond":
            return jnp.sum(jax.lax.cond(True, lambda: fn(X, w, B), lambda: X @ w))
        return jax.lax.fori_loop(0, 2, lambda i, c: c + jnp.sum(fn(X, w, B)), 0.0)

    assert not W.committed
    got = jax.grad(lambda w: loss(f, w))(W)
    np.testing.assert_allclose(got, jax.grad(lambda w: loss(dense_relu, w))(W), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_a_sharded_function_runs_under_a_callers_set_mesh(axis_type):
    # Under jax.set_mesh over another mesh the program was traced against that mesh: on
    # Explicit axes every sharding constraint asserted; on Auto ones jit compared the
    # cotangent with the results' out_shardings under grad.
    from jax.sharding import AxisType

    def loss(x, w, b):
        return jnp.sum(dense_relu(x, w, b) ** 2)

    f = jaxpar.shard(loss)
    theirs = jax.make_mesh((2, 4), ("a", "b"), axis_types=(getattr(AxisType, axis_type),) * 2)
    # jitted: jax 0.11.2's eager dot_general, once an eager grad through a lax.cond ran a jit
    # over a mesh in its branch (the test above), types its results on that mesh while placing
    # them on one device, and the next op under jax.set_mesh(theirs) refuses them (reproduced
    # without jaxpar; README, On a GPU)
    want = jax.jit(jax.grad(loss, argnums=(0, 1)))(X, W, B)
    with jax.set_mesh(theirs):
        np.testing.assert_allclose(f(X, W, B), loss(X, W, B), rtol=1e-5)
        assert f.plan(X, W, B).mesh.names == ("d0", "d1", "d2")
        x = X if axis_type == "Auto" else jax.device_put(X, NamedSharding(theirs, P("a")))
        got = jax.grad(lambda x, w: f(x, w, B) * 2.0, argnums=(0, 1))(x, W)
        for g, v in zip(got, want, strict=True):
            np.testing.assert_allclose(g, 2.0 * v, rtol=1e-5, atol=1e-6)
        # a gradient used by the caller's next op, inside its jit: it comes back typed on
        # the caller's mesh (it came back on the plan's, and the op refused it)
        got = jax.jit(lambda x: jax.grad(lambda x: f(x, W, B))(x) * 1.0)(X)
        np.testing.assert_allclose(got, want[0], rtol=1e-5, atol=1e-6)
    smaller = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    with jax.set_mesh(smaller):  # a direct call still runs; a traced one is refused in words
        np.testing.assert_allclose(f(X, W, B), loss(X, W, B), rtol=1e-5)
        with pytest.raises(ValueError, match=r"over 4 \(x=4\).*mesh of another size"):
            jax.jit(f)(X, W, B)


def test_calls_inside_shard_map_or_a_sharded_vmap_are_refused_in_words():
    # Both failed deep inside JAX (a manual axis type, a constraint naming the vmap's axis).
    f = jaxpar.shard(dense_relu)
    inside = jax.shard_map(lambda x: f(x, W, B), mesh=f.mesh, in_specs=P("d0"),
                           out_specs=P("d0"))
    with pytest.raises(ValueError, match=r"inside jax.shard_map.*outside the shard_map"):
        jax.jit(inside)(X)
    xs = jnp.stack([X, X])
    with pytest.raises(ValueError, match=r"spmd_axis_name.*jaxpar.shard\(jax.vmap\(fn\)\)"):
        jax.vmap(f, in_axes=(0, None, None), spmd_axis_name="d0")(xs, W, B)


def test_a_sharded_function_differentiated_from_outside_keeps_custom_derivatives():
    # The graph inlines custom_jvp and custom_vjp functions as their primal computes; the
    # derivative must still be theirs (it was the primal's: relu's 0.5 at 0, the identity's 1).
    @jax.custom_vjp
    def clip_gradient(x):
        return x

    clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))

    def loss(x, w):
        return jnp.sum(3.0 * clip_gradient(jax.nn.relu(x @ w)))

    x = jnp.zeros((8, 16)).at[:4].set(1.0)  # relu at 0 for half the rows
    w = jnp.ones((16, 8))
    f = jaxpar.shard(loss, in_strategy=((8, 1), None))
    for got, want in [(jax.grad(f, argnums=(0, 1))(x, w), jax.grad(loss, argnums=(0, 1))(x, w)),
                      (jax.jit(jax.grad(f))(x, w), jax.grad(loss)(x, w)),
                      (jax.vmap(jax.grad(f), in_axes=(None, 0))(x, jnp.stack([w, -w])),
                       jax.vmap(jax.grad(loss), in_axes=(None, 0))(x, jnp.stack([w, -w])))]:
        for g, v in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                        strict=True):
            np.testing.assert_allclose(g, v, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(x, w), loss(x, w), rtol=1e-6)
    # Forward mode too (of relu's custom_jvp: JAX has none for a custom_vjp).
    relu = jaxpar.shard(lambda x: jnp.sum(jax.nn.relu(x)), in_strategy=((8, 1),))
    t = jnp.ones_like(x)
    assert jax.jvp(relu, (x,), (t,))[1] == jax.jvp(
        lambda x: jnp.sum(jax.nn.relu(x)), (x,), (t,))[1]


def test_carried_pairs_match_state_returned_in_place():
    from jaxpar.api import carried_pairs

    params = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32),
              "b": jax.ShapeDtypeStruct((4,), jnp.float32)}
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    loss = jax.ShapeDtypeStruct((), jnp.float32)
    assert carried_pairs((params, x), (params, loss)) == [(0, 0), (1, 1)]
    assert carried_pairs((x, params), (loss, params)) == [(1, 1), (2, 2)]
    assert carried_pairs((params, x), params) == [(0, 0), (1, 1)]  # sgd_step -> params
    assert carried_pairs((x, params), params) == []  # only a first argument is replaced whole
    other = {"w": jax.ShapeDtypeStruct((4, 4), jnp.bfloat16), "b": params["b"]}
    assert carried_pairs((params, x), (other, loss)) == []  # dtype changed: not the same state
    # State returned elsewhere than in place: found by its structure where that is unique
    # (it was planned freely, then moved back before every next call).
    state = {"mu": params, "count": loss}
    assert carried_pairs((params, state, x), (loss, params, state)) == \
        [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert carried_pairs((params, state, x), {"loss": loss, "params": params, "state": state}) \
        == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert carried_pairs((params, params, x), (loss, loss, params)) == []  # which? neither
    # One array after data is data: per-example weights beside a per-example loss, a learning
    # rate beside the loss (they were tied, so AutoParallel left them out of the batch and
    # its dataset_strategy count). State of several leaves after data is still found.
    w, wt = x, jax.ShapeDtypeStruct((8,), jnp.float32)
    assert carried_pairs((w, x, x, wt), (w, wt)) == [(0, 0)]
    assert carried_pairs((params, x, loss), (params, loss)) == [(0, 0), (1, 1)]
    assert carried_pairs((x, params, state), (params, state, loss)) == \
        [(1, 0), (2, 1), (3, 2), (4, 3), (5, 4)]
    assert carried_pairs((x, wt), (loss, x)) == [(0, 1)]  # one array before any data: found


def test_state_returned_after_the_loss_keeps_its_layout_for_the_next_call():
    # step(params, x) -> (loss, params): the state was planned freely (its update data
    # parallel, say) and moved back onto the input's layout before every next call.
    def step(p, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) @ p["v"]))(p)
        return loss, jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

    p = {"w": jnp.ones((32, 64)) * 0.01, "v": jnp.ones((64, 8)) * 0.01}
    x = jnp.ones((64, 32))
    want = jax.jit(step)(jax.jit(step)(p, x)[1], x)[0]
    f = jaxpar.shard(step, search_mode="dynamic_programming", donate_argnums=0)
    plan = f.plan(p, x)
    assert plan.flat_out_specs[1:] == plan.flat_in_specs[:2]
    assert any(n.startswith("carried state: 2 outputs") for n in plan.notes)
    loss, p2 = f(p, x)
    for k in p2:  # the next call takes the state as it lies
        assert p2[k].sharding.is_equivalent_to(NamedSharding(f.mesh, plan.in_specs[0][k]), 2)
    np.testing.assert_allclose(f(p2, x)[0], want, rtol=1e-5)



def test_state_that_several_returned_values_match_is_left_untied_with_a_note():
    # step(params, x) -> (loss, grads, params): the grads look like the params, so neither is
    # known to be them; the plan said nothing, and the params came back in another layout.
    from jaxpar.api import carried_pairs

    def step(p, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) @ p["v"]))(p)
        return loss, g, jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

    p = {"w": jnp.ones((32, 64)) * 0.01, "v": jnp.ones((64, 8)) * 0.01}
    x = jnp.ones((64, 32))
    unsure: dict = {}
    assert carried_pairs((p, x), jax.eval_shape(step, p, x), unsure) == []
    assert unsure == {0: [1, 2]}
    plan = jaxpar.shard(step).plan(p, x)
    assert any(n.startswith("argument 0 is not tied as carried state: returned elements 1, 2")
               for n in plan.notes), plan.notes
    kept = jaxpar.shard(lambda p, x: step(p, x)[::-1]).plan(p, x)  # params in place: tied
    assert not any("not tied" in n for n in kept.notes), kept.notes

def test_an_argument_used_as_a_python_value_gets_jaxpars_advice():
    """JAX's own error advises static_argnums, which jaxpar.shard does not have."""
    def zeros_plus(x, n):
        return jnp.zeros((n,)) + x.sum()

    def relu_if(x, positive):
        return jnp.maximum(x, 0) if positive else x

    with pytest.raises(TypeError, match=r"functools.partial\(zeros_plus, n=...\)") as err:
        jaxpar.shard(zeros_plus)(X, 3)
    assert "static_argnums or" not in str(err.value)  # JAX's advice is left out
    with pytest.raises(TypeError, match="jaxpar could not trace relu_if"):
        jaxpar.shard(relu_if)(X, True)
    with pytest.raises(TypeError, match="dot_general requires"):  # other errors pass as they are
        jaxpar.shard(lambda x: x @ x[0, :3])(X)
    got = jaxpar.shard(functools.partial(zeros_plus, n=3))(X)  # as the message says
    np.testing.assert_allclose(got, jnp.full((3,), X.sum()), rtol=1e-5)


def test_plan_methods_and_estimate_time_refuse_bad_arguments(tmp_path):
    """Each was passed on to pathlib, rich or the HLO reader (a TypeError from inside them, a
    raw FileNotFoundError, or an empty table for width=0 and any report for rtol='x')."""
    f = jaxpar.shard(dense_relu, in_strategy=((4, 2), None, None))
    plan, compiled = f.plan(X, W, B), f.lower(X, W, B).compile()
    with pytest.raises(TypeError, match="path=3"):
        plan.save(3)
    with pytest.raises(TypeError, match="path=None"):
        jaxpar.Plan.load(None)
    with pytest.raises(ValueError, match="Plan.save .*missing.* does not exist"):
        plan.save(tmp_path / "missing" / "plan.json")
    with pytest.raises(ValueError, match="Plan.save .*is a directory"):
        plan.save(tmp_path)
    with pytest.raises(ValueError, match="Plan.save '': .*the path is empty"):  # was "is a
        plan.save("")                                                        # directory"
    for width in (0, -5, "wide", 1.5, True):
        with pytest.raises(ValueError, match="width="):
            plan.explain(width=width)
    with pytest.raises(TypeError, match="decisions='yes'"):
        plan.explain(decisions="yes")
    for rtol in ("x", -1, float("nan"), float("inf"), 10 ** 400):
        with pytest.raises(ValueError, match="rtol="):
            plan.verify(compiled, rtol=rtol)
    assert plan.verify(compiled, rtol=0.2).ok
    with pytest.raises(TypeError, match="mesh='mesh'"):
        jaxpar.estimate_time(compiled, "mesh", "cpu")


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["in_specs"].__setitem__(0, [["d0", "d1", "d2"], ["d0"]]),
     r"uses a mesh axis twice"),
    (lambda d: d["in_specs"].__setitem__(1, [[], ["d0", "d1", "d2"]]),
     r"in_specs\[1\] is \[-, d0\+d1\+d2\], which does not cut shape \(128, 10\)"),
    (lambda d: d["out_specs"].__setitem__(0, [[]]), r"out_specs\[0\] is \[-\], of rank 1"),
    # These two loaded and ran: the input came in cut as the edit said, and the plan's ops
    # read it as planned (a collective verify did not predict); JAX reads axes in mesh order.
    (lambda d: d["in_specs"].__setitem__(0, [["d0"], ["d1"]]),
     r"in_specs\[0\] is \[d0, d1\] where the plan's ops read that input as \[d0\+d1, d2\]"),
    (lambda d: d["in_specs"].__setitem__(0, [["d1", "d0"], ["d2"]]),
     r"in_specs\[0\] is \[d1\+d0, d2\], whose axes of one dim are out of the mesh's order"),
    (lambda d: next(iter(d["graph"]["choices"].values()))["strategy"]["ins"].pop(),
     r"graph.choices\[0\] \(dot_general\) has 1 operand and 1 result specs for an op of 2"),
    # These two failed inside the lowering (KeyError: 0) and in MeshInfo (tuple.index).
    (lambda d: d["graph"].__setitem__("specs", {}), r"graph.specs has no spec for values \[0,"),
    # This one loaded and failed while priced (KeyError in out_spec): no op reads the
    # output, so its missing spec went unseen.
    (lambda d: d["graph"]["specs"].pop(str(max(map(int, d["graph"]["specs"])))),
     r"graph.specs has no spec for values \[\d+\], which ops read or the program returns"),
    (lambda d: d["graph"]["specs"].__setitem__("0", [["zz"], []]),
     r"field graph: its specs name axes \['zz'\] outside the mesh"),
])
def test_a_plan_file_that_does_not_fit_the_program_is_refused_before_lowering(
        tmp_path, edit, match):
    """Hand-edited files whose specs name the mesh's axes but cannot lay out the program's
    arrays used to fail inside jax.sharding (DuplicateSpecError, IndivisibleError) or in
    the lowering's zip."""
    import json

    f = jaxpar.shard(dense_relu, in_strategy=((4, 2), None, None))
    data = f.plan(X, W, B).to_json()
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        f.with_plan(jaxpar.Plan.load(path))(X, W, B)


def test_a_strategy_file_whose_plans_are_not_a_list_is_refused_by_plan_load(tmp_path):
    """Plan.load's message about a several-plan file took len() of its "plans": a TypeError
    for a corrupt one."""
    import json

    path = tmp_path / "plans.json"
    for plans in (5, None):
        path.write_text(json.dumps({"format": "jaxpar-plans", "version": 1, "plans": plans}))
        with pytest.raises(ValueError, match=r"this file holds plans, one per argument"):
            jaxpar.Plan.load(path)
        with pytest.raises(ValueError, match=r"corrupt plan file \(no list of plans\)"):
            jaxpar.plan.load_plans(path)


def test_a_plan_file_cutting_a_per_shard_op_as_its_rule_does_not_is_refused(tmp_path):
    # top_k runs per shard (registry.LOCAL); a file edited to cut its sorted dim loaded and ran,
    # and each device's top 2 of its own block came back: shape (8, 4), wrong values.
    import json

    def f(x):
        return jax.lax.top_k(x, 2)[0]

    x = jnp.asarray(RNG.standard_normal((8, 16)), jnp.float32)
    g = jaxpar.shard(f)
    data = g.plan(x).to_json()
    cut = [[], ["d0"]]
    (choice,) = data["graph"]["choices"].values()
    choice["strategy"]["ins"], choice["strategy"]["outs"] = [cut], [cut, cut]
    data["graph"]["specs"] = {v: cut for v in data["graph"]["specs"]}
    data["in_specs"], data["out_specs"] = [cut], [cut]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"\(top_k\) takes \[-, d0\] to .*which its rule does "
                                         r"not offer"):
        g.with_plan(jaxpar.Plan.load(path))(x)
    np.testing.assert_array_equal(g.with_plan(g.plan(x))(x), jax.jit(f)(x))  # as planned: runs

def test_a_plan_file_whose_partial_sums_its_specs_do_not_make_is_refused(tmp_path):
    # An op's "partial" (which results are sums still to reduce, over which axes) follows from
    # its specs; explain() shows the specs alone, so a file edited there loaded and ran with
    # no note, its peak counted from the edit (a relu said to be partial over d0) and a bf16
    # matmul's widening read from it.
    import json

    f = jaxpar.shard(dense_relu, in_strategy=((4, 2), None, None))
    data = f.plan(X, W, B).to_json()
    choices = data["graph"]["choices"]
    dot = next(c for c in choices.values() if any(c["strategy"]["partial"]))  # x's d2 cut
    relu = choices[str(max(map(int, choices)))]  # the last op: the relu, on the sum
    path = tmp_path / "plan.json"
    for choice, partial, match in (
            (dot, [[]], r"leaves its results partial over \[-\], where .* partial over "
                        r"\[d2\]"),
            (relu, [["d0"]], r"leaves its results partial over \[d0\], where .* partial over "
                             r"\[-\]")):
        edited = json.loads(json.dumps(data))
        key = next(k for k, c in data["graph"]["choices"].items() if c is choice)
        edited["graph"]["choices"][key]["strategy"]["partial"] = partial
        path.write_text(json.dumps(edited))
        with pytest.raises(ValueError, match=match):
            f.with_plan(jaxpar.Plan.load(path))(X, W, B)
    path.write_text(json.dumps(data))  # as saved: runs
    np.testing.assert_allclose(f.with_plan(jaxpar.Plan.load(path))(X, W, B),
                               jax.jit(dense_relu)(X, W, B), rtol=1e-5)


@pytest.mark.parametrize("mode", [0, "", False, [], "dynamic-programming"])
def test_a_search_mode_that_is_not_a_mode_is_refused(mode):
    with pytest.raises(ValueError, match=r"shard\(search_mode=.*supports"):
        jaxpar.shard(dense_relu, search_mode=mode)


@pytest.mark.parametrize("dtype", [object, str, "datetime64[D]"])
def test_a_numpy_array_jax_cannot_hold_is_named_before_tracing(dtype):
    x = np.zeros((8, 32), dtype=dtype)
    with pytest.raises(TypeError, match=r"argument x is a numpy array of dtype .*convert it"):
        jaxpar.shard(dense_relu)(x, W, B)


def test_a_shape_dtype_struct_of_a_dtype_jax_cannot_hold_is_refused_before_tracing():
    # It was planned, and lowering it failed inside JAX (no dtype_to_ir_type handler).
    with pytest.raises(TypeError, match=r"argument x is a jax.ShapeDtypeStruct of dtype <U3"):
        jaxpar.shard(lambda x: x).plan(jax.ShapeDtypeStruct((8,), "U3"))


def test_a_shape_dtype_struct_of_typed_prng_keys_is_planned_and_lowered():
    # np.dtype(key<fry>) raised numpy's "Cannot interpret" before the check above could skip it
    def noisy(keys, x):
        return x + jax.vmap(lambda k: jax.random.normal(k, x.shape[1:]))(keys)

    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 8))
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    f = jaxpar.shard(noisy)
    plan = f.plan(keys, x)
    assert plan.in_paths == ["keys", "x"] and plan.flat_in_specs[0].rank == 1
    f.lower(keys, x).compile()
    real = jax.random.split(jax.random.key(0), 8)
    np.testing.assert_allclose(f(real, jnp.ones((8, 16))),
                               jax.jit(noisy)(real, jnp.ones((8, 16))), rtol=1e-6)


@pytest.mark.parametrize("fn", [
    lambda k, x: (k, x * 2),  # handed back as it came
    lambda k, x: (jax.random.fold_in(k, 1), x + jax.random.normal(k, x.shape)),
    lambda k, x: (jax.random.split(k, 4), x),
], ids=["returned", "fold_in", "split"])
@pytest.mark.parametrize("donate", [(), (0,)])
def test_a_program_returning_typed_prng_keys_runs_as_jit_does(fn, donate):
    # Every output's dtype went through np.dtype when jaxpar paired outputs with donated
    # arguments: "Cannot interpret 'key<fry>' as a data type" for any step handing a key
    # back (an nnx model's Rngs in its state, through AutoParallel too).
    key, x = jax.random.key(3), jnp.arange(128.0).reshape(16, 8)
    want = jax.jit(fn)(key, x)
    got = jaxpar.shard(fn, donate_argnums=donate)(jax.random.key(3), x)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        assert g.dtype == w.dtype
        if jax.dtypes.issubdtype(g.dtype, jax.dtypes.prng_key):
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_an_nnx_model_with_dropout_trains_under_autoparallel_as_under_jit():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(8, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.linear(x))

    def step(model, opt, x):
        loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
        opt.update(model, grads)
        return loss

    def fresh():
        model = Net(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    x = jnp.arange(128.0).reshape(16, 8) / 128
    (m1, o1), (m2, o2) = fresh(), fresh()
    jitted, net = nnx.jit(step), jaxpar.AutoParallel(step)
    for _ in range(2):  # the key advances: the second step draws another mask
        np.testing.assert_allclose(net(m2, o2, x), jitted(m1, o1, x), rtol=1e-5)
    np.testing.assert_allclose(m2.linear.kernel[...], m1.linear.kernel[...], rtol=1e-5)


def test_a_program_compiled_for_another_device_count_is_not_verified():
    plan = jaxpar.shard(dense_relu).plan(X, W, B)
    mesh4 = jaxpar.make_mesh(4)
    other = jaxpar.shard(dense_relu, mesh=mesh4).lower(X, W, B).compile()
    with pytest.raises(ValueError, match=r"Plan.verify: the program runs on 4 device\(s\) but "
                                         r"the plan is for mesh d0=2 x d1=2 x d2=2 \(8\)"):
        plan.verify(other)
    # a one-device program's HLO names no device count: it was compared (512 bytes against
    # none moved); so was a program of another function with the same collectives' bytes
    with pytest.raises(ValueError, match=r"runs on 1 device\(s\)"):
        plan.verify(jax.jit(dense_relu).lower(X, W, B).compile())
    other = jaxpar.shard(jnp.sin, in_strategy=((8,),)).lower(jnp.ones(128)).compile()
    with pytest.raises(ValueError, match=r"arguments are of shapes \(128,\); the plan's are "
                                         r"x \(rank 2\), weight \(rank 2\), bias \(rank 1\)\."):
        plan.verify(other)


@pytest.mark.parametrize("wrap,paths", [(lambda y: y, ["out"]),
                                        (lambda y: {"a": y, "b": y + 1}, ["out/a", "out/b"])],
                         ids=["one output", "a dict"])
def test_verify_compares_the_sharding_of_a_single_or_dict_output(wrap, paths):
    # One output's shardings came as a bare NamedSharding (list() of it failed and nothing was
    # compared), a dict's as its keys: the check held only for tuples of outputs.
    def f(x):
        return wrap(jnp.sin(x) @ jnp.ones((8, 16)))

    x = jnp.ones((64, 8))
    planned = jaxpar.shard(f, in_strategy=((8, 1),), out_strategy=(P(("d0", "d1", "d2")),))
    plan = planned.plan(x)
    assert plan.verify(planned.lower(x).compile()).ok
    mesh = planned.mesh
    other = jax.jit(f, in_shardings=NamedSharding(mesh, P(("d0", "d1", "d2"))),
                    out_shardings=NamedSharding(mesh, P(None, ("d0", "d1", "d2"))))
    check = plan.verify(other.lower(x).compile())
    assert not check.ok
    assert [m.split(":")[0] for m in check.sharding_mismatches] == paths
    assert "sharding differs: out" in str(check)


def test_a_hardware_file_that_is_not_yaml_or_lacks_a_key_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("foo: [1")
    with pytest.raises(ValueError, match="hardware=.*bad.yaml.*cannot read"):
        jaxpar.shard(dense_relu, hardware=str(bad)).plan(X, W, B)
    short = tmp_path / "short.yaml"
    short.write_text("name: x\npeak_flops: 1.0e12\nmemory_bytes: 1.0e9\n"
                     "memory_bandwidth: 1.0e11\n")
    with pytest.raises(ValueError, match="missing key 'intra'"):
        jaxpar.shard(dense_relu, hardware=str(short)).plan(X, W, B)


@pytest.mark.parametrize("field, value", [
    ("in_specs", "garbage"), ("in_specs", [[["zz"]], [[]], [[]]]), ("out_paths", "garbage"),
    ("in_paths", ["x"]), ("collectives", "garbage"), ("collectives", {"all-gather": 3}),
    ("in_specs", [[["d0"], ["d0"]], [[], []], [[]]]), ("in_specs", [["d0"], [[]], [[]]]),
    ("mesh", {"names": ["d0", "d1", "d2"], "sizes": ["2", "2", "2"]}),
    ("graph", {"specs": None, "choices": {}}), ("collectives", {"all-gather": {"count": "one",
                                                                            "bytes": 8}}),
    ("cost", {"compute_s": "fast"}), ("rows", [{"path": 0}]), ("notes", "hi"),
    ("decisions", [1]), ("layout", 3),
    ("graph", {"specs": {}, "choices": {"0": {"strategy": None}}}),
    # negative figures and unknown kinds loaded, and explain() printed them
    ("collectives", {"all-reduce": {"count": -3, "bytes": -512}}),
    ("collectives", {"teleport": {"count": 1, "bytes": 8}}),
    ("search_mode", "bogus")])  # loaded, and explain() printed it
def test_a_plan_file_with_a_corrupt_field_is_refused_when_loaded(tmp_path, field, value):
    """Such files loaded, then failed inside jax.sharding when lowered (a stray axis) or in
    explain() (zip, str.items)."""
    import json

    plan = jaxpar.shard(dense_relu, in_strategy=((4, 2), None, None)).plan(X, W, B)
    data = plan.to_json()
    data[field] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"corrupt plan file .*field {field}"):
        jaxpar.Plan.load(path)


@pytest.mark.parametrize("key, value, said", [
    ("score", -1.0, "score: a number of 0 or more"), ("score", "abc", "score"),
    pytest.param("score", 10 ** 400, "score", id="score-10**400"),  # OverflowError before
    ("runner_score", float("nan"), "runner_score"), ("n", "x", "n: a whole number"),
    ("trips", -3, "trips"), ("has_rule", "yes", "has_rule: true or false"),
    ("cost.compute_s", -5, "cost.compute_s"), ("cost.comm_bytes", "x", "cost.comm_bytes"),
    ("cost.collectives", [["all-gather", ["d0"], -1, 1]], "cost.collectives"),
    ("cost.collectives", [["bogus", ["d0"], 8, 1]], "cost.collectives"),
    ("cost.collectives", [["all-gather", ["zz"], 8, 1]], "axes .'zz'. outside the mesh"),
    ("regions", {}, "regions"),
    ("strategy.name", 3, "strategy.name: a str expected, not 3")])  # explain() failed in rich
def test_a_hand_edited_choice_in_a_plan_file_is_refused_with_its_op(tmp_path, key, value, said):
    """A choice's costs were loaded unchecked: a negative or NaN score, a string for bytes or
    an unknown collective kind was explained or verified as written."""
    import json

    plan = jaxpar.shard(dense_relu).plan(X, W, B)
    data = json.loads(json.dumps(plan.to_json()))
    op, choice = next(iter(data["graph"]["choices"].items()))
    where, _, field = key.partition(".")
    if field:
        choice[where][field] = value
    else:
        choice[where] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"corrupt plan file .*field graph: .*{said}"):
        jaxpar.Plan.load(path)
    if "zz" not in said:
        with pytest.raises(ValueError, match=f"op {op}'s"):
            jaxpar.Plan.load(path)


def test_an_edited_strategy_is_explained_priced_and_predicted_as_it_runs(tmp_path):
    """A plan file's rows, cost and predicted collectives were shown as saved: the matmul
    edited to read x whole ran two all-gathers of it that neither explain() nor verify()'s
    prediction had (a reduce-scatter of 512 bytes was all they named)."""
    f = jaxpar.shard(dense_relu, in_strategy=((4, 2), None, None))
    saved = f.plan(X, W, B)
    data = json.loads(json.dumps(saved.to_json()))
    dot = data["graph"]["choices"]["0"]
    assert saved.rows[0].op == "dot_general" and "all-gather" not in saved.collectives
    dot["strategy"]["ins"][0] = [[], []]  # x whole: gathered
    (tmp_path / "plan.json").write_text(json.dumps(data))
    plan = jaxpar.Plan.load(tmp_path / "plan.json")
    g = f.with_plan(plan)
    np.testing.assert_allclose(g(X, W, B), jax.jit(dense_relu)(X, W, B), rtol=1e-5)
    assert plan.rows[0].chosen.startswith("[-, -] ") and plan.rows[0].runner_up == ""
    assert plan.collectives["all-gather"]["count"] == 2
    assert plan.cost.comm_bytes > saved.cost.comm_bytes
    assert "edited: the strategies of ops 0 are not those" in plan.notes[-1]
    measured = plan.verify(g.lower(X, W, B).compile()).measured
    assert measured["all-gather"] == plan.collectives["all-gather"]


def test_an_edited_output_spec_is_priced_as_it_runs(tmp_path):
    """A plan file's out_specs edited to hand the result back whole ran two all-gathers that
    its cost and predicted collectives (a reduce-scatter of 512 bytes) never named, and
    verify() failed on the plan's own program."""
    f = jaxpar.shard(dense_relu, in_strategy=((4, 2), None, None))
    saved = f.plan(X, W, B)
    data = json.loads(json.dumps(saved.to_json()))
    assert data["out_specs"] == [[["d0", "d1"], ["d2"]]]
    data["out_specs"] = [[[], []]]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    plan = jaxpar.Plan.load(tmp_path / "plan.json")
    g = f.with_plan(plan)
    y = g(X, W, B)
    np.testing.assert_allclose(y, jax.jit(dense_relu)(X, W, B), rtol=1e-5)
    assert y.sharding.spec == P()
    assert plan.collectives["all-gather"]["count"] == 2
    assert plan.cost.comm_bytes > saved.cost.comm_bytes
    assert [r.chosen for r in plan.rows] == [r.chosen for r in saved.rows]  # rows kept
    assert "priced again: the file's predicted collectives are not those" in plan.notes[-1]
    assert plan.verify(g.lower(X, W, B).compile()).ok
    # saved and loaded unedited: nothing priced again
    (tmp_path / "same.json").write_text(json.dumps(saved.to_json()))
    same = jaxpar.Plan.load(tmp_path / "same.json")
    f.with_plan(same).plan(X, W, B)
    assert same.collectives == saved.collectives and not same.notes


def test_a_plan_says_what_objective_and_budget_it_was_searched_for(tmp_path):
    # explain() and the file named the mode and profile but not level, mem_coeff or budget.
    f = jaxpar.shard(dense_relu, search_mode="dynamic_programming", level=1, mem_coeff=0.5,
                     memory_budget=1e6)
    plan = f.plan(X, W, B)
    said = "level 1, mem_coeff 0.5, memory_budget 1000000 bytes per device"
    assert plan.objective == said
    assert f"searched for: {said}" in plan.explain().splitlines()
    plan.save(tmp_path / "plan.json")
    assert jaxpar.Plan.load(tmp_path / "plan.json").objective == said
    assert jaxpar.shard(dense_relu).plan(X, W, B).objective == "level 0, mem_coeff 0.1"
    data = plan.to_json()
    del data["objective"]  # a file saved before the field: loads, saying nothing
    assert jaxpar.Plan.from_json(data).objective == ""
    data["objective"] = 3
    with pytest.raises(ValueError, match="field objective: a string expected"):
        jaxpar.Plan.from_json(data)


def test_a_plan_files_peak_is_counted_again_for_the_budget(tmp_path):
    """A peak edited in the file (or one the arguments donated change) was what the budget
    was held to: 0 bytes passed a budget of 100."""
    plan = jaxpar.shard(dense_relu).plan(X, W, B)
    data = plan.to_json()
    data["cost"]["peak_memory_bytes"] = 0
    (tmp_path / "plan.json").write_text(json.dumps(data))
    edited = jaxpar.Plan.load(tmp_path / "plan.json")
    f = jaxpar.shard(dense_relu, memory_budget=100).with_plan(edited)
    with pytest.raises(ValueError, match="memory_budget"):
        f.plan(X, W, B)
    assert edited.cost.peak_memory_bytes == plan.cost.peak_memory_bytes


@pytest.mark.parametrize("data, error, said", [
    ({}, ValueError, "field 'mesh' is missing"),
    ({"mesh": "d0"}, ValueError, "field mesh: "),
    ("plan.json", TypeError, r"Plan.from_json\(d=str\): pass the dict"),
    ([1], TypeError, r"Plan.from_json\(d=list\)")])
def test_plan_from_json_refuses_what_is_no_plan_in_its_own_words(data, error, said):
    # KeyError: 'mesh' and "string indices must be integers" before
    with pytest.raises(error, match=said):
        jaxpar.Plan.from_json(data)


def test_a_program_that_returns_nothing_verifies():
    """JAX runs a program that reads no argument and returns nothing on one device; verify()
    said it was no program of the plan's (8 devices)."""
    f = jaxpar.shard(lambda a: None)
    result = f.plan(X).verify(f.lower(X).compile())
    assert result.ok and result.measured == {} and result.predicted == {}


def test_an_empty_array_is_predicted_to_move_nothing():
    # an all-gather of 0 bytes was predicted for a (0, 8) operand
    z = jnp.zeros((0, 8))
    f = jaxpar.shard(lambda a, b: a @ b.T)
    plan = f.plan(z, jnp.ones((16, 8)))
    assert plan.collectives == {} and plan.cost.comm_s == 0
    assert plan.verify(f.lower(z, jnp.ones((16, 8))).compile()).measured == {}


def test_a_choice_for_an_op_the_program_has_not_is_refused_with_the_program(tmp_path):
    # Such a choice was ignored silently (a value id the program has not was refused).
    import json

    f = jaxpar.shard(dense_relu)
    data = json.loads(json.dumps(f.plan(X, W, B).to_json()))
    choices = data["graph"]["choices"]
    choices["999"] = next(iter(choices.values()))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    loaded = jaxpar.Plan.load(path)  # a file alone cannot tell: the program can
    with pytest.raises(ValueError, match=r"graph.choices names ops \[999\], which the program "
                                         r"has not \(its ops are 0 to \d+\)"):
        jaxpar.shard(dense_relu).with_plan(loaded)(X, W, B)


def test_a_choice_edited_to_contradict_the_specs_is_refused_with_the_program(tmp_path):
    # The program runs the values' specs; explain() showed the edited strategy, which did not
    # run (a cut matmul marked as making its result replicated).
    import json

    f = jaxpar.shard(dense_relu, in_strategy=((4, 2), None, None))
    data = json.loads(json.dumps(f.plan(X, W, B).to_json()))
    dot = data["graph"]["choices"]["0"]["strategy"]
    assert dot["outs"] == [[["d0", "d1"], ["d2"]]] and dot["partial"] == [["d2"]]
    dot["outs"], dot["partial"] = [[[], []]], [[]]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"graph.choices\[0\] \(dot_general\) makes result 0 as "
                                         r".*, where graph.specs\[\d+\] holds it as "):
        jaxpar.shard(dense_relu).with_plan(jaxpar.Plan.load(path))(X, W, B)


def test_negative_totals_in_a_plan_file_are_refused(tmp_path):
    import json

    plan = jaxpar.shard(dense_relu).plan(X, W, B)
    for field in ("cost", "rows"):
        data = json.loads(json.dumps(plan.to_json()))
        if field == "cost":
            data["cost"]["comm_s"] = -1.0
        else:
            data["rows"][0]["cost_s"] = -1.0
        path = tmp_path / "plan.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=f"corrupt plan file .*field {field}"):
            jaxpar.Plan.load(path)
    plan.save(tmp_path / "fine.json")
    assert jaxpar.Plan.load(tmp_path / "fine.json").cost == plan.cost


def test_a_file_that_is_not_text_is_named_with_its_reader(tmp_path):
    """Bytes that are not UTF-8 raised a bare UnicodeDecodeError naming neither the file nor
    the call."""
    blob = tmp_path / "blob.json"
    blob.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match=r"Plan.load\(.*blob.json'\): cannot read a plan"):
        jaxpar.Plan.load(blob)
    yaml_blob = tmp_path / "blob.yaml"
    yaml_blob.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match=r"hardware=.*blob.yaml.*cannot read"):
        jaxpar.shard(dense_relu, hardware=str(yaml_blob)).plan(X, W, B)
    with pytest.raises(ValueError, match=r"blob.yaml: not a YAML text file"):
        jaxpar.load_config(yaml_blob)


def test_a_plan_file_of_another_format_version_shows_the_value_as_written(tmp_path):
    import json

    data = jaxpar.shard(dense_relu).plan(X, W, B).to_json()
    data["version"] = str(data["version"])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"format version '1' is not 1"):
        jaxpar.Plan.load(path)


def test_plan_files_that_python_cannot_read_or_that_hide_a_plan_are_refused(tmp_path):
    import json

    path = tmp_path / "plan.json"
    path.write_text("[" * 100000 + "]" * 100000)  # was a RecursionError traceback
    with pytest.raises(ValueError, match=r"cannot read a plan \(nested too deeply\)"):
        jaxpar.Plan.load(path)
    path.write_text('{"format": "jaxpar-plan", "version": ' + "9" * 5000 + "}")
    with pytest.raises(ValueError, match=r"plan.json'\): cannot read a plan \(Exceeds"):
        jaxpar.Plan.load(path)  # the message named no file
    inner = jaxpar.shard(dense_relu).plan(X, W, B).to_json()
    path.write_text(json.dumps({"format": "jaxpar-plans", "version": 1,
                                "plans": [inner | {"version": 99}, inner]}))
    with pytest.raises(ValueError, match=r"format version 99 is not 1"):
        jaxpar.plan.load_plans(path)  # each plan's own version went unchecked


@pytest.mark.parametrize("in_strategy", [None, ((1, 8),)])
def test_results_with_no_elements_come_back_readable(in_strategy):
    """XLA returns an empty result whole on every device whatever its out_sharding says; cut,
    the array labelled (0, 16) blocks as (0, 2) shards and reading it failed inside jax."""
    a = jnp.ones((0, 32))
    y = jaxpar.shard(lambda a: a * 2, in_strategy=in_strategy)(a)
    np.testing.assert_array_equal(np.asarray(y), np.zeros((0, 32)))
    z = jaxpar.shard(lambda a, b: a @ b.T)(a, jnp.ones((16, 32)))
    assert np.asarray(z).shape == (0, 16)


def _two_processes(monkeypatch, rank: int, plan_of_0=None):
    """This process as `rank` of two whose other process planned otherwise (the all-gathered
    plan digests differ; the shapes' are alike), process 0's plan being `plan_of_0`."""
    from jax.experimental import multihost_utils

    sent = []

    def allgather(x):
        other = x.copy()
        other[len(x) // 2:] += 1  # the row's first half is the arguments' shapes
        return np.stack([other, x] if rank else [x, other])

    def broadcast(x):  # process 0's bytes: its plan's length, then the plan
        sent.append(x)
        text = json.dumps(plan_of_0.to_json()).encode() if plan_of_0 is not None else b""
        return np.int32(len(text)) if np.ndim(x) == 0 else np.frombuffer(text, np.uint8)

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: rank)
    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", broadcast)
    return sent


def test_a_process_that_planned_apart_runs_process_0s_plan(monkeypatch):
    """Each process plans on its own; a search stopped by its time limit on a busier machine
    gave one process another plan, and the first step died inside gloo after 30 s. Process
    0's plan is now every process's."""
    theirs = jaxpar.shard(dense_relu, search_mode="sharding_propagation",
                          in_strategy=((1, 8), None, None)).plan(X, W, B)
    f = jaxpar.shard(dense_relu)
    assert f.plan(X, W, B).flat_in_specs != theirs.flat_in_specs  # planned otherwise
    _two_processes(monkeypatch, 1, theirs)
    with pytest.warns(UserWarning, match=r"dense_relu: this process \(process 1\) planned it "
                                         r"otherwise than process 0 .* runs process 0's plan"):
        y = f(X, W, B)
    np.testing.assert_allclose(y, jax.jit(dense_relu)(X, W, B), rtol=1e-5)
    assert f.plan(X, W, B).flat_in_specs == theirs.flat_in_specs
    assert f.plan(X, W, B).to_json()["graph"] == theirs.to_json()["graph"]


def test_process_0_keeps_its_plan_and_sends_it(monkeypatch):
    f = jaxpar.shard(dense_relu)
    mine = f.plan(X, W, B)
    sent = _two_processes(monkeypatch, 0, mine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say on process 0
        np.testing.assert_allclose(f(X, W, B), jax.jit(dense_relu)(X, W, B), rtol=1e-5)
    assert len(sent) == 2 and bytes(sent[1]) == json.dumps(mine.to_json()).encode()
    assert f.plan(X, W, B) is mine
    f(X, W, B)
    assert len(sent) == 2  # agreed once, before the first run


def test_processes_agree_on_a_plan_called_inside_jit_too(monkeypatch):
    """Inside jax.jit (grad, vmap, ...) no process checked the plans: two ranks compiled
    different collectives and died in a gloo timeout."""
    theirs = jaxpar.shard(dense_relu, search_mode="sharding_propagation",
                          in_strategy=((1, 8), None, None)).plan(X, W, B)
    f = jaxpar.shard(dense_relu)
    _two_processes(monkeypatch, 1, theirs)
    with pytest.warns(UserWarning, match=r"runs process 0's plan"):
        y = jax.jit(f)(X, W, B)
    np.testing.assert_allclose(y, jax.jit(dense_relu)(X, W, B), rtol=1e-5)
    assert f.plan(X, W, B).flat_in_specs == theirs.flat_in_specs


def test_a_lowered_program_is_called_as_the_function_is():
    """f.lower(...).compile() took the flat leaves and returned a flat tuple (in sorted-key
    order for a dict), where jax.jit(f).lower(...).compile() takes the function's arguments
    and returns its outputs' structure; called with the arguments, it failed inside JAX."""
    def f(p, x):
        return {"y": jnp.tanh(x @ p["w"]), "n": x.sum()}

    p, x = {"w": W}, X
    sf = jaxpar.shard(f, in_strategy=(None, (8, 1)))
    compiled = sf.lower(p, x).compile()
    want = jax.jit(f)(p, x)
    got = compiled(p, x)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5)
    assert got["y"].sharding.spec == sf.plan(p, x).out_specs["y"]
    assert sf.plan(p, x).verify(compiled).ok
    # donate_argnums holds for the lowered program too
    double = jaxpar.shard(lambda p, x: {"x": x * 2}, in_strategy=(None, (8, 1)),
                          donate_argnums=1)
    placed = jax.device_put(x, NamedSharding(double.mesh, P(("d0", "d1", "d2"))))
    np.testing.assert_allclose(double.lower(p, x).compile()(p, placed)["x"], X * 2)
    assert placed.is_deleted()


def test_lower_takes_process_0s_plan(monkeypatch):
    theirs = jaxpar.shard(dense_relu, search_mode="sharding_propagation",
                          in_strategy=((1, 8), None, None)).plan(X, W, B)
    f = jaxpar.shard(dense_relu)
    _two_processes(monkeypatch, 1, theirs)
    with pytest.warns(UserWarning, match=r"runs process 0's plan"):
        compiled = f.lower(X, W, B).compile()
    assert [s.spec for s in compiled.input_shardings[0]] == \
        [s.to_pspec() for s in theirs.flat_in_specs]


def test_processes_that_pass_arguments_of_other_shapes_are_refused_before_placing(monkeypatch):
    """Process 0 passing x of (16, 8) and process 1 of (8, 8) planned the same specs: the call
    made one global array of two shapes, silently or dying inside gloo."""
    from jax.experimental import multihost_utils

    def allgather(x):  # a second process whose arguments' shapes differ, its plan alike
        other = x.copy()
        other[0] += 1
        return np.stack([x, other])

    placed = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    monkeypatch.setattr(jaxpar.api, "_placed", lambda *a: placed.append(1))
    with pytest.raises(ValueError, match=r"dense_relu: the processes passed arguments of other "
                       r"shapes or dtypes \(processes \[1\] differ from process 0; process 0 "
                       r"passed x \(32, 128\) float32, weight \(128, 10\) float32"):
        jaxpar.shard(dense_relu)(X, W, B)
    assert not placed


def test_numpy_arrays_of_ml_dtypes_are_taken():
    """A numpy bfloat16 (float8, int4) array, numpy's dtype kind 'V' like a void, was refused
    as a dtype "JAX cannot hold" (jax.jit takes it)."""
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn, jnp.int4):
        x = np.ones((16, 8), dtype=dtype)
        got = jaxpar.shard(lambda x: x * 2, in_strategy=((8, 1),))(x)
        want = jax.jit(lambda x: x * 2)(x)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(TypeError, match=r"numpy array of dtype \|V4, which JAX cannot hold"):
        jaxpar.shard(lambda x: x)(np.zeros(8, dtype="V4"))


def test_a_float0_argument_is_named_as_a_zero_tangent():
    """A float0 array (jax.grad(..., allow_int=True)'s tangent of an integer input) was refused
    as a dtype "JAX cannot hold", which jax.jit takes: jaxpar cannot place it, and says what it
    is and how to leave it out."""
    zero = np.zeros((3,), jax.dtypes.float0)
    with pytest.raises(TypeError, match=r"argument t is a numpy array of dtype float0 \(the zero "
                       r"tangent .*allow_int=True.*Leave it out of the call"):
        jaxpar.shard(lambda x, t: x * 2)(X, zero)


@pytest.mark.parametrize("setting,value", [("jax_enable_x64", True),
                                           ("jax_threefry_partitionable", False)])
def test_a_changed_jax_setting_plans_again(setting, value):
    """A sharded function kept the program of its first call after jax.config changed: int32
    results under x64 (jax.jit's int64), the random bits of the other threefry (1.36 off)."""
    def g(k, x):
        return jnp.sum(x.astype(int)), x * jax.random.uniform(k, x.shape)

    k, x = jax.random.key(1), jnp.arange(128.0).reshape(16, 8)
    f = jaxpar.shard(g, in_strategy=(None, (8, 1)))
    f(k, x)
    old = getattr(jax.config, setting)
    jax.config.update(setting, value)
    try:
        for got, want in zip(f(k, x), jax.jit(g)(k, x), strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=1e-6)
    finally:
        jax.config.update(setting, old)


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming"])
def test_a_plan_with_an_empty_output_says_how_it_comes_back(mode):
    """An output with no elements comes back replicated whatever its spec (XLA returns it
    whole): the plan said cut, so verify() failed on jaxpar's own plan."""
    x = jnp.zeros((0, 8))
    f = jaxpar.shard(lambda x: x + 1, out_strategy=((1, 8),), search_mode=mode)
    plan = f.plan(x)
    assert plan.flat_out_specs[0].axes() == ()
    assert any("outputs with no elements come back replicated" in n for n in plan.notes)
    v = plan.verify(f.lower(x).compile())
    assert v.ok and not v.sharding_mismatches
    assert f(x).shape == (0, 8)


def test_an_ordered_debug_print_is_refused_before_planning():
    """jax.debug.print(..., ordered=True) failed inside JAX's lowering at the first call (its
    ordered effects run on one device only); an ordered io_callback, which JAX shards, runs."""
    from jax.experimental import io_callback

    def printing(x):
        jax.debug.print("{}", x.sum(), ordered=True)
        return x * 2

    with pytest.raises(ValueError, match=r"printing: it has ordered effects \(OrderedDebugEffect"
                                         r"\), which JAX cannot run on more than one device"):
        jaxpar.shard(printing).plan(X)
    seen = []

    def calling(x):
        io_callback(lambda v: seen.append(float(v)), None, x.sum(), ordered=True)
        return x * 2

    np.testing.assert_allclose(jaxpar.shard(calling)(X), 2 * X)
    assert seen == [pytest.approx(float(X.sum()), rel=1e-5)]


def test_a_host_callbacks_result_broadcast_is_predicted():
    """A pure_callback or io_callback runs on one device and XLA all-reduces its results to
    the others: a collective the plan did not predict, so verify() failed."""
    from jax.experimental import io_callback

    def pure(x):
        y, z = jax.pure_callback(lambda v: (np.asarray(v) * 2, np.asarray(v)[:2]),
                                 (jax.ShapeDtypeStruct(x.shape, x.dtype),
                                  jax.ShapeDtypeStruct((2, 8), x.dtype)), x)
        return y + 1, z

    def io(x):
        return io_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype),
                           x) + 1

    a = jnp.arange(64.0).reshape(8, 8)
    for fn, moved in ((pure, (64 + 16) * 4), (io, 64 * 4)):
        f = jaxpar.shard(fn)
        plan = f.plan(a)
        assert plan.collectives == {"all-reduce": {"count": 1, "bytes": moved}}
        assert plan.verify(f.lower(a).compile()).ok
        for got, want in zip(jax.tree.leaves(f(a)), jax.tree.leaves(fn(a)), strict=True):
            np.testing.assert_allclose(got, want)


def test_a_forward_of_params_then_batch_is_reported_data_parallel():
    """fwd(params, x) took x, all but the first argument, for the weights: a data parallel
    plan (x cut, params whole) was reported as "tp8"."""
    from jaxpar.models.mlp import init_mlp, mlp_forward

    params = init_mlp(jax.random.key(0), [64, 64, 64])
    plan = jaxpar.shard(mlp_forward, in_strategy=(None, (8, 1))).plan(params, jnp.ones((64, 64)))
    assert plan.flat_in_specs[-1] == jaxpar.Spec((("d0", "d1", "d2"), ()))
    assert plan.layout == "dp8"
    assert jaxpar.shard(dense_relu, in_strategy=((8, 1), None, None)).plan(X, W, B).layout == "dp8"


def test_an_activation_returned_in_its_arguments_place_is_not_reported_as_a_weight():
    """`layer(x, w) -> x + tanh(x @ w)` returns x's shape in x's place, so x is carried (tied
    in and out) like a step's parameters; the layout report took it for the weight and
    called data parallel "tp8" and tensor parallel "dp8". Only a program that differentiates
    (a training step) has its carried state taken for weights."""
    x, w = jnp.ones((16, 8)), jnp.ones((8, 8))

    def layer(a, w):
        return a + jnp.tanh(a @ w)

    def sgd(w, a):  # a training step of one weight: w comes back updated
        return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(a @ w)))(w)

    def scanned(a, w):  # the carry of a scan comes back in its argument's place too
        return jax.lax.scan(lambda c, _: (layer(c, w), None), a, None, length=3)[0]
    for fn in (layer, scanned):
        assert jaxpar.shard(fn, in_strategy=((8, 1), (1, 1))).plan(x, w).layout == "dp8"
    assert jaxpar.shard(layer, in_strategy=((1, 1), (1, 8))).plan(x, w).layout == "tp8"
    assert build_graph(trace(layer, (x, w)).closed_jaxpr).differentiates is False
    assert build_graph(trace(sgd, (w, x)).closed_jaxpr).differentiates is True
    assert jaxpar.shard(sgd, in_strategy=((1, 1), (8, 1))).plan(w, x).layout == "dp8"
    assert jaxpar.shard(sgd, in_strategy=((1, 8), (1, 1))).plan(w, x).layout == "tp8"
