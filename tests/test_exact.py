"""search_mode="dynamic_programming": the exact optimum of the cost model, end to end."""

import jax
import numpy as np
import pytest

import jaxpar
from jaxpar.cost.hardware import load_profile
from jaxpar.cost.model import CostModel
from jaxpar.ir import build_graph, trace
from jaxpar.models import PROGRAMS
from jaxpar.search.exact import dynamic_programming
from jaxpar.search.propagation import graph_cost, propagate
from jaxpar.spec import MeshInfo
from jaxpar.strategy import parse_in_strategy

FAST = ["moe_top2", "embedding_xent", "scan_layers", "cond_and_fori"]


def _search_costs(name):
    """Scores of the exact and the greedy plan of a program under one and the same model (the
    automatic modes' model, which spreads heavy ops over the whole mesh)."""
    fn, args, in_strategy = PROGRAMS[name]()
    mesh = jaxpar.make_mesh(8)
    fixed = parse_in_strategy(in_strategy, args, mesh)
    traced = trace(fn, args)
    graph = build_graph(traced.closed_jaxpr, traced.in_paths)
    model = CostModel(MeshInfo.of(mesh), load_profile("h100-nvlink"), recompute_heavy=False)
    fixed_in = {graph.inputs[i]: s for i, s in enumerate(fixed) if s}
    exact, _ = dynamic_programming(graph, model, fixed_in, {})
    greedy = propagate(graph, model, fixed_in, {})
    return tuple(model.score(graph_cost(graph, p, model)) for p in (exact, greedy))


@pytest.mark.parametrize("name", FAST)
def test_exact_plan_is_never_costlier_than_propagation_and_runs_right(name):
    exact_cost, greedy_cost = _search_costs(name)
    assert exact_cost <= greedy_cost * (1 + 1e-9)
    fn, args, in_strategy = PROGRAMS[name]()
    exact = jaxpar.shard(fn, in_strategy=in_strategy, search_mode="dynamic_programming",
                         hardware="h100-nvlink")
    p_exact = exact.plan(*args)
    assert any("dynamic_programming: optimal" in n for n in p_exact.notes)
    assert "dynamic_programming: optimal" in p_exact.explain()
    got, want = exact(*args), jax.jit(fn)(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["embedding_xent", "mlp_train_step"])
def test_exact_beats_propagation_where_greedy_goes_wrong(name):
    exact_cost, greedy_cost = _search_costs(name)  # about 2x and 4x cheaper
    assert exact_cost < 0.6 * greedy_cost


def test_exact_plan_round_trips_through_a_file(tmp_path):
    fn, args, in_strategy = PROGRAMS["scan_layers"]()
    f = jaxpar.shard(fn, in_strategy=in_strategy, search_mode="dynamic_programming")
    f.plan(*args).save(tmp_path / "p.json")
    loaded = jaxpar.Plan.load(tmp_path / "p.json")
    assert loaded.notes == f.plan(*args).notes
    out = jaxpar.shard(fn).with_plan(loaded)(*args)
    for g, w in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(f(*args)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("budget,match", [
    (64, r"memory_budget=64 bytes per device: the inputs whose strategy is fixed already take"),
    (4200, r"memory_budget=4200 bytes per device cannot be met .* smallest possible peak"),
])
def test_impossible_memory_budget_is_a_clear_error(budget, match):
    fn, args, in_strategy = PROGRAMS["moe_top2"]()
    f = jaxpar.shard(fn, in_strategy=in_strategy, search_mode="dynamic_programming",
                     memory_budget=budget)
    with pytest.raises(ValueError, match=match):
        f.plan(*args)
