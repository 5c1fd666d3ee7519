"""Exact reductions of a strategy-selection Problem to a small core, and back.

Before: a `Problem` (dynamic.py). After: a `Core` -- one variable per group of tied nodes, edges
between variables over spec classes, parallel edges merged, separable edges folded away and
(unless a memory budget needs every node) every variable of degree <= 2 eliminated -- whose
optimum, expanded by `Core.expand`, is an optimum of the problem. Each reduction is exact:

  tie        nodes of one group take one candidate index (the problem says so: repeated layers
             share a strategy); a variable's cost is the sum of its members' costs, and an edge
             inside a group adds its diagonal C[s, s] to that cost.
  merge      edges between one pair of variables add up, over the common refinement of their
             classes (a candidate's class is the tuple of its classes on each edge).
  separable  an edge with C[p, q] = r[p] + c[q] moves into its endpoints' costs.
  eliminate  a variable i with one neighbour j adds min_s (c_i[s] + C[s, t]) to c_j[t]; with two
             neighbours j, l it becomes the edge N[t, u] = min_s (C[t, s] + c_i[s] + C[s, u])
             (variable elimination: on a chain or a tree it is the Viterbi / tree DP, on
             series-parallel graphs it goes on). Its choice is recovered from its neighbours'.

Memory (when a budget is set): each live set becomes a row of counts over *terms*, a term being
a (variable, bytes per candidate) pair, so tied layers count once per copy alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy import sparse

# Largest (pairs x classes x classes) table one elimination may build; bigger ones stay.
ELIMINATION_LIMIT = 4e7
_ONE = np.zeros(1, dtype=np.int64)  # the class of a node's one candidate


@dataclass
class CEdge:
    """C[s, t] = K[row[s], col[t]] between variables a < b (rows: a's candidates)."""

    K: np.ndarray
    row: np.ndarray
    col: np.ndarray

    def toward(self, first: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(K, own classes, other classes) seen from a (first) or from b."""
        return (self.K, self.row, self.col) if first else (self.K.T, self.col, self.row)


@dataclass
class Core:
    """The reduced problem. Variables keep their numbers (eliminated ones leave `alive`)."""

    cost: list[np.ndarray]
    edges: dict[tuple[int, int], CEdge]
    adj: list[set[int]]
    var_of: np.ndarray                       # node -> variable
    alive: set[int] = field(default_factory=set)
    eliminated: list[tuple] = field(default_factory=list)   # (var, cost, [(nbr, K, own, other)])
    terms: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (var, bytes per cand)
    rows: sparse.csr_array | None = None     # live set x term -> how many copies are alive
    acyclic: bool = True                     # no cycle met while eliminating (a forest)
    max_degree: int = 0                      # before elimination (2: chains)
    offset: float = 0.0                      # the optimum of parts eliminated entirely

    def size(self) -> int:
        """How many candidates (of alive variables) and class pairs (of edges) the core holds:
        its LP relaxation's variables, less memory terms."""
        return (sum(len(self.cost[v]) for v in self.alive) +
                sum(e.K.size for e in self.edges.values()))

    def edge(self, i: int, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(K, i's classes, j's classes) of the edge between variables i and j."""
        return self.edges[(min(i, j), max(i, j))].toward(i < j)

    def expand(self, choice: dict[int, int] | np.ndarray) -> np.ndarray:
        """Node choices from the alive variables' choices: eliminated variables last-in first."""
        x = np.full(len(self.cost), -1, dtype=np.int64)
        for v in self.alive:
            x[v] = choice[v]
        for v, cost, links in reversed(self.eliminated):
            local = cost.copy()
            for j, k, own, other in links:
                local += k[own, other[x[j]]]
            x[v] = int(np.argmin(local))
        return x[self.var_of]


def reduce_problem(problem, memory: bool = False) -> Core:
    """The Core of `problem` (see the module docstring). memory: keep every variable (the
    budget constrains them all) and turn the live sets into rows; else the budget is ignored
    and variables of degree <= 2 are eliminated."""
    var_of, n = _variables(problem)
    cost = [np.zeros(0)] * n
    for i, c in enumerate(problem.node_cost):
        v = var_of[i]
        cost[v] = c.copy() if not len(cost[v]) else cost[v] + c
    core = Core(cost, {}, [set() for _ in range(n)], var_of, set(range(n)))
    _add_edges(core, problem)
    if memory:
        _memory(core, problem)
    settled: dict[tuple, tuple] = {}
    for key in list(core.edges):
        _settle(core, key, settled)
    core.max_degree = max((len(a) for a in core.adj), default=0)
    if not memory:
        _eliminate_all(core)
    return core


def _variables(problem) -> tuple[np.ndarray, int]:
    var_of = np.arange(len(problem.node_cost))
    for group in problem.tied or ():
        var_of[list(group)] = group[0]
    used, inverse = np.unique(var_of, return_inverse=True)
    return inverse.astype(np.int64), len(used)


def _add_edges(core: Core, problem) -> None:
    """Edges grouped by variable pair; identical ones (tied layers) summed by multiplicity."""
    groups: dict[tuple[int, int], dict[tuple, list]] = {}
    for u, v, k, row, col in problem.edges:
        a, b = int(core.var_of[u]), int(core.var_of[v])
        if a == b:  # both ends in one group: same candidate index s on both sides
            core.cost[a] = core.cost[a] + k[row, col]
            continue
        flip = a > b
        same = groups.setdefault((min(a, b), max(a, b)), {}).setdefault(
            (id(k), id(row), id(col), flip), [k, row, col, flip, 0])
        same[4] += 1
    transposed: dict[int, np.ndarray] = {}  # one view per matrix: _settle keys on its id
    for key, parts in groups.items():
        edges = []
        for k, row, col, flip, n in parts.values():
            if flip:
                k, row, col = transposed.setdefault(id(k), k.T), col, row
            edges.append(CEdge(k if n == 1 else k * n, row, col))
        core.edges[key] = _merge(edges)
        core.adj[key[0]].add(key[1])
        core.adj[key[1]].add(key[0])


def _refine(idx: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Common refinement of several class maps: (new class per candidate, a representative
    candidate per new class)."""
    if len(idx) == 1:
        _, first, inverse = np.unique(idx[0], return_index=True, return_inverse=True)
        return inverse.ravel(), first
    _, first, inverse = np.unique(np.stack(idx, axis=1), axis=0, return_index=True,
                                  return_inverse=True)
    return inverse.ravel(), first


def _merge(edges: list[CEdge]) -> CEdge:
    if len(edges) == 1:
        return edges[0]
    row, rep_r = _refine([e.row for e in edges])
    col, rep_c = _refine([e.col for e in edges])
    k = sum(e.K[e.row[rep_r]][:, e.col[rep_c]] for e in edges)
    return CEdge(k, row, col)


def _distinct_rows(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of the first of each distinct row, class of every row)."""
    first: dict[bytes, int] = {}
    cls = np.array([first.setdefault(r.tobytes(), len(first)) for r in k], dtype=np.int64)
    reps = np.zeros(len(first), dtype=np.int64)
    reps[cls[::-1]] = np.arange(len(k))[::-1]
    return reps, cls


def _used(idx: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(idx, return_inverse=True) for indices in range(n) (an edge's classes: a few
    each, and a deep model's reduction settles tens of thousands of edges)."""
    used = np.flatnonzero(np.bincount(idx, minlength=n))
    number = np.zeros(n, dtype=np.int64)
    number[used] = np.arange(len(used))
    return used, number[idx]


def _canonical(e: CEdge) -> CEdge:
    """Drop unused classes and merge classes whose rows (columns) of K are equal."""
    used_r, row = _used(e.row, e.K.shape[0])
    used_c, col = _used(e.col, e.K.shape[1])
    k = e.K[used_r][:, used_c]
    reps_r, cls_r = _distinct_rows(k)
    reps_c, cls_c = _distinct_rows(np.ascontiguousarray(k.T))
    return CEdge(k[reps_r][:, reps_c], cls_r[row.ravel()], cls_c[col.ravel()])


def _settle(core: Core, key: tuple[int, int], memo: dict | None = None) -> None:
    """Canonicalise an edge; fold it into its ends' costs when it is separable. memo: the
    canonical forms found so far, by the ids of (K, row, col) (many edges share them: the
    layers of a deep model, ops alike on one shape)."""
    a, b = key
    e = core.edges[key]
    if len(core.cost[a]) == 1:  # an end with one candidate: all of it to the other end
        _fold(core, key, np.zeros(1), e.K[e.row[0]], _ONE, e.col)
        return
    if len(core.cost[b]) == 1:
        _fold(core, key, e.K[:, e.col[0]], np.zeros(1), e.row, _ONE)
        return
    ids = (id(e.K), id(e.row), id(e.col))
    hit = memo.get(ids) if memo is not None else None
    if hit is None:
        c = _canonical(e)
        k = c.K
        r, s = k[:, 0], k[0, :] - k[0, 0]
        separable = float(np.abs(k - r[:, None] - s[None, :]).max()) <= \
            1e-12 * max(float(k.max()), 1e-300)
        hit = (c, (r, s) if separable else None, e)  # e kept alive: its ids stay its own
        if memo is not None:
            memo[ids] = hit
    e, parts, _ = hit
    if parts is not None:
        _fold(core, key, *parts, e.row, e.col)
    else:
        core.edges[key] = e


def _fold(core: Core, key: tuple[int, int], r: np.ndarray, c: np.ndarray, row: np.ndarray,
          col: np.ndarray) -> None:
    """A separable edge K[p, q] = r[p] + c[q] moved into its ends' costs."""
    a, b = key
    core.cost[a] = core.cost[a] + r[row]
    core.cost[b] = core.cost[b] + c[col]
    del core.edges[key]
    core.adj[a].discard(b)
    core.adj[b].discard(a)


def _memory(core: Core, problem) -> None:
    """Live sets as count rows over (variable, bytes vector) terms."""
    if problem.node_mem is None:
        core.rows = sparse.csr_array((0, 0))
        return
    index: dict[tuple[int, int], int] = {}
    term_of = []
    for i, m in enumerate(problem.node_mem):
        v = int(core.var_of[i])
        t = index.setdefault((v, id(m)), len(core.terms))
        if t == len(core.terms):
            core.terms.append((v, m))
        term_of.append(t)
    term_of = np.asarray(term_of, dtype=np.int64)
    if problem.live_ranges is not None:
        core.rows = _live_rows(_range_counts(problem, term_of, len(core.terms)))
        return
    groups = problem.groups()
    lengths = [len(g) for g in groups]
    cols = term_of[np.concatenate([np.asarray(g, dtype=np.int64) for g in groups])] \
        if groups else np.zeros(0, np.int64)
    rows = np.repeat(np.arange(len(groups)), lengths)
    counts = sparse.csr_array((np.ones(len(cols)), (rows, cols)),
                              shape=(len(groups), len(core.terms)))
    counts.sum_duplicates()
    core.rows = _live_rows(counts)


def _range_counts(problem, term_of: np.ndarray, n_terms: int) -> sparse.csr_array:
    """Count rows at each point where a live range ends, a dense block of points at a time:
    each node adds 1 to its term over the points its range spans."""
    points = problem.points()
    first = np.searchsorted(points, problem.live_ranges[:, 0])
    stop = np.searchsorted(points, problem.live_ranges[:, 1], side="right")
    step = max(1, 2**22 // max(n_terms, 1))
    blocks = [sparse.csr_array((0, n_terms))]
    for b0 in range(0, len(points), step):
        b1 = min(b0 + step, len(points))
        inside = (first < b1) & (stop > b0)
        change = np.zeros((b1 - b0 + 1, n_terms), dtype=np.int32)
        np.add.at(change, (np.maximum(first[inside], b0) - b0, term_of[inside]), 1)
        np.add.at(change, (np.minimum(stop[inside], b1) - b0, term_of[inside]), -1)
        blocks.append(sparse.csr_array(np.cumsum(change, axis=0)[:-1].astype(float)))
    return sparse.vstack(blocks, format="csr")


def _live_rows(counts: sparse.csr_array) -> sparse.csr_array:
    """Drop repeated rows and rows no larger than the row before or after them."""
    dense_keys = {}
    keep = []
    for r in range(counts.shape[0]):
        lo, hi = counts.indptr[r], counts.indptr[r + 1]
        key = (counts.indices[lo:hi].tobytes(), counts.data[lo:hi].tobytes())
        if key not in dense_keys:
            dense_keys[key] = r
            keep.append(r)
    counts = counts[keep]
    if counts.shape[0] < 2:
        return counts
    diff_next = counts[:-1] - counts[1:]
    below_next = np.asarray((diff_next > 0).sum(axis=1)).ravel() == 0
    diff_prev = counts[1:] - counts[:-1]
    below_prev = np.asarray((diff_prev > 0).sum(axis=1)).ravel() == 0
    drop = np.zeros(counts.shape[0], dtype=bool)
    drop[:-1] |= below_next
    drop[1:] |= below_prev & ~drop[:-1]  # of two equal neighbours keep one
    return counts[~drop]


def _class_min(values: np.ndarray, idx: np.ndarray, n: int) -> np.ndarray:
    out = np.full(n, np.inf)
    np.minimum.at(out, idx, values)
    return out


def _eliminate_all(core: Core) -> None:
    queue = [v for v in range(len(core.cost)) if len(core.adj[v]) <= 2]
    while queue:
        v = queue.pop()
        if v not in core.alive or len(core.adj[v]) > 2:
            continue
        nbrs = sorted(core.adj[v])
        if len(nbrs) == 2:
            if not _eliminate_two(core, v, *nbrs):
                continue
        elif nbrs:
            _eliminate_one(core, v, nbrs[0])
        else:
            core.eliminated.append((v, core.cost[v], []))
            core.offset += float(core.cost[v].min())
        core.alive.discard(v)
        queue += [j for j in nbrs if len(core.adj[j]) <= 2]


def _detach(core: Core, v: int, j: int) -> tuple:
    k, own, other = core.edge(v, j)
    del core.edges[(min(v, j), max(v, j))]
    core.adj[v].discard(j)
    core.adj[j].discard(v)
    return j, k, own, other


def _eliminate_one(core: Core, v: int, j: int) -> None:
    link = _detach(core, v, j)
    _, k, own, other = link
    best = _class_min(core.cost[v], own, k.shape[0])  # cheapest candidate of v per class
    core.cost[j] = core.cost[j] + (best[:, None] + k).min(axis=0)[other]
    core.eliminated.append((v, core.cost[v], [link]))


def _eliminate_two(core: Core, v: int, j: int, m: int) -> bool:
    ka, own_a, cls_j = core.edge(v, j)
    kb, own_b, cls_m = core.edge(v, m)
    pairs, inverse = np.unique(own_a * kb.shape[0] + own_b, return_inverse=True)
    if len(pairs) * ka.shape[1] * kb.shape[1] > ELIMINATION_LIMIT:
        return False
    best = _class_min(core.cost[v], inverse.ravel(), len(pairs))
    left = ka[pairs // kb.shape[0]] + best[:, None]       # (pairs, classes of j)
    right = kb[pairs % kb.shape[0]]                         # (pairs, classes of m)
    step = max(1, int(4e6 // max(1, left.shape[1] * right.shape[1])))
    n = np.min([np.min(left[s:s + step, :, None] + right[s:s + step, None, :], axis=0)
                for s in range(0, len(pairs), step)], axis=0)
    if m in core.adj[j]:
        core.acyclic = False
    core.eliminated.append((v, core.cost[v], [_detach(core, v, j), _detach(core, v, m)]))
    new = CEdge(n, cls_j, cls_m)  # j < m
    key = (j, m)
    core.edges[key] = _merge([core.edges[key], new]) if key in core.edges else new
    core.adj[j].add(m)
    core.adj[m].add(j)
    _settle(core, key)
    return True
