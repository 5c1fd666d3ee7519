"""dynamic_programming: the exact strategy-selection kernel (tree DP or ILP).

Before: a `Problem` -- N nodes, node i with k_i candidate strategies priced by `node_cost[i]`,
edges (u, v, C) with C[s, t] the resharding cost when u picks s and v picks t, and optionally a
per-device memory budget. After: a `Solution` with one candidate per node minimising

    sum_i node_cost[i][choice_i] + sum_(u,v,C) C[choice_u, choice_v]

subject to the memory model: every live set L (default: one set holding every node) satisfies
sum_(i in L) node_mem[i][choice_i] <= budget. That is Alpa's "peak of live tensors" when the
caller passes the tensors live at each program point as `live_sets`.

Method. Edges between the same pair of nodes are merged; an edge that splits as
C[s, t] = r[s] + c[t] (all-zero edges, constant edges, edges at a pinned k=1 node) is folded into
its endpoints' node costs. If what remains is a forest, a leaf-to-root min-sum pass (Viterbi on
chains) is exact in O(sum k_u * k_v); its answer stands when it also fits the budget. Otherwise
an ILP goes to HiGHS via `scipy.optimize.milp`, with the marginal edge formulation:

    x_i[s] in {0, 1},  sum_s x_i[s] = 1                       (one-hot choice per node)
    e_uv[s, t] >= 0,   sum_t e_uv[s, t] = x_u[s],  sum_s e_uv[s, t] = x_v[t]   (marginals)
    min  sum c_i . x_i + sum C_uv . e_uv,   sum_(i in L) m_i . x_i <= budget  (memory rows)

With x integral the marginals force e_uv to the one-hot outer product, so e stays continuous.
The LP relaxation is exact on trees and usually tight on resharding costs (uniform random costs
or a binding budget can leave a gap of several percent for branch and bound); the textbook
linearisation e >= x_u + x_v - 1 is weak (minutes instead of sub-second solves) and is not used.
Candidates with equal rows (columns) of C share e variables: e runs over the distinct rows p and
columns q of C, with sum_q e[p, q] = sum_(s in class p) x_u[s] -- a tensor has far fewer
distinct specs than its ops have strategies. If HiGHS stops at the time limit, its incumbent and
a greedy start are polished by local search and the better one is returned, with its gap.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp


@dataclass(frozen=True)
class Problem:
    """One strategy-selection instance, validated (and made float64) on creation.

    Args:
        node_cost: per node, the cost of each of its k_i >= 1 candidates (finite, >= 0);
            k_i = 1 pins the node.
        edges: (u, v, C), C of shape (k_u, k_v): the cost when u picks s and v picks t; or
            (u, v, K, row, col) meaning C[s, t] = K[row[s], col[t]] (costs over spec classes),
            stored expanded. Edges between one pair add up; direction does not matter.
        node_mem: per node, the bytes per device it keeps live under each candidate.
        live_sets: groups of nodes live at the same time, each of which must fit the budget;
            None means one group of every node.
        budget: bytes per device; None (or inf) means no memory constraint.

    Example:
        >>> p = Problem((np.array([1.0, 2.0]), np.array([0.0, 5.0])),
        ...             ((0, 1, np.array([[9.0, 0.0], [0.0, 9.0]])),))
        >>> solve(p).cost
        2.0
    """

    node_cost: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int, np.ndarray], ...] = ()
    node_mem: tuple[np.ndarray, ...] | None = None
    live_sets: tuple[tuple[int, ...], ...] | None = None
    budget: float | None = None

    def __post_init__(self) -> None:
        costs = tuple(_vector(c, f"node_cost[{i}]") for i, c in enumerate(self.node_cost))
        object.__setattr__(self, "node_cost", costs)
        k = self.sizes
        object.__setattr__(self, "edges", tuple(
            _edge(e, j, k) for j, e in enumerate(self.edges)))
        if self.node_mem is not None:
            if len(self.node_mem) != len(k):
                raise ValueError(f"node_mem has {len(self.node_mem)} entries; the problem has "
                                 f"{len(k)} nodes")
            object.__setattr__(self, "node_mem", tuple(
                _vector(m, f"node_mem[{i}]", k[i]) for i, m in enumerate(self.node_mem)))
        self._check_memory_model(k)

    def _check_memory_model(self, k: tuple[int, ...]) -> None:
        if self.budget is not None and not self.budget >= 0:
            raise ValueError(f"budget={self.budget!r} must be a number of bytes >= 0 (or None)")
        if (self.budget is not None or self.live_sets is not None) and self.node_mem is None:
            raise ValueError("budget and live_sets need node_mem (bytes per candidate per node)")
        if self.live_sets is None:
            return
        sets = tuple(tuple(int(i) for i in s) for s in self.live_sets)
        for j, s in enumerate(sets):
            if len(set(s)) != len(s) or any(not 0 <= i < len(k) for i in s):
                raise ValueError(f"live_sets[{j}]={s} must hold distinct node indices in "
                                 f"[0, {len(k)})")
        object.__setattr__(self, "live_sets", sets)

    @property
    def sizes(self) -> tuple[int, ...]:
        """k_i, the number of candidates of each node."""
        return tuple(len(c) for c in self.node_cost)

    @property
    def has_budget(self) -> bool:
        """Whether a finite memory budget constrains the choice."""
        return self.budget is not None and bool(np.isfinite(self.budget))

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The live sets the budget applies to (every node together when none were given)."""
        return self.live_sets if self.live_sets is not None else (tuple(range(len(self.sizes))),)


def _vector(values, name: str, size: int | None = None) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    if a.ndim != 1 or len(a) == 0 or (size is not None and len(a) != size):
        want = f"length {size}" if size is not None else "a non-empty 1-D array"
        raise ValueError(f"{name} has shape {a.shape}; expected {want}")
    bad = np.flatnonzero(~(np.isfinite(a) & (a >= 0)))
    if len(bad):
        raise ValueError(f"{name}[{bad[0]}]={float(a[bad[0]])} must be finite and >= 0")
    return a


def _edge(edge, j: int, k: tuple[int, ...]) -> tuple[int, int, np.ndarray]:
    u, v, c = int(edge[0]), int(edge[1]), np.asarray(edge[2], dtype=np.float64)
    if not (0 <= u < len(k) and 0 <= v < len(k)) or u == v:
        raise ValueError(f"edges[{j}] joins nodes ({u}, {v}); expected two distinct nodes in "
                         f"[0, {len(k)})")
    if len(edge) == 5:
        c = _expand(c, edge[3], edge[4], f"edges[{j}] ({u} -> {v})", k[u], k[v])
    if c.shape != (k[u], k[v]):
        raise ValueError(f"edges[{j}] ({u} -> {v}) has a cost matrix of shape {c.shape}; "
                         f"expected (k_{u}, k_{v}) = ({k[u]}, {k[v]})")
    bad = np.argwhere(~(np.isfinite(c) & (c >= 0)))
    if len(bad):
        s, t = bad[0]
        raise ValueError(f"edges[{j}] ({u} -> {v}) has C[{s}, {t}]={float(c[s, t])}; resharding "
                         f"costs must be finite and >= 0")
    return u, v, c


def _expand(c: np.ndarray, row, col, name: str, ku: int, kv: int) -> np.ndarray:
    """C[s, t] = K[row[s], col[t]] from the class form of an edge."""
    row, col = np.asarray(row), np.asarray(col)
    for what, idx, size, n in (("row", row, ku, c.shape[0]), ("col", col, kv, c.shape[-1])):
        if c.ndim != 2 or idx.shape != (size,) or not np.all((idx >= 0) & (idx < n)):
            raise ValueError(f"{name} has K of shape {c.shape} and {what} {idx.tolist()}; "
                             f"expected {size} class indices into K")
    return c[np.ix_(row, col)]


@dataclass(frozen=True)
class Solution:
    """The chosen candidate per node and how it was found.

    Attributes:
        choice: the candidate index chosen for each node (int64, length N).
        cost: the objective of `choice` on the original problem.
        optimal: whether `choice` is proven optimal (to HiGHS's gap tolerance for the ILP).
        gap: relative gap between `cost` and the best lower bound (0 for DP and brute force).
        method: "chain-dp", "tree-dp", "ilp" or "brute-force".
        seconds: wall time spent in the solver.
    """

    choice: np.ndarray
    cost: float
    optimal: bool
    gap: float
    method: str
    seconds: float


def objective(problem: Problem, choice: np.ndarray) -> float:
    """The total node plus edge cost of `choice` (one candidate index per node)."""
    total = sum(float(c[choice[i]]) for i, c in enumerate(problem.node_cost))
    return total + sum(float(c[choice[u], choice[v]]) for u, v, c in problem.edges)


def peak_memory(problem: Problem, choice: np.ndarray) -> float:
    """The largest live-set memory of `choice`; 0 when the problem has no node_mem."""
    if problem.node_mem is None:
        return 0.0
    mem = [float(m[choice[i]]) for i, m in enumerate(problem.node_mem)]
    return max((sum(mem[i] for i in s) for s in problem.groups()), default=0.0)


def solve(problem: Problem, time_limit: float = 30.0, rel_gap: float = 1e-9) -> Solution:
    """Choose one candidate per node, exactly: tree DP where it applies, else an ILP.

    Args:
        problem: the instance.
        time_limit: seconds HiGHS may spend; when it stops early the best assignment found is
            returned with optimal=False and its gap.
        rel_gap: relative optimality gap at which HiGHS stops (its absolute gap is 1e-6 of the
            largest cost coefficient, as the objective is scaled to max |cost| = 1).

    Returns:
        A Solution; `cost` is always the objective of `choice` on `problem`.

    Raises:
        ValueError: when no assignment fits the memory budget (names the smallest peak).

    Example:
        >>> p = Problem((np.array([1.0, 0.0]), np.array([0.0, 1.0])),
        ...             ((0, 1, np.array([[0.0, 5.0], [5.0, 0.0]])),))
        >>> s = solve(p); (s.choice.tolist(), s.cost, s.method)
        ([0, 0], 1.0, 'chain-dp')
    """
    start = time.perf_counter()
    if problem.has_budget:
        _check_budget(problem)
    costs, pairs = _fold_separable(problem)
    adj = _adjacency(len(costs), pairs)
    tree = _forest_dp(costs, adj)
    if tree is not None and (not problem.has_budget or _fits(problem, tree[0])):
        choice, method, optimal, gap = tree[0], tree[1], True, 0.0
    else:
        choice, optimal, gap = _solve_ilp(problem, costs, pairs, adj, time_limit, rel_gap)
        method = "ilp"
    return Solution(choice, objective(problem, choice), optimal, gap, method,
                    time.perf_counter() - start)


def _fits(problem: Problem, choice: np.ndarray) -> bool:
    return peak_memory(problem, choice) <= problem.budget * (1 + 1e-12)


def _check_budget(problem: Problem) -> None:
    # Each node's least-memory candidate minimises every live set's sum at once, so the max
    # over sets of those sums is the exact smallest achievable peak for this memory model.
    least = [float(m.min()) for m in problem.node_mem]
    sums = [sum(least[i] for i in s) for s in problem.groups()]
    worst = int(np.argmax(sums)) if sums else 0
    if sums and sums[worst] > problem.budget * (1 + 1e-12):
        where = f" in live_sets[{worst}]" if problem.live_sets is not None else ""
        raise ValueError(
            f"no strategy assignment fits memory_budget={problem.budget:.6g} bytes per device; "
            f"the smallest possible peak is {sums[worst]:.6g} bytes{where} (found by taking "
            f"every node's least-memory candidate, which is exact for this memory model)")


def _fold_separable(problem: Problem) -> tuple[list[np.ndarray], dict]:
    """Merge parallel edges into pairs (a < b) -> C_ab; fold C = r[s] + c[t] into node costs."""
    costs = [c.copy() for c in problem.node_cost]
    merged: dict[tuple[int, int], np.ndarray] = {}
    for u, v, c in problem.edges:
        key, m = ((u, v), c) if u < v else ((v, u), c.T)
        merged[key] = merged[key] + m if key in merged else m.copy()
    pairs = {}
    for (a, b), c in merged.items():
        r, col = c[:, 0], c[0, :] - c[0, 0]
        if np.allclose(c, r[:, None] + col[None, :], rtol=0, atol=1e-12 * c.max()):
            costs[a] += r
            costs[b] += col
        else:
            pairs[(a, b)] = c
    return costs, pairs


def _adjacency(n: int, pairs: dict) -> list[list[tuple[int, np.ndarray]]]:
    """adj[i]: (j, M) per neighbour j, with M[s, t] the edge cost when i picks s and j picks t."""
    adj: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for (a, b), c in pairs.items():
        adj[a].append((b, c))
        adj[b].append((a, c.T))
    return adj


def _forest_dp(costs: list[np.ndarray], adj: list) -> tuple[np.ndarray, str] | None:
    """Exact min-sum over a forest by leaf-to-root messages; None if `adj` has a cycle."""
    walk = _walk_forest(adj)
    if walk is None:
        return None
    order, parent, to_parent = walk
    f = [c.copy() for c in costs]  # f[i][s]: best cost of i's subtree with i at candidate s
    back = {}  # back[i][s_p]: best candidate of i when its parent p picks s_p
    for i in reversed(order):
        if parent[i] >= 0:
            total = to_parent[i] + f[i][None, :]  # (k_p, k_i)
            back[i] = total.argmin(axis=1)
            f[parent[i]] += total.min(axis=1)
    choice = np.zeros(len(costs), dtype=np.int64)
    for i in order:
        choice[i] = back[i][choice[parent[i]]] if parent[i] >= 0 else int(np.argmin(f[i]))
    chain = all(len(n) <= 2 for n in adj)
    return choice, "chain-dp" if chain else "tree-dp"


def _walk_forest(adj: list) -> tuple[list[int], list[int], dict] | None:
    """Depth-first order (parents before children), parent and edge to parent; None on a cycle."""
    order, parent, to_parent = [], [-1] * len(adj), {}
    seen = [False] * len(adj)
    for root in range(len(adj)):
        if seen[root]:
            continue
        seen[root], queue = True, [root]
        while queue:
            i = queue.pop()
            order.append(i)
            for j, c in adj[i]:
                if j == parent[i]:
                    continue
                if seen[j]:
                    return None  # a second path to j: a cycle
                seen[j], parent[j], to_parent[j] = True, i, c
                queue.append(j)
    return order, parent, to_parent


def _solve_ilp(problem: Problem, costs: list[np.ndarray], pairs: dict, adj: list,
               time_limit: float, rel_gap: float) -> tuple[np.ndarray, bool, float]:
    c, constraints, xoff = _build_ilp(problem, costs, pairs)
    scale = max(float(np.abs(c).max(initial=0.0)), 1e-300)  # HiGHS's absolute gap is 1e-6
    integrality = (np.arange(len(c)) < xoff[-1]).astype(int)  # x binary, e continuous
    res = milp(c / scale, integrality=integrality, bounds=Bounds(0, 1), constraints=constraints,
               options={"time_limit": time_limit, "mip_rel_gap": rel_gap})
    if res.status == 2:
        _check_budget(problem)  # raises the user-facing message when the budget is the cause
    if res.status not in (0, 1):
        raise RuntimeError(f"HiGHS failed on the strategy ILP: {res.message}")
    found = [] if res.x is None else [  # x_i is one-hot up to HiGHS's integrality tolerance
        np.array([np.argmax(res.x[a:b]) for a, b in itertools.pairwise(xoff)], np.int64)]
    if res.status == 0:
        return found[0], True, 0.0
    # Stopped early: polish the incumbent and a greedy start by local search, keep the best.
    starts = found + [_fallback(problem, costs)]
    choice = min((_local_search(problem, costs, adj, s) for s in starts),
                 key=lambda s: objective(problem, s))
    cost, bound = objective(problem, choice), res.get("mip_dual_bound")
    if bound is None or not np.isfinite(bound):
        return choice, False, float("inf")
    return choice, False, max(0.0, cost - bound * scale) / max(cost, 1e-300)


def _build_ilp(problem: Problem, costs: list[np.ndarray],
               pairs: dict) -> tuple[np.ndarray, list[LinearConstraint], np.ndarray]:
    """Objective vector [c_i..., C_uv.ravel()...], constraints, and x_i's offsets xoff."""
    k = np.array([len(c) for c in costs])
    xoff = np.concatenate([[0], np.cumsum(k)])  # x_i occupies [xoff[i], xoff[i+1])
    items = [(ab, *_classes(c)) for ab, c in pairs.items()]
    eoff = xoff[-1] + np.concatenate([[0], np.cumsum([m.size for _, m, _, _ in items])])
    eq, rhs = _marginal_rows(k, xoff, items, eoff.astype(int))
    constraints = [LinearConstraint(eq, rhs, rhs)]
    if problem.has_budget:
        constraints.append(_memory_rows(problem, xoff, int(eoff[-1])))
    return np.concatenate(costs + [m.ravel() for _, m, _, _ in items]), constraints, xoff


def _classes(c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """C = K[row][:, col] with K's rows and columns distinct: candidates that reshard alike
    (same output spec, say) share edge variables, which shrinks the ILP."""
    distinct_rows, row = np.unique(c, axis=0, return_inverse=True)
    k, col = np.unique(distinct_rows, axis=1, return_inverse=True)
    return k, row.ravel(), col.ravel()


def _marginal_rows(k: np.ndarray, xoff: np.ndarray, items: list,
                   eoff: np.ndarray) -> tuple[sparse.csr_array, np.ndarray]:
    """Rows: one-hot per node (= 1); per edge over classes p (of u) and q (of v),
    sum_q e[p,q] - sum_(s: row[s]=p) x_u[s] and sum_p e[p,q] - sum_(t: col[t]=q) x_v[t] (= 0)."""
    n = len(k)
    rows, cols, vals = [np.repeat(np.arange(n), k)], [np.arange(xoff[-1])], [np.ones(xoff[-1])]
    r0 = n
    for j, ((a, b), m, row, col) in enumerate(items):
        na, nb = m.shape
        e = eoff[j] + np.arange(na * nb)  # e[p, q] at eoff + p * nb + q
        rows += [r0 + np.repeat(np.arange(na), nb), r0 + row,
                 r0 + na + np.tile(np.arange(nb), na), r0 + na + col]
        cols += [e, xoff[a] + np.arange(len(row)), e, xoff[b] + np.arange(len(col))]
        vals += [np.ones(na * nb), -np.ones(len(row)), np.ones(na * nb), -np.ones(len(col))]
        r0 += na + nb
    matrix = sparse.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                              shape=(r0, int(eoff[-1])))
    rhs = np.zeros(r0)
    rhs[:n] = 1.0
    return matrix, rhs


def _memory_rows(problem: Problem, xoff: np.ndarray, nvar: int) -> LinearConstraint:
    """sum_(i in L) m_i . x_i <= budget per live set L, each row divided by the budget."""
    scale = problem.budget if problem.budget > 0 else 1.0
    pick = [(r, i) for r, group in enumerate(problem.groups()) for i in group]
    k = [len(problem.node_mem[i]) for _, i in pick]
    rows = np.repeat(np.array([r for r, _ in pick], dtype=int), k)
    cols = np.concatenate([xoff[i] + np.arange(n) for (_, i), n in zip(pick, k, strict=True)]
                          + [np.zeros(0, int)])
    vals = np.concatenate([problem.node_mem[i] for _, i in pick] + [np.zeros(0)]) / scale
    matrix = sparse.csr_array((vals, (rows, cols)), shape=(len(problem.groups()), nvar))
    return LinearConstraint(matrix, -np.inf, problem.budget / scale)


def _fallback(problem: Problem, costs: list[np.ndarray]) -> np.ndarray:
    """A feasible assignment when HiGHS stopped with none: cheapest nodes, else least memory."""
    cheap = np.array([int(np.argmin(c)) for c in costs], dtype=np.int64)
    if not problem.has_budget or _fits(problem, cheap):
        return cheap
    return np.array([int(np.argmin(m)) for m in problem.node_mem], dtype=np.int64)


def _local_search(problem: Problem, costs: list[np.ndarray], adj: list,
                  choice: np.ndarray, sweeps: int = 50) -> np.ndarray:
    """Iterated conditional modes: move one node at a time to a cheaper candidate given its
    neighbours' choices, keeping the budget, until no move helps."""
    choice = choice.copy()
    for _ in range(sweeps):
        moved = False
        for i in range(len(costs)):
            local = costs[i] + sum((m[:, choice[j]] for j, m in adj[i]), np.zeros(len(costs[i])))
            for s in np.argsort(local, kind="stable"):
                if local[s] >= local[choice[i]] - 1e-12 * abs(local[choice[i]]):
                    break
                trial = choice.copy()
                trial[i] = s
                if not problem.has_budget or _fits(problem, trial):
                    choice, moved = trial, True
                    break
        if not moved:
            return choice
    return choice


def brute_force(problem: Problem, max_assignments: int = 2_000_000) -> Solution:
    """Try every assignment (for tests and tiny problems).

    Args:
        problem: the instance.
        max_assignments: prod(k_i) above this raises ValueError (as does an infeasible budget).

    Returns:
        An optimal Solution, method "brute-force" (ties go to the first assignment found).

    Example:
        >>> brute_force(Problem((np.array([3.0, 1.0]),))).choice.tolist()
        [1]
    """
    start = time.perf_counter()
    k = problem.sizes
    if np.prod(k, dtype=float) > max_assignments:
        raise ValueError(f"brute_force: {np.prod(k, dtype=float):.3g} assignments for sizes "
                         f"{k} exceed max_assignments={max_assignments}")
    grid = np.array(list(itertools.product(*map(range, k))), dtype=np.int64).reshape(-1, len(k))
    total = sum(c[grid[:, i]] for i, c in enumerate(problem.node_cost)) + np.zeros(len(grid))
    for u, v, c in problem.edges:
        total += c[grid[:, u], grid[:, v]]
    if problem.has_budget:
        _check_budget(problem)
        mem = [m[grid[:, i]] for i, m in enumerate(problem.node_mem)]
        peak = np.max([sum((mem[i] for i in s), np.zeros(len(grid))) for s in problem.groups()],
                      axis=0)
        total = np.where(peak <= problem.budget * (1 + 1e-12), total, np.inf)
    best = int(np.argmin(total))
    return Solution(grid[best], float(total[best]), True, 0.0, "brute-force",
                    time.perf_counter() - start)


def prune_dominated(problem: Problem) -> tuple[Problem, list[np.ndarray]]:
    """Drop candidates that another candidate of the same node dominates, to a fixed point.

    Candidate t of node i dominates s when its node cost, memory and, on every edge at i, its
    row (or column) of costs are elementwise <= those of s (of exact ties the first is kept).
    Swapping s -> t never costs more or breaks the budget, so the optimum is unchanged.

    Args:
        problem: the instance (not modified).

    Returns:
        (pruned problem, keep) where keep[i][new] is the original index of node i's candidate.

    Example:
        >>> p = Problem((np.array([1.0, 2.0]),))
        >>> pruned, keep = prune_dominated(p); keep[0].tolist()
        [0]
    """
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
    parts += [c if u == i else c.T for u, v, c in problem.edges if i in (u, v)]
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
        tuple((u, v, c[np.ix_(keep[u], keep[v])]) for u, v, c in problem.edges),
        None if mem is None else tuple(m[keep[i]] for i, m in enumerate(mem)),
        problem.live_sets, problem.budget)
