"""dynamic_programming: the exact strategy-selection kernel (DP, dual ascent, ILP).

Before: a `Problem` -- N nodes, node i with k_i candidate strategies priced by `node_cost[i]`,
edges (u, v, K, row, col) with K[row[s], col[t]] the resharding cost when u picks s and v picks t
(costs over spec classes: a tensor has far fewer distinct specs than its ops have strategies),
optionally groups of tied nodes that must pick the same candidate index (repeated layers), and
a per-device memory budget. After: a `Solution` with one candidate per node minimising

    sum_i node_cost[i][choice_i] + sum_(u,v,K,row,col) K[row[choice_u], col[choice_v]]

over the assignments in which tied nodes agree, subject to the memory model: every live set L
(default: one set holding every node) satisfies sum_(i in L) node_mem[i][choice_i] <= budget
(Alpa's "peak of live tensors" when `live_sets` are the tensors live at each program point).

Method, each step exact:
1. compress.py reduces the problem: tied nodes become one variable, parallel edges merge,
   separable edges fold into node costs, and variables of degree <= 2 are eliminated (the
   Viterbi / tree DP on chains and trees; it goes on through series-parallel graphs).
2. What is left (the core), when it holds at most FIX_SIZE candidates and class pairs and no
   budget binds, has its whole LP relaxation (the formulation of step 3) solved by HiGHS's
   dual simplex: on resharding costs the vertex found is usually integral, and then the
   optimum (method "lp"; a mesh axis of a 48-layer GPT step solved again: 0.3 s where dual
   ascent, fixing and the LP of what fixing kept took 0.8 s). Otherwise the core gets a lower
   bound from dual ascent on the LP relaxation (dual.py: TRW-S-style sweeps over spec classes)
   and an assignment decoded from it and polished by local search. On resharding costs this LP
   is usually tight: when the assignment meets the bound (to rel_gap) it is optimal. A narrow
   core (small treewidth) is solved exactly by variable elimination over all its variables at
   once instead (elimination.py, method "elimination"), when it fits in ELIMINATION_SHARE of
   the time left: at once when that is quick, else once dual ascent has had DUAL_FIRST of the
   time elimination would take and reduced-cost fixing (step 3) keeps more than FIX_SIZE (a
   scanned residual stack's backward body, 23 variables each eliminated with three
   neighbours: 0.2 s, where the MIP took 18 to 27 s). A core of at most FIX_SIZE candidates
   and class pairs leaves dual ascent after four sweeps (HiGHS proves it faster than the bound
   creeps up).
3. Otherwise reduced-cost fixing drops every candidate and class pair whose reduced cost
   exceeds the gap (they are in no assignment better than the incumbent), and the rest goes
   to HiGHS (`scipy.optimize.milp`) with the marginal edge formulation:

    x_i[s] in {0, 1},  sum_s x_i[s] = 1                          (one-hot choice per variable)
    e_uv[p, q] >= 0,   sum_q e_uv[p, q] = sum_(s in p) x_u[s],   sum_p e_uv[p, q] = ...x_v
    min  sum c_i . x_i + sum K_uv . e_uv,   memory rows per live set <= budget

   (the textbook linearisation e >= x_u + x_v - 1 is weak and not used). Without memory rows
   the LP relaxation is solved first: on resharding costs it is often integral, and then the
   optimum. If HiGHS stops at the time limit, the best assignment found is returned with its
   gap to the best bound.
4. A memory budget the cheapest assignment breaks is relaxed the Lagrangian way (its most
   overflowing live set's bytes priced, steps 1-3 per price) for a bound and fitting
   assignments, then the ILP with every live set's row closes what gap it can in the time left.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from jaxpar.search import elimination
from jaxpar.search.compress import Core, reduce_problem
from jaxpar.search.dual import DualAscent, LocalSearch, ascend, fixing
from jaxpar.search.dual import size as kept_size

# Dual ascent hands over to the ILP once reduced-cost fixing keeps this many candidates and
# class pairs (HiGHS proves such a remainder optimal in a fraction of a second).
FIX_SIZE = 20_000
# Prices tried on the overflowing live set's memory when the budget binds.
PRICE_STEPS = 10
# HiGHS overruns its time limit: by what loading the model takes (scipy's checks, presolve),
# 3.4-6.2 us a variable on this 2-core machine (ILPs of 0.26M-1.6M variables: a 0.9 s limit
# took 3.9 s, a 6.8 s one 12.1 s; ILP_LOAD_S_PER_VAR allows for a busier machine), and by
# finishing the node it is in (1.35 s of 19.9 on an 83k-variable ILP). So it is given
# ILP_SHARE of the time left less the load, and an ILP that has no time left past its load is
# not started (the dual's best assignment stands).
ILP_SHARE = 0.9
# Elimination knows its work before it starts (elimination.order): it takes a core it can solve
# in this share of the time left (at elimination.RATE), leaving the rest to the ILP of a core it
# declines, which would rarely close its gap in that time anyway. A core it solves in at most
# QUICK_ELIMINATION table entries (about 0.05 s) it solves at once; a larger one goes to dual
# ascent first, for DUAL_FIRST of the time elimination would take (a scanned residual stack's
# backward body: the dual proves it in 0.08 s, elimination in 0.58 s; a 64-layer MLP step's
# core of 440 variables, the dual does not in 4 s, elimination in 4 s).
ELIMINATION_SHARE = 0.75
QUICK_ELIMINATION = 1e7
DUAL_FIRST = 0.2
ILP_LOAD_S_PER_VAR = 8e-6
_INTEGRAL = 1e-7  # an LP solution's x this close to 0 or 1 counts as integral


@dataclass(frozen=True)
class Problem:
    """One strategy-selection instance, validated (and made float64) on creation.

    Args:
        node_cost: per node, the cost of each of its k_i >= 1 candidates (finite, >= 0);
            k_i = 1 pins the node.
        edges: (u, v, C), C of shape (k_u, k_v): the cost when u picks s and v picks t; or
            (u, v, K, row, col) meaning C[s, t] = K[row[s], col[t]] (costs over spec classes).
            Stored in the class form (a dense C gets row = col = arange). Edges between one
            pair add up; direction does not matter.
        node_mem: per node, the bytes per device it keeps live under each candidate.
        live_sets: groups of nodes live at the same time, each of which must fit the budget;
            None means one group of every node.
        live_ranges: instead of live_sets, per node the first and last program point at which
            it is live (inclusive); the budget holds at every point (in effect, at every point
            where some node is live for the last time: the others hold subsets of those).
        budget: bytes per device; None (or inf) means no memory constraint.
        tied: disjoint groups of nodes with equal k that must pick the same candidate index
            (the ops of repeated layers); the optimum is then over such assignments only.

    Example:
        >>> p = Problem((np.array([1.0, 2.0]), np.array([0.0, 5.0])),
        ...             ((0, 1, np.array([[9.0, 0.0], [0.0, 9.0]])),))
        >>> solve(p).cost
        2.0
    """

    node_cost: tuple[np.ndarray, ...]
    edges: tuple[tuple, ...] = ()
    node_mem: tuple[np.ndarray, ...] | None = None
    live_sets: tuple[tuple[int, ...], ...] | None = None
    budget: float | None = None
    tied: tuple[tuple[int, ...], ...] | None = None
    live_ranges: np.ndarray | None = None

    def __post_init__(self) -> None:
        seen: set[int] = set()  # arrays shared by identity (repeated layers) checked once
        costs = tuple(_vector(c, f"node_cost[{i}]", seen=seen)
                      for i, c in enumerate(self.node_cost))
        object.__setattr__(self, "node_cost", costs)
        k = self.sizes
        checked: set[int] = set()
        object.__setattr__(self, "edges", tuple(
            _edge(e, j, k, checked) for j, e in enumerate(self.edges)))
        if self.node_mem is not None:
            if len(self.node_mem) != len(k):
                raise ValueError(f"node_mem has {len(self.node_mem)} entries; the problem has "
                                 f"{len(k)} nodes")
            object.__setattr__(self, "node_mem", tuple(
                _vector(m, f"node_mem[{i}]", k[i]) for i, m in enumerate(self.node_mem)))
        self._check_memory_model(k)
        self._check_tied(k)

    def _check_memory_model(self, k: tuple[int, ...]) -> None:
        if self.budget is not None and not self.budget >= 0:
            raise ValueError(f"budget={self.budget!r} must be a number of bytes >= 0 (or None)")
        live = self.live_sets is not None or self.live_ranges is not None
        if (self.budget is not None or live) and self.node_mem is None:
            raise ValueError("budget and live_sets need node_mem (bytes per candidate per node)")
        if self.live_ranges is not None:
            self._check_ranges(k)
        if self.live_sets is None:
            return
        sets = tuple(tuple(int(i) for i in s) for s in self.live_sets)
        for j, s in enumerate(sets):
            if len(set(s)) != len(s) or any(not 0 <= i < len(k) for i in s):
                raise ValueError(f"live_sets[{j}]={s} must hold distinct node indices in "
                                 f"[0, {len(k)})")
        object.__setattr__(self, "live_sets", sets)

    def _check_ranges(self, k: tuple[int, ...]) -> None:
        ranges = np.asarray(self.live_ranges, dtype=np.int64)
        if self.live_sets is not None:
            raise ValueError("give live_sets or live_ranges, not both")
        if ranges.shape != (len(k), 2) or np.any(ranges[:, 0] < 0) or \
                np.any(ranges[:, 0] > ranges[:, 1]):
            raise ValueError(f"live_ranges has shape {ranges.shape}; expected one (first, last) "
                             f"pair with 0 <= first <= last per node ({len(k)} nodes)")
        object.__setattr__(self, "live_ranges", ranges)

    def _check_tied(self, k: tuple[int, ...]) -> None:
        if self.tied is None:
            return
        groups = tuple(tuple(int(i) for i in g) for g in self.tied)
        seen: set[int] = set()
        for j, g in enumerate(groups):
            if not g or any(not 0 <= i < len(k) for i in g) or seen & set(g) or \
                    len(set(g)) != len(g):
                raise ValueError(f"tied[{j}]={g} must hold node indices in [0, {len(k)}) that "
                                 "no other group holds")
            if len({k[i] for i in g}) != 1:
                raise ValueError(f"tied[{j}]={g} joins nodes with {[k[i] for i in g]} "
                                 "candidates; tied nodes need equal candidate lists")
            seen |= set(g)
        object.__setattr__(self, "tied", groups)

    @property
    def sizes(self) -> tuple[int, ...]:
        """k_i, the number of candidates of each node."""
        return tuple(len(c) for c in self.node_cost)

    @property
    def has_budget(self) -> bool:
        """Whether a finite memory budget constrains the choice."""
        return self.budget is not None and bool(np.isfinite(self.budget))

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The live sets the budget applies to (every node together when none were given; at
        each point where a range ends, with live_ranges)."""
        if self.live_ranges is not None:
            return tuple(tuple(np.flatnonzero(self._alive_at(p)).tolist())
                         for p in self.points())
        return self.live_sets if self.live_sets is not None else (tuple(range(len(self.sizes))),)

    def points(self) -> np.ndarray:
        """With live_ranges: the program points where some node is live for the last time."""
        return np.unique(self.live_ranges[:, 1])

    def _alive_at(self, p: int) -> np.ndarray:
        return (self.live_ranges[:, 0] <= p) & (p <= self.live_ranges[:, 1])

    def usage(self, nbytes: np.ndarray) -> np.ndarray:
        """The bytes in each live set (in groups() order) when node i holds nbytes[i]."""
        nbytes = np.asarray(nbytes, dtype=float)
        if self.live_ranges is None:
            return np.array([float(nbytes[list(g)].sum()) for g in self.groups()])
        points = self.points()
        first = np.searchsorted(points, self.live_ranges[:, 0])
        stop = np.searchsorted(points, self.live_ranges[:, 1], side="right")
        change = np.zeros(len(points) + 1)
        np.add.at(change, first, nbytes)
        np.add.at(change, stop, -nbytes)
        return np.cumsum(change)[:-1]

    def members(self, j: int) -> np.ndarray:
        """The nodes of live set j (in groups() order)."""
        if self.live_ranges is not None:
            return np.flatnonzero(self._alive_at(int(self.points()[j])))
        return np.asarray(self.groups()[j], dtype=np.int64)


def _vector(values, name: str, size: int | None = None,
            seen: set[int] | None = None) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    if seen is not None and a is values:  # a float64 array, maybe one checked already
        if id(a) in seen and a.ndim == 1 and len(a) and (size is None or len(a) == size):
            return a
        seen.add(id(a))
    if a.ndim != 1 or len(a) == 0 or (size is not None and len(a) != size):
        want = f"length {size}" if size is not None else "a non-empty 1-D array"
        raise ValueError(f"{name} has shape {a.shape}; expected {want}")
    bad = np.flatnonzero(~(np.isfinite(a) & (a >= 0)))
    if len(bad):
        raise ValueError(f"{name}[{bad[0]}]={float(a[bad[0]])} must be finite and >= 0")
    return a


def _edge(edge, j: int, k: tuple[int, ...], checked: set) -> tuple:
    u, v, c = int(edge[0]), int(edge[1]), np.asarray(edge[2], dtype=np.float64)
    name = f"edges[{j}] ({u} -> {v})"
    if not (0 <= u < len(k) and 0 <= v < len(k)) or u == v:
        raise ValueError(f"edges[{j}] joins nodes ({u}, {v}); expected two distinct nodes in "
                         f"[0, {len(k)})")
    if len(edge) == 5:
        key = (id(c), id(edge[3]), id(edge[4]), k[u], k[v])
        if key in checked and isinstance(edge[3], np.ndarray) and \
                isinstance(edge[4], np.ndarray):  # shared class indices: checked once
            row, col = edge[3], edge[4]
        else:
            row, col = _class_index(c, edge[3], edge[4], name, k[u], k[v])
            if row is edge[3] and col is edge[4]:
                checked.add(key)
    elif c.shape != (k[u], k[v]):
        raise ValueError(f"{name} has a cost matrix of shape {c.shape}; "
                         f"expected (k_{u}, k_{v}) = ({k[u]}, {k[v]})")
    else:
        row, col = np.arange(k[u]), np.arange(k[v])
    if id(c) not in checked:  # shared class matrices (repeated layers) are checked once
        bad = np.argwhere(~(np.isfinite(c) & (c >= 0)))
        if len(bad):
            s, t = bad[0]
            raise ValueError(f"{name} has C[{s}, {t}]={float(c[s, t])}; resharding costs "
                             "must be finite and >= 0")
        checked.add(id(c))
    return u, v, c, row, col


def _class_index(c: np.ndarray, row, col, name: str, ku: int, kv: int):
    row, col = np.asarray(row, dtype=np.int64), np.asarray(col, dtype=np.int64)
    for what, idx, size, n in (("row", row, ku, c.shape[0]), ("col", col, kv, c.shape[-1])):
        if c.ndim != 2 or idx.shape != (size,) or not np.all((idx >= 0) & (idx < n)):
            raise ValueError(f"{name} has K of shape {c.shape} and {what} {idx.tolist()}; "
                             f"expected {size} class indices into K")
    return row, col


@dataclass(frozen=True)
class Solution:
    """The chosen candidate per node and how it was found.

    Attributes:
        choice: the candidate index chosen for each node (int64, length N).
        cost: the objective of `choice` on the original problem.
        optimal: whether `choice` is proven optimal (to rel_gap), over the assignments the
            problem allows (tied nodes agreeing).
        gap: relative gap between `cost` and the best lower bound (0 when optimal).
        method: "chain-dp", "tree-dp", "dp" (eliminated entirely), "dual" (the dual bound
            met), "ilp" or "brute-force".
        seconds: wall time spent in the solver.
        repeats_tied: the problem was built with repeated layers tied (exact.repeats):
            `optimal` is then over the plans in which they agree.
        refitted: solved again for a budget lowered by what the plan held over the one
            given (exact._refit): `optimal` and `gap` are then for that lower budget.
        moved: how many carried states were moved after the solve, where their copies at
            the step's end (which the live sets miss) broke the budget (copies.shed_copies):
            `optimal` is then False and `gap` is to the bound of the plan they were moved from.
        tail_groups: the (kind, mesh axes) groups the step's tail reductions were kept to
            when it was solved again so (exact._one_latency_per_group) and that plan kept:
            `optimal` and `gap` are then over the plans whose tail reduces over those alone.
    """

    choice: np.ndarray
    cost: float
    optimal: bool
    gap: float
    method: str
    seconds: float
    repeats_tied: bool = False
    refitted: bool = False
    moved: int = 0
    tail_groups: tuple[tuple[str, tuple[str, ...]], ...] = ()


def objective(problem: Problem, choice: np.ndarray) -> float:
    """The total node plus edge cost of `choice` (one candidate index per node)."""
    total = sum(float(c[choice[i]]) for i, c in enumerate(problem.node_cost))
    return total + sum(float(k[row[choice[u]], col[choice[v]]])
                       for u, v, k, row, col in problem.edges)


def restricted(problem: Problem, keep: dict[int, np.ndarray]
               ) -> tuple[Problem, Callable[[np.ndarray], np.ndarray]]:
    """`problem` with node i's candidates cut to the indices keep[i] (a sorted, non-empty
    int array; nodes not in `keep` keep all), and the map from a choice of the smaller
    problem back to the candidates of `problem`. Tied nodes must keep the same indices.
    exact._one_latency_per_group solves the plans of fewer device groups so: a smaller
    problem, where a penalty on the other candidates (a cost far above every other) kept
    them all and put numbers many orders apart in one LP."""
    for g in problem.tied or ():
        kept = [keep.get(i) for i in g]
        if any(k is None for k in kept) != all(k is None for k in kept) or \
                any(k is not None and not np.array_equal(k, kept[0]) for k in kept):
            raise ValueError(f"restricted: tied nodes {g} keep different candidates")
    pick = [keep.get(i) for i in range(len(problem.node_cost))]
    if any(k is not None and not len(k) for k in pick):
        raise ValueError("restricted: every node keeps a candidate")

    def cut(values: np.ndarray, i: int) -> np.ndarray:
        return values if pick[i] is None else values[pick[i]]

    edges = tuple((u, v, k, cut(row, u), cut(col, v)) for u, v, k, row, col in problem.edges)
    smaller = dataclasses.replace(
        problem, node_cost=tuple(cut(c, i) for i, c in enumerate(problem.node_cost)),
        edges=edges, node_mem=None if problem.node_mem is None else
        tuple(cut(m, i) for i, m in enumerate(problem.node_mem)))

    def back(choice: np.ndarray) -> np.ndarray:
        return np.array([c if pick[i] is None else int(pick[i][c])
                         for i, c in enumerate(choice)], dtype=np.int64)
    return smaller, back


def peak_memory(problem: Problem, choice: np.ndarray) -> float:
    """The largest live-set memory of `choice`; 0 when the problem has no node_mem."""
    if problem.node_mem is None:
        return 0.0
    usage = problem.usage([m[choice[i]] for i, m in enumerate(problem.node_mem)])
    return float(usage.max()) if len(usage) else 0.0


def solve(problem: Problem, time_limit: float = 30.0, rel_gap: float = 1e-9) -> Solution:
    """Choose one candidate per node, exactly (see the module docstring).

    Args:
        problem: the instance.
        time_limit: seconds for the whole search; when the ILP stops early the best assignment
            found is returned with optimal=False and its gap.
        rel_gap: relative gap at which an assignment counts as optimal (HiGHS's absolute gap
            is 1e-6 of the largest cost coefficient, as its objective is scaled to max 1).

    Returns:
        A Solution; `cost` is always the objective of `choice` on `problem`.

    Raises:
        BudgetUnmet (a ValueError): when no assignment fits the memory budget (names the
            smallest peak); NotFound (a BudgetUnmet) when none that fits was found within the
            time limit and none is proven impossible.

    Example:
        >>> p = Problem((np.array([1.0, 0.0]), np.array([0.0, 1.0])),
        ...             ((0, 1, np.array([[0.0, 5.0], [5.0, 0.0]])),))
        >>> s = solve(p); (s.choice.tolist(), s.cost, s.method)
        ([0, 0], 1.0, 'chain-dp')
    """
    start = time.perf_counter()
    deadline = start + time_limit
    if problem.has_budget:
        _check_budget(problem)
    core = reduce_problem(problem)
    if core.alive:
        found = _solve_core(problem, core, deadline, rel_gap)
    else:
        found = core.expand({}), True, 0.0, _dp_method(core)
    if problem.has_budget and not _fits(problem, found[0]):
        found = _solve_budget(problem, found, deadline, rel_gap)
    choice, optimal, gap, method = found
    return Solution(choice, objective(problem, choice), optimal, gap, method,
                    time.perf_counter() - start)


def _dp_method(core: Core) -> str:
    if core.acyclic:
        return "chain-dp" if core.max_degree <= 2 else "tree-dp"
    return "dp"


def _fits(problem: Problem, choice: np.ndarray) -> bool:
    return peak_memory(problem, choice) <= problem.budget * (1 + 1e-12)


def _check_budget(problem: Problem) -> None:
    # Each node's least-memory candidate minimises every live set's sum at once, so the max
    # over sets of those sums is the smallest achievable peak for this memory model: exactly,
    # unless no candidate is least-memory for all of a group of tied nodes at once (then it
    # bounds it from below).
    sums = problem.usage([m.min() for m in problem.node_mem])
    worst = int(np.argmax(sums)) if len(sums) else 0
    if len(sums) and sums[worst] > problem.budget * (1 + 1e-12):
        where = f" in live_sets[{worst}]" if problem.live_sets is not None else \
            f" at program point {problem.points()[worst]}" if problem.live_ranges is not None \
            else ""
        exact = all(np.logical_and.reduce([problem.node_mem[i] <= problem.node_mem[i].min()
                                            for i in g]).any() for g in problem.tied or ())
        raise BudgetUnmet(
            f"no strategy assignment fits memory_budget={byte_count(problem.budget)} bytes per "
            f"device; the smallest possible peak is {'' if exact else 'at least '}"
            f"{byte_count(sums[worst])} bytes{where} (found by taking every node's least-memory "
            "candidate"
            f"{', which is exact for this memory model' if exact else ''})")


class BudgetUnmet(ValueError):
    """No strategy assignment meets the memory budget (solve: proven; NotFound: none found in
    time). `reason` and `placed` are the parts a caller words a message of its own with:
    why (the message itself, unless said otherwise), and what fixed inputs took of the budget
    first ("" where none did; exact.dynamic_programming's errors say it)."""

    def __init__(self, message: str, reason: str | None = None, placed: str = ""):
        super().__init__(message)
        self.reason = message if reason is None else reason
        self.placed = placed


class NotFound(BudgetUnmet):
    """No assignment that fits the memory budget was found before the time limit, and none
    is proven impossible (a BudgetUnmet of another type says the budget cannot be met:
    proven)."""


def byte_count(x: float) -> str:
    """Bytes as a message shows them: whole numbers in full (a budget of 3,245,831 and a peak
    one byte over it must not both read 3.24583e+06), fractions to two places."""
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"


def _scale(core: Core) -> float:
    return max([float(core.cost[v].max()) for v in core.alive] +
               [float(e.K.max()) for e in core.edges.values()] + [1e-300])


def _until(deadline: float, share: float) -> float:
    now = time.perf_counter()
    return now + share * max(deadline - now, 0.0)


def _solve_core(problem: Problem, core: Core, deadline: float, rel_gap: float) -> tuple:
    """(node choice, optimal, gap, method) without the memory budget: a core of at most
    FIX_SIZE candidates and class pairs gets its whole LP relaxation solved first, the
    optimum when integral; else dual ascent, then reduced-cost fixing and the ILP unless the
    bound already meets the assignment."""
    scale = _scale(core)
    if core.rows is None and core.size() <= FIX_SIZE:
        found = _integral_lp(problem, core, _everything(core), scale, deadline)
        if found is not None:
            return core.expand(found[0]), True, 0.0, "lp"
    narrow = None  # a narrow core's elimination order, in ELIMINATION_SHARE of the time left
    if core.rows is None:
        narrow = elimination.order(core, total=elimination.RATE * ELIMINATION_SHARE * max(
            deadline - time.perf_counter(), 0.0))
        if narrow is not None and narrow.work <= QUICK_ELIMINATION:
            return core.expand(elimination.eliminate(core, plan=narrow)), True, 0.0, \
                "elimination"
    dual, search = DualAscent(core, core.cost, scale), LocalSearch(core, core.cost)
    stop = _until(deadline, 0.5)
    if narrow is not None:  # the dual gets a share of what elimination would take
        stop = min(stop, time.perf_counter() + DUAL_FIRST * narrow.work / elimination.RATE)
    best, lower, keep = ascend(dual, search, stop, rel_gap, FIX_SIZE)
    if best is not None and search.value(best) - lower <= rel_gap * abs(search.value(best)):
        return core.expand(best), True, 0.0, "dual"
    upper = search.value(best) if best is not None else float("inf")
    keep = keep or fixing(dual, upper - lower)
    if narrow is not None and kept_size(keep) > FIX_SIZE:  # HiGHS proves a small rest fast
        return core.expand(elimination.eliminate(core, plan=narrow)), True, 0.0, "elimination"
    return _finish_ilp(problem, core, search, keep, best, lower, deadline, rel_gap)


def _solve_budget(problem: Problem, unbounded: tuple, deadline: float, rel_gap: float) -> tuple:
    """(node choice, optimal, gap, method) when the cheapest assignment breaks the budget.

    Lagrangian relaxation of the live set it overflows most, L: the bytes of L's nodes are
    priced at alpha per byte, and alpha is raised until the priced optimum fits, then bisected.
    Each priced problem is an unbudgeted one (eliminated and solved as above), and for every
    alpha, its bound - alpha * budget is a lower bound of the budgeted optimum; the fitting
    assignments are upper bounds. What gap is left goes to the ILP with every live set's row,
    after reduced-cost fixing from a dual of the priced problem over all variables.
    """
    choice, _, gap0, _ = unbounded
    usage = problem.usage([m[choice[i]] for i, m in enumerate(problem.node_mem)])
    worst = np.zeros(len(problem.sizes), dtype=bool)
    worst[problem.members(int(np.argmax(usage)))] = True
    lower = objective(problem, choice) * (1 - gap0)
    best, upper = None, float("inf")
    low, high, alpha = 0.0, None, max(objective(problem, choice), 1e-300) / problem.budget
    stage = _until(deadline, 0.6)
    for step in range(PRICE_STEPS):
        priced = Problem(_priced(problem, worst, alpha), problem.edges, tied=problem.tied)
        x, _, gap, _ = _unbudgeted(priced, _until(stage, 1.0 / (PRICE_STEPS - step)), rel_gap)
        lower = max(lower, objective(priced, x) * (1 - gap) - alpha * problem.budget)
        if _fits(problem, x):
            high = alpha
            if objective(problem, x) < upper:
                best, upper = x, objective(problem, x)
        else:
            low = alpha
        alpha = alpha * 4 if high is None else (low + high) / 2
        if upper - lower <= rel_gap * upper < np.inf or time.perf_counter() > stage:
            break
    if upper - lower <= rel_gap * upper < np.inf:
        return best, True, 0.0, "dual"
    return _budget_ilp(problem, best, lower, worst, high or 0.0, deadline, rel_gap)


def _priced(problem: Problem, worst: np.ndarray, alpha: float) -> tuple[np.ndarray, ...]:
    return tuple(c + alpha * m if w else c for c, m, w in
                 zip(problem.node_cost, problem.node_mem, worst, strict=True))


def _unbudgeted(problem: Problem, deadline: float, rel_gap: float) -> tuple:
    core = reduce_problem(problem)
    if core.alive:
        return _solve_core(problem, core, deadline, rel_gap)
    return core.expand({}), True, 0.0, _dp_method(core)


def _budget_ilp(problem: Problem, best: np.ndarray | None, lower: float, worst: np.ndarray,
                alpha: float, deadline: float, rel_gap: float) -> tuple:
    """The ILP with live-set rows over every variable; fixing uses a dual of the problem priced
    at alpha over all variables (its bound - alpha * budget bounds the budgeted optimum)."""
    core = reduce_problem(problem, memory=True)
    search = LocalSearch(core, core.cost, (core.rows, problem.budget))
    x = None
    if best is not None:
        first = np.unique(core.var_of, return_index=True)[1]
        x = search.polish({v: int(best[i]) for v, i in enumerate(first)})
    priced = {v: core.cost[v].copy() for v in core.alive}
    for i in np.flatnonzero(worst):
        priced[int(core.var_of[i])] += alpha * problem.node_mem[i]
    dual = DualAscent(core, priced, _scale(core))
    _, bound, _ = ascend(dual, LocalSearch(core, priced), _until(deadline, 0.3), rel_gap, None)
    own = bound - alpha * problem.budget
    keep = fixing(dual, (search.value(x) if x is not None else float("inf")) - own)
    return _finish_ilp(problem, core, search, keep, x, max(lower, own), deadline, rel_gap)


def _finish_ilp(problem: Problem, core: Core, search: LocalSearch, keep: tuple[dict, dict],
                best: dict | None, lower: float, deadline: float, rel_gap: float) -> tuple:
    """The ILP over what fixing kept; the better of its answer and `best`, with the gap."""
    found, bound, proven = _solve_ilp(problem, core, keep, _scale(core), deadline, rel_gap)
    impossible = bound == np.inf  # HiGHS proved that no kept assignment fits the budget
    if impossible:
        bound = -np.inf
    if found is not None:
        found = search.polish(found)
        if best is None or search.value(found) < search.value(best):
            best = found
    if best is None:  # the ILP found none in time, or none exists
        least = search.least_memory()
        if not search.feasible(least):
            if not impossible:  # the ILP stopped: none found, none proven impossible
                raise NotFound(
                    f"no strategy assignment that fits memory_budget="
                    f"{byte_count(problem.budget)} bytes per device was found within the time "
                    "limit, and none is proven impossible (the one of least bytes per node "
                    f"peaks at {byte_count(search.usage(least).max())})")
            raise BudgetUnmet(f"no strategy assignment in which tied nodes agree fits "
                             f"memory_budget={byte_count(problem.budget)} bytes per device")
        best = search.polish(least)
    if proven:
        return core.expand(best), True, 0.0, "ilp"
    upper, lower = search.value(best), max(lower, bound)
    return core.expand(best), False, max(0.0, upper - lower) / max(abs(upper), 1e-300), "ilp"


def _solve_ilp(problem: Problem, core: Core, keep: tuple[dict, dict], scale: float,
               deadline: float, rel_gap: float) -> tuple[dict | None, float, bool]:
    """(assignment or None, lower bound, proven optimal) from HiGHS on the kept variables.
    Without memory rows its LP relaxation is solved first (dual simplex, a vertex): when
    every x is 0 or 1 it is the optimum, found without the MIP's presolve and heuristics (a
    mesh axis of a 48-layer GPT step solved again: 0.3 s against 0.45 s). Else the MIP."""
    cands, pairs = keep
    c, constraints, xoff, nvar = _build_ilp(problem, core, cands, pairs, scale)
    integrality = (np.arange(nvar) < xoff[-1]).astype(int)  # x binary, e and m continuous
    upper = np.ones(nvar)  # (HiGHS can hang on integer variables without an upper bound)
    upper[nvar - (len(core.terms) if core.rows is not None else 0):] = np.inf
    load = ILP_LOAD_S_PER_VAR * nvar
    seconds = _highs_seconds(deadline, load)
    # No memory rows: the LP relaxation is often integral already, and then the optimum.
    if seconds is not None and core.rows is None:
        found = _lp(c, constraints[0], cands, xoff, scale, seconds)
        if found is not None:
            return (*found, True)
        seconds = _highs_seconds(deadline, load)  # what the LP left
    if seconds is None:
        return None, -np.inf, False
    res = milp(c, integrality=integrality, bounds=Bounds(0, upper), constraints=constraints,
               options={"time_limit": seconds, "mip_rel_gap": rel_gap})
    if res.status == 2 and problem.has_budget:
        _check_budget(problem)  # raises the user-facing message when the budget is the cause
        return None, np.inf, False  # proven: no assignment fits (an empty set's bound)
    if res.status not in (0, 1, 2):
        raise RuntimeError(f"HiGHS failed on the strategy ILP: {res.message}")
    found = None
    if res.x is not None:  # x_i is one-hot up to HiGHS's integrality tolerance
        found = {v: int(cands[v][np.argmax(res.x[a:b])])
                 for v, a, b in zip(sorted(cands), xoff[:-1], xoff[1:], strict=True)}
    bound = res.get("mip_dual_bound")
    bound = float(bound) * scale if bound is not None and np.isfinite(bound) else -np.inf
    return found, bound, res.status == 0


def _everything(core: Core) -> tuple[dict, dict]:
    """Every candidate and class pair of the core, as fixing's `keep`."""
    return ({v: np.arange(len(core.cost[v])) for v in core.alive},
            {k: np.argwhere(np.ones(e.K.shape, dtype=bool)) for k, e in core.edges.items()})


def _integral_lp(problem: Problem, core: Core, keep: tuple[dict, dict], scale: float,
                 deadline: float) -> tuple[dict, float] | None:
    """(assignment, its cost) when the LP relaxation over `keep` (no memory rows) has an
    integral optimum, else None (fractional, or no time for it)."""
    cands, pairs = keep
    c, constraints, xoff, nvar = _build_ilp(problem, core, cands, pairs, scale)
    seconds = _highs_seconds(deadline, ILP_LOAD_S_PER_VAR * nvar)
    return None if seconds is None else _lp(c, constraints[0], cands, xoff, scale, seconds)


def _highs_seconds(deadline: float, load: float) -> float | None:
    """HiGHS's time limit for a model that takes `load` seconds to load: ILP_SHARE of the
    time left less the load (at least 0.05 s), or None when only the load would fit (HiGHS
    is then not started)."""
    left = ILP_SHARE * (deadline - time.perf_counter()) - load
    return None if left < 0.05 and load > 0.05 else max(left, 0.05)


def _lp(c: np.ndarray, eq: LinearConstraint, cands: dict, xoff: np.ndarray, scale: float,
        seconds: float) -> tuple[dict, float] | None:
    """The LP relaxation (dual simplex: a vertex) of the one-hot and marginal rows `eq`:
    (assignment, cost) when every x is 0 or 1, else None."""
    lp = linprog(c, A_eq=eq.A, b_eq=eq.lb, bounds=(0, 1), method="highs-ds",
                 options={"time_limit": seconds})
    if lp.status != 0:
        return None
    x = lp.x[:xoff[-1]]
    if not np.all((x < _INTEGRAL) | (x > 1 - _INTEGRAL)):
        return None
    return ({v: int(cands[v][np.argmax(lp.x[a:b])])
             for v, a, b in zip(sorted(cands), xoff[:-1], xoff[1:], strict=True)},
            float(lp.fun) * scale)


def _build_ilp(problem: Problem, core: Core, cands: dict, pairs: dict, scale: float):
    """(objective, constraints, x offsets, number of variables): x over the kept candidates,
    then e over the kept class pairs of each edge, then one m per memory term."""
    order = sorted(cands)
    xoff = np.concatenate([[0], np.cumsum([len(cands[v]) for v in order])]).astype(int)
    start = dict(zip(order, xoff[:-1], strict=True))
    keys = sorted(pairs)
    eoff = xoff[-1] + np.concatenate([[0], np.cumsum([len(pairs[k]) for k in keys])]).astype(int)
    memory = core.rows is not None
    nvar = int(eoff[-1]) + (len(core.terms) if memory else 0)
    rows, cols, vals, rhs = [], [], [], []
    for v in order:  # one-hot
        rows.append(np.full(len(cands[v]), len(rhs)))
        cols.append(start[v] + np.arange(len(cands[v])))
        vals.append(np.ones(len(cands[v])))
        rhs.append(1.0)
    for key, e0 in zip(keys, eoff[:-1], strict=True):
        _marginals(core, key, cands, pairs[key], start, int(e0), rows, cols, vals, rhs)
    c = np.concatenate([core.cost[v][cands[v]] for v in order] +
                       [core.edges[k].K[pairs[k][:, 0], pairs[k][:, 1]] for k in keys] +
                       [np.zeros(nvar - int(eoff[-1]))]) / scale
    if memory:
        _memory_terms(core, cands, start, int(eoff[-1]), rows, cols, vals, rhs)
    n_eq = len(rhs)
    eq = sparse.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                          shape=(n_eq, nvar))
    constraints = [LinearConstraint(eq, np.asarray(rhs), np.asarray(rhs))]
    if memory and core.rows.shape[0]:
        budget = problem.budget if problem.budget > 0 else 1.0
        live = sparse.hstack([sparse.csr_array((core.rows.shape[0], int(eoff[-1]))),
                              core.rows / budget], format="csr")
        constraints.append(LinearConstraint(live, -np.inf, problem.budget / budget))
    return c, constraints, xoff, nvar


def _marginals(core: Core, key, cands: dict, kept: np.ndarray, start: dict, e0: int,
               rows: list, cols: list, vals: list, rhs: list) -> None:
    """sum_q e[p, q] - sum_(s in p) x_a[s] = 0 per row class p; likewise per column class."""
    e = core.edges[key]
    for side, v in enumerate(key):
        own = e.row if side == 0 else e.col
        n = e.K.shape[side]
        r0 = len(rhs)
        rows += [r0 + kept[:, side], r0 + own[cands[v]]]
        cols += [e0 + np.arange(len(kept)), start[v] + np.arange(len(cands[v]))]
        vals += [np.ones(len(kept)), -np.ones(len(cands[v]))]
        rhs += [0.0] * n


def _memory_terms(core: Core, cands: dict, start: dict, m0: int, rows: list, cols: list,
                  vals: list, rhs: list) -> None:
    """m_t = sum_s bytes_t[s] x_v[s] per term t (bytes per device, scaled by the budget)."""
    for t, (v, mem) in enumerate(core.terms):
        r = len(rhs)
        rows += [np.full(len(cands[v]) + 1, r)]
        cols += [np.concatenate([start[v] + np.arange(len(cands[v])), [m0 + t]])]
        vals += [np.concatenate([-mem[cands[v]], [1.0]])]
        rhs.append(0.0)


def brute_force(problem: Problem, max_assignments: int = 2_000_000) -> Solution:
    """Try every assignment (for tests and tiny problems); tied nodes move together.

    Args:
        problem: the instance.
        max_assignments: the number of assignments above this raises ValueError (as does an
            infeasible budget).

    Returns:
        An optimal Solution, method "brute-force" (ties go to the first assignment found).

    Example:
        >>> brute_force(Problem((np.array([3.0, 1.0]),))).choice.tolist()
        [1]
    """
    start = time.perf_counter()
    var_of, sizes = _free_variables(problem)
    if np.prod(sizes, dtype=float) > max_assignments:
        raise ValueError(f"brute_force: {np.prod(sizes, dtype=float):.3g} assignments for "
                         f"sizes {problem.sizes} exceed max_assignments={max_assignments}")
    free = np.array(list(itertools.product(*map(range, sizes))), dtype=np.int64)
    grid = free.reshape(-1, len(sizes))[:, var_of]
    total = sum(c[grid[:, i]] for i, c in enumerate(problem.node_cost)) + np.zeros(len(grid))
    for u, v, k, row, col in problem.edges:
        total += k[row[grid[:, u]], col[grid[:, v]]]
    if problem.has_budget:
        _check_budget(problem)
        mem = [m[grid[:, i]] for i, m in enumerate(problem.node_mem)]
        peak = np.max([sum((mem[i] for i in s), np.zeros(len(grid))) for s in problem.groups()],
                      axis=0)
        total = np.where(peak <= problem.budget * (1 + 1e-12), total, np.inf)
    best = int(np.argmin(total))
    return Solution(grid[best], float(total[best]), True, 0.0, "brute-force",
                    time.perf_counter() - start)


def _free_variables(problem: Problem) -> tuple[np.ndarray, list[int]]:
    var_of = np.arange(len(problem.sizes))
    for g in problem.tied or ():
        var_of[list(g)] = g[0]
    used, inverse = np.unique(var_of, return_inverse=True)
    return inverse.ravel(), [problem.sizes[i] for i in used]


def prune_dominated(problem: Problem) -> tuple[Problem, list[np.ndarray]]:
    """Drop candidates that another candidate of the same node dominates, to a fixed point.

    Candidate t of node i dominates s when its node cost, memory and, on every edge at i, its
    row (or column) of costs are elementwise <= those of s (of exact ties the first is kept).
    Swapping s -> t never costs more or breaks the budget, so the optimum is unchanged.
    (solve() does not need it: reduced-cost fixing prunes far more.)

    Args:
        problem: the instance (not modified); it may not tie nodes.

    Returns:
        (pruned problem, keep) where keep[i][new] is the original index of node i's candidate.

    Example:
        >>> p = Problem((np.array([1.0, 2.0]),))
        >>> pruned, keep = prune_dominated(p); keep[0].tolist()
        [0]
    """
    if problem.tied:
        raise ValueError("prune_dominated: a problem with tied nodes would lose its ties; "
                         "prune the problem before tying")
    keep = [np.arange(k) for k in problem.sizes]
    while True:
        current = _restrict(problem, keep)
        kept = [keep[i][_undominated(_features(current, i))] for i in range(len(keep))]
        if all(len(a) == len(b) for a, b in zip(kept, keep, strict=True)):
            return current, keep
        keep = kept


def _features(problem: Problem, i: int) -> np.ndarray:
    """One row per candidate of node i: everything that must be <= for dominance."""
    parts = [problem.node_cost[i][:, None]]
    if problem.node_mem is not None:
        parts.append(problem.node_mem[i][:, None])
    for u, v, k, row, col in problem.edges:
        if u == i:
            parts.append(k[np.ix_(row, col)])
        elif v == i:
            parts.append(k[np.ix_(row, col)].T)
    return np.concatenate(parts, axis=1)


def _undominated(f: np.ndarray) -> np.ndarray:
    # beats[t, s]: t dominates s, strictly or as an exact tie with t first (a strict order).
    le = np.all(f[:, None, :] <= f[None, :, :], axis=2)
    equal = le & le.T
    beats = le & (~equal | np.tri(len(f), k=-1, dtype=bool).T)
    return np.flatnonzero(~beats.any(axis=0))


def _restrict(problem: Problem, keep: list[np.ndarray]) -> Problem:
    mem = problem.node_mem
    return Problem(
        tuple(c[keep[i]] for i, c in enumerate(problem.node_cost)),
        tuple((u, v, k, row[keep[u]], col[keep[v]]) for u, v, k, row, col in problem.edges),
        None if mem is None else tuple(m[keep[i]] for i, m in enumerate(mem)),
        problem.live_sets, problem.budget)
