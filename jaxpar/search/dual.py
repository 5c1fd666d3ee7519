"""Bounds and assignments for a reduced strategy problem (a compress.Core).

Before: a Core (variables, class-form edges, optionally memory rows) and a cost per candidate of
each variable (the core's own, or the core's plus a price on memory). After: a lower bound on
the optimum from dual ascent on the LP relaxation, the best assignment decoded from it and
polished by local search, and the candidates and class pairs that reduced-cost fixing keeps.

Dual ascent (Lagrangian of the marginal constraints). lam[e] = (l_a, l_b) is what edge
e = (a, b) hands its ends, per class. The reparametrised costs theta_a[s] = c_a[s] + sum_e
l_e,a[class_e(s)] and theta_e[p, q] = K[p, q] - l_a[p] - l_b[q] sum to the objective for every
assignment, so sum_a min theta_a + sum_e min theta_e is a lower bound whatever lam is. Updating
a variable a picks its multipliers optimally with the others fixed: with mu_e[p] = min_q (K[p, q]
- l_b[q]) and a's belief T = c_a + sum_e mu_e[class_e], edges toward variables already passed
take all they can give (l = mu) and each edge ahead gets back 1/max(#behind, #ahead) of T's
minimum per class. Sweeps go forward and backward in turn (the weights of Kolmogorov's TRW-S /
SRMP; handing the belief on along the order is what lets chains of layers converge in tens of
sweeps). A balanced sweep hands every edge 1/(degree + 1) instead (MPLP's star update), which
spreads the bound evenly before fixing.

Reduced-cost fixing: for every assignment x, objective(x) >= bound + (theta_a[x_a] - min
theta_a) for each a (and likewise per edge), so a candidate or class pair whose reduced cost
exceeds (incumbent - bound) is in no assignment better than the incumbent.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from jaxpar.search.compress import Core


class DualAscent:
    """The multipliers of one core and the costs they reparametrise (see the module doc)."""

    def __init__(self, core: Core, cost: dict[int, np.ndarray], scale: float):
        self.core, self.scale = core, scale
        self.vars = sorted(core.alive)
        self.keys = sorted(core.edges)
        self.lam = {key: [np.zeros(e.K.shape[0]), np.zeros(e.K.shape[1])]
                    for key, e in core.edges.items()}
        self.reprice(cost)
        self.links = {v: [self._link(v, j) for j in sorted(core.adj[v])] for v in self.vars}
        self.weight = {v: 1.0 / max(sum(j < v for j in core.adj[v]),
                                    sum(j > v for j in core.adj[v]), 1) for v in self.vars}
        # what a sweep reads of each link, in one tuple: (the pair of multipliers it updates,
        # its side, the other side, K, own classes, order, starts, ahead forward, backward)
        self._sweep = {v: [(self.lam[key], side, 1 - side, k, own, order, starts, j > v, j < v)
                           for key, side, k, own, j, _, order, starts in links]
                       for v, links in self.links.items()}

    def reprice(self, cost: dict[int, np.ndarray]) -> None:
        """New candidate costs; the multipliers stay (a warm start)."""
        self.cost = {v: cost[v] / self.scale for v in self.vars}

    def _link(self, v: int, j: int) -> tuple:
        key = (min(v, j), max(v, j))
        k, own, other = self.core.edge(v, j)
        order = np.argsort(own, kind="stable")
        starts = np.searchsorted(own[order], np.arange(k.shape[0]))
        side = 0 if v < j else 1
        return key, side, np.ascontiguousarray(k) / self.scale, own, j, other, order, starts

    def _mu(self, link) -> np.ndarray:
        key, side, k = link[:3]
        return (k - self.lam[key][1 - side][None, :]).min(axis=1)

    def sweep(self, backward: bool, balanced: bool = False) -> None:
        """One pass over the variables, forward or backward (see the module doc)."""
        least, reduceat = np.minimum.reduce, np.minimum.reduceat
        for v in (reversed(self.vars) if backward else self.vars):
            links = self._sweep[v]
            if not links:
                continue
            # _mu of each link, inline (8% of the 48-layer GPT step's grouped solve)
            mus = [least(k - pair[other], axis=1) for pair, _, other, k, *_ in links]
            total = self.cost[v] + sum(m[link[4]] for m, link in zip(mus, links, strict=True))
            w = 1.0 / (len(links) + 1) if balanced else self.weight[v]
            for m, (pair, side, _, _, _, order, starts, forward, back) in zip(mus, links,
                                                                              strict=True):
                if balanced or (back if backward else forward):
                    pair[side] = m - w * reduceat(total[order], starts)
                else:
                    pair[side] = m

    def theta(self, v: int) -> np.ndarray:
        t = self.cost[v].copy()
        for key, side, _, own, *_ in self.links[v]:
            t += self.lam[key][side][own]
        return t

    def edge_theta(self, key) -> np.ndarray:
        la, lb = self.lam[key]
        return self.core.edges[key].K / self.scale - la[:, None] - lb[None, :]

    def bound(self) -> float:
        """The lower bound, in the costs' units (with what elimination settled already)."""
        lb = sum(float(self.theta(v).min()) for v in self.vars)
        lb += sum(float(self.edge_theta(key).min()) for key in self.keys)
        return lb * self.scale + self.core.offset

    def decode(self) -> dict[int, int]:
        """Variables in order, each at its best candidate given the ones decided before it and
        the multipliers of the ones after it."""
        x: dict[int, int] = {}
        for v in self.vars:
            t = self.cost[v].copy()
            for link in self.links[v]:
                _, _, k, own, j, other = link[:6]
                t += k[own, other[x[j]]] if j in x else self._mu(link)[own]
            x[v] = int(np.argmin(t))
        return x


class LocalSearch:
    """Objective, memory check and one-variable moves over a core's alive variables.

    memory: (live rows x terms counts, budget) to keep every move within the budget, or None.
    """

    def __init__(self, core: Core, cost: dict[int, np.ndarray] | list[np.ndarray],
                 memory: tuple | None = None):
        self.core, self.cost, self.memory = core, cost, memory
        self.vars = sorted(core.alive)
        self.links = {v: [core.edge(v, j) + (j,) for j in core.adj[v]] for v in self.vars}

    def local(self, x: dict, v: int) -> np.ndarray:
        t = self.cost[v].copy()
        for k, own, other, j in self.links[v]:
            t += k[own, other[x[j]]]
        return t

    def value(self, x: dict) -> float:
        """The objective of x (plus what elimination settled already)."""
        total = self.core.offset + sum(float(self.cost[v][x[v]]) for v in self.vars)
        return total + sum(float(e.K[e.row[x[a]], e.col[x[b]]])
                           for (a, b), e in self.core.edges.items())

    def usage(self, x: dict) -> np.ndarray:
        """Bytes per live row under x."""
        used = np.array([float(m[x[v]]) for v, m in self.core.terms])
        return self.core.rows @ used if len(used) else np.zeros(self.core.rows.shape[0])

    def feasible(self, x: dict) -> bool:
        if self.memory is None:
            return True
        usage = self.usage(x)
        return not len(usage) or float(usage.max()) <= self.memory[1] * (1 + 1e-12)

    def least_memory(self) -> dict:
        """Every variable at the candidate with the least bytes summed over its terms."""
        mem = {v: np.zeros(len(self.cost[v])) for v in self.vars}
        for v, m in self.core.terms:
            mem[v] += m
        return {v: int(np.argmin(mem[v])) for v in self.vars}

    def polish(self, x: dict, sweeps: int = 50) -> dict:
        """Iterated conditional modes: move one variable at a time to a cheaper candidate
        given its neighbours' choices, keeping the budget, until no move helps. Without a
        budget a variable is looked at again only once a neighbour has moved (else it would
        stay where it is: its costs are the same), which ends where the full sweeps end."""
        x = dict(x)
        stale = set(self.vars)  # to look at in the next sweep
        for _ in range(sweeps):
            moved = False
            for v in self.vars:
                if self.memory is None:
                    if v not in stale:
                        continue
                    stale.discard(v)
                t = self.local(x, v)
                for s in np.argsort(t, kind="stable"):
                    if t[s] >= t[x[v]] - 1e-12 * abs(t[x[v]]):
                        break
                    old, x[v] = x[v], int(s)
                    if self.feasible(x):
                        moved = True
                        stale.update(j for *_, j in self.links[v])  # its neighbours
                        break
                    x[v] = old
            if not moved:
                break
        return x


def ascend(dual: DualAscent, search: LocalSearch, stop: float, rel_gap: float,
           fix_size: int | None) -> tuple[dict | None, float, tuple[dict, dict] | None]:
    """Sweeps until the best assignment meets the bound, fixing would leave at most fix_size
    candidates and class pairs (None: not tried), the bound stalls, or the clock passes
    `stop`. Returns (best
    feasible assignment or None, bound, what fixing keeps or None if not computed).
    Assignments are decoded forward after a backward sweep, which has just sent every
    variable's belief back toward the start. A core that holds at most fix_size candidates
    and class pairs in all goes to the ILP after the first four sweeps unless they closed
    the gap (the bound may creep up for a hundred sweeps where HiGHS takes a fraction of a
    second: one mesh axis of a 48-layer GPT step, 2.7 s against 0.8)."""
    best, upper, history = None, float("inf"), []
    whole = dual.core.size()
    for it in itertools.count():
        dual.sweep(backward=bool(it % 2))
        if it % 4 != 3:
            continue
        history.append(dual.bound())
        x = search.polish(dual.decode())
        if search.feasible(x) and search.value(x) < upper:
            best, upper = x, search.value(x)
        if upper - history[-1] <= rel_gap * abs(upper):
            return best, history[-1], None
        keep = None
        if fix_size is not None and (whole <= fix_size or
                                     upper - history[-1] <= 1e-3 * abs(upper)):
            for k in range(2):
                dual.sweep(backward=bool(k % 2), balanced=True)
            history[-1] = max(history[-1], dual.bound())
            keep = fixing(dual, upper - history[-1])
        small = keep is not None and size(keep) <= fix_size
        stalled = len(history) > 4 and history[-1] - history[-5] <= 1e-9 * abs(history[-1])
        if small or stalled or time.perf_counter() > stop:
            return best, history[-1], keep
    raise AssertionError("unreachable")


def size(keep: tuple[dict, dict]) -> int:
    """How many candidates and class pairs fixing kept."""
    return sum(map(len, keep[0].values())) + sum(map(len, keep[1].values()))


def fixing(dual: DualAscent, slack: float) -> tuple[dict, dict]:
    """(candidates per variable, class pairs per edge) whose reduced cost is within `slack`
    (the costs' units; inf keeps everything)."""
    slack = slack / dual.scale * (1 + 1e-6) + 1e-9
    cands = {}
    for v in dual.vars:
        t = dual.theta(v)
        cands[v] = np.flatnonzero(t - t.min() <= slack)
    pairs = {}
    for key in dual.keys:
        t = dual.edge_theta(key)
        pairs[key] = np.argwhere(t - t.min() <= slack)
    return cands, pairs
