"""search_mode="dynamic_programming": the exact optimum of the cost model, end to end."""

import jax
import numpy as np
import pytest

import jaxpar
from jaxpar.models import PROGRAMS

FAST = ["moe_top2", "embedding_xent", "scan_layers", "cond_and_fori"]


@pytest.mark.parametrize("name", FAST)
def test_exact_plan_is_never_costlier_than_propagation_and_runs_right(name):
    fn, args, in_strategy = PROGRAMS[name]()
    exact = jaxpar.shard(fn, in_strategy=in_strategy, search_mode="dynamic_programming",
                         hardware="h100-nvlink")
    prop = jaxpar.shard(fn, in_strategy=in_strategy, hardware="h100-nvlink")
    p_exact, p_prop = exact.plan(*args), prop.plan(*args)
    assert p_exact.cost.total_s <= p_prop.cost.total_s * (1 + 1e-9)
    assert any("dynamic_programming: optimal" in n for n in p_exact.notes)
    assert "dynamic_programming: optimal" in p_exact.explain()
    got, want = exact(*args), jax.jit(fn)(*args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_exact_beats_propagation_where_greedy_goes_wrong():
    fn, args, in_strategy = PROGRAMS["moe_top2"]()
    kw = {"in_strategy": in_strategy, "hardware": "h100-nvlink"}
    exact = jaxpar.shard(fn, search_mode="dynamic_programming", **kw).plan(*args)
    greedy = jaxpar.shard(fn, **kw).plan(*args)
    assert exact.cost.total_s < 0.9 * greedy.cost.total_s


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
