"""recursive_programming: MindSpore's SAPP (double recursive) search over an OpGraph.

Before: an OpGraph, the specs the user fixed (inputs and outputs), a CostModel of the automatic
modes (heavy ops use every device), an optional memory budget per device. After: a GraphPlan
like propagate()'s, and the decision log.

1. Main ops (dot_general, conv, gather, scatter-add, reductions over big tensors) are linked to
   each other through the ops between them (elementwise ops, reshapes, transposes, ...): a link
   says which dimension of one main op's operand or result is which of the other's (links.py).
   Main ops at the same place in identical layers form a class (ir.repeat.op_classes) and are
   decided once, by the class's first op in its context.
2. The outer recursion walks the device count factor by factor (the mesh axes, outermost
   first); the inner one the main ops in order of cost. Each chooses which of its loops the axis
   cuts (I, J, K or batch of a matmul; a dimension of other ops; or none) among the cuts its
   strategies allow given the axes decided before. A cut costs its op-cost (the cheapest of the
   op's strategies that cut so; mem_coeff included) plus its rest-cost: resharding against the
   neighbours decided on this axis and the fixed specs, over the axes decided so far, plus for
   each undecided neighbour the extra cost of its best answer to the cut. The cheapest cut wins
   and every price goes to the log, in MindSpore's words. Two other ways to cut the axis are
   priced over all links against the greedy one and taken when cheaper: a second greedy pass
   from the first op's runner-up cut (when that was close), and every op cutting as on the
   axis before (greedy passes trust their one-step look-ahead too much on long chains).
3. With the main ops' strategies fixed, sharding propagation plans every other op (per class);
   carried state (`ties`) goes in and out in the spec the main ops reading it need.
4. A plan over the memory budget is searched again with mem_coeff four times larger (more model
   parallel, less memory) a few times, then fails with a ValueError saying what it needs.
The work is linear in the number of ops: every op is walked or propagated once, and the main
ops of repeated layers are decided once per class.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence

from jaxpar.cost.comm import reshard as comm_reshard
from jaxpar.cost.model import CostModel
from jaxpar.ir.graph import Lit, Op, OpGraph
from jaxpar.ir.repeat import op_classes
from jaxpar.rules.registry import OpInfo
from jaxpar.search.links import Link, Linker, Slot, mapped
from jaxpar.search.propagation import Choice, GraphPlan, latency_shares, propagate
from jaxpar.spec import MeshInfo, OpStrategy, Spec

log = logging.getLogger("jaxpar.search.recursive")

_ALWAYS_MAIN = frozenset({"dot_general", "conv_general_dilated", "gather", "scatter-add"})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})
_RETRIES = 6          # memory budget: searches again with mem_coeff x4, x16, ...
_TIE = 1e-9           # relative: cuts this close in cost count as equal (the first one wins)
_CLOSE = 1.25         # a first decision's runner-up this close is tried as a second start


def recursive_programming(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
                          fixed_out: dict[int, Spec], memory_budget: float | None = None,
                          ties: Sequence[tuple[int, int]] = ()
                          ) -> tuple[GraphPlan, list[str]]:
    """Plan `graph` the SAPP way (see the module docstring).

    Args:
      graph: the program.
      model: prices strategies; its mem_coeff trades data parallel (small) for model parallel.
      fixed_in: {value id: Spec} the user fixed; fixed_out: {output position: Spec}.
      memory_budget: bytes per device the plan's peak must fit in, or None.
      ties: (input value, output position) pairs of carried state (a training step's
        parameters and optimizer state): the output comes back in the input's spec, so the
        update that makes it is linked to the ops that read the input, and both take one spec.

    Returns:
      (GraphPlan, decision log lines); each line also goes to the "jaxpar.search.recursive"
      logger at debug level.

    Example:
      >>> gp, decisions = recursive_programming(graph, model, {}, {})
      >>> [d for d in decisions if "Choose NOT to cut" in d]
    """
    collecting = gc.isenabled()
    gc.disable()  # the search makes many small objects and frees none of them early
    try:
        return _search(graph, model, fixed_in, fixed_out, memory_budget, tuple(ties))
    finally:
        if collecting:
            gc.enable()


def _search(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
            fixed_out: dict[int, Spec], memory_budget: float | None,
            ties: tuple[tuple[int, int], ...]) -> tuple[GraphPlan, list[str]]:
    from jaxpar.plan import peak_memory

    _check_fixed(graph, model.mesh, fixed_in, memory_budget)
    classes = op_classes(graph)
    lines: list[str] = []
    peaks = []
    for attempt in range(_RETRIES + 1):
        m = model if attempt == 0 else _with_mem_coeff(model, _bigger(model.mem_coeff, attempt))
        gp = _Sapp(graph, m, fixed_in, fixed_out, classes, lines, ties).run()
        if memory_budget is None:
            return gp, lines
        peaks.append(peak_memory(graph, gp, model.mesh))
        if peaks[-1] <= memory_budget:
            return gp, lines
        _note(lines, f"memory_budget={memory_budget:.0f} bytes per device: the plan with "
                     f"mem_coeff={m.mem_coeff:g} peaks at {peaks[-1]:.0f} bytes; searching "
                     "again with a larger mem_coeff")
    raise ValueError(
        f"memory_budget={memory_budget:.0f} bytes per device cannot be met by "
        f"recursive_programming: its leanest plan peaks at {min(peaks):.0f} bytes per device "
        f"(mem_coeff up to {_bigger(model.mem_coeff, _RETRIES):g}). Cut more dimensions in "
        "in_strategy/parameter_plan, use a larger mesh, try search_mode='dynamic_programming' "
        "(it bounds memory exactly), or raise the budget.")


def _bigger(mem_coeff: float, attempt: int) -> float:
    return max(mem_coeff, 0.1) * 4.0 ** attempt


def _with_mem_coeff(model: CostModel, mem_coeff: float) -> CostModel:
    return CostModel(model.mesh, model.profile, model.level, mem_coeff, model.recompute_heavy)


def _check_fixed(graph: OpGraph, mesh: MeshInfo, fixed_in: dict[int, Spec],
                 budget: float | None) -> None:
    if budget is None:
        return
    fixed = sum(graph.values[v].nbytes / s.shards(mesh) for v, s in fixed_in.items())
    if fixed > budget:
        raise ValueError(f"memory_budget={budget:.0f} bytes per device: the inputs whose "
                         f"strategy is fixed already take {fixed:.0f} bytes per device. Cut "
                         "them further, use a larger mesh, or raise the budget.")


def _note(lines: list[str], line: str) -> None:
    log.debug(line)
    lines.append(line)


def main_ops(graph: OpGraph) -> list[int]:
    """Indices of the ops SAPP decides itself: matmuls, convs, gathers, scatter-adds, and
    reductions whose operand is at least as big as the smallest of those ops' largest operands
    (every reduction when there are none)."""
    heavy = [op for op in graph.ops if op.name in _ALWAYS_MAIN]
    big = min((max(_nbytes(graph, v) for v in op.inputs) for op in heavy), default=0)
    return [op.index for op in graph.ops if not op.regions and (
        op.name in _ALWAYS_MAIN
        or (op.name in _REDUCTIONS and _nbytes(graph, op.inputs[0]) >= big))]


def _nbytes(graph: OpGraph, v: int | Lit) -> int:
    return 0 if isinstance(v, Lit) else graph.values[v].nbytes


def _slot(s: OpStrategy, slot: Slot) -> Spec:
    return s.ins[slot[1]] if slot[0] == 0 else s.outs[slot[1]]


def _usage(s: OpStrategy, axis: str) -> tuple:
    """How a strategy uses one mesh axis: the dim it cuts in each operand and result, and
    whether the op reduces over it."""
    return (tuple(sp.dim_of(axis) for sp in s.ins), tuple(sp.dim_of(axis) for sp in s.outs),
            any(axis in p for p in s.partial))


class _Sapp:
    """One search: links, the axis-by-axis decisions, then propagation."""

    def __init__(self, graph: OpGraph, model: CostModel, fixed_in, fixed_out,
                 classes: list[int], lines: list[str], ties: tuple = ()):
        self.g, self.model, self.fixed_in, self.fixed_out = graph, model, fixed_in, fixed_out
        self.mesh, self.lines = model.mesh, lines
        self.ties = [(v, pos) for v, pos in ties if v not in fixed_in and pos not in fixed_out
                     and isinstance(graph.outputs[pos], int)]
        self.mains = main_ops(graph)
        self.linker = Linker(graph, set(self.mains), fixed_in, fixed_out, self.ties,
                             min(model.mesh.sizes, default=2))
        self.users, self.out_pos = self.linker.users, self.linker.out_pos
        self.infos: dict[int, OpInfo] = {}
        self.scores_cache: dict = {}
        self.usage_cache: dict = {}
        self.shares = latency_shares(graph)
        self.classes = self._main_classes(classes)

    # -- setup ---------------------------------------------------------------------------
    def info(self, op: Op) -> OpInfo:
        if op.index not in self.infos:
            self.infos[op.index] = OpInfo.of(op, self.g)
        return self.infos[op.index]

    def share(self, op: Op) -> float:
        """graph.op_latency_share(op)."""
        return max((self.shares(v) for v in op.outputs), default=1.0)

    def _main_classes(self, classes: list[int]) -> list[int]:
        """op_classes, with main ops also told apart by their reductions' latency share; each
        main class remembers its members (first one first)."""
        out, number = list(classes), {}
        self.members: dict[int, list[int]] = {}
        for x in self.mains:
            key = (classes[x], self.share(self.g.ops[x]))
            c = number.setdefault(key, len(classes) + len(number))
            out[x] = c
            self.members.setdefault(c, []).append(x)
        return out

    def run(self) -> GraphPlan:
        g, model = self.g, self.model
        links = self._link_classes()
        self.cands, self.scores, self.alive = {}, {}, {}
        for c, xs in self.members.items():
            op = g.ops[xs[0]]
            cands, costs = model.options(self.info(op), self.share(op))
            key = id(cands)
            if key not in self.scores_cache:
                self.scores_cache[key] = [model.score(cost) for cost in costs]
            self.cands[c], self.scores[c] = cands, self.scores_cache[key]
            self.alive[c] = list(range(len(cands)))
        self.op_links, self.fixed_links, rev = {}, {}, {}
        for c in self.members:
            self.op_links[c] = [lk for lk in links[c] if lk.other >= 0]
            self.fixed_links[c] = [lk for lk in links[c] if lk.other < 0]
            for lk in self.op_links[c]:
                if self.classes[lk.other] != c:
                    rev.setdefault(self.classes[lk.other], []).append((c, lk))
        self.rev = rev
        order = sorted(self.members, key=lambda c: (-min(self.scores[c]), self.members[c][0]))
        _note(self.lines, f"recursive_programming: {len(self.mains)} main ops of "
                          f"{len(g.ops)} ({len(order)} classes), mesh {self.mesh.describe()}, "
                          f"mem_coeff={model.mem_coeff:g}; costs in modeled seconds")
        for k, axis in enumerate(self.mesh.names):
            self._axis(k, axis, order)
        fixed = {}
        for c, xs in self.members.items():
            best = self.cands[c][min(self.alive[c], key=self.scores[c].__getitem__)]
            fixed.update((x, best) for x in xs)
        fixed_in, fixed_out = dict(self.fixed_in), dict(self.fixed_out)
        for v, pos in self.ties:  # carried state: in and out in the spec its readers need
            spec = self._carried_spec(v, fixed)
            if spec is not None:
                fixed_in[v], fixed_out[pos] = fixed_in.get(v, spec), spec
        gp = propagate(g, model, fixed_in, fixed_out, fixed, self.classes, tuple(self.ties))
        self._runner_ups(gp)
        return gp

    def _carried_spec(self, v: int, fixed: dict[int, OpStrategy]) -> Spec | None:
        """The spec, among those the main ops reading carried input v need and the replicated
        one, that costs least to reshard into all of them (None: no main op reads it)."""
        needs = [fixed[op.index].ins[i].resolved() for op, i in self.users.get(v, [])
                 if op.index in fixed]
        if not needs:
            return None
        info, share = self.g.values[v], self.shares(v)
        options = list(dict.fromkeys(needs + [Spec.replicated(len(info.shape))]))
        return min(options, key=lambda src: sum(self.model.score(self.model.reshard(
            src, need, info.shape, info.dtype, share)) for need in needs))

    # -- links ---------------------------------------------------------------------------
    def _link_classes(self) -> dict[int, list[Link]]:
        """Each main class's links (from its first op). A class linked to itself is split in
        two, its ops alternating between them: a stack of identical layers may alternate
        (Megatron's column- and row-parallel matmuls)."""
        walk = self.linker.walk_all
        found = {c: walk(self.g.ops[xs[0]]) for c, xs in self.members.items()}
        for c in list(self.members):
            xs = self.members[c]
            if len(xs) > 1 and any(lk.other >= 0 and self.classes[lk.other] == c
                                   for lk in found[c]):
                new = max(self.members) + 1
                self.members[c], self.members[new] = xs[0::2], xs[1::2]
                for x in xs[1::2]:
                    self.classes[x] = new
                found[new] = walk(self.g.ops[xs[1]])
        return {c: self.linker.merged(self.g.ops[xs[0]], found[c], self.classes)
                for c, xs in self.members.items()}

    # -- one axis ------------------------------------------------------------------------
    def _axis(self, k: int, axis: str, order: list[int]) -> None:
        """Decide one mesh axis for every main class: the greedy pass, or one of two others
        when its links price cheaper over the whole graph: a greedy pass started from the
        first class's runner-up cut when that was close, and every class cutting as on the
        axis before."""
        self.k, self.axis = k, axis
        self.axes = frozenset(self.mesh.names[:k + 1])
        self.before = frozenset(self.mesh.names[:k])
        self.tab, self.base, self.vectors, self.geo = {}, {}, {}, {}
        self.link_shapes, self.shape_ids = {}, {}
        self.opts = {c: self._options(c) for c in order}
        self.start = {c: [sum(self._cost(lk, u[lk.slot[0]][lk.slot[1]], None)
                              for lk in self.fixed_links[c]) for u, _, _ in self.opts[c]]
                      for c in order}
        runs = [self._greedy(order)]
        second = runs[0][2]
        if second is not None:
            runs.append(self._greedy(order, {order[0]: second}))
        if k > 0:
            again = {c: self.prev[c] if any(u == self.prev[c] for u, _, _ in self.opts[c])
                     else u for c, u in runs[0][0].items()}
            runs.append((again, [], None))
        costs = [self._objective(chosen) for chosen, _, _ in runs]
        best = min(range(len(runs)), key=lambda n: (costs[n] * (1 + _TIE * n), n))
        chosen, lines, _ = runs[best]
        for line in runs[0][1] if not runs[best][1] else lines:
            _note(self.lines, line)
        if best:
            how = (f"cutting every main op as on axis {self.mesh.names[k - 1]}"
                   if not runs[best][1] else
                   f"starting from the runner-up cut of op {self.members[order[0]][0]}")
            _note(self.lines, f"axis {axis}: {how} costs {costs[best]:.6g} over the links, "
                              f"less than the greedy choices ({costs[0]:.6g}): taken instead")
        for c, u in chosen.items():
            usage = self.usage_cache[(id(self.cands[c]), axis)]
            self.alive[c] = [i for i in self.alive[c] if usage[i] == u]
        self.prev = chosen

    def _greedy(self, order: list[int], forced: dict | None = None):
        """One greedy pass: (cut per class, log lines, the first class's runner-up cut when
        it priced within _CLOSE of the best, else None)."""
        self.decided = dict.fromkeys(order)
        self.acc = {c: list(acc) for c, acc in self.start.items()}
        lines: list[str] = []
        second = None
        for c in order:
            rows = self._decide(c, (forced or {}).get(c), lines)
            if c == order[0]:
                mine = next(r[0] for r in rows if r[5] == self.decided[c])
                others = sorted(r for r in rows if r[5] != self.decided[c])
                if others and others[0][0] <= _CLOSE * mine:
                    second = others[0][5]
        return dict(self.decided), lines, second

    def _objective(self, chosen: dict[int, tuple]) -> float:
        """Op-costs plus resharding over every link, each class counted once per op, when
        every main class cuts this axis as `chosen` says."""
        total = 0.0
        for c, u in chosen.items():
            own = next(op_cost for v, op_cost, _ in self.opts[c] if v == u)
            own += sum(self._cost(lk, u[lk.slot[0]][lk.slot[1]], None)
                       for lk in self.fixed_links[c])
            own += sum(self._cost(lk, u[lk.slot[0]][lk.slot[1]],
                                  self._dy(lk, chosen[self.classes[lk.other]]))
                       for lk in self.op_links[c])
            total += own * len(self.members[c])
        return total

    def _options(self, c: int) -> list[tuple[tuple, float, int]]:
        """Each way the axis can cut class c given its earlier decisions:
        (usage, op-cost, candidate), in the order the op's rule lists them."""
        key = (id(self.cands[c]), self.axis)
        if key not in self.usage_cache:
            self.usage_cache[key] = [_usage(s, self.axis) for s in self.cands[c]]
        usage, scores = self.usage_cache[key], self.scores[c]
        best: dict[tuple, tuple[float, int]] = {}
        for i in self.alive[c]:
            u = usage[i]
            if u not in best or scores[i] < best[u][0]:
                best[u] = (scores[i], i)
        return [(u, op_cost, i) for u, (op_cost, i) in best.items()]

    def _decide(self, c: int, forced: tuple | None, lines: list[str]) -> list:
        """Price each cut of class c, choose (or take `forced`), and tell the neighbours."""
        rows, self.extra = [], {}
        for n, (u, op_cost, _) in enumerate(self.opts[c]):
            rest = self.acc[c][n] + self._lookahead(c, u)
            rows.append((op_cost + rest, _uncut(u), n, op_cost, rest, u))
        low = min(r[0] for r in rows)
        best = min((r for r in rows if r[0] <= low + _TIE * abs(low)), key=lambda r: r[1:3])
        u = forced or best[5]
        self.decided[c] = u
        self._log(c, rows, u, lines, forced is not None)
        for d, lk in self.rev.get(c, []):  # neighbours now see this decision
            if self.decided[d] is None:
                theirs = self._dy(lk, u)
                acc = self.acc[d]
                for n, (ud, _, _) in enumerate(self.opts[d]):
                    acc[n] += self._cost(lk, ud[lk.slot[0]][lk.slot[1]], theirs)
        return rows

    def _lookahead(self, c: int, u: tuple) -> float:
        """Links to undecided classes: the extra cost each pays for its best answer to cut u
        (a class's own members answer with u itself)."""
        total, pending = 0.0, {}
        for lk in self.op_links[c]:
            d = self.classes[lk.other]
            dx = u[lk.slot[0]][lk.slot[1]]
            if d == c:
                total += self._cost(lk, dx, self._dy(lk, u))
            elif self.decided[d] is None:
                pending.setdefault(d, []).append((lk, dx))
        for d, items in pending.items():
            key = (d, tuple((lk.n, dx) for lk, dx in items))
            if key not in self.extra:  # cuts of c that look alike to d share its answer
                own = [op_cost + acc
                       for (_, op_cost, _), acc in zip(self.opts[d], self.acc[d], strict=True)]
                answer = own
                for lk, dx in items:
                    answer = [a + b for a, b in zip(answer, self._answers(lk, dx, d),
                                                    strict=True)]
                self.extra[key] = min(answer) - min(own)
            total += self.extra[key]
        return total

    def _answers(self, lk: Link, dx: int | None, d: int) -> list[float]:
        """The link's cost for each cut of its other end's class d, the owner cutting dx."""
        key = (lk.n, dx)
        if key not in self.vectors:
            self.vectors[key] = [self._cost(lk, dx, self._dy(lk, ud)) for ud, _, _ in self.opts[d]]
        return self.vectors[key]

    @staticmethod
    def _dy(lk: Link, u: tuple) -> int | None:
        """Where the other end's cut u falls in the owner's dims (None: nowhere)."""
        e = u[lk.other_slot[0]][lk.other_slot[1]]
        return None if e is None else lk.inv.get(e)

    def _cost(self, lk: Link, dx: int | None, dy: int | None) -> float:
        """Resharding across a link over the axes decided so far, the owner cutting its dim dx
        and the other end the owner's dim dy on this axis."""
        key = (lk.n, dx, dy)
        hit = self.tab.get(key)
        if hit is None:
            shape = self.link_shapes.get(lk.n)
            if shape is None:
                mine = self._base(lk.owner, lk.slot)
                theirs = _project(lk.fixed, self.axes) if lk.other < 0 else \
                    mapped(self._base(lk.other, lk.other_slot), lk.dims)
                bases = (mine, theirs, lk.other < 0, lk.into, lk.nbytes)
                shape = self.link_shapes[lk.n] = self.shape_ids.setdefault(
                    bases, (len(self.shape_ids), bases))
            hit = self.tab[key] = self._geometry(shape, dx, dy) * lk.count
        return hit

    def _geometry(self, shape: tuple[int, tuple], dx: int | None, dy: int | None) -> float:
        """_cost for every link alike (same base specs, ends, direction and size: one
        `shape` number)."""
        key = (shape[0], dx, dy)
        if key not in self.geo:
            mine, theirs, fixed, into, nbytes = shape[1]
            mine = _add_axis(mine, dx, self.axis)
            theirs = theirs if fixed else _add_axis(theirs, dy, self.axis)
            src, dst = (theirs, mine) if into else (mine, theirs)
            self.geo[key] = 0.0 if src == dst else self._reshard(src, dst, nbytes)
        return self.geo[key]

    def _reshard(self, src: Spec, dst: Spec, nbytes: int) -> float:
        key = (src, dst, nbytes)
        if key not in self.scores_cache:
            self.scores_cache[key] = self.model.score(self.model.collectives_cost(
                comm_reshard(src, dst, nbytes, self.mesh)))
        return self.scores_cache[key]

    def _base(self, x: int, slot: Slot) -> Spec:
        """A main op's slot spec over the axes decided before this one (every candidate
        left to its class agrees on those)."""
        c = self.classes[x]
        key = (c, slot)
        if key not in self.base:
            self.base[key] = _project(_slot(self.cands[c][self.alive[c][0]], slot), self.before)
        return self.base[key]

    def _log(self, c: int, rows: list, chosen: tuple, lines: list[str], forced: bool) -> None:
        if len(rows) < 2:
            return
        xs = self.members[c]
        op = self.g.ops[xs[0]]
        info = self.info(op)
        like = f" (and {len(xs) - 1} like it)" if len(xs) > 1 else ""
        head = f"op {op.index} {op.name}{like}, axis {self.axis}: "
        lines.extend(head + _price_line(info, u, op_cost, rest, total)
                     for total, _, _, op_cost, rest, u in rows)
        lines.append(head + _choose_line(info, chosen) + (" (to try the runner-up)" if forced
                                                          else ""))

    # -- report --------------------------------------------------------------------------
    def _runner_ups(self, gp: GraphPlan) -> None:
        """Main ops' choices as propagate() reports them: the chosen and the runner-up
        strategy, each priced as its own cost plus resharding to and from the plan around the
        class's first op."""
        made: dict = {}
        for xs in self.members.values():
            op, chosen = self.g.ops[xs[0]], gp.choices[xs[0]].strategy
            cands, costs = self.model.options(self.info(op), self.share(op))
            ins = [gp.specs[v] if isinstance(v, int) else None for v in op.inputs]
            needs = [self._needs(gp, v) for v in op.outputs]
            key = (id(cands), chosen, tuple(ins), tuple(map(tuple, needs)))
            if key not in made:  # a signature in one context is priced once
                priced = sorted((p, i) for i, p in enumerate(self._local(op, cands, ins, needs)))
                mine = cands.index(chosen)
                score = next(p for p, i in priced if i == mine)
                runner = next(((p, i) for p, i in priced if i != mine), None)
                made[key] = Choice(chosen, costs[mine], score,
                                   cands[runner[1]] if runner else None,
                                   runner[0] if runner else None, len(cands), True)
            for x in xs:
                gp.choices[x] = made[key]

    def _needs(self, gp: GraphPlan, v: int) -> list[Spec]:
        """What v's consumers and fixed outputs need of it in the plan."""
        needs = [gp.choices[u.index].strategy.ins[i] for u, i in self.users.get(v, [])]
        return needs + [self.fixed_out[p] for p in self.out_pos.get(v, []) if p in self.fixed_out]

    def _local(self, op: Op, cands: list[OpStrategy], ins: list[Spec | None],
               needs: list[list[Spec]]) -> list[float]:
        """Each candidate's own score plus resharding from its operands' specs `ins` and into
        what its results' consumers need (`needs`)."""
        total = list(self.scores_cache[id(cands)])
        for i, (v, spec) in enumerate(zip(op.inputs, ins, strict=True)):
            if spec is not None:
                self._add_edges(total, [s.ins[i] for s in cands], v, [spec], True)
        for j, v in enumerate(op.outputs):
            self._add_edges(total, [s.outs[j] for s in cands], v, needs[j], False)
        return total

    def _add_edges(self, total: list[float], specs: list[Spec], v: int, others: list[Spec],
                   into: bool) -> None:
        """Add to each candidate's total the resharding between its spec of value v and
        `others` (from them into it, or from it into them)."""
        info, share, seen = self.g.values[v], self.shares(v), {}
        for n, spec in enumerate(specs):
            if spec not in seen:
                seen[spec] = sum(self.model.score(self.model.reshard(
                    other if into else spec, spec if into else other, info.shape, info.dtype,
                    share)) for other in others)
            total[n] += seen[spec]


def _project(spec: Spec, axes: frozenset) -> Spec:
    """The spec over some axes only (no partial: ops resolve their own)."""
    return Spec(tuple(tuple(a for a in d if a in axes) for d in spec.dims))


def _add_axis(spec: Spec, dim: int | None, axis: str) -> Spec:
    """spec with `axis` (later in mesh order than any it holds) also cutting `dim`."""
    if dim is None:
        return spec
    return Spec(tuple(d + (axis,) if i == dim else d for i, d in enumerate(spec.dims)))


def _uncut(u: tuple) -> bool:
    ins, outs, partial = u
    return not partial and all(d is None for d in ins + outs)


def _cut_name(info: OpInfo, u: tuple) -> str:
    """MindSpore's names for a matmul's cuts (I, J, K, batch); a dimension for other ops."""
    ins, outs, partial = u
    if info.primitive.name == "dot_general":
        (lc, _), (lb, _) = info.params["dimension_numbers"]
        p, q = ins[0], ins[1]
        lhs_free = [d for d in range(len(info.in_shapes[0])) if d not in lc and d not in lb]
        if p is not None and p in lb:
            name = "the batch axis" + (f" (lhs dim {p})" if len(lb) > 1 else "")
        elif p is not None and p in lc:
            name = "the K-axis" + (f" (lhs dim {p})" if len(lc) > 1 else "")
        elif p is not None:
            name = "the I-axis" + (f" (lhs dim {p})" if len(lhs_free) > 1 else "")
        else:
            name = f"the J-axis (rhs dim {q})" if len(info.in_shapes[1]) - len(lc) - len(lb) > 1 \
                else "the J-axis"
    else:
        i, d = next(((i, d) for i, d in enumerate(ins) if d is not None), (None, None))
        name = f"dim {d} of operand {i}" if i is not None else \
            f"dim {next(d for d in outs if d is not None)} of the result"
    if partial:
        name += " (all-reduce)" if all(d is None for d in outs) else \
            f" (reduce-scatter onto result dim {next(d for d in outs if d is not None)})"
    return name


def _price_line(info: OpInfo, u: tuple, op_cost: float, rest: float, total: float) -> str:
    what = "If do NOT cut the axis" if _uncut(u) else f"If {_cut_name(info, u)} is cut"
    return (f"{what}, the op-cost is {op_cost:.6g}, the rest-cost is {rest:.6g}, and the "
            f"total cost is {total:.6g}")


def _choose_line(info: OpInfo, u: tuple) -> str:
    return "Choose NOT to cut" if _uncut(u) else f"Choose to cut {_cut_name(info, u)}"
