"""Acceptance programs through jaxpar.shard: single-device numbers and predicted collectives.

Each program (attention, a top-2 MoE layer, a conv net with pooling, a scan over layers, cond and
fori_loop, a while loop, embedding gather + cross-entropy, a jax.grad training step) runs sharded
and must equal unsharded jax.jit; the plan's predicted collective bytes must be within 10% of
what the compiled program really moves (jaxpar.collective_stats).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.models import COMMUNICATING, PROGRAMS
from jaxpar.verify import Verification


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_program_matches_single_device_and_predicted_bytes(name):
    fn, args, in_strategy = PROGRAMS[name]()
    f = jaxpar.shard(fn, in_strategy=in_strategy, hardware="h100-nvlink")
    got, want = f(*args), jax.jit(fn)(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
    plan = f.plan(*args)
    check = plan.verify(f.lower(*args).compile())
    assert check.bytes_ok, f"{name}: predicted vs measured\n{check}"
    if name in COMMUNICATING:
        assert check.measured_bytes > 0, f"{name} was expected to communicate"
    assert not check.sharding_mismatches, check.sharding_mismatches


@pytest.mark.parametrize("mode", ["sharding_propagation", "dynamic_programming"])
def test_training_step_keeps_its_state_sharding(mode):
    fn, (params, x, y), in_strategy = PROGRAMS["mlp_train_step"]()
    f = jaxpar.shard(fn, in_strategy=in_strategy, search_mode=mode)
    plan = f.plan(params, x, y)
    n = len(jax.tree_util.tree_leaves(params))
    assert plan.flat_out_specs[:n] == plan.flat_in_specs[:n]  # params out as params came in
    assert any("carried state" in note for note in plan.notes)
    new_params, _ = f(params, x, y)
    for a, b in zip(jax.tree_util.tree_leaves(new_params),
                    jax.tree_util.tree_leaves(f(new_params, x, y)[0]), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


@pytest.mark.parametrize("mode", ["sharding_propagation", "dynamic_programming",
                                  "recursive_programming"])
@pytest.mark.parametrize("params_fixed", [False, True])
def test_a_data_parallel_step_moves_one_all_reduce_of_its_gradients(mode, params_fixed):
    # The batch cut 8 ways and the parameters free, or fixed replicated: the step is data
    # parallel, as jit partitions it (one all-reduce of the gradients and the loss). Before,
    # sharding propagation reduce-scattered each gradient (cheapest for its matmul alone),
    # updated the parameters cut and gathered them back at the end of the step (369 us
    # modelled against 76), and dynamic_programming, with the parameters fixed, left out the
    # price of gathering them back (436 us).
    fn, (params, x, y), in_strategy = PROGRAMS["mlp_train_step"]()
    if params_fixed:
        in_strategy = (jax.tree_util.tree_map(lambda _: P(), params),) + in_strategy[1:]
    f = jaxpar.shard(fn, in_strategy=in_strategy, search_mode=mode)
    plan = f.plan(params, x, y)
    check = plan.verify(f.lower(params, x, y).compile())
    grads = sum(p.nbytes for p in jax.tree_util.tree_leaves(params))
    assert check.measured == {"all-reduce": {"count": 1, "bytes": grads + 4}}, check
    assert check.predicted["all-reduce"]["bytes"] == grads + 4, check
    assert plan.flat_out_specs[:len(jax.tree_util.tree_leaves(params))] == \
        plan.flat_in_specs[:len(jax.tree_util.tree_leaves(params))]


def test_sharding_propagation_over_a_memory_budget_searches_again_with_larger_mem_coeffs():
    # The refined data-parallel step holds every parameter whole (75.8 KB at its peak). Under
    # a budget of 65 KB this mode kept the propagated plan (59.5 KB, 6.5x the unbudgeted
    # modelled time) and refused every budget below that; it now searches again with larger
    # mem_coeffs: 2.0x at 65 KB, and 40 KB is met (the least any plan can hold: 31.6 KB).
    fn, (params, x, y), in_strategy = PROGRAMS["mlp_train_step"]()
    free = jaxpar.shard(fn, in_strategy=in_strategy).plan(params, x, y)
    f = jaxpar.shard(fn, in_strategy=in_strategy, memory_budget=65_000)
    plan = f.plan(params, x, y)
    assert free.cost.peak_memory_bytes > 65_000 >= plan.cost.peak_memory_bytes
    assert plan.cost.total_s < 3 * free.cost.total_s
    assert any("so it searched again with larger mem_coeffs" in note for note in plan.notes)
    np.testing.assert_allclose(f(params, x, y)[1], jax.jit(fn)(params, x, y)[1], rtol=1e-5)
    lean = jaxpar.shard(fn, in_strategy=in_strategy, memory_budget=40_000).plan(params, x, y)
    assert lean.cost.peak_memory_bytes <= 40_000
    with pytest.raises(ValueError, match=r"no plan holds less than \d+ bytes per device.*"
                                         r"sharding_propagation's plan peaks at 75844"):
        jaxpar.shard(fn, in_strategy=in_strategy, memory_budget=30_000).plan(params, x, y)


def test_training_step_can_loop_on_its_own_outputs():
    fn, (params, x, y), in_strategy = PROGRAMS["mlp_train_step"]()
    f = jaxpar.shard(fn, in_strategy=in_strategy)
    ref = jax.jit(fn)
    p1, p2 = params, params
    for _ in range(3):
        (p1, l1), (p2, l2) = f(p1, x, y), ref(p2, x, y)
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
    assert float(l1) < float(jax.jit(fn)(params, x, y)[1])


def test_verification_allows_a_few_bytes_and_ten_percent():
    # XLA reduces a scalar loss over a 2-D mesh once per axis: 8 bytes where 4 were planned.
    ar = lambda count, nbytes: {"all-reduce": {"count": count, "bytes": nbytes}}  # noqa: E731
    assert Verification(ar(1, 4.0), ar(2, 8)).bytes_ok
    assert Verification(ar(1, 1e6), ar(1, 1.09e6)).bytes_ok
    assert not Verification(ar(1, 1e6), ar(1, 1.2e6)).bytes_ok
    assert not Verification(ar(1, 4.0), ar(3, 1000)).bytes_ok


def test_verification_names_the_kinds_that_differ_where_the_totals_agree():
    """verify's `ok` compares totals (XLA may run a move by another kind); a plan that named an
    all-reduce what the program runs as a reduce-scatter passed with nothing said."""
    kind = lambda k, nbytes: {k: {"count": 1, "bytes": nbytes}}  # noqa: E731
    check = Verification(kind("all-reduce", 1e6), kind("reduce-scatter", 1e6))
    assert check.ok and check.kind_gaps == {"all-reduce": -1e6, "reduce-scatter": 1e6}
    assert "by kind: the totals agree" in str(check)
    same = Verification(kind("all-reduce", 1e6), kind("all-reduce", 1.05e6))
    assert same.kind_gaps == {} and "by kind" not in str(same)


def test_verification_of_bf16_reductions_widened_by_xla_cpu():
    ar = lambda nbytes: {"all-reduce": {"count": 1, "bytes": nbytes}}  # noqa: E731
    # Half of a 2000-byte f32 all-reduce may have been bf16: 1000 to 2000 bytes on a GPU.
    for planned in (1000, 1500, 2000):
        assert Verification(ar(planned), ar(2000), widened=1000).bytes_ok
    assert not Verification(ar(600), ar(2000), widened=1000).bytes_ok
    assert not Verification(ar(1000), ar(2000)).bytes_ok
    assert "widened, at most" in str(Verification(ar(1000), ar(2000), widened=1000))


def test_a_bf16_training_step_verifies_on_cpu():
    def step(w, x):
        def loss(w):
            h = jnp.tanh(x.astype(jnp.bfloat16) @ w["a"].astype(jnp.bfloat16))
            return jnp.mean((h @ w["b"].astype(jnp.bfloat16)).astype(jnp.float32) ** 2)
        g = jax.grad(loss)(w)
        return jax.tree.map(lambda p, d: p - 0.1 * d, w, g)

    rng = np.random.default_rng(0)
    w = {"a": jnp.asarray(rng.standard_normal((64, 128)), jnp.float32),
         "b": jnp.asarray(rng.standard_normal((128, 16)), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    f = jaxpar.shard(step, in_strategy=(None, (8, 1)), hardware="h100-nvlink",
                     search_mode="recursive_programming")  # data parallel: bf16 gradients
    check = f.plan(w, x).verify(f.lower(w, x).compile())
    assert check.widened > 0 and check.measured_bytes > 1.5 * check.predicted_bytes
    assert check.bytes_ok, str(check)


def test_a_bf16_gather_verifies_on_cpu():
    # XLA:CPU gathers bf16 as f32: the plan's bf16 bytes are half what it measures.
    f = jaxpar.shard(lambda x: jnp.sin(x) * 2, in_strategy=((8, 1),), out_strategy=((1, 1),))
    x = jnp.ones((64, 16), jnp.bfloat16)
    check = f.plan(x).verify(f.lower(x).compile())
    assert (check.predicted_bytes, check.measured_bytes) == (64 * 16 * 2, 64 * 16 * 4)
    assert check.bytes_ok, str(check)


def test_a_scan_trained_through_moves_what_its_plan_says():
    """A scan over stacked weights and its backward scan, which reads the forward's residuals:
    each loop's state (carry, xs slices) is laid out as its plan says, so the partitioner
    neither gathers the residuals before the backward loop nor moves the carry again after
    the forward one (it did: 131,076 bytes for a plan of 98,308)."""
    def loss(ws, x):
        x, _ = jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)
        return x.mean()

    def step(ws, x):
        value, grad = jax.value_and_grad(loss)(ws, x)
        return ws - 0.1 * grad, value

    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.standard_normal((3, 64, 64)) * 0.1, jnp.float32)
    x = jnp.asarray(rng.standard_normal((8, 16, 64)) * 0.1, jnp.float32)
    f = jaxpar.shard(step, hardware="h100-nvlink")
    for got, want in zip(f(ws, x), jax.jit(step)(ws, x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    check = f.plan(ws, x).verify(f.lower(ws, x).compile())
    assert check.measured_bytes == check.predicted_bytes > 0, str(check)


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming"])
def test_cond_branches_planned_apart_return_their_results_alike(mode):
    """The branches of a cond are planned apart (tanh in one, relu in the other, each cut as
    its own ops prefer) into the cond's result specs; lowered, each branch's results must be
    laid out so, or XLA refuses the program ("Inconsistent conditional sharding")."""
    def fn(w, x, flag):
        def loss(w):
            h = jax.lax.cond(flag, jnp.tanh, lambda h: jax.nn.relu(h) * 0.5, x @ w)
            return jnp.sum(h ** 2)
        return jax.value_and_grad(loss)(w)

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((32, 64)) * 0.1, jnp.float32)
    x = jnp.asarray(rng.standard_normal((16, 32)) * 0.1, jnp.float32)
    f = jaxpar.shard(fn, mesh=jaxpar.make_mesh((4, 2), ("dp", "tp")), search_mode=mode)
    for flag in (True, False):
        got, want = f(w, x, jnp.asarray(flag)), jax.jit(fn)(w, x, jnp.asarray(flag))
        for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                        strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


def test_state_one_cond_updates_is_placed_per_shape():
    """optax.MultiSteps updates every state leaf (its step counters, the accumulated
    gradients, the inner optimizer's state) in one cond: the carried units it makes are told
    apart by their shapes, or a scalar counter's spec was given to a matrix."""
    import optax

    params = {"w": jnp.full((16, 32), 0.1), "b": jnp.zeros(32)}
    tx = optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=2)

    def step(p, state, x):
        g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(p)
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state

    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 16)), jnp.float32)
    f = jaxpar.shard(step, search_mode="recursive_programming")
    state, ref_state, p, ref_p = tx.init(params), tx.init(params), params, params
    for _ in range(2):  # the second call takes the other branch (an update every 2)
        p, state = f(p, state, x)
        ref_p, ref_state = jax.jit(step)(ref_p, ref_state, x)
    for g, r in zip(jax.tree_util.tree_leaves((p, state)),
                    jax.tree_util.tree_leaves((ref_p, ref_state)), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


def _scalar_reads(x, w):
    h = x @ w
    return h * w[0, 0] + h * w[1, 1] + h * w[2, 2]


def _twice_returned(x, w):
    y = x @ w
    return y, y, x


def _scanned_scalar_reads(x, w):
    def body(h, _):
        return jnp.tanh(h @ w) * w[0, 0] + h * w[1, 1], None
    return jax.lax.scan(body, x, None, length=2)[0]


def _whole_and_row(x, w):  # w gathered whole for one reader, for the other a row of it
    return x[:, :8] * w[0, 0] + jnp.sum(w[2])


def _scanned_invariant_product(x, w):  # w @ w.T computed from a constant only
    def body(h, _):
        return jnp.tanh(h @ (w @ w.T)), None
    return jax.lax.scan(body, x[:, :16], None, length=8)[0]


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming",
                                  "dynamic_programming"])
@pytest.mark.parametrize("case", [
    (_scalar_reads, (None, (1, 8)), None, (32, 8)),            # three readers gather w once
    (_twice_returned, ((8, 1), None), (P(), P(), P()), (32, 8)),  # y returned twice: once
    (_scanned_scalar_reads, (None, (1, 8)), None, (32, 32)),   # in a loop's body, and w
                                                                 # gathered once, out of it
    (_whole_and_row, (None, (8, 1)), None, (32, 8)),           # one gather: CSE, then a slice
    (_scanned_invariant_product, (None, (1, 8)), None, (16, 64)),  # hoisted with its reduction
], ids=["readers", "outputs", "scan-body", "gather-then-slice", "scan-invariant-op"])
def test_a_value_several_readers_need_alike_is_predicted_moved_once(case, mode):
    """XLA reshards a value once for every reader that reshards it by the same collectives
    (its CSE merges them), and what a loop computes from its constants alone once for every
    trip (it hoists it out of the loop, collectives included); the plan predicted one
    resharding per reader and per trip (3 x 1024 bytes gathered where 1024 were; 20480 bytes
    in the scan where 8192 were; an all-reduce 8 x 8192 bytes where 1024 were), and verify
    failed."""
    fn, in_strategy, out_strategy, w_shape = case
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32) * 0.1
    f = jaxpar.shard(fn, in_strategy=in_strategy, out_strategy=out_strategy, search_mode=mode)
    for g, r in zip(jax.tree_util.tree_leaves(f(x, w)),
                    jax.tree_util.tree_leaves(jax.jit(fn)(x, w)), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    check = f.plan(x, w).verify(f.lower(x, w).compile())
    assert check.measured_bytes > 0 and check.bytes_ok, str(check)


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming",
                                  "dynamic_programming"])
def test_a_while_loop_counted_between_literals_is_priced_per_trip(mode):
    """XLA runs a while loop counting a carry from one literal to another (here 2 to 5) a
    known number of times, every collective in its body once per trip; the plan priced one
    trip (2048 bytes reduce-scattered where 6144 were). A bound it cannot see (a traced n)
    stays one trip for both. (w is big enough that gathering it costs more than reducing in
    the loop each trip, so every mode reduces there.)"""
    from jaxpar.ir import build_graph, trace
    from jaxpar.search.regions import known_trips

    def counted(x, w):
        return jax.lax.while_loop(lambda s: s[0] < 5, lambda s: (1 + s[0], jnp.tanh(s[1] @ w)),
                                  (2, x))[1]

    def traced(x, w, n):
        return jax.lax.fori_loop(0, n, lambda i, h: jnp.tanh(h @ w), x)

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 512)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((512, 512)) * 0.05, jnp.float32)
    f = jaxpar.shard(counted, in_strategy=((1, 8), (8, 1)), search_mode=mode)
    np.testing.assert_allclose(f(x, w), jax.jit(counted)(x, w), rtol=1e-5, atol=1e-6)
    check = f.plan(x, w).verify(f.lower(x, w).compile())
    per_trip = {k: v["count"] for k, v in check.measured.items() if v["count"] == 3}
    assert check.ok and per_trip, str(check)
    assert all(check.predicted[k]["count"] == 3 for k in per_trip), str(check)
    for fn, args, trips in ((counted, (x, w), 3), (traced, (x, w, 3), None)):
        t = trace(fn, args)
        (loop,) = [op for op in build_graph(t.closed_jaxpr, t.in_paths).ops if op.name == "while"]
        assert known_trips(loop) == trips


@pytest.mark.parametrize("start, test, step, trips", [
    (0, lambda i: i <= 4, lambda i: i + 1, 5), (0, lambda i: i != 5, lambda i: 1 + i, 5),
    (0, lambda i: i < 10, lambda i: i + 2, 5), (5, lambda i: i > 0, lambda i: i - 1, 5),
    (5, lambda i: 0 < i, lambda i: i + -1, 5), (9, lambda i: i >= 1, lambda i: i - 2, 5),
    (7, lambda i: i < 5, lambda i: i + 1, 0), (0, lambda i: i != 9, lambda i: i + 2, None),
    (0, lambda i: i < 5, lambda i: i - 1, None), (0, lambda i: i < 5, lambda i: 5 - i, None),
    (0, lambda i: i < 200, lambda i: i + 3, 67), (0, lambda i: 200 > i, lambda i: i + 1, 200),
    (0, lambda i: i != 128, lambda i: i + 1, 128), (0, lambda i: i != 129, lambda i: i + 1, None),
    (199, lambda i: i >= 0, lambda i: i - 1, None)])
def test_while_trip_counts_in_the_forms_xla_counts(start, test, step, trips):
    """Only `i < literal` with `i + 1` was counted: `i <= 4`, `i != 5`, a step of 2 or a
    counter going down priced one trip where XLA ran five (the compiled program moved 5x the
    predicted bytes). None: forever (9 never met by even steps; moving away from the bound),
    not a step (5 - i), or a form XLA only runs through (over 128 trips it counts one)."""
    from jaxpar.ir import build_graph, trace
    from jaxpar.search.regions import known_trips

    def fn(x, w):
        return jax.lax.while_loop(lambda s: test(s[1]), lambda s: (jnp.tanh(s[0] @ w),
                                                                   step(s[1])), (x, start))[0]

    x, w = jnp.ones((32, 16)), jnp.eye(16)
    t = trace(fn, (x, w))
    (loop,) = [op for op in build_graph(t.closed_jaxpr, t.in_paths).ops if op.name == "while"]
    assert known_trips(loop) == trips
    if trips == 5 and start == 0 and test(4) and not test(5):  # i <= 4 and i != 5: compiled
        f = jaxpar.shard(fn, in_strategy=((1, 8), None), search_mode="sharding_propagation")
        check = f.plan(x, w).verify(f.lower(x, w).compile())
        assert check.ok and check.predicted == {
            k: {"count": v["count"], "bytes": float(v["bytes"])}
            for k, v in check.measured.items()}, str(check)


@pytest.mark.parametrize("mode", ["sharding_propagation", "dynamic_programming"])
def test_a_loop_that_never_runs_moves_nothing(mode):
    """XLA deletes a loop it knows never runs; a reduction of a loop constant in its body was
    still priced once, as if hoisted out of it (256 bytes predicted, none moved)."""
    def never(x):
        return jax.lax.while_loop(lambda s: s[0] != 0, lambda s: (s[0] - 1, s[1] + x.sum(0)),
                                  (0, jnp.zeros(16)))[1]

    def empty(x):
        return jax.lax.scan(lambda c, _: (c + x.sum(0), None), jnp.zeros(16), None,
                            length=0)[0]

    x = jnp.ones((64, 16))
    for fn in (never, empty):
        f = jaxpar.shard(fn, in_strategy=((8, 1),), search_mode=mode)
        np.testing.assert_allclose(f(x), jax.jit(fn)(x))
        check = f.plan(x).verify(f.lower(x).compile())
        assert check.ok and check.predicted == {} and check.measured == {}, str(check)


def test_a_while_loops_condition_is_priced_one_run_more_than_its_body():
    """The condition of a while loop whose bound is traced runs twice for the body's one trip
    (the test that ends the loop), as the compiled program's collectives count it; the plan
    priced it once (an all-gather and an all-reduce of 8,192 and 4 bytes, against 16,384 and
    8 measured), and verify failed on a plan that was right."""
    def f(x):
        return jax.lax.while_loop(lambda c: jnp.max(c @ c.T) < 10.0, lambda c: c * 2.0, x)

    x = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) * 1e-4
    f_sharded = jaxpar.shard(f, in_strategy=((8, 1),), out_strategy=((8, 1),))
    np.testing.assert_allclose(f_sharded(x), jax.jit(f)(x), rtol=1e-6)
    check = f_sharded.plan(x).verify(f_sharded.lower(x).compile())
    assert check.measured["all-gather"]["count"] == 2, str(check)
    assert check.predicted == check.measured and check.ok, str(check)


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming",
                                  "dynamic_programming"])
def test_a_vmapped_while_loop_stops_each_row_at_its_own_trip(mode):
    """Under vmap a while loop whose test reads the mapped value tests each row (its
    condition returns bool[8]); replayed through lax.while_loop, which takes a scalar test,
    every mode failed with JAX's "cond_fun must return a boolean scalar"."""
    def f(x, step):
        def row(r):
            return jax.lax.while_loop(lambda c: c[0].sum() < 50.0,
                                      lambda c: (c[0] * 1.5 + step, c[1] + 1), (r, 0))
        return jax.vmap(row)(jnp.abs(x))

    x = jax.random.normal(jax.random.key(0), (8, 16))
    got, want = jaxpar.shard(f, search_mode=mode)(x, 0.1), jax.jit(f)(x, 0.1)
    assert len(set(np.asarray(want[1]).tolist())) > 1  # the rows stop at different trips
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


def test_a_vmapped_while_loop_keeps_its_carries_where_planned_and_prices_its_lanes():
    """A row-wise test laid out otherwise than a carry: the finished rows' carries were kept
    by a select in the test's layout, and XLA gathered the (16, 6) carry it had cut so, each
    turn and after the loop (1,538 bytes of collectives, none predicted). The test's lanes
    now go to each carry's layout (16 bytes of bool), and the plan prices them and the
    all-reduce of the loop's one predicate."""
    def f(a):
        return jax.lax.while_loop(lambda s: s[1].sum() < 50.0,
                                  lambda s: (s[0] + 1, s[1] * 1.5 + 0.1), (0, jnp.abs(a)))

    x = jax.random.normal(jax.random.key(0), (16, 6))
    net = jaxpar.AutoParallel(jax.vmap(f), "semi_auto")
    np.testing.assert_allclose(net(x)[1], jax.jit(jax.vmap(f))(x)[1], rtol=1e-6)
    check = net.plan(x).verify(net.lower(x).compile())
    assert check.measured_bytes < 64, str(check)
    assert check.predicted == check.measured, str(check)
