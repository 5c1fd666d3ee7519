"""Exact variable elimination over a reduced strategy problem's core (a compress.Core).

Before: a Core without memory rows: its alive variables, their candidate costs, and pairwise
edges in class form (C[s, t] = K[row[s], col[t]]). After: an optimal candidate per alive
variable, or None when eliminating them would build a table over `limit` entries.

compress.py eliminates every variable of at most two neighbours; what is left has cycles
through variables of three or more. Eliminating such a variable x makes a table over all its
neighbours at once (bucket elimination, "min-sum" on factors): for every combination of their
classes, the cheapest answer of x. The work is the product of the table sizes along the way, so
it is exact and fast where the core is narrow (small treewidth) however many variables it has:
a loop body's gradient of eight residual matmuls (23 variables of 27 or 64 candidates, each
eliminated with at most three neighbours) is solved in a fraction of a second where the ILP
took 18 to 27 s.

Factors stay in class form: a factor's axis for a variable is indexed by a class map of that
variable's candidates (the edge's row or col at first). Combining the factors that hold x
refines each variable's maps (the common refinement, as compress._merge does for one edge),
and x's own cost enters as its cheapest candidate per refined class: candidates of x in one
class look the same to every factor, so only the cheapest of them can be optimal. The order is
greedy: the variable whose table would be smallest goes next (min-weight), each table being
known before it is built; when the smallest is over `limit` the search gives up (None) and the
caller's other methods solve the core.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxpar.search.compress import Core

# Largest table (entries, float64) one elimination may build. The tables are built and
# minimised at about RATE entries a second on this 2-core machine (a loop body's core of 258
# variables, 128 tables of 4.3e6 entries and 6.1e8 in all: 2.7 s, where the ILP stopped at its
# 30 s limit with a plan 2.4% dearer); dynamic.solve gives them ELIMINATION_SHARE of the time left.
TABLE_LIMIT = 2e7
RATE = 2e8


@dataclass
class _Factor:
    """table[i_1, ..., i_n] for the variables of `scope`, axis k indexed by maps[k][candidate]
    and `sizes[k]` long (every class used)."""

    scope: tuple[int, ...]
    maps: tuple[np.ndarray, ...]
    table: np.ndarray | None  # None: planning the order only
    sizes: tuple[int, ...]


@dataclass
class _Step:
    """How to recover an eliminated variable from the choices of its neighbours."""

    var: int
    cost: np.ndarray             # its candidates' costs when it was eliminated
    own: np.ndarray              # its candidates' refined classes
    scope: tuple[int, ...]       # its neighbours then
    maps: tuple[np.ndarray, ...]  # their candidates' refined classes
    best: np.ndarray             # its best refined class per combination of theirs


@dataclass(frozen=True)
class Order:
    """The variables in the order they are eliminated, and the tables' entries in all."""

    variables: tuple[int, ...]
    work: float


def order(core: Core, limit: float | None = None, total: float = np.inf) -> Order | None:
    """The order eliminate() takes (the smallest table next), or None when some elimination
    would build a table of more than `limit` entries (None: TABLE_LIMIT) or all of them more
    than `total`: eliminate() without the tables, which only the class maps decide."""
    if core.rows is not None:
        raise ValueError("elimination solves cores without memory rows")
    limit = TABLE_LIMIT if limit is None else limit
    bank = _Bank(core)
    plans: dict[int, tuple] = {}
    variables, work = [], 0.0
    while bank.holding:
        for v in bank.holding:
            if v not in plans:
                plans[v] = _plan(v, len(core.cost[v]),
                                 [bank.factors[n] for n in sorted(bank.holding[v])], limit)
        var = min(bank.holding, key=lambda v: (plans[v][0], v))
        size, scope, maps, _ = plans.pop(var)
        work += size
        if size > limit or work > total:
            return None
        bank.take(var)
        for u in scope:
            plans.pop(u, None)  # its factors change
        if len(scope) > 1:
            bank.add(_Factor(scope, maps, None, tuple(int(m.max()) + 1 for m in maps)))
        variables.append(var)
    return Order(tuple(variables), work)


def eliminate(core: Core, limit: float | None = None, total: float = np.inf,
              plan: Order | None = None) -> dict[int, int] | None:
    """An optimal candidate per alive variable of `core` (no memory rows), eliminated in the
    order `plan` (None: order(core, limit, total), and None when that is None)."""
    plan = plan or order(core, limit, total)
    if plan is None:
        return None
    unary = {v: np.asarray(core.cost[v], dtype=float) for v in core.alive}
    bank = _Bank(core)
    steps: list[_Step] = []
    for var in plan.variables:
        mine = bank.take(var)
        _, scope, maps, own = _plan(var, len(unary[var]), mine)
        step, table = _combine(var, unary.pop(var), own, scope, maps, mine)
        steps.append(step)
        if len(scope) == 1:
            unary[scope[0]] = unary[scope[0]] + table[maps[0]]
        elif scope:
            bank.add(_Factor(scope, maps, table, table.shape))
    choice: dict[int, int] = {}
    for s in reversed(steps):
        at = tuple(m[choice[u]] for u, m in zip(s.scope, s.maps, strict=True))
        members = np.flatnonzero(s.own == s.best[at])
        choice[s.var] = int(members[np.argmin(s.cost[members])])
    return choice


class _Bank:
    """The factors not yet combined, and which of them hold each variable."""

    def __init__(self, core: Core):
        self.factors: dict[int, _Factor] = {}
        self.holding: dict[int, set[int]] = {v: set() for v in core.alive}
        self.made = 0  # factors added so far: the next one's id
        for key, e in core.edges.items():
            self.add(_Factor(key, (e.row, e.col), e.K,
                             (len(np.unique(e.row)), len(np.unique(e.col)))))

    def add(self, f: _Factor) -> None:
        self.factors[self.made] = f
        for u in f.scope:
            self.holding[u].add(self.made)
        self.made += 1

    def take(self, var: int) -> list[_Factor]:
        """The factors holding var, out of the bank (their other variables let go of them)."""
        mine = [self.factors.pop(n) for n in sorted(self.holding.pop(var))]
        for f in mine:
            for u in f.scope:
                if u != var:
                    self.holding[u] = {n for n in self.holding[u] if n in self.factors}
        return mine


def _plan(var: int, k: int, mine: list[_Factor], limit: float = np.inf) -> tuple:
    """(table size, neighbours, their refined maps, var's refined map) of eliminating var,
    which has k candidates and the factors `mine`; (inf, ...) as soon as the size passes
    `limit` (a variable joined to many is not refined further; nor at all where its factors'
    own sizes already tell: a variable's refined classes are at least as many as any factor's
    axis for it has)."""
    least: dict[int, int] = {}
    for f in mine:
        for u, n in zip(f.scope, f.sizes, strict=True):
            least[u] = max(least.get(u, 1), n)
    if float(np.prod([float(n) for n in least.values()])) > limit:
        return np.inf, tuple(sorted(u for u in least if u != var)), (), None
    own = _refine([f.maps[f.scope.index(var)] for f in mine], k)
    scope = tuple(sorted({u for f in mine for u in f.scope if u != var}))
    size, maps = float(own.max()) + 1, []
    for u in scope:
        m = _refine([f.maps[f.scope.index(u)] for f in mine if u in f.scope], 0)
        size *= float(m.max()) + 1
        if size > limit:
            return np.inf, scope, (), own
        maps.append(m)
    return size, scope, tuple(maps), own


def _refine(idx: list[np.ndarray], k: int) -> np.ndarray:
    """The common refinement of class maps (a class per candidate); k candidates in one class
    without maps."""
    if not idx:
        return np.zeros(k, dtype=np.int64)
    if len(idx) == 1:
        return np.unique(idx[0], return_inverse=True)[1].ravel()
    return np.unique(np.stack(idx, axis=1), axis=0, return_inverse=True)[1].ravel()


def _combine(var: int, cost: np.ndarray, own: np.ndarray, scope: tuple[int, ...],
             maps: tuple[np.ndarray, ...], mine: list[_Factor]) -> tuple[_Step, np.ndarray]:
    """Eliminate var: (how to recover it, the table over its neighbours' refined classes of
    the least it adds for each combination of them)."""
    classes = int(own.max()) + 1
    cheapest = np.full(classes, np.inf)
    np.minimum.at(cheapest, own, cost)
    shape = (*(int(m.max()) + 1 for m in maps), classes)  # var's axis last: minimised along
    table = np.empty(shape)
    table[...] = cheapest
    first = {u: np.unique(m, return_index=True)[1] for u, m in zip(scope, maps, strict=True)}
    first[var] = np.unique(own, return_index=True)[1]
    at = {u: i for i, u in enumerate(scope)} | {var: len(scope)}
    for f in mine:  # each factor read at a representative candidate of every refined class
        part = f.table[np.ix_(*(m[first[u]] for u, m in zip(f.scope, f.maps, strict=True)))]
        axes = [at[u] for u in f.scope]
        part = part.transpose(np.argsort(axes))
        table += part.reshape([shape[a] if a in axes else 1 for a in range(len(shape))])
    best = table.argmin(axis=-1)
    return (_Step(var, cost, own, scope, maps, best),
            np.take_along_axis(table, best[..., None], axis=-1)[..., 0])
