"""sharding_propagation on small graphs: fixed specs hold, choices follow the cost model."""

import jax
import jax.numpy as jnp
import pytest

from jaxpar.cost import CostModel, load_profile
from jaxpar.ir import build_graph, trace
from jaxpar.search import propagate
from jaxpar.search.propagation import graph_cost
from jaxpar.spec import MeshInfo, Spec

MESH = MeshInfo(("d0", "d1", "d2"), (2, 2, 2))


def plan_of(fn, args, fixed_in=None, fixed_out=None, hardware="h100-nvlink", level=0):
    graph = build_graph(trace(fn, args).closed_jaxpr)
    model = CostModel(MESH, load_profile(hardware), level)
    fixed = {graph.inputs[i]: s for i, s in (fixed_in or {}).items()}
    return graph, propagate(graph, model, fixed, fixed_out), model


def S(*dims):
    return Spec(tuple(tuple(d) if isinstance(d, tuple) else ((d,) if d else ()) for d in dims))


def test_fixed_inputs_and_outputs_are_kept():
    x, w = jnp.ones((64, 32)), jnp.ones((32, 16))
    graph, plan, _ = plan_of(lambda x, w: jnp.tanh(x @ w), (x, w),
                             {0: S(("d0", "d1", "d2"), None)}, {0: S(None, "d0")})
    assert plan.specs[graph.inputs[0]] == S(("d0", "d1", "d2"), None)
    assert set(plan.choices) == {op.index for op in graph.ops}


def test_data_parallel_input_propagates_without_communication():
    x, w1, w2 = jnp.ones((1024, 64)), jnp.ones((64, 64)), jnp.ones((64, 64))
    graph, plan, model = plan_of(lambda x, a, b: jnp.tanh(jnp.tanh(x @ a) @ b), (x, w1, w2),
                                 {0: S(("d0", "d1", "d2"), None)})
    assert plan.specs[graph.inputs[1]] == S(None, None)  # weights replicated
    assert graph_cost(graph, plan, model).comm_bytes == 0


def test_megatron_pair_search_is_no_worse_than_row_parallel():
    # x replicated, w1 cut by columns. Row-parallel w2 costs one all-reduce; the search must
    # find a plan at least that cheap, and under level 1 (memory) must not replicate w2.
    x, w1, w2 = jnp.ones((256, 1024)), jnp.ones((1024, 4096)), jnp.ones((4096, 1024))
    fn, args = (lambda x, a, b: jax.nn.relu(x @ a) @ b), (x, w1, w2)
    fixed = {0: S(None, None), 1: S(None, ("d0", "d1", "d2"))}
    graph, plan, model = plan_of(fn, args, fixed)
    _, megatron, _ = plan_of(fn, args, fixed | {2: S(("d0", "d1", "d2"), None)})
    assert [c.kind for c in graph_cost(graph, megatron, model).collectives] in (
        ["all-reduce"], ["reduce-scatter"])  # the row-parallel matmul's one reduction
    chosen, row = graph_cost(graph, plan, model), graph_cost(graph, megatron, model)
    assert model.score(chosen) <= model.score(row)
    _, lean, _ = plan_of(fn, args, fixed, level=1)
    assert lean.specs[graph.inputs[2]].shards(MESH) > 1


def test_scan_carry_keeps_one_spec():
    def f(x, ws):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), jnp.sum(c)), x, ws)

    graph, plan, _ = plan_of(f, (jnp.ones((64, 32)), jnp.ones((3, 32, 32))),
                             {0: S(("d0", "d1"), None)})
    scan = next(op for op in graph.ops if op.name == "scan")
    choice = plan.choices[scan.index]
    body, body_plan = scan.regions[0], choice.regions[0]
    carry_in = body_plan.specs[body.inputs[0]]
    assert carry_in == S(("d0", "d1"), None)
    assert choice.strategy.outs[0] == carry_in and choice.trips == 3


def test_unconstrained_program_still_gets_a_full_plan():
    graph, plan, _ = plan_of(lambda x: jnp.sum(jnp.exp(x) * 2.0), (jnp.ones((64, 64)),))
    assert len(plan.choices) == len(graph.ops)
    assert all(v in plan.specs for v in graph.inputs)


def test_specs_are_interned_and_survive_pickling():
    import pickle

    a, b = S(("d0", "d1"), None), S(("d0", "d1"), None)
    assert a is b and hash(a) == hash(b) and a != S("d0", None)
    assert pickle.loads(pickle.dumps(a)) is a
    assert a.resolved() is a
    partial = Spec(a.dims, ("d2",))
    assert partial != a and partial.resolved() is a
    assert a.shards(MESH) == 4 and a.fits((8, 3), MESH) and not a.fits((6, 3), MESH)


def _mlp_graph():
    x, w1, w2 = jnp.ones((64, 128)), jnp.ones((128, 256)), jnp.ones((256, 128))
    fn = lambda x, a, b: jnp.sum(jax.nn.relu(x @ a) @ b)  # noqa: E731
    return build_graph(trace(fn, (x, w1, w2)).closed_jaxpr)


def test_priced_equals_pricing_candidate_by_candidate():
    from jaxpar.search.propagation import _Graph

    graph = _mlp_graph()
    model = CostModel(MESH, load_profile("h100-nvlink"))
    g = _Graph(graph, model, None)
    dot = next(op for op in graph.ops if op.name == "dot_general")
    o = g.opts(dot)
    ins = (S("d0", None), S(None, "d1"))
    needs = ((S(("d0", "d1"), None), S(None, "d2")),)
    want = [o.scores[n]
            + g.price(dot.inputs[0], ins[0], s.ins[0]) + g.price(dot.inputs[1], ins[1], s.ins[1])
            + sum(g.price(dot.outputs[0], s.outs[0], w) for w in needs[0])
            for n, s in enumerate(o.cands)]
    got = g.priced(dot, o, ins, needs)
    assert len(set(want)) > 3  # the specs price the candidates apart
    assert list(got) == want  # the same sums, added in the same order
    assert list(g.priced(dot, o, ins, needs)) == want  # again, from the columns kept
    assert list(g.priced(dot, o, (None, ins[1]), ((),))) == [
        o.scores[n] + g.price(dot.inputs[1], ins[1], s.ins[1]) for n, s in enumerate(o.cands)]
    other = S(None, "d0")  # operand 0 from another spec: priced anew, not from its column
    assert list(g.priced(dot, o, (other, None), ((),))) == [
        o.scores[n] + g.price(dot.inputs[0], other, s.ins[0]) for n, s in enumerate(o.cands)]


def test_choice_takes_the_first_cheapest_and_the_first_cheapest_other():
    from jaxpar.search.propagation import _Graph

    graph = _mlp_graph()
    g = _Graph(graph, CostModel(MESH, load_profile("h100-nvlink")), None)
    o = g.opts(next(op for op in graph.ops if op.name == "dot_general"))
    n = len(o.cands)
    inf = float("inf")

    def picked(totals):
        c = g.choice(o, totals)
        return o.cands.index(c.strategy), (o.cands.index(c.runner_up), c.score,
                                           c.runner_score)

    assert picked([5.0] * n)[0] == 0 and picked([5.0] * n)[1][0] == 1
    totals = [9.0] * n
    totals[3] = totals[5] = 1.0
    assert picked(totals) == (3, (5, 1.0, 1.0))
    totals[5], totals[7] = 2.0, 2.0
    assert picked(totals) == (3, (5, 1.0, 2.0))
    only = [inf] * n
    only[4] = 3.0  # every other infinite (an op that may only move its results)
    assert picked(only) == (4, (0, 3.0, inf))
    only[4], only[0] = inf, 3.0
    assert picked(only) == (0, (1, 3.0, inf))


class _NeverAgain(dict):
    """A memo that remembers nothing: every op priced afresh."""

    def get(self, key, default=None):
        return default


def _same_plan(a, b):
    return a.specs == b.specs and {x: c.strategy for x, c in a.choices.items()} == \
        {x: c.strategy for x, c in b.choices.items()}


def test_ops_alike_in_one_context_are_priced_once_with_the_same_plan(monkeypatch):
    # A 3-layer GPT training step: its layers' ops meet the same specs around them, so most
    # choices come from the memo; planning each op afresh must give the very same plan.
    from jaxpar.models.gpt import GPTConfig, abstract_train_step
    from jaxpar.search import propagation

    step, args = abstract_train_step(GPTConfig(layers=3, d_model=32, heads=2, vocab=64,
                                               seq=8), 4)
    graph = build_graph(trace(step, args).closed_jaxpr)
    model = CostModel(MESH, load_profile("h100-nvlink"))
    fixed = {graph.inputs[-2]: S(("d0", "d1"), None)}  # the tokens cut on the batch
    priced = []
    original = propagation._Graph.priced
    monkeypatch.setattr(propagation._Graph, "priced",
                        lambda self, *a: priced.append(1) or original(self, *a))
    memo = propagate(graph, model, fixed)
    once = len(priced)
    init = propagation._Propagation.__init__

    def forgetful(self, *a, **k):
        init(self, *a, **k)
        self.chosen = _NeverAgain()
    monkeypatch.setattr(propagation._Propagation, "__init__", forgetful)
    fresh = propagate(graph, model, fixed)
    assert len(priced) - once > 1.5 * once  # the memo saved most of the pricing
    assert _same_plan(memo, fresh)


def test_planners_of_one_graph_and_model_share_its_pricing_through_the_index():
    # Two propagations (as jaxpar.shard's default mode runs: the second with the carried
    # state pinned) share one _Graph through the GraphIndex, and plan as apart.
    from jaxpar.search.propagation import GraphIndex, _Graph

    graph = _mlp_graph()
    model, index = CostModel(MESH, load_profile("h100-nvlink")), GraphIndex(graph)
    base = _Graph.of(graph, model, None, index)
    assert _Graph.of(graph, model, None, index) is base
    assert _Graph.of(graph, CostModel(MESH, load_profile("h100-nvlink")), None,
                     index) is not base  # another model prices apart
    assert _Graph.of(graph, model, [0] * len(graph.ops), index) is not base  # with classes
    assert _Graph.of(graph, model, None) is not base  # no index: one of its own
    first = propagate(graph, model, {graph.inputs[0]: S("d0", None)}, index=index)
    pinned = {graph.inputs[0]: S(None, "d1"), graph.inputs[1]: S("d1", None)}
    again = propagate(graph, model, pinned, index=index)
    assert base.op_options  # the first propagation priced through the shared _Graph
    alone = propagate(graph, CostModel(MESH, load_profile("h100-nvlink")), pinned)
    assert _same_plan(again, alone) and not _same_plan(first, again)


class _Node:
    def __init__(self):
        self.me = [self]  # a cycle: only the cyclic collector frees it


def test_paused_gc_leaves_what_the_search_kept_out_of_the_young_generation():
    import gc
    import weakref

    from jaxpar.search import paused_gc

    assert gc.isenabled()
    gc.collect()
    with paused_gc():
        assert not gc.isenabled()
        kept = [_Node() for _ in range(20000)]
        dropped = weakref.ref(_Node())  # garbage: a cycle no one refers to
    assert gc.isenabled()
    # Without the move to the oldest generation the next allocation would walk 40k objects.
    # (Python 3.11 keeps the cycle until a full collection; 3.12 frees it at the next young
    # one: either way it goes.)
    assert gc.get_count()[0] < 1000
    gc.collect()
    assert dropped() is None and len(kept) == 20000  # garbage still goes in a full collection

    gc.freeze()  # the caller's own frozen objects stay frozen
    try:
        frozen = gc.get_freeze_count()
        with paused_gc():
            more = [_Node() for _ in range(100)]
        assert gc.get_freeze_count() == frozen and gc.isenabled() and len(more) == 100
    finally:
        gc.unfreeze()

    gc.disable()  # a caller that turned the collector off keeps it off
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def _scanned_gpt_step():
    from jaxpar.models.gpt import GPTConfig, abstract_train_step

    cfg = GPTConfig(layers=3, d_model=64, heads=4, vocab=128, seq=16, scan_layers=True)
    step, args = abstract_train_step(cfg, 16)
    traced = trace(step, args)
    graph = build_graph(traced.closed_jaxpr, traced.in_paths)
    ties = tuple((graph.inputs[i], i) for i in range(len(jax.tree_util.tree_leaves(args[:2]))))
    return graph, ties


def _models(search_bodies):
    return CostModel(MESH, load_profile("h100-nvlink"), 0, 0.1, recompute_heavy=False,
                     search_bodies=search_bodies)


def test_the_automatic_searches_solve_loop_bodies_exactly():
    """A GPT step over scanned layers: its forward and backward scans were planned by
    propagation alone; with their bodies solved exactly (for free operands, then for the
    specs a first solution gives them) both searches find far cheaper plans."""
    from jaxpar.search.exact import dynamic_programming
    from jaxpar.search.recursive import recursive_programming

    graph, ties = _scanned_gpt_step()
    scores = {}
    for searched in (False, True):
        model = _models(searched)
        dp, _ = dynamic_programming(graph, model, {}, {}, ties=ties)
        rp, _ = recursive_programming(graph, model, {}, {}, ties=ties)
        scores[searched] = [model.score(graph_cost(graph, p, model)) for p in (dp, rp)]
    (dp_before, rp_before), (dp_after, rp_after) = scores[False], scores[True]
    assert dp_after < 0.5 * dp_before  # measured: 0.065
    assert rp_after < 0.5 * rp_before  # measured: 0.065 (0.50 before the loops' neighbourhood
                                       # was solved again)
    scan = [op for op in graph.ops if op.name == "scan"]
    assert len(scan) == 2 and all(dp.choices[op.index].regions for op in scan)


def test_a_mesh_axis_solved_again_around_loops_ends_no_higher_than_it_started():
    """solve_axis keeps every op's use of the other axes and searches the plans of one axis,
    the plan it starts from among them. A loop's candidates were its bodies planned anew from
    operand specs, none of them the plan's own: from a propagated scanned GPT step, axis d1
    ended at 1.063x the objective it started from (and a Linen nn.scan step's at 13x, so
    sharding_propagation kept a plan 1.28x the exact search's modelled time). The loops now
    also take their choice in that plan, bodies and all."""
    from jaxpar.search.resolve import objective, solve_axis

    graph, ties = _scanned_gpt_step()
    model = _models(True)
    start = propagate(graph, model, {}, {}, ties=ties)
    before = objective(graph, model, start, {}, ties)
    after = [objective(graph, model, solve_axis(graph, model, start, {}, {}, ties, axis), {},
                       ties) for axis in model.mesh.names]
    assert max(after) <= before * (1 + 1e-9), (before, after)
    assert min(after) < 0.9 * before  # measured: 0.83 (d0); before the fix 0.96 at best


def test_the_automatic_searches_solve_cond_branches(monkeypatch):
    """A step under optax.apply_if_finite updates the parameters and the optimizer state in
    a cond's branch. Its branches were planned by propagation alone, from free operands: the
    update ran replicated and every gradient was gathered into it. Solved exactly (each
    branch leading in turn, the operands in the specs the update reads them in), both
    searches cut the update; the sharded step still computes what jit does."""
    import numpy as np
    import optax

    import jaxpar
    from jaxpar.search import regions

    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.standard_normal((1024, 4096)) * 0.05, jnp.float32),
              "w2": jnp.asarray(rng.standard_normal((4096, 1024)) * 0.05, jnp.float32)}
    x, y = (jnp.asarray(rng.standard_normal((256, 1024)), jnp.float32) for _ in range(2))
    tx = optax.apply_if_finite(optax.adam(1e-3, eps=1e-3), 3)  # (eps: no noise amplified)

    def step(p, st, x, y):
        g = jax.grad(lambda p: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2))(p)
        u, st = tx.update(g, st, p)
        return optax.apply_updates(p, u), st

    args = (params, tx.init(params), x, y)
    want = jax.jit(step)(*args)

    def plan(mode):
        f = jaxpar.shard(step, search_mode=mode, hardware="h100-nvlink")
        return f, f.plan(*args)

    for mode in ("recursive_programming", "dynamic_programming"):
        f, solved = plan(mode)
        cond = next(c for c in solved.graph_plan.choices.values() if len(c.regions) == 2)
        update = max(cond.regions, key=lambda p: len(p.choices))
        big = [c for c in update.choices.values()
               if any(sp.rank == 2 for sp in c.strategy.outs)]
        assert big and all(sp.axes() for c in big for sp in c.strategy.outs if sp.rank == 2)
        with monkeypatch.context() as m:  # the branches propagated only, as before
            m.delitem(regions._SEARCHED, "cond")
            before = plan(mode)[1].cost.total_s
        assert solved.cost.total_s < 0.9 * before  # measured: 0.82 and 0.61 (modelled time:
        # the gradients' layouts still differ from the update's, and three all-reduces check
        # them finite)
        for got, ref in zip(jax.tree.leaves(f(*args)), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_recursive_programming_solves_the_loops_neighbourhood_again(monkeypatch):
    """recursive_programming's walk decides the ops around a loop without the loop's costs, and
    the loop's body is then planned for what they chose: on a scanned GPT step that was 2.5x
    dynamic_programming's objective. The ops between the loops and the main ops around them,
    solved again exactly (each body also for the operand specs the plan gives it), bring it
    within 5%. (The exact searches now keep free inputs at their leanest spec of equal cost,
    exact._leanest; without that, as here, the region solve is what brings it there.)"""
    from jaxpar.search import exact
    from jaxpar.search.exact import dynamic_programming
    from jaxpar.search.recursive import recursive_programming

    graph, ties = _scanned_gpt_step()
    model = _models(True)
    with monkeypatch.context() as m:  # first: the model caches the bodies' plans
        m.setattr(exact, "_leanest", lambda t, choice, node, touching: int(choice[node]))
        taken, lines = recursive_programming(graph, model, {}, {}, ties=ties)
    assert any("between the 2 loops and the main ops around them solved again exactly" in line
               and "taken instead" in line for line in lines)
    dp, _ = dynamic_programming(graph, model, {}, {}, ties=ties)
    rp, _ = recursive_programming(graph, model, {}, {}, ties=ties)
    scores = [model.score(graph_cost(graph, p, model, {pos: p.specs[v] for v, pos in ties}))
              for p in (dp, taken, rp)]
    assert max(scores[1:]) <= 1.05 * scores[0]  # measured: 1.000 (2.540 before the region solve)


def test_dynamic_programming_solves_loop_bodies_again_until_their_operands_repeat(monkeypatch):
    """Each answer gives the loops operand specs their bodies were not yet planned for; solved
    again with those too (up to exact._LOOP_PASSES times), a scanned GPT step's plan is
    cheaper than after one such solve. (Shown with the operand specs alone: the loops' bodies
    solved also for the specs the plan wants their results in, one pass finds 0.991 ms, and
    so do four.)"""
    from jaxpar.models.gpt import GPTConfig, abstract_train_step
    from jaxpar.search import exact

    cfg = GPTConfig(layers=1, d_model=512, heads=8, vocab=1024, seq=512, scan_layers=True)
    step, args = abstract_train_step(cfg, 16)
    traced = trace(step, args)
    graph = build_graph(traced.closed_jaxpr, traced.in_paths)
    ties = tuple((graph.inputs[i], i) for i in range(len(jax.tree_util.tree_leaves(args[:2]))))
    # The free inputs as the solver takes them: with each kept at its leanest spec of equal
    # cost (exact._leanest) one solve already finds 1.181 ms here, and the passes keep it.
    monkeypatch.setattr(exact, "_leanest", lambda t, choice, node, touching: int(choice[node]))
    seeded = _models(True)
    plan, _ = exact.dynamic_programming(graph, seeded, {}, {}, ties=ties)
    best = seeded.score(graph_cost(graph, plan, seeded, {pos: plan.specs[v] for v, pos in ties}))
    monkeypatch.setattr(exact, "_wanted", lambda *args: None)
    monkeypatch.setattr(exact, "_whole", lambda *args: None)
    scores = []
    for passes in (1, exact._LOOP_PASSES):
        monkeypatch.setattr(exact, "_LOOP_PASSES", passes)
        model = _models(True)
        plan, _ = exact.dynamic_programming(graph, model, {}, {}, ties=ties)
        back = {pos: plan.specs[v] for v, pos in ties}
        scores.append(model.score(graph_cost(graph, plan, model, back)))
    assert scores[1] < 0.99 * scores[0]  # measured: 1.191 ms against 1.212 ms
    assert best < 0.9 * scores[1]  # measured: 0.991 ms


def test_a_loop_offers_its_propagated_and_its_solved_body():
    from jaxpar.rules.registry import OpInfo
    from jaxpar.search.regions import region_candidates

    graph, _ = _scanned_gpt_step()
    backward = [op for op in graph.ops if op.name == "scan"][1]
    info, free = OpInfo.of(backward, graph), [None] * len(backward.inputs)
    assert len(region_candidates(backward, info, free, _models(False))) == 1
    model = _models(True)
    found = region_candidates(backward, info, free, model)
    assert len(found) == 2 and model.score(found[1][2]) < model.score(found[0][2])
    assert region_candidates(backward, info, free, model) is found  # asked once


def test_a_loop_body_is_solved_within_its_own_time_limit(monkeypatch):
    # Each exact solve of a body gets BODY_S seconds, not the 30 s of a whole search: a search
    # may solve a body several times, each outside the search's own limit (a scan's gradient
    # of 20 equations took 142 s to plan, 53 s with one scan, when its solves went to the MIP).
    from jaxpar.rules.registry import OpInfo
    from jaxpar.search import exact, regions

    limits = []
    solve = exact.dynamic_programming

    def spy(graph, *args, **kwargs):
        limits.append((graph, kwargs.get("time_limit")))
        return solve(graph, *args, **kwargs)

    monkeypatch.setattr(exact, "dynamic_programming", spy)
    graph, _ = _scanned_gpt_step()
    backward = [op for op in graph.ops if op.name == "scan"][1]
    info = OpInfo.of(backward, graph)
    regions.region_candidates(backward, info, [None] * len(backward.inputs), _models(True))
    assert [limit for body, limit in limits] == [regions.BODY_S]
    assert limits[0][0] is backward.regions[0]


@pytest.mark.parametrize("mode", ["recursive_programming", "dynamic_programming"])
def test_a_scanned_gpt_step_runs_like_jit_and_moves_what_it_predicts(mode):
    import numpy as np

    import jaxpar
    from jaxpar.models import gpt

    cfg = gpt.GPTConfig(layers=2, d_model=32, heads=2, vocab=64, seq=8, scan_layers=True)
    params = gpt.init_params(cfg, jax.random.key(0))
    step, opt_state = gpt.make_train_step(cfg, params)
    tokens, targets = gpt.batch(cfg, 16)
    f = jaxpar.shard(step, search_mode=mode, hardware="h100-nvlink")
    got, want = f(params, opt_state, tokens, targets), jax.jit(step)(params, opt_state, tokens,
                                                                      targets)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    check = f.plan(params, opt_state, tokens, targets).verify(
        f.lower(params, opt_state, tokens, targets).compile())
    assert check.bytes_ok, str(check)


def _scanned_mlp_step(opt, layers: int, d: int, batch: int, act=jnp.tanh):
    """An optax step of an MLP (activation `act`) whose `layers` square weights (d x d) run
    under lax.scan, and its arguments (weights, optimizer state, a batch)."""
    import optax

    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (act(h @ w), None), x, ws)
        return jnp.mean(h ** 2)

    def step(ws, state, x):
        updates, state = opt.update(jax.grad(loss)(ws, x), state, ws)
        return optax.apply_updates(ws, updates), state

    ws = jax.random.normal(jax.random.key(0), (layers, d, d)) * 0.1
    return step, (ws, opt.init(ws), jax.random.normal(jax.random.key(1), (batch, d)))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("mode", ["recursive_programming", "dynamic_programming"])
def test_a_scanned_step_all_reduces_its_gradients_as_data_parallel_does(mode, optimizer):
    """A loop's results were made where its body alone found them cheapest: the backward
    scan reduce-scattered each layer's weight gradient, and the update then worked on slices
    and gathered the parameters back (recursive_programming: FSDP, 3 reduce-scatters and 3
    all-gathers, 90 us on h100-nvlink; dynamic_programming 100 us) where data parallel
    all-reduces them (45 us). The loops are now also solved for the specs the plan wants
    their results in (exact._wanted: the parameter an SGD update adds the stacked gradient
    to) and, Adam's state cut as consistently as the parameters, with them whole."""
    import numpy as np
    import optax

    import jaxpar
    from jaxpar.analysis import collective_stats

    step, args = _scanned_mlp_step(optax.sgd(0.1) if optimizer == "sgd" else optax.adam(1e-3),
                                   3, 64, 64)
    f = jaxpar.shard(step, search_mode=mode, hardware="h100-nvlink")
    plan = f.plan(*args)
    assert plan.collectives == {"all-reduce": {"count": 3, "bytes": 3 * 64 * 64 * 4.0}}
    assert collective_stats(f.lower(*args).compile()) == {
        "all-reduce": {"count": 3, "bytes": 3 * 64 * 64 * 4}}
    for got, want in zip(jax.tree_util.tree_leaves(f(*args)),
                         jax.tree_util.tree_leaves(jax.jit(step)(*args)), strict=True):
        # Adam divides by the root of the squared gradient: reordered sums show more
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_dynamic_programming_keeps_the_walks_plan_where_its_loops_make_it_better():
    """dynamic_programming is exact over a few plans of each loop body; recursive_programming
    solves the loops again for the plans around them it finds. On a scanned Adam MLP step
    (2 layers, d 1024, batch 16) the exact search's plan scores 1.52x the walk's (2.026e-4 vs
    1.332e-4); it now keeps the walk's where that scores lower, and says so."""
    import optax

    import jaxpar
    from jaxpar.ir import build_graph

    step, args = _scanned_mlp_step(optax.adam(1e-3), 2, 1024, 16)
    graph = build_graph(trace(step, args).closed_jaxpr)
    model = CostModel(MESH, load_profile("h100-nvlink"), 0, 0.1)
    plans = {mode: jaxpar.shard(step, search_mode=mode, hardware="h100-nvlink").plan(*args)
             for mode in ("recursive_programming", "dynamic_programming")}
    exact, walk = (model.score(graph_cost(graph, plans[m].graph_plan, model,
                                          dict(enumerate(plans[m].flat_out_specs))))
                   for m in ("dynamic_programming", "recursive_programming"))
    assert exact <= walk * (1 + 1e-9)
    assert any("over the loop bodies it tried: kept instead" in n
               for n in plans["dynamic_programming"].notes)


def test_a_memory_budget_is_priced_like_the_plan_for_a_scanned_step(monkeypatch):
    """A loop's node holds its results, and a node tied to it what its bodies add while they
    run, at the loop's own program point, as plan.peak_memory counts it. dynamic_programming's
    smallest possible peak for a scanned GPT step was 2 to 3 times the peak its own unbudgeted
    plan reached (a loop's node held the memory of every op of its bodies), then 1.01 times
    (the bodies' memory held over the loop's results' whole live range): a budget of its own
    peak was refused. (A 5 s time limit: the budgets need a plan that fits, not the optimum,
    and the search of the tightest one runs to its limit.)"""
    import functools
    import re

    import jaxpar
    import jaxpar.api
    from jaxpar.models.gpt import GPTConfig, abstract_train_step

    monkeypatch.setattr(jaxpar.api, "dynamic_programming",
                        functools.partial(jaxpar.api.dynamic_programming, time_limit=5.0))

    cfg = GPTConfig(layers=2, d_model=64, heads=4, vocab=128, seq=16, scan_layers=True)
    step, args = abstract_train_step(cfg, 16)

    def plan(budget=None):
        return jaxpar.shard(step, search_mode="dynamic_programming",
                            memory_budget=budget).plan(*args)

    peak = plan().cost.peak_memory_bytes
    assert plan(peak).cost.peak_memory_bytes <= peak
    said = r"no plan among those searched fits.* the smallest peak of those is"
    with pytest.raises(ValueError, match=said + r".*\. Each loop's body") as err:
        plan(peak / 4)
    smallest = float(re.search(said + r" (?:at least )?([\d.e+]+)", str(err.value))[1])
    # measured: 0.37 x peak (0.898 x before the loops were also solved for the specs the
    # plan wants their results in: the unbudgeted plan is now data parallel, gradients whole)
    assert smallest < peak
    # A plan stopped at its time limit also faces the walk's plan under the budget
    # (api._within_budget): the walk refused here, the plan is dynamic_programming's own (the
    # walk took 45 s of this test's 70).

    def not_asked(*a, **k):
        raise ValueError("not asked")

    monkeypatch.setattr("jaxpar.search.recursive.recursive_programming", not_asked)
    assert plan(1.01 * smallest).cost.peak_memory_bytes <= 1.01 * smallest


def test_dynamic_programming_offers_loops_lean_bodies_under_a_budget():
    """Under a memory budget a loop also offers its body solved for the least memory
    (CostModel.lean). A scan over layers, each a cond, planned by dynamic_programming with
    nine tenths of its unbudgeted peak: refused before ("the smallest possible peak is
    17360 bytes", over bodies solved for time only) though recursive_programming met it.
    With the conds' branches solved too, the unbudgeted plan peaks at 17616 bytes, not
    39452, and six tenths of that were met (9936 bytes). With the partial sums an op
    reduce-scatters held whole while it runs, it peaks at 18128 bytes and three quarters of
    that are met (12752 bytes). With each cond also offered whole (operands and results
    replicated), the unbudgeted plan takes them so (0.703 -> 0.370 ms modelled) and peaks at
    79376 bytes; a fifth of that is met by the lean bodies (12752 bytes again)."""
    import numpy as np

    import jaxpar

    def fn(ws, x):
        def loss(ws):
            def layer(h, wi):
                w, flag = wi
                h = jax.lax.cond(flag > 0, lambda h: jnp.tanh(h @ w),
                                 lambda h: jax.nn.relu(h @ w), h)
                return h, None
            h, _ = jax.lax.scan(layer, x, (ws, jnp.arange(3) % 2))
            return jnp.mean(h ** 2)
        return jax.value_and_grad(loss)(ws)

    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.standard_normal((3, 32, 32)) * 0.1, jnp.float32)
    x = jnp.asarray(rng.standard_normal((16, 32)) * 0.1, jnp.float32)
    peak = jaxpar.shard(fn, search_mode="dynamic_programming").plan(
        ws, x).cost.peak_memory_bytes
    f = jaxpar.shard(fn, search_mode="dynamic_programming", memory_budget=0.9 * peak)
    assert f.plan(ws, x).cost.peak_memory_bytes <= 0.9 * peak
    for got, want in zip(f(ws, x), jax.jit(fn)(ws, x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    lean = jaxpar.shard(fn, search_mode="dynamic_programming", memory_budget=0.2 * peak)
    assert lean.plan(ws, x).cost.peak_memory_bytes <= 0.2 * peak
    with pytest.raises(ValueError, match="solved for the least memory"):
        jaxpar.shard(fn, search_mode="dynamic_programming", memory_budget=0.1 * peak).plan(
            ws, x)


def test_the_automatic_searches_plan_a_scanned_sin_mlp_step_like_its_best_layout():
    """On a scanned Adam MLP step (sin, 2 layers, d 1024, batch 16) the walk's plan scored
    1.09x the best plan using every axis together (2.540e-4 vs 2.327e-4), so the loops and
    the ops around them were solved again from that plan alone: 2.026e-4, in both modes,
    where the plan with the inputs fixed in the walk's layout scores 1.332e-4. The axes solved
    again from each start offered the loops their bodies planned anew only, never the plan's
    own (test_a_mesh_axis_solved_again_around_loops_ends_no_higher_than_it_started); now
    they do, and both modes end at 1.338e-4. (With tanh, jax 0.10's derivative happened to
    lead the walk there.)"""
    import optax
    from jax.sharding import PartitionSpec as P

    import jaxpar

    step, args = _scanned_mlp_step(optax.adam(1e-3), 2, 1024, 16, act=jnp.sin)
    graph = build_graph(trace(step, args).closed_jaxpr)
    model = CostModel(MESH, load_profile("h100-nvlink"), 0, 0.1)
    cut = P(None, ("d1", "d2"))
    state = jax.tree_util.tree_map(lambda a: cut if a.ndim == 3 else P(), args[1])
    layout = (cut, state, P("d0", ("d1", "d2")))
    scores = {}
    for mode in ("recursive_programming", "dynamic_programming", "fixed"):
        f = jaxpar.shard(step, search_mode="sharding_propagation", in_strategy=layout,
                         hardware="h100-nvlink") if mode == "fixed" else \
            jaxpar.shard(step, search_mode=mode, hardware="h100-nvlink")
        plan = f.plan(*args)
        scores[mode] = model.score(graph_cost(graph, plan.graph_plan, model,
                                              dict(enumerate(plan.flat_out_specs))))
    assert scores["recursive_programming"] <= scores["fixed"] * 1.01, scores
    assert scores["dynamic_programming"] <= scores["fixed"] * 1.01, scores


@pytest.mark.parametrize("mode", ["dynamic_programming", "recursive_programming"])
def test_a_budget_counts_each_result_of_a_loop_until_its_own_last_reader(mode):
    """A scan's results die at different points: its final carry at its one reader, the
    stacked residuals at the backward scan. The exact search's live sets held all of them
    until the last one's reader (a node's results as one), so a plan that peaks at 7,440
    bytes (plan.peak_memory) counted 7,696 there: budgets of 7,440 and 7,500 were refused,
    "the smallest peak of those is 7696 bytes", by both modes, where a budget of 7,696 got that
    very plan. (Figures before the partial sums reduce-scattered inside the body counted in
    the peak, whole while their op runs: that plan now peaks at 7,952 bytes, and a budget of
    8,000 is met, where those live sets would have counted 256 bytes more.)"""
    import numpy as np

    import jaxpar

    def grad_scan(xs, w):
        def loss(w):
            def body(h, x):
                h = jnp.tanh(h @ w + x)
                return h, jnp.sum(h)
            return jnp.sum(jax.lax.scan(body, jnp.zeros((16, 32)), xs)[0] ** 2)
        return jax.grad(loss)(w)

    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.standard_normal((4, 16, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 32)) * 0.2, jnp.float32)
    f = jaxpar.shard(grad_scan, search_mode=mode, memory_budget=8000)
    assert f.plan(xs, w).cost.peak_memory_bytes <= 8000
    # the gradient sums over shards in another order: entries near 0 differ by ~2e-6 under
    # XLA's default optimisation (jaxlib 0.11, where conftest's fast-compile flags are off)
    np.testing.assert_allclose(f(xs, w), jax.jit(grad_scan)(xs, w), rtol=1e-5, atol=1e-5)


def test_sharding_propagation_plans_a_data_parallel_gpt_step_as_well_as_the_exact_search():
    # gpt_plans' data-parallel layout (parameters replicated, the batch cut 8 ways) on a
    # smaller GPT. Ops planned as the front reached them decided each weight gradient
    # dW = dY^T X from the activation X before the backward pass made dY, and the tied output
    # head from the gradient its table's update asked for: 368 us modelled, where the exact
    # search finds 234. Propagation that also tries waiting for the bigger operand: 244.
    # Those figures priced the step's tail reductions a share of one latency each. Priced as
    # XLA runs them (one collective, one latency, per kind and device group: plan.tail_latency)
    # they are 269 and 244 us, each equal to the estimate from its compiled HLO: propagation's
    # plan reduces over more groups and gathers more, 1.10x the exact search.
    from jax.sharding import PartitionSpec as P

    import jaxpar
    from jaxpar.models.gpt import GPTConfig, abstract_train_step

    step, args = abstract_train_step(GPTConfig(layers=2, d_model=512, heads=8, vocab=4096,
                                               seq=256), 16)
    every = ("d0", "d1", "d2")
    strategy = (P(), P(), P(every, None), P(every, None))
    cost = {mode: jaxpar.shard(step, in_strategy=strategy, mesh=jaxpar.make_mesh(8),
                               hardware="h100-nvlink", search_mode=mode).plan(*args).cost.total_s
            for mode in ("sharding_propagation", "dynamic_programming")}
    assert cost["sharding_propagation"] <= 1.15 * cost["dynamic_programming"], cost


def _bench_mlp_step():
    """benchmarks/models.py's MLP (search_gap's): an Adam step of 8 dense layers 1024, 4096,
    ..., 1024 at batch 256, abstract."""
    from bench_loader import load_benchmark

    bench = load_benchmark("models").mlp_model()
    return bench.step, bench.args


@pytest.mark.parametrize("program", ["gpt", "mlp"])
def test_sharding_propagation_solves_each_axis_again_with_no_strategy_given(program):
    # The GPT (2 layers, d 512) with nothing fixed: propagation alone cuts whatever the front
    # reaches first (755 us modelled, 2.7x the exact search's 277). Each mesh axis then solved
    # again exactly, the others held (resolve.solve_axes): 354 us, 1.23x; and from the best
    # plans using every axis together and d0+d1 and d2 each together too (nothing pinned:
    # semi.py's step 6): 0.96x (this mode's matmuls may also run whole). search_gap's MLP
    # Adam step (8 layers, 1024 x 4096, batch 256): 1.74x, then 1.00x: propagated from
    # nothing, its first cuts are two-way cuts that suit one axis of three, and one axis
    # solved at a time does not undo them.
    import jaxpar
    from jaxpar.models.gpt import GPTConfig, abstract_train_step

    step, args = abstract_train_step(GPTConfig(layers=2, d_model=512, heads=8, vocab=4096,
                                               seq=256), 16) if program == "gpt" else \
        _bench_mlp_step()
    from jaxpar.search.resolve import objective

    plans = {mode: jaxpar.shard(step, mesh=jaxpar.make_mesh(8), hardware="h100-nvlink",
                                search_mode=mode).plan(*args)
             for mode in ("sharding_propagation", "dynamic_programming")}
    traced = trace(step, args)
    graph = build_graph(traced.closed_jaxpr, traced.in_paths)
    model = CostModel(plans["dynamic_programming"].mesh, load_profile("h100-nvlink"), 0, 0.1)
    # what the modes minimise (the default objective; the GPT's modelled times: 312 and 295
    # us, the exact search's plan paying more for memory)
    score = {mode: objective(graph, model, plan.graph_plan, dict(enumerate(plan.flat_out_specs)),
                             ()) for mode, plan in plans.items()}
    # (the GPT: 1.172 ms of objective against 1.148, 1.02x, since the exact search also
    # solves again without its tail's rarest device group: exact._one_latency_per_group)
    assert score["sharding_propagation"] <= 1.03 * score["dynamic_programming"], score
    assert any("no weight fixed, so the mesh axes were also solved again from the best plan "
               "using" in note for note in plans["sharding_propagation"].notes)


@pytest.mark.parametrize("batch", ["fixed", "free"])
def test_sharding_propagation_keeps_its_first_pass_where_placing_the_state_made_it_worse(batch):
    # A Linen transformer under nn.scan, SGD with momentum, the batch fixed 8 ways and the
    # parameters and momentum free (a helper's audit). Propagation places the free state from
    # a first pass, then plans again with it placed; here that second pass came out twice as
    # dear and cut the final LayerNorm's backward and the backward scan's carry on d2 alone:
    # 6 all-gathers, 8 collective-permutes and an all-to-all beside the gradients' all-reduces
    # (0.79 ms modelled, the exact search 0.28). The first pass is now a start too.
    # With nothing fixed the plan kept the output head's bias cut on d2 (an all-gather and a
    # reduce-scatter more, 0.36 ms): each mesh axis solved again offered the scans their
    # bodies planned anew only, never the plan's own, and ended far above it.
    import flax.linen as nn
    import numpy as np
    import optax

    import jaxpar

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.LayerNorm()(x)
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            x = x + nn.MultiHeadDotProductAttention(num_heads=4)(h, h, mask=mask)
            h = nn.LayerNorm()(x)
            return x + nn.Dense(32)(nn.gelu(nn.Dense(128)(h))), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(64, 32)(tokens)
            x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=2)()(x, None)
            return nn.Dense(64)(nn.LayerNorm()(x))

    model, tx = Model(), optax.sgd(0.1, momentum=0.9)
    tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, 64)
    targets = jax.random.randint(jax.random.key(2), (8, 16), 0, 64)
    params = model.init(jax.random.key(0), tokens)["params"]
    args = (params, tx.init(params), tokens, targets)

    def step(params, opt, tokens, targets):
        def loss(p):
            logits = model.apply({"params": p}, tokens)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    given = dict(in_strategy=(None, None, (8, 1), (8, 1))) if batch == "fixed" else {}
    f = jaxpar.shard(step, mesh=jaxpar.make_mesh(8), **given)
    exact = jaxpar.shard(step, mesh=jaxpar.make_mesh(8), search_mode="dynamic_programming",
                         **given)
    assert f.plan(*args).cost.total_s <= 1.05 * exact.plan(*args).cost.total_s
    assert set(jaxpar.collective_stats(f.lower(*args).compile())) == {"all-reduce"}
    for got, want in zip(jax.tree_util.tree_leaves(f(*args)),
                         jax.tree_util.tree_leaves(jax.jit(step)(*args)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_sharding_propagation_completes_a_megatron_layout_at_the_exact_optimum(monkeypatch):
    # gpt_plans' Megatron layout (tp2 x dp4) on a smaller GPT. The ops reading a weight fixed
    # cut read it as laid out (pinned); every other op is free. Propagation and the polish
    # left the plan 5% above the exact optimum of that problem (objective 1.404 ms against
    # 1.334); each mesh axis solved again exactly reaches it.
    from jax.sharding import PartitionSpec as P

    import jaxpar
    from jaxpar import api
    from jaxpar.ir import leaf_paths
    from jaxpar.models.gpt import GPTConfig, abstract_train_step
    from jaxpar.search.exact import dynamic_programming
    from jaxpar.search.propagation import GraphIndex, pinned_ops
    from jaxpar.search.resolve import objective

    seen = {}
    planner = api.sharding_propagation

    def spy(graph, model, fixed_in, fixed_out, ties=(), index=None, kept=None,
            memory_budget=None):
        gp, notes = planner(graph, model, fixed_in, fixed_out, ties, index, kept, memory_budget)
        seen.update(graph=graph, model=model, fixed_in=fixed_in, fixed_out=fixed_out,
                    ties=tuple(ties), kept=kept, plan=gp)
        return gp, notes
    monkeypatch.setattr(api, "sharding_propagation", spy)

    step, args = abstract_train_step(GPTConfig(layers=2, d_model=512, heads=8, vocab=4096,
                                               seq=256), 16)
    cut = {"wqkv": P(None, "tp"), "bqkv": P("tp"), "w1": P(None, "tp"), "b1": P("tp"),
           "wo": P("tp", None), "w2": P("tp", None), "wte": P("tp", None)}
    layout = {path: cut.get(path.rsplit("/", 1)[-1], P())
              for name, tree in zip(("params", "opt_state"), args[:2], strict=True)
              for path in leaf_paths(tree, name)}
    jaxpar.shard(step, in_strategy=(None, None, P("dp", None), P("dp", None)),
                 parameter_plan=layout, mesh=jaxpar.make_mesh((4, 2), ("dp", "tp")),
                 hardware="h100-nvlink").plan(*args)
    graph, model, plan = seen["graph"], seen["model"], seen["plan"]
    pinned = pinned_ops(graph, GraphIndex(graph), seen["fixed_in"], seen["kept"])
    assert pinned

    class Pinned:  # tables.Allow: the pinned ops as planned, every other op free
        def op(self, x, cands):
            if x in pinned:
                return tuple(i for i, s in enumerate(cands) if s == plan.choices[x].strategy)
            return tuple(range(len(cands)))

        def specs(self, v, specs):
            return specs

    exact, solution = dynamic_programming(graph, model, seen["fixed_in"], seen["fixed_out"],
                                          ties=seen["ties"], allow=Pinned(), group_tail=False)
    assert solution.optimal

    def score(gp):
        return objective(graph, model, gp, seen["fixed_out"], seen["ties"])
    assert score(plan) <= score(exact) * (1 + 1e-9), (score(plan), score(exact))


# ---- outputs held twice at the end (plan.returned_copies) -------------------------------------

_MODES = ["dynamic_programming", "recursive_programming", "sharding_propagation"]


@pytest.mark.parametrize("mode", _MODES)
def test_peak_holds_an_output_returned_in_another_spec_than_it_is_made_in(mode):
    """A result made cut 8 ways and returned whole (out_strategy) is gathered at the end: the
    made and the returned copy are both held then. The peak counted the made copy alone:
    x, sin(x) and sin(x) * 2 cut, 3/8 of the 1 MiB array per device, where XLA holds 1 3/8
    (arguments 1/8, the output whole, 2/8 of temporaries); a budget of half of that was met."""
    import jaxpar
    from jaxpar.analysis import compiled_bytes

    size = 512 * 512 * 4
    x = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    keep = dict(in_strategy=((8, 1),), out_strategy=((1, 1),), search_mode=mode)
    f = jaxpar.shard(lambda x: jnp.sin(x) * 2.0, **keep)
    peak = f.plan(x).cost.peak_memory_bytes
    assert peak >= size + size / 8
    assert peak >= compiled_bytes(f.lower(x).compile())
    with pytest.raises(ValueError, match="memory_budget"):
        jaxpar.shard(lambda x: jnp.sin(x) * 2.0, memory_budget=size / 2, **keep).plan(x)


@pytest.mark.parametrize("mode", _MODES)
def test_peak_holds_the_copy_of_an_argument_returned_unchanged(mode):
    """A step returning frozen weights as they came (not donated): XLA returns them in an
    output buffer of their own, a copy beside the argument. The peak counted them once."""
    import jaxpar
    from jaxpar.analysis import compiled_bytes

    def step(frozen, x):
        return frozen, jnp.sum(jnp.tanh(x @ frozen))

    args = (jax.ShapeDtypeStruct((256, 256), jnp.float32),
            jax.ShapeDtypeStruct((16, 256), jnp.float32))
    f = jaxpar.shard(step, search_mode=mode)
    plan = f.plan(*args)
    held = 256 * 256 * 4 / plan.flat_in_specs[0].shards(plan.mesh)
    assert plan.cost.peak_memory_bytes >= 2 * held
    assert plan.cost.peak_memory_bytes >= 0.95 * compiled_bytes(f.lower(*args).compile())


def test_outputs_pair_with_donated_arguments_as_jax_pairs_them():
    """graph.aliases follows jax.jit: each output in turn takes the first donated argument
    not yet taken of its shape and dtype (so b + 1, returned first, takes a's buffer). Made
    before a's last read (a + 1), b + 1 cannot be made in it; a + 1 is made in b's."""
    a = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    c = jax.ShapeDtypeStruct((3,), jnp.float32)
    graph = build_graph(trace(lambda a, b, c: (b + 1, a + 1, c.sum()), (a, a, c)).closed_jaxpr)
    graph.donated = frozenset(graph.inputs[:2])
    assert graph.aliases() == {0: graph.inputs[0], 1: graph.inputs[1]}
    assert graph.in_place() == {graph.outputs[1]: graph.inputs[1]}
    graph.donated = frozenset(graph.inputs[1:])  # c: no output of its shape
    assert graph.aliases() == {0: graph.inputs[1]}


@pytest.mark.parametrize("mode", _MODES)
def test_donated_state_is_updated_in_its_own_buffers(mode):
    """An Adam step donating its weight and optimizer state writes the new state in the old
    one's buffers: the peak counted both (the old held throughout, the new from its update
    on), and a budget the donated program fits in was refused. The peak now drops by what
    XLA's drops (the two moments are made in place before the peak, the weight after it),
    XLA aliases the bytes graph.aliases pairs, and a budget between the two peaks is met."""
    import optax

    import jaxpar
    from jaxpar.analysis import compiled_bytes, memory_stats

    tx = optax.adam(1e-3)

    def step(w, opt, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), opt

    w = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    args = (w, jax.eval_shape(tx.init, w), jax.ShapeDtypeStruct((8, 512), jnp.float32))
    found = {}
    for donate in ((), (0, 1)):
        f = jaxpar.shard(step, search_mode=mode, donate_argnums=donate)
        plan, compiled = f.plan(*args), f.lower(*args).compile()
        found[donate] = plan, compiled_bytes(compiled), memory_stats(compiled)["alias_bytes"]
    (kept, held, _), (given, holds, aliased) = found[()], found[(0, 1)]
    assert given.flat_in_specs == kept.flat_in_specs
    state = 512 * 512 * 4 / given.flat_in_specs[0].shards(given.mesh)  # w, mu, nu each
    assert aliased == 3 * state + 4  # and the step count, an int32
    saved = kept.cost.peak_memory_bytes - given.cost.peak_memory_bytes
    assert saved == pytest.approx(held - holds, rel=0.02)
    assert saved >= 2 * state
    if mode != "sharding_propagation":  # (its plan here is fixed by the data, budget or not)
        budget = (given.cost.peak_memory_bytes + kept.cost.peak_memory_bytes) / 2
        plan = jaxpar.shard(step, search_mode=mode, donate_argnums=(0, 1),
                            memory_budget=budget).plan(*args)
        assert plan.cost.peak_memory_bytes <= budget
        with pytest.raises(ValueError, match="memory_budget"):
            jaxpar.shard(step, search_mode=mode, memory_budget=budget).plan(*args)


def _scanned_layers_with_a_fill(ws, x):
    """Four tanh layers under lax.scan, each filling where its product is negative: JAX
    hoists the fill (a broadcast of -1e9, 512 KiB) out of the scan, and the zeros of its
    gradient out of the backward scan, as loop-invariant operands."""
    fill = jnp.full((8, 128, 128), -1e9, jnp.float32)

    def layer(h, w):
        s = jnp.einsum("bij,jk->bik", h, w)
        return jnp.tanh(jnp.where(s > 0, s, fill)), None

    return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)


_SCANNED = (jax.ShapeDtypeStruct((4, 128, 128), jnp.float32),
            jax.ShapeDtypeStruct((8, 128, 128), jnp.float32))


def test_broadcasts_of_a_literal_read_by_loops_alone_are_sunk():
    """graph.sunk: the fill and its gradient's zeros, read by the scans as constants, and no
    broadcast of a literal another op reads (the gradient's ones, read by a mul), of a
    traced scalar, or read as a loop's carry."""
    step = jax.grad(_scanned_layers_with_a_fill)
    graph = build_graph(trace(step, _SCANNED).closed_jaxpr)
    made = {op.outputs[0]: op for op in graph.ops if op.name == "broadcast_in_dim"}
    readers = graph.users()
    assert {v for v, op in made.items() if {r.name for r, _ in readers[v]} == {"scan"}} == \
        graph.sunk() != set()
    assert all(made[v].inputs[0].value in (-1e9, 0.0) for v in graph.sunk())
    assert any(r.name == "mul" for v in made if v not in graph.sunk() for r, _ in readers[v])

    def carried(a, n):  # a literal broadcast as the carry, a traced one as a constant
        ones, fill = jnp.ones((8, 8)), jnp.broadcast_to(a, (8, 8))
        return jax.lax.scan(lambda c, _: (c * fill, None), ones, None, length=n)[0]

    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    graph = build_graph(trace(lambda a: carried(a, 3), (f32,)).closed_jaxpr)
    assert sum(op.name == "broadcast_in_dim" for op in graph.ops) == 2
    assert graph.sunk() == frozenset()


def test_a_broadcast_xla_sinks_into_the_layers_holds_no_memory():
    """XLA sinks the hoisted fill and zeros into the scans' bodies and never allocates them;
    the peak counted them, so every plan's peak was above the compiled program's (2,064,384
    bytes for sharding_propagation's plan, which compiles to 1,605,960) and a budget that
    program fits in was refused. The peak now stays at or below the compiled program's
    (what it leaves out: XLA's temporaries), close to it, and the budget is met."""
    import jaxpar
    from jaxpar.analysis import compiled_bytes

    step = jax.grad(_scanned_layers_with_a_fill)
    f = jaxpar.shard(step, search_mode="sharding_propagation", memory_budget=1.6e6)
    peak, held = f.plan(*_SCANNED).cost.peak_memory_bytes, compiled_bytes(
        f.lower(*_SCANNED).compile())
    assert peak <= 1.6e6
    assert 0.9 * held <= peak <= held


def test_sharding_propagation_searches_again_under_a_memory_budget():
    """Under a budget its plan broke, sharding_propagation kept the leaner of its propagated
    and polished plans and searched no further: a 1-layer GPT Adam step given 0.8 of its
    unbudgeted peak got a plan modelled 4.08x the unbudgeted step. It now searches again with
    larger mem_coeffs, as recursive_programming does (budget.within_budget): 1.45x."""
    import jaxpar
    from jaxpar.models.gpt import GPTConfig, abstract_train_step

    step, args = abstract_train_step(GPTConfig(layers=1, d_model=64, heads=4, vocab=128,
                                               seq=16), 16)
    free = jaxpar.shard(step).plan(*args)
    budget = 0.8 * free.cost.peak_memory_bytes
    plan = jaxpar.shard(step, memory_budget=budget).plan(*args)
    assert plan.cost.peak_memory_bytes <= budget
    assert plan.cost.total_s < 2 * free.cost.total_s
    assert any("searched again with larger mem_coeffs" in note and
               f"memory_budget={budget:.0f} bytes per device" in note for note in plan.notes)
    with pytest.raises(ValueError, match="no plan holds less than .* sharding_propagation's "
                                         "plan peaks at"):
        jaxpar.shard(step, memory_budget=0.1 * budget).plan(*args)


def test_sharding_propagation_keeps_a_propagated_plan_that_fits_where_no_polished_one_does():
    """mem_coeff weighs the bytes a plan holds, not their peak: on an SGD MLP step no polished
    plan of sharding_propagation's meets 1.8x the least peak any plan can have (49,540 bytes
    at mem_coeff 0.1 for 11,153), whatever the mem_coeff, while the plans they were polished
    from do (10,196). Of those the one of least objective is kept; at 1.5x none fits, and the
    refusal says what this mode tried."""
    from budget_cases import sgd_mlp_and_its_least_peak

    import jaxpar

    step, args, least = sgd_mlp_and_its_least_peak()
    plan = jaxpar.shard(step, memory_budget=1.8 * least).plan(*args)
    assert plan.cost.peak_memory_bytes <= 1.8 * least
    assert any("kept the propagated plan of mem_coeff=" in note for note in plan.notes)
    with pytest.raises(ValueError, match="this mode searched again with larger mem_coeffs and "
                                         "kept the leanest plan it found"):
        jaxpar.shard(step, memory_budget=1.5 * least).plan(*args)


def test_exact_search_fits_a_budget_with_the_copies_held_at_the_end():
    """dynamic_programming's live sets hold the copies plan.peak_memory counts at the end:
    for x -> sin(x) * 2, x fixed cut and the result returned whole, every plan holds the
    whole result at the end, and a budget of half of it was met (every value cut: 3/8 of the
    array), by a plan holding 1 1/4 of it as the plan counts it."""
    from jaxpar.plan import peak_memory, returned_specs
    from jaxpar.search.exact import dynamic_programming

    x = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    graph = build_graph(trace(lambda x: jnp.sin(x) * 2.0, (x,)).closed_jaxpr)
    model = CostModel(MESH, load_profile("h100-nvlink"))
    fixed_in, fixed_out = {graph.inputs[0]: S(("d0", "d1", "d2"), None)}, {0: S(None, None)}
    size = 512 * 512 * 4
    with pytest.raises(ValueError, match="cannot be met"):
        dynamic_programming(graph, model, fixed_in, fixed_out, memory_budget=size / 2)
    gp, _ = dynamic_programming(graph, model, fixed_in, fixed_out, memory_budget=1.3 * size)
    assert peak_memory(graph, gp, MESH, returned_specs(gp, fixed_out)) <= 1.3 * size


def test_dynamic_programming_over_its_budget_keeps_a_walk_that_fits(monkeypatch):
    """The exact search's live sets miss a carried output's copy made in another layout than
    its input comes in, so its optimum can end a few percent over a budget that a plan meets:
    the plan's check refused the budget (the memory_budget benchmark's GPT at 0.5). The walk
    under the budget is then kept where it fits. Here the exact search is made to ignore the
    budget, so that its plan is over it."""
    import jaxpar
    import jaxpar.api as api
    from jaxpar.models.mlp import init_mlp, make_sgd_step

    params = init_mlp(jax.random.key(0), [128, 512, 512, 128])
    args = (params, jax.ShapeDtypeStruct((64, 128), jnp.float32),
            jax.ShapeDtypeStruct((64, 128), jnp.float32))
    step = make_sgd_step(0.1)
    free = jaxpar.shard(step, search_mode="dynamic_programming").plan(*args)
    budget = 0.9 * free.cost.peak_memory_bytes  # met by both searches (the least: 0.88)
    real = api.dynamic_programming
    monkeypatch.setattr(api, "dynamic_programming",
                        lambda *a, **k: real(*a[:4], None, ties=k.get("ties", ())))
    plan = jaxpar.shard(step, search_mode="dynamic_programming", memory_budget=budget).plan(*args)
    assert plan.cost.peak_memory_bytes <= budget
    assert any("recursive_programming's plan under the budget holds" in n for n in plan.notes)


def test_a_plan_solved_again_for_a_lower_budget_gives_way_to_a_walk_that_scores_less(
        monkeypatch):
    """A plan dynamic_programming solved again for a budget lowered by what its first plan
    held over the one given (exact._refit) is the optimum for the lower budget only (the
    memory_budget benchmark's MoE at 0.3 scored 14.2x the optimum's objective so, the walk
    under the budget 6.0x), and the one it had when it stopped at its time limit is no proven
    optimum either. The walk's plan under the budget is then made too, and the lower score
    kept (api._within_budget); a proven optimum that fits is kept as it is. The walk, the
    peaks and the scores are stand-ins here."""
    import jaxpar.api as api
    import jaxpar.plan
    import jaxpar.search.recursive as recursive
    import jaxpar.search.resolve as resolve

    graph = build_graph(trace(lambda x: jnp.sin(x) * 2.0,
                              (jax.ShapeDtypeStruct((64, 64), jnp.float32),)).closed_jaxpr)
    model = CostModel(MESH, load_profile("h100-nvlink"))
    exact, walk = propagate(graph, model, {}, {}), propagate(graph, model, {}, {})
    monkeypatch.setattr(jaxpar.plan, "search_peak", lambda *a, **k: 1.0)
    monkeypatch.setattr(recursive, "recursive_programming", lambda *a, **k: (walk, []))
    # Solved again for a lower budget, or stopped at its time limit with what it had found (a
    # 1-layer GPT step at 0.4 of its peak: 1.885 ms of modelled step against the walk's 1.377).
    for how, what in (({"refitted": True}, "solved again for a lower budget"),
                      ({"optimal": False}, "the exact search had when it stopped")):
        monkeypatch.setattr(resolve, "objective",
                            lambda g, m, p, *a: 2.0 if p is exact else 1.0)
        notes = []
        assert api._within_budget(exact, notes, graph, model, {}, {}, [], None, 10.0,
                                  **how) is walk
        assert notes == [f"dynamic_programming: recursive_programming's plan under the budget "
                         f"scores 1, less than the 2 of the plan {what}: kept instead"]
        monkeypatch.setattr(resolve, "objective", lambda g, m, p, *a: 1.0)  # a tie: exact kept
        assert api._within_budget(exact, [], graph, model, {}, {}, [], None, 10.0,
                                  **how) is exact

    def not_asked(*a, **k):
        raise AssertionError("the walk is not planned for a plan that fits as first solved")

    monkeypatch.setattr(recursive, "recursive_programming", not_asked)
    assert api._within_budget(exact, [], graph, model, {}, {}, [], None, 10.0) is exact


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming",
                                  "dynamic_programming"])
def test_a_budget_the_unbudgeted_plan_meets_gives_that_plan(mode, monkeypatch):
    """A budget the unbudgeted plan meets binds nothing: the plan is the same, op for op.
    dynamic_programming builds its tables unfolded under a budget, each op's node tied to the
    nodes holding its results' spans and partial sums; its tail's solve again cut a tail
    node's candidates and not theirs, was refused, and the tail was never solved again under
    a budget: this MLP Adam step given 600,000 bytes (its unbudgeted optimum holds 486,728)
    took 213.9 us, not 208.9, its tail reduced over more device groups. (It now takes the
    optimum without the budget where that fits, exact._unbudgeted_fits: turned off here, so
    that the search under the budget is what is tested.)"""
    import numpy as np
    import optax

    import jaxpar
    from jaxpar.models import mlp
    from jaxpar.search import exact

    monkeypatch.setattr(exact, "_unbudgeted_fits", lambda *args: None)

    tx = optax.adam(1e-2)
    params = jax.eval_shape(lambda: mlp.init_mlp(jax.random.key(0), [64, 256, 256, 16]))
    x, y = (jax.ShapeDtypeStruct((32, n), np.float32) for n in (64, 16))
    args = (params, jax.eval_shape(tx.init, params), x, y)

    def plan(budget=None):
        return jaxpar.shard(mlp.make_train_step(tx), search_mode=mode, level=2, mem_coeff=0.0,
                            donate_argnums=(0, 1), memory_budget=budget).plan(*args)

    free = plan()
    budgeted = plan(1.25 * free.cost.peak_memory_bytes)  # (at its peak exactly: the exact
    # search's live sets, which miss one copy at the end, may find it binding and take 30 s)
    assert [c.strategy for c in budgeted.graph_plan.choices.values()] == \
        [c.strategy for c in free.graph_plan.choices.values()]
    assert budgeted.cost.total_s == pytest.approx(free.cost.total_s, rel=1e-12)
    assert budgeted.notes == free.notes  # dynamic_programming's names the tail's groups alike
