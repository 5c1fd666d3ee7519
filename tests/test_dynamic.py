"""The exact strategy-selection kernel against brute force on seeded random tiny graphs."""

import dataclasses
import doctest
import itertools

import numpy as np
import pytest

from jaxpar.search import dual, dynamic, elimination
from jaxpar.search.compress import reduce_problem
from jaxpar.search.dynamic import (
    Problem,
    brute_force,
    objective,
    peak_memory,
    prune_dominated,
    restricted,
    solve,
)

SHAPES = ("chain", "tree", "dag", "dense")  # dense: DAGs with two parents per node, k >= 2


def _pairs(rng: np.random.Generator, n: int, shape: str) -> list[tuple[int, int]]:
    """Node pairs of a chain, a tree or a DAG with diamonds (and parallel edges), shuffled."""
    order = rng.permutation(n)
    if shape == "chain":
        pairs = [(order[i], order[i + 1]) for i in range(n - 1)]
    else:
        pairs = [(order[int(rng.integers(0, v))], order[v]) for v in range(1, n)]
    if shape == "dag" and n > 2:
        extra = rng.integers(0, n, (n // 2 + 1, 2))
        pairs += [(order[min(a, b)], order[max(a, b)]) for a, b in extra if a != b]
    if shape == "dense":
        pairs += [(order[int(rng.integers(0, v - 1))], order[v]) for v in range(2, n)]
    return [(int(v), int(u)) if rng.random() < 0.3 else (int(u), int(v)) for u, v in pairs]


def _budget(rng: np.random.Generator, mem: list[np.ndarray], groups) -> float:
    """A feasible budget somewhere between the smallest and the largest possible peak."""
    low = max(sum(mem[i].min() for i in g) for g in groups)
    high = max(sum(mem[i].max() for i in g) for g in groups)
    return float(np.floor(low + rng.random() * (high - low)))


def _random_edge(rng: np.random.Generator, u: int, v: int, k: np.ndarray) -> tuple:
    """A dense matrix (sometimes zero), or the class form (u, v, K, row, col) with few classes."""
    if rng.random() < 0.6:
        return u, v, rng.integers(0, 10, (k[u], k[v])) * float(rng.random() > 0.15)
    na, nb = int(rng.integers(1, k[u] + 1)), int(rng.integers(1, k[v] + 1))
    return (u, v, rng.integers(0, 10, (na, nb)).astype(float), rng.integers(0, na, k[u]),
            rng.integers(0, nb, k[v]))


def random_problem(seed: int, shape: str, with_budget: bool) -> Problem:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4 if shape == "dense" else 1, 8))
    k = rng.integers(2 if shape == "dense" else 1, 5, n)
    costs = tuple(rng.integers(0, 10, ki).astype(float) for ki in k)
    edges = tuple(_random_edge(rng, u, v, k) for u, v in _pairs(rng, n, shape))
    if not with_budget:
        return Problem(costs, edges)
    mem = [rng.integers(0, 20, ki).astype(float) for ki in k]
    live = None
    if rng.random() < 0.5:
        live = tuple(tuple(int(i) for i in rng.choice(n, int(rng.integers(1, n + 1)),
                                                      replace=False)) for _ in range(3))
    budget = _budget(rng, mem, live or (tuple(range(n)),))
    return Problem(costs, edges, tuple(mem), live, budget)


@pytest.mark.parametrize("with_budget", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(20))
def test_solve_matches_brute_force(seed, shape, with_budget):
    problem = random_problem(seed, shape, with_budget)
    exact, got = brute_force(problem), solve(problem)
    assert got.cost == pytest.approx(exact.cost, rel=1e-9, abs=1e-9)
    assert got.cost == pytest.approx(objective(problem, got.choice), rel=1e-12)
    assert got.optimal and got.gap == 0.0
    if with_budget:
        assert peak_memory(problem, got.choice) <= problem.budget
    if shape == "chain" and not with_budget:
        assert got.method == "chain-dp"


def _tie(problem: Problem, rng: np.random.Generator) -> Problem:
    """The problem with random groups of nodes of equal k tied together."""
    by_k: dict[int, list[int]] = {}
    for i, k in enumerate(problem.sizes):
        by_k.setdefault(k, []).append(i)
    groups = []
    for nodes in by_k.values():
        rng.shuffle(nodes)
        while len(nodes) >= 2 and rng.random() < 0.8:
            take = int(rng.integers(2, len(nodes) + 1))
            groups.append(tuple(nodes[:take]))
            nodes = nodes[take:]
    return Problem(problem.node_cost, problem.edges, problem.node_mem, problem.live_sets,
                   problem.budget, tuple(groups))


def random_tied_problem(seed: int, shape: str, with_budget: bool) -> Problem:
    """A random problem with ties; its budget (if any) fits some assignment that honours them."""
    rng = np.random.default_rng(1000 + seed)
    tied = _tie(random_problem(seed, shape, False), rng)
    if not with_budget:
        return tied
    mem = tuple(rng.integers(0, 20, k).astype(float) for k in tied.sizes)
    x = np.array([int(rng.integers(0, k)) for k in tied.sizes])
    for g in tied.tied:
        x[list(g)] = x[g[0]]
    free = Problem(tied.node_cost, tied.edges, mem)
    budget = peak_memory(free, x) + float(rng.integers(0, 10))
    return Problem(tied.node_cost, tied.edges, mem, None, budget, tied.tied)


@pytest.mark.parametrize("with_budget", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(12))
def test_tied_solve_matches_brute_force(seed, shape, with_budget):
    problem = random_tied_problem(seed, shape, with_budget)
    exact, got = brute_force(problem), solve(problem)
    assert got.cost == pytest.approx(exact.cost, rel=1e-9, abs=1e-9)
    assert got.optimal
    for group in problem.tied:
        assert len({int(got.choice[i]) for i in group}) == 1
    if with_budget:
        assert peak_memory(problem, got.choice) <= problem.budget


def test_tying_restricts_and_untied_optimum_is_no_worse():
    for seed in range(20):
        tied = random_tied_problem(seed, "dag", False)
        free = Problem(tied.node_cost, tied.edges)
        assert solve(free).cost <= solve(tied).cost + 1e-9


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(10))
def test_reduction_keeps_every_value_and_the_optimum(seed, shape):
    # Merged, folded and eliminated: the core's value of an assignment is the objective of
    # its expansion, and the best expansion is the optimum.
    problem = random_tied_problem(seed, shape, False) if seed % 2 else \
        random_problem(seed, shape, False)
    core = reduce_problem(problem)
    alive = sorted(core.alive)
    values = []
    for x in itertools.product(*(range(len(core.cost[v])) for v in alive)):
        x = dict(zip(alive, x, strict=True))
        values.append(objective(problem, core.expand(x)))
        assert dual.LocalSearch(core, core.cost).value(x) == pytest.approx(values[-1], abs=1e-9)
    assert min(values) == pytest.approx(brute_force(problem).cost, abs=1e-9)


def test_an_end_with_one_candidate_folds_its_edges_into_the_other_end():
    # A node with one candidate (an op the search holds) makes every edge it has separable:
    # the edge's column (row) for that candidate moves into the other end's cost.
    k01 = (np.array([[9.0, 9.0, 9.0], [4.0, 0.0, 7.0]]), np.array([1]), np.arange(3))
    k12 = np.array([[0.0, 5.0, 9.0], [5.0, 0.0, 9.0], [9.0, 9.0, 0.0]])
    k30 = (np.array([[5.0, 1.0], [5.0, 8.0]]), np.array([1, 0]), np.array([1]))
    problem = Problem((np.array([2.0]), np.zeros(3), np.array([0.0, 1.0, 0.5]),
                       np.array([3.0, 0.0])), ((0, 1, *k01), (1, 2, k12), (3, 0, *k30)))
    core = reduce_problem(problem, memory=True)  # nothing eliminated: only the folds
    assert set(core.edges) == {(1, 2)} and not core.adj[0] and not core.adj[3]
    np.testing.assert_allclose(core.cost[1], [4.0, 0.0, 7.0])
    np.testing.assert_allclose(core.cost[3], [3.0 + 8.0, 0.0 + 1.0])
    for x in itertools.product(range(1), range(3), range(3), range(2)):
        assert dual.LocalSearch(core, core.cost).value(dict(enumerate(x))) == \
            pytest.approx(objective(problem, np.array(x)))


@pytest.mark.parametrize("seed", range(10))
def test_dual_bound_never_passes_the_optimum_and_never_drops(seed):
    problem = random_problem(200 + seed, "dense", False)
    core = reduce_problem(problem, memory=True)  # nothing eliminated: a dual over everything
    ascent = dual.DualAscent(core, core.cost, 10.0)
    optimum, last = brute_force(problem).cost, -np.inf
    for it in range(12):
        ascent.sweep(backward=bool(it % 2), balanced=it > 8)
        bound = ascent.bound()
        assert last - 1e-9 <= bound <= optimum + 1e-9
        last = bound


def test_fixing_keeps_every_assignment_within_the_slack():
    problem = layout_dag(1, n=12, k=6, m=20)
    core = reduce_problem(problem, memory=True)
    ascent = dual.DualAscent(core, core.cost, 100.0)
    for it in range(8):
        ascent.sweep(backward=bool(it % 2))
    best = solve(problem)
    slack = best.cost - ascent.bound()
    cands, pairs = dual.fixing(ascent, slack)
    x = {int(core.var_of[i]): int(c) for i, c in enumerate(best.choice)}
    assert all(x[v] in cands[v] for v in core.alive)
    for (a, b), e in core.edges.items():
        assert [e.row[x[a]], e.col[x[b]]] in pairs[(a, b)].tolist()


def _full_sweeps(search: dual.LocalSearch, x: dict) -> dict:
    """Iterated conditional modes, every variable looked at in every sweep until none moves
    (what LocalSearch.polish did before it skipped the variables no neighbour's move touched)."""
    x = dict(x)
    while True:
        moved = False
        for v in search.vars:
            t = search.local(x, v)
            best = int(np.argsort(t, kind="stable")[0])
            if t[best] < t[x[v]] - 1e-12 * abs(t[x[v]]):
                x[v], moved = best, True
        if not moved:
            return x


@pytest.mark.parametrize("seed", range(30))
def test_polish_ends_where_full_sweeps_end(seed):
    # Without a budget, polish looks again only at variables whose neighbour moved: from any
    # start it must end at the assignment that sweeping every variable each time ends at,
    # and at one no single move improves.
    problem = random_problem(300 + seed, "dense" if seed % 2 else "dag", False)
    core = reduce_problem(problem, memory=True)  # nothing eliminated: many variables
    search = dual.LocalSearch(core, core.cost)
    rng = np.random.default_rng(seed)
    for _ in range(5):
        start = {v: int(rng.integers(len(core.cost[v]))) for v in search.vars}
        got = search.polish(start)
        assert got == _full_sweeps(search, start)
        for v in search.vars:
            t = search.local(got, v)
            assert t[got[v]] <= t.min() + 1e-12 * abs(t[got[v]])


@pytest.mark.parametrize("seed", range(16))
def test_live_ranges_act_as_the_live_sets_at_every_point(seed):
    base = random_problem(300 + seed, SHAPES[seed % 4], True)
    rng = np.random.default_rng(seed)
    n = len(base.sizes)
    first = rng.integers(0, 6, n)
    last = first + rng.integers(0, 4, n)
    sets = tuple(tuple(i for i in range(n) if first[i] <= p <= last[i])
                 for p in range(int(last.max()) + 1))
    budget = _budget(rng, list(base.node_mem), [g for g in sets if g])
    ranged = Problem(base.node_cost, base.edges, base.node_mem, None, budget,
                     live_ranges=np.stack([first, last], axis=1))
    listed = Problem(base.node_cost, base.edges, base.node_mem, sets, budget)
    for _ in range(5):
        x = np.array([int(rng.integers(0, k)) for k in base.sizes])
        assert peak_memory(ranged, x) == peak_memory(listed, x)
    got = solve(ranged)
    assert got.cost == pytest.approx(brute_force(listed).cost, abs=1e-9)
    assert brute_force(ranged).cost == brute_force(listed).cost
    assert peak_memory(listed, got.choice) <= budget


def test_tied_budget_that_no_agreeing_assignment_meets_is_an_error():
    # Untied, node 0 at candidate 0 and node 1 at candidate 1 fit; tied, neither index does.
    mem = (_mat([1, 9]), _mat([9, 1]))
    problem = Problem((_mat([0, 0]), _mat([0, 0])), ((0, 1, SWAP),), mem, budget=3.0,
                      tied=((0, 1),))
    with pytest.raises(ValueError, match=r"tied nodes agree fits memory_budget=3"):
        solve(problem)


def test_prune_dominated_refuses_tied_problems():
    with pytest.raises(ValueError, match="tied"):
        prune_dominated(Problem((_mat([1, 2]), _mat([1, 2])), tied=((0, 1),)))


def _mat(rows) -> np.ndarray:
    return np.array(rows, dtype=float)


SWAP = _mat([[0, 5], [5, 0]])  # non-separable: keeping the same candidate is free


def test_methods_chain_tree_dp_and_core():
    cost = tuple(_mat([1, 0]) for _ in range(4))
    chain = Problem(cost, ((0, 1, SWAP), (2, 1, SWAP), (2, 3, SWAP)))
    star = Problem(cost, ((0, 1, SWAP), (0, 2, SWAP), (0, 3, SWAP)))
    diamond = Problem(cost, ((0, 1, SWAP), (0, 2, SWAP), (1, 3, SWAP), (2, 3, SWAP)))
    clique = Problem(cost, tuple((a, b, SWAP) for a in range(4) for b in range(a + 1, 4)))
    assert solve(chain).method == "chain-dp"
    assert solve(star).method == "tree-dp"
    assert solve(diamond).method == "dp"  # series-parallel: eliminated, no core left
    assert solve(clique).method in ("dual", "lp", "ilp")  # every node has degree 3
    for p in (chain, star, diamond, clique):
        assert solve(p).cost == brute_force(p).cost == 0.0


def test_small_core_goes_to_the_ilp_after_four_sweeps(monkeypatch):
    # Three candidates on a 4-clique that pays for agreeing: no assignment is free (four nodes,
    # three colours) but the LP relaxation is (spread evenly), so dual ascent would creep
    # until it stalls; a core this small goes to HiGHS after the first four sweeps (where
    # elimination declines it: here its table limit is 0).
    monkeypatch.setattr(elimination, "TABLE_LIMIT", 0)
    sweeps = []
    sweep = dual.DualAscent.sweep
    monkeypatch.setattr(dual.DualAscent, "sweep",
                        lambda self, *a, **k: sweeps.append(k) or sweep(self, *a, **k))
    agree = np.eye(3) * 10.0
    problem = Problem(tuple(np.zeros(3) for _ in range(4)),
                      tuple((a, b, agree) for a in range(4) for b in range(a + 1, 4)))
    got = solve(problem)
    assert (got.method, got.optimal, got.cost) == ("ilp", True, 10.0)
    assert sum(not k.get("balanced") for k in sweeps) == 4
    assert got.cost == brute_force(problem).cost


def test_a_small_core_with_an_integral_lp_is_solved_by_the_lp_without_dual_ascent(monkeypatch):
    # A 4-clique that pays for disagreeing, candidates priced apart per node: the LP
    # relaxation's vertex is integral (everyone on the cheapest common candidate), so the core
    # (well under FIX_SIZE) is answered by one LP, no dual sweep and no MIP.
    sweeps, mips = [], []
    monkeypatch.setattr(dual.DualAscent, "sweep", lambda *a, **k: sweeps.append(1))
    monkeypatch.setattr(dynamic, "milp", lambda *a, **k: mips.append(1))
    apart = 1.0 - np.eye(3)
    costs = (np.array([3.0, 1.0, 2.0]), np.array([0.0, 1.5, 2.0]), np.array([1.0, 0.2, 0.0]),
             np.array([0.5, 0.1, 4.0]))
    problem = Problem(costs, tuple((a, b, apart) for a in range(4) for b in range(a + 1, 4)))
    assert len(reduce_problem(problem).alive) == 4
    got = solve(problem)
    assert (got.method, got.optimal, got.gap) == ("lp", True, 0.0)
    assert not sweeps and not mips
    exact = brute_force(problem)
    assert got.cost == pytest.approx(exact.cost) and got.choice.tolist() == exact.choice.tolist()


def test_zero_parallel_and_pinned_edges_do_not_break_a_chain():
    cost = (_mat([1, 0]), _mat([0, 1]), _mat([2]), _mat([0, 3]))
    edges = ((0, 1, SWAP), (1, 0, SWAP), (0, 1, np.zeros((2, 2))), (1, 2, _mat([[4], [0]])),
             (2, 3, _mat([[0, 9]])), (3, 0, _mat([[1, 2], [3, 4]])), (3, 1, np.zeros((2, 2))))
    problem = Problem(cost, edges)
    got = solve(problem)
    assert got.method == "chain-dp"
    assert got.cost == brute_force(problem).cost


def test_class_form_edges_stay_small_and_price_like_dense_ones():
    k_classes = _mat([[0, 4], [4, 1]])
    row, col = np.array([0, 0, 1]), np.array([1, 0, 0, 1])
    cost = (_mat([0, 1, 2]), _mat([3, 2, 1, 0]), _mat([0, 0]))
    classed = Problem(cost, ((0, 1, k_classes, row, col), (1, 2, SWAP[col]), (0, 2, SWAP[row])))
    dense = Problem(cost, ((0, 1, k_classes[np.ix_(row, col)]), (1, 2, SWAP[col]),
                           (0, 2, SWAP[row])))
    assert classed.edges[0][2].shape == (2, 2)  # not expanded to (3, 4)
    for x in itertools.product(range(3), range(4), range(2)):
        assert objective(classed, np.array(x)) == objective(dense, np.array(x))
    assert solve(classed).cost == solve(dense).cost == brute_force(dense).cost
    core = reduce_problem(classed, memory=True)
    assert [e.K.shape for e in core.edges.values()] == [(2, 2)] * 3  # dense ones found classes
    everything = ({v: np.arange(len(core.cost[v])) for v in core.alive},
                  {k: np.argwhere(e.K >= 0) for k, e in core.edges.items()})
    _, constraints, _, nvar = dynamic._build_ilp(classed, core, *everything, 1.0)
    assert nvar == 3 + 4 + 2 + 3 * 2 * 2  # x, then e over 2 x 2 classes per edge


def test_binding_budget_goes_to_the_ilp_and_holds():
    problem = Problem((_mat([0, 3]), _mat([0, 3])), ((0, 1, SWAP),),
                      node_mem=(_mat([10, 1]), _mat([10, 1])), budget=12.0)
    got = solve(problem)
    assert got.method == "ilp"
    assert peak_memory(problem, got.choice) <= 12.0
    assert got.cost == brute_force(problem).cost == 6.0


def test_infeasible_budget_names_budget_and_smallest_peak():
    mem = (_mat([5, 7]), _mat([3, 4]))
    problem = Problem((_mat([0, 0]), _mat([0, 0])), ((0, 1, SWAP),), mem, budget=6.0)
    for fn in (solve, brute_force):
        with pytest.raises(ValueError, match=r"memory_budget=6 bytes.*smallest possible peak is "
                                             r"8 bytes.*least-memory candidate"):
            fn(problem)
    live = Problem(problem.node_cost, problem.edges, mem, ((0,), (0, 1)), budget=7.0)
    with pytest.raises(ValueError, match=r"peak is 8 bytes in live_sets\[1\]"):
        solve(live)


def test_tied_nodes_that_disagree_on_their_least_memory_candidate_give_a_bound():
    # Nodes 0 and 1 must take one candidate: node 0 holds least with its first, node 1 with
    # its second. Each one's least (5 + 3) only bounds the smallest peak (the best is 9).
    mem = (_mat([5, 6]), _mat([4, 3]))
    tied = Problem((_mat([0, 0]), _mat([0, 0])), (), mem, budget=7.0, tied=((0, 1),))
    with pytest.raises(ValueError, match=r"smallest possible peak is at least 8 bytes \(found "
                                         r"by taking every node's least-memory candidate\)$"):
        solve(tied)
    agree = Problem(tied.node_cost, (), (_mat([5, 6]), _mat([3, 4])), budget=7.0,
                    tied=((0, 1),))
    with pytest.raises(ValueError, match=r"peak is 8 bytes .*which is exact"):
        solve(agree)


def test_a_budget_no_found_assignment_fits_is_refused_as_proven_or_as_not_found(monkeypatch):
    # Tied nodes 0 and 1 hold 1 + 9 or 9 + 1 bytes: no assignment fits 5, though each node's
    # least (1 + 1) does, so the first check passes and the ILP has the last word. Where it
    # proves none fits, the budget cannot be met; where it stops before finding one, the
    # search says that it found none in time (it said none fits, and a ViT step's budget
    # that recursive_programming meets was refused so).
    tied = Problem((_mat([0, 1]), _mat([1, 0]), _mat([0, 0])),
                   ((0, 2, _mat([[0, 1], [1, 0]])), (1, 2, _mat([[0, 1], [1, 0]]))),
                   (_mat([1, 9]), _mat([9, 1]), _mat([0, 0])), budget=5.0, tied=((0, 1),))
    with pytest.raises(ValueError, match=r"^no strategy assignment in which tied nodes agree "
                                         r"fits memory_budget=5 bytes") as proven:
        solve(tied)
    assert not isinstance(proven.value, dynamic.NotFound)
    monkeypatch.setattr(dynamic, "_solve_ilp", lambda *a, **k: (None, -np.inf, False))
    with pytest.raises(dynamic.NotFound, match=r"^no strategy assignment that fits "
                                               r"memory_budget=5 bytes per device was found "
                                               r"within the time limit, and none is proven "
                                               r"impossible \(.* peaks at 10\)$"):
        solve(tied)


def test_pruning_removes_a_dominated_candidate():
    # Candidate 1 of node 0 costs more, uses more memory and reshards no cheaper: dominated.
    problem = Problem((_mat([1, 2, 0]), _mat([0, 0])),
                      ((0, 1, _mat([[0, 1], [1, 2], [0, 0]])),),
                      node_mem=(_mat([1, 2, 9]), _mat([1, 1])))
    pruned, keep = prune_dominated(problem)
    assert keep[0].tolist() == [0, 2] and keep[1].tolist() == [0]
    assert pruned.sizes == (2, 1) and problem.sizes == (3, 2)


def test_pruning_keeps_exactly_one_of_identical_candidates():
    pruned, keep = prune_dominated(Problem((_mat([1, 1, 1]),)))
    assert keep[0].tolist() == [0]


@pytest.mark.parametrize("with_budget", [False, True])
@pytest.mark.parametrize("seed", range(15))
def test_pruning_keeps_the_optimum(seed, with_budget):
    problem = random_problem(100 + seed, SHAPES[seed % 4], with_budget)
    pruned, keep = prune_dominated(problem)
    got = solve(pruned)
    choice = np.array([keep[i][c] for i, c in enumerate(got.choice)])
    assert objective(problem, choice) == pytest.approx(brute_force(problem).cost, rel=1e-9)
    if with_budget:
        assert peak_memory(problem, choice) <= problem.budget


def layout_dag(seed: int, n: int = 40, k: int = 25, m: int = 60) -> Problem:
    """A DAG whose resharding costs are edge sizes times an L1 distance between layouts."""
    rng = np.random.default_rng(seed)
    layouts = rng.integers(0, 4, (k, 3))
    distance = np.abs(layouts[:, None, :] - layouts[None, :, :]).sum(-1).astype(float)
    edges = [(int(rng.integers(0, v)), v) for v in range(1, n)]
    while len(edges) < m:
        u, v = sorted(int(x) for x in rng.choice(n, 2, replace=False))
        edges.append((u, v))
    return Problem(tuple(rng.integers(0, 50, k).astype(float) for _ in range(n)),
                   tuple((u, v, float(rng.integers(1, 20)) * distance) for u, v in edges))


def test_scale_forty_nodes_twenty_five_candidates():
    problem = layout_dag(0)  # 1,000 binaries and 37,500 edge variables
    got = solve(problem, time_limit=60.0)
    assert got.method in ("dual", "lp", "ilp") and got.optimal and got.gap == 0.0
    assert got.choice.shape == (40,) and got.choice.dtype == np.int64
    assert np.all((got.choice >= 0) & (got.choice < 25))
    assert got.cost == pytest.approx(objective(problem, got.choice))
    assert got.seconds > 0


@pytest.mark.parametrize("with_budget", [False, True])
@pytest.mark.parametrize("time_limit", [0.05, 1.0])
def test_time_limit_returns_a_valid_assignment_with_its_gap(time_limit, with_budget):
    # Uniform random costs on a cyclic graph: the LP bound is loose (about 5%) and proving
    # optimality takes HiGHS ~20 s, so it stops with no incumbent (0.05 s) or a heuristic one.
    rng = np.random.default_rng(0)
    n, k = 40, 25
    edges = [(int(rng.integers(0, v)), v) for v in range(1, n)]
    while len(edges) < 60:
        edges.append(tuple(sorted(int(x) for x in rng.choice(n, 2, replace=False))))
    costs = tuple(rng.integers(0, 100, k).astype(float) for _ in range(n))
    matrices = tuple((u, v, rng.integers(0, 100, (k, k)).astype(float)) for u, v in edges)
    mem = [rng.integers(0, 100, k).astype(float) for _ in range(n)]
    budget = _budget(rng, mem, [range(n)]) if with_budget else None
    problem = Problem(costs, matrices, tuple(mem), None, budget)
    got = solve(problem, time_limit=time_limit)
    assert got.method == "ilp" and not got.optimal and got.gap > 0
    assert got.choice.shape == (n,) and np.all((got.choice >= 0) & (got.choice < k))
    assert got.cost == pytest.approx(objective(problem, got.choice))
    if with_budget:
        assert peak_memory(problem, got.choice) <= budget


def test_empty_and_pinned_problems():
    assert solve(Problem(())).choice.shape == (0,)
    pinned = Problem((_mat([2]), _mat([3])), ((0, 1, _mat([[4]])),))
    got = solve(pinned)
    assert got.choice.tolist() == [0, 0] and got.cost == 9.0


SHARED = (np.zeros((2, 2)), np.arange(2))  # one K and one class index used by two edges


@pytest.mark.parametrize("kwargs, match", [
    (dict(node_cost=(_mat([1]), _mat([1, 2])), edges=((0, 1, np.zeros((2, 2))),)),
     r"edges\[0\] \(0 -> 1\) has a cost matrix of shape \(2, 2\); expected .* \(1, 2\)"),
    (dict(node_cost=(_mat([1]), _mat([1, -2]))), r"node_cost\[1\]\[1\]=-2.0 must be finite"),
    (dict(node_cost=(_mat([1, np.nan]),)), r"node_cost\[0\]"),
    (dict(node_cost=(np.zeros(0),)), r"node_cost\[0\] has shape \(0,\)"),
    (dict(node_cost=(_mat([1]), _mat([1]), _mat([1])),
          edges=((0, 1, _mat([[0]])), (2, 1, _mat([[np.nan]])))),
     r"edges\[1\] \(2 -> 1\) has C\[0, 0\]=nan"),
    (dict(node_cost=(_mat([1]), _mat([1])), edges=((0, 0, _mat([[0]])),)), r"edges\[0\] joins"),
    (dict(node_cost=(_mat([1, 2]), _mat([1])), edges=((0, 1, _mat([[0]]), [0, 1], [0]),)),
     r"edges\[0\] \(0 -> 1\) has K of shape \(1, 1\) and row \[0, 1\]"),
    (dict(node_cost=(_mat([1]), _mat([1])), edges=((0, 5, _mat([[0]])),)), r"edges\[0\] joins"),
    (dict(node_cost=(_mat([1, 2]), _mat([1, 2]), _mat([1])),  # arrays shared by identity
          edges=((0, 1, SHARED[0], SHARED[1], SHARED[1]),
                 (0, 2, SHARED[0], SHARED[1], SHARED[1]))),
     r"edges\[1\] \(0 -> 2\) has K of shape \(2, 2\) and col \[0, 1\]"),
    (dict(node_cost=(_mat([1]),), node_mem=(_mat([1]), _mat([1]))), r"node_mem has 2 entries"),
    (dict(node_cost=(_mat([1, 2]),), node_mem=(_mat([1]),)), r"node_mem\[0\] has shape"),
    (dict(node_cost=(_mat([1]),), budget=10.0), r"need node_mem"),
    (dict(node_cost=(_mat([1]),), node_mem=(_mat([1]),), budget=float("nan")), r"budget=nan"),
    (dict(node_cost=(_mat([1]),), node_mem=(_mat([1]),), live_sets=((0, 3),), budget=1.0),
     r"live_sets\[0\]=\(0, 3\)"),
    (dict(node_cost=(_mat([1]), _mat([1])), node_mem=(_mat([1]), _mat([1])),
          live_ranges=[[0, 1], [2, 1]]), r"live_ranges has shape \(2, 2\); expected .* first <="),
    (dict(node_cost=(_mat([1]),), node_mem=(_mat([1]),), live_ranges=[[0, 1], [0, 1]]),
     r"live_ranges has shape \(2, 2\)"),
    (dict(node_cost=(_mat([1]),), node_mem=(_mat([1]),), live_sets=((0,),),
          live_ranges=[[0, 1]]), r"live_sets or live_ranges, not both"),
    (dict(node_cost=(_mat([1, 2]), _mat([1])), tied=((0, 1),)),
     r"tied\[0\]=\(0, 1\) joins nodes with \[2, 1\] candidates"),
    (dict(node_cost=(_mat([1]), _mat([1]), _mat([1])), tied=((0, 1), (1, 2))),
     r"tied\[1\]=\(1, 2\) must hold node indices .* no other group holds"),
])
def test_problem_validation_names_the_culprit(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Problem(**kwargs)


def test_docstring_examples_run():
    assert doctest.testmod(dynamic).failed == 0


@pytest.mark.parametrize("frustrated", [False, True])
def test_an_integral_lp_relaxation_is_the_answer_and_a_fractional_one_goes_to_the_mip(
        monkeypatch, frustrated):
    # Four nodes all joined (no elimination), two candidates each. Agreeing pays nothing
    # and the first candidate is cheaper: the LP relaxation's vertex is integral, the optimum,
    # and HiGHS's MIP is not started. Agreeing costs 1 on every edge (four nodes cannot all
    # disagree pairwise): the LP's optimum puts 1/2 on each candidate and scores 0.2 against
    # the integral optimum's 2.2, so the MIP runs and finds the brute-force optimum.
    same, apart = (1.0, 0.0) if frustrated else (0.0, 1.0)
    k = np.array([[same, apart], [apart, same]])
    problem = Problem(tuple(np.array([0.0, 0.1]) for _ in range(4)),
                      tuple((u, v, k) for u, v in itertools.combinations(range(4), 2)))
    core = reduce_problem(problem)
    assert len(core.alive) == 4
    cands = {v: np.arange(len(core.cost[v])) for v in core.alive}
    pairs = {key: np.argwhere(np.ones(e.K.shape, dtype=bool)) for key, e in core.edges.items()}
    mips = []
    real = dynamic.milp
    monkeypatch.setattr(dynamic, "milp", lambda *a, **kw: mips.append(1) or real(*a, **kw))
    found, bound, proven = dynamic._solve_ilp(problem, core, (cands, pairs),
                                              dynamic._scale(core), 1e9, 1e-9)
    assert proven and len(mips) == int(frustrated)
    exact = brute_force(problem)
    got = core.expand(found)
    assert objective(problem, got) == pytest.approx(exact.cost, abs=1e-12)
    assert bound == pytest.approx(exact.cost, abs=1e-9)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(10))
def test_a_restricted_problem_solves_to_the_best_plan_of_the_candidates_kept(seed, shape):
    # Brute force over the whole problem, each candidate left out priced far above the rest:
    # the plans of the kept candidates only, and their optimum is the restricted one's.
    problem = random_problem(seed, shape, with_budget=False)
    rng = np.random.default_rng(seed + 1000)
    keep = {i: np.sort(rng.choice(k, int(rng.integers(1, k + 1)), replace=False))
            for i, k in enumerate(problem.sizes) if rng.random() < 0.6}
    smaller, back = restricted(problem, keep)
    assert smaller.sizes == tuple(len(keep[i]) if i in keep else k
                                  for i, k in enumerate(problem.sizes))
    found = back(solve(smaller).choice)
    assert all(found[i] in kept for i, kept in keep.items())
    penalised = tuple(c + 1e6 * ~np.isin(np.arange(len(c)), keep.get(i, np.arange(len(c))))
                      for i, c in enumerate(problem.node_cost))
    best = brute_force(Problem(penalised, problem.edges))
    assert objective(problem, found) == pytest.approx(best.cost, abs=1e-9)


def test_restricted_refuses_a_node_left_empty_and_tied_nodes_kept_apart():
    problem = Problem((np.array([1.0, 2.0]), np.array([3.0, 4.0])), tied=((0, 1),))
    with pytest.raises(ValueError, match="keeps a candidate"):
        restricted(dataclasses.replace(problem, tied=None), {0: np.array([], dtype=np.int64)})
    with pytest.raises(ValueError, match="keep different candidates"):
        restricted(problem, {0: np.array([0]), 1: np.array([1])})
    smaller, back = restricted(problem, {0: np.array([1]), 1: np.array([1])})
    assert list(back(solve(smaller).choice)) == [1, 1]
