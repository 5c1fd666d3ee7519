"""Exact variable elimination on cores compress.py leaves (every variable of degree three or
more) against brute force, and its place in dynamic.solve."""

import numpy as np
import pytest

from jaxpar.search import dynamic, elimination
from jaxpar.search.compress import reduce_problem
from jaxpar.search.dynamic import Problem, brute_force, objective, solve
from jaxpar.search.elimination import eliminate


def _cyclic_problem(seed: int) -> Problem:
    """A random graph every node of which has three or more neighbours (a wheel, a ladder with
    a hub, or a clique), edges dense or in class form: the first drawn of which compress.py
    leaves a core (edges that happen to be separable fold away, and the rest may then be
    eliminated)."""
    rng = np.random.default_rng(seed)
    while True:
        problem = _draw(rng, seed)
        if reduce_problem(problem).alive:
            return problem


def _draw(rng: np.random.Generator, seed: int) -> Problem:
    kind = ("wheel", "ladder", "clique")[seed % 3]
    if kind == "wheel":  # a rim of six around hub 0
        n, pairs = 7, [(0, i) for i in range(1, 7)] + [(i, i % 6 + 1) for i in range(1, 7)]
    elif kind == "ladder":  # rails 1-2-3 and 4-5-6, three rungs, hub 0 on five of them
        n, pairs = 7, [(1, 2), (2, 3), (4, 5), (5, 6), (1, 4), (2, 5), (3, 6), (0, 1), (0, 2),
                       (0, 3), (0, 4), (0, 6)]
    else:
        n, pairs = 5, [(a, b) for a in range(5) for b in range(a + 1, 5)]
    k = rng.integers(3, 6, n)
    costs = tuple(rng.integers(0, 10, ki).astype(float) for ki in k)
    edges = []
    for a, b in pairs:
        u, v = (b, a) if rng.random() < 0.3 else (a, b)
        if rng.random() < 0.5:
            edges.append((u, v, rng.random((k[u], k[v])).round(2)))
        else:  # class form: few classes, some candidates alike
            na, nb = int(rng.integers(2, k[u] + 1)), int(rng.integers(2, k[v] + 1))
            edges.append((u, v, rng.integers(0, 10, (na, nb)).astype(float),
                          rng.integers(0, na, k[u]), rng.integers(0, nb, k[v])))
    return Problem(costs, tuple(edges))


@pytest.mark.parametrize("seed", range(30))
def test_elimination_matches_brute_force_on_cores_of_cycles(seed):
    problem = _cyclic_problem(seed)
    core = reduce_problem(problem)
    found = eliminate(core)
    assert core.alive and found is not None and set(found) == core.alive
    choice = core.expand(found)
    assert objective(problem, choice) == pytest.approx(brute_force(problem).cost, abs=1e-9)


def test_elimination_declines_a_table_over_its_limits():
    # A 6-clique of 5 candidates each, edges that tell every candidate apart: eliminating any
    # node first builds a table over it and its five neighbours, 5**6 = 15,625 entries.
    rng = np.random.default_rng(0)
    problem = Problem(tuple(rng.random(5) for _ in range(6)),
                      tuple((a, b, rng.random((5, 5))) for a in range(6) for b in range(a + 1, 6)))
    core = reduce_problem(problem)
    assert len(core.alive) == 6
    assert eliminate(core, limit=15_624) is None
    assert eliminate(core, total=15_624) is None
    found = eliminate(core, limit=15_625)
    assert objective(problem, core.expand(found)) == pytest.approx(brute_force(problem).cost)


def test_a_core_too_wide_is_declined_from_its_factors_sizes_alone(monkeypatch):
    # Every node of the 6-clique above meets factors with 5 classes for it and its five
    # neighbours: 5**6 entries over a limit of 15,624, known without refining any class map
    # (the GPT step's core of 448 variables: 0.16 -> 0.08 s to decline).
    rng = np.random.default_rng(0)
    problem = Problem(tuple(rng.random(5) for _ in range(6)),
                      tuple((a, b, rng.random((5, 5))) for a in range(6) for b in range(a + 1, 6)))
    core = reduce_problem(problem)

    def refine(*args):
        raise AssertionError("refined a class map")

    monkeypatch.setattr(elimination, "_refine", refine)
    assert elimination.order(core, limit=15_624) is None


def test_a_core_whose_lp_is_fractional_is_solved_by_elimination_without_the_ilp(monkeypatch):
    # This went to HiGHS's MIP; its core is narrow (the largest table 3**4 entries), so
    # elimination answers it exactly.
    mips = []
    monkeypatch.setattr(dynamic, "milp", lambda *a, **k: mips.append(1))
    got = solve(_agree())
    assert (got.method, got.optimal, got.gap, got.cost) == ("elimination", True, 0.0, 10.0)
    assert not mips


def _agree() -> Problem:
    """Three candidates on a 4-clique that pays for agreeing: its LP relaxation is fractional
    (spread evenly), and dual ascent cannot close the gap."""
    return Problem(tuple(np.zeros(3) for _ in range(4)),
                   tuple((a, b, np.eye(3) * 10.0) for a in range(4) for b in range(a + 1, 4)))


def test_elimination_gets_a_share_of_the_time_left():
    # Its tables' entries are bounded by RATE times a share of the time left: with none left,
    # the core goes on to the other methods.
    problem = _agree()
    core = reduce_problem(problem)
    assert core.alive and eliminate(core) is not None
    assert eliminate(core, total=0.0) is None
    assert solve(problem).method == "elimination"
    assert solve(problem, time_limit=0.0).method != "elimination"


def test_elimination_refuses_memory_rows():
    problem = Problem((np.zeros(2), np.zeros(2)), ((0, 1, np.eye(2)),),
                      (np.ones(2), np.ones(2)), None, 10.0)
    with pytest.raises(ValueError, match="without memory rows"):
        eliminate(reduce_problem(problem, memory=True))
