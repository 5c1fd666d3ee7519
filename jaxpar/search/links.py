"""Links between the units recursive_programming decides: which dimension of one unit's operand
or result is which dimension of another's, through the ops between them.

Before: an OpGraph, its units (the main ops recursive_programming decides, and the carried
state of a training step, one unit per input/output pair), the specs the user fixed. After: for
a unit, its `Link`s. A walk leaves each operand up to its producers and each result down to its
consumers, through ops that are not main (elementwise ops, reshapes, transposes, broadcasts,
...; what dimension becomes which is read off each op's own rule on a one-axis mesh), and stops
at main ops, carried state, fixed specs and after `HOPS` ops that combine arrays (ops on one
array, like an optimizer's scalings, pass free). Early on it may turn once: to the other
consumers of a free input (siblings) or to the other operands of an op (values made by two
main ops and combined). A carried unit's operand is the output that replaces its input (walked
up to the update that makes it), its result the input (walked down to its readers). Each link
remembers the ops it passed (`path`): they run cut on an axis when either end cuts what the
link carries, and uncut otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jax import lax

from jaxpar.cost.model import _signature
from jaxpar.ir.graph import Op
from jaxpar.rules.registry import OpInfo, candidates
from jaxpar.search.propagation import GraphIndex, handed_back
from jaxpar.spec import MeshInfo, Spec

HOPS = 8  # array-combining ops a link may pass through
TURN = 2  # ... of which at most this many before it turns (siblings, co-operands)
Slot = tuple[int, int]  # (0: operand / 1: result, position)


@dataclass(frozen=True, eq=False)
class Link:
    """A unit's operand or result joined to another unit's (or to a fixed spec)."""

    n: int                          # the link's number in its search
    owner: int                      # the unit it belongs to
    slot: Slot
    other: int                      # the other unit, -1 for a fixed spec
    other_slot: Slot
    dims: tuple[int | None, ...]    # owner's slot dims -> the other end's dims
    into: bool                      # data flows from the other end into the owner
    nbytes: int                     # bytes of the smaller of the two ends' values
    fixed: Spec | None = None       # a fixed end's spec, in the owner's slot dims
    inv: dict = field(default_factory=dict)  # the other end's dims -> owner's slot dims
    count: int = 1                  # links alike (to units of one class) it stands for
    path: tuple[int, ...] = ()      # the ops between the two ends
    start: int = -1                 # the value the owner's walk started from


class Linker:
    """Walks the links of units in one graph (caching what each op maps where).

    Units are numbered: main ops by op index, carried state from len(graph.ops) on;
    `carried_in`/`carried_out` map a carried input / the output replacing it to its unit.
    """

    def __init__(self, index: GraphIndex, mains: set[int], fixed_in: dict[int, Spec],
                 fixed_out: dict[int, Spec], carried_in: dict[int, int],
                 carried_out: dict[int, int], axis_size: int):
        graph = index.g
        self.g, self.is_main, self.fixed_in, self.fixed_out = graph, mains, fixed_in, fixed_out
        self.carried_in, self.carried_out = carried_in, carried_out
        self.carried_starts: dict[int, list[tuple[Slot, int, str]]] = {}
        for v, u in carried_out.items():
            self.carried_starts.setdefault(u, []).append(((0, 0), v, "up"))
        for v, u in carried_in.items():
            self.carried_starts.setdefault(u, []).append(((1, 0), v, "down"))
        self.axis_size = axis_size
        self.index, self.nbytes = index, index.nbytes
        self.out_pos: dict[int, list[int]] = {}
        for pos, v in enumerate(graph.outputs):
            if isinstance(v, int):
                self.out_pos.setdefault(v, []).append(pos)
        self.maps: dict[int, dict] = {}
        self.maps_by_sig: dict = {}
        self.arrays: dict[int, int] = {}
        self.line = MeshInfo(("_",), (axis_size,))  # the one-axis mesh dims are read on
        self.count = 0

    def dim_maps(self, op: Op) -> dict[tuple[int, int], dict[int, int]]:
        """For operand i and result j of a non-main op: which result dim each operand dim
        becomes, read off the op's rule on a one-axis mesh."""
        if op.index in self.maps:
            return self.maps[op.index]
        info = OpInfo.of(op, self.g)
        key = _signature(info)
        maps = self.maps_by_sig.get(key) if key is not None else None
        if maps is None:
            maps = {}
            for s in candidates(info, self.line):
                if any(s.partial):
                    continue
                ins, outs = [sp.dim_of("_") for sp in s.ins], [sp.dim_of("_") for sp in s.outs]
                for i, p in enumerate(ins):
                    for j, q in enumerate(outs):
                        if p is not None and q is not None:
                            maps.setdefault((i, j), {}).setdefault(p, q)
            if key is not None:
                self.maps_by_sig[key] = maps
        self.maps[op.index] = maps
        return maps

    def walk_all(self, unit: int) -> list[Link]:
        """Every link of one unit, unnumbered."""
        found: dict = {}
        for slot, v, phase in self._starts(unit):
            self._walk(unit, slot, v, phase, found)
        return list(found.values())

    def _starts(self, unit: int) -> list[tuple[Slot, int, str]]:
        if unit >= len(self.g.ops):  # carried state: in from its update, out to its readers
            return self.carried_starts.get(unit, [])
        op = self.g.ops[unit]
        return [((0, k), v, "up") for k, v in enumerate(op.inputs) if isinstance(v, int)] + \
            [((1, k), v, "down") for k, v in enumerate(op.outputs)]

    def merged(self, unit: int, found: list[Link], classes: list[int]) -> list[Link]:
        """A unit's links, numbered; links alike to units of one class become one, counted."""
        merged: dict = {}
        for lk in found:
            key = (classes[lk.other] if lk.other >= 0 else -1, lk.slot, lk.other_slot,
                   lk.dims, lk.into, lk.nbytes, lk.fixed)
            merged.setdefault(key, []).append(lk)
        out = []
        for alike in merged.values():
            lk = alike[0]
            out.append(Link(self.count, unit, lk.slot, lk.other, lk.other_slot, lk.dims,
                            lk.into, lk.nbytes, lk.fixed, lk.inv, len(alike), lk.path,
                            lk.start))
            self.count += 1
        return out

    def _walk(self, unit: int, slot: Slot, v0: int, phase0: str, links: dict) -> None:
        """Links from one slot: up to producers, down to consumers, and one early turn (to the
        other consumers of a value on the way up, or the other operands of an op on the way
        down: siblings and co-operands)."""
        # A carried unit never turns: the op combining its input with the update is its own.
        hops = TURN + 1 if unit >= len(self.g.ops) else 0
        stack = [(v0, tuple(range(len(self.g.values[v0].shape))), phase0, unit, hops, ())]
        seen = set()
        size = self.nbytes(v0)

        def add(other, other_slot, dims, into, end: int, path, fixed=None):
            key = (slot, v0, other, other_slot, dims, into, fixed)  # v0: a group's member
            if other != unit and key not in links:
                inv = {d: t for t, d in enumerate(dims) if d is not None}
                links[key] = Link(-1, unit, slot, other, other_slot, dims, into,
                                  min(size, self.nbytes(end)), fixed, inv, 1, path, v0)

        carried = unit >= len(self.g.ops)
        while stack:
            state = stack.pop()
            v, dims, phase = state[:3]
            if (v, dims, phase) in seen or all(d is None for d in dims):
                continue
            seen.add((v, dims, phase))
            if phase in ("up", "down-up"):
                self._step_up(state, stack, add, carried)
            else:
                self._step_down(state, stack, add, carried)

    def _step_up(self, state, stack, add, carried: bool) -> None:
        v, dims, phase, prev, hops, path = state
        if v in self.fixed_in:
            add(-1, (0, 0), dims, True, v, path, mapped(self.fixed_in[v], dims))
            return
        if v in self.carried_in:  # carried state: the unit holding it (see _step_down)
            if not carried:
                add(self.carried_in[v], (1, 0), dims, True, v, path)
            return
        x = self.index.producer.get(v)
        if x is None:
            if phase == "up" and hops <= TURN:  # a free input's other consumers share it
                stack.append((v, dims, "up-down", prev, hops, path))
            return
        op, j = self.g.ops[x], self.index.port[v]
        if op.index in self.is_main:
            add(op.index, (1, j), dims, True, v, path)
        elif not op.regions and hops < HOPS:
            maps = self.dim_maps(op)
            step = hops + self._hop(op)
            for i, u in enumerate(op.inputs):
                if isinstance(u, int):
                    inv = {q: p for p, q in maps.get((i, j), {}).items()}
                    stack.append((u, tuple(inv.get(d) for d in dims), phase, op.index, step,
                                  path + (op.index,)))

    def _step_down(self, state, stack, add, carried: bool) -> None:
        v, dims, phase, prev, hops, path = state
        if phase == "down":
            for pos in self.out_pos.get(v, []):
                if pos in self.fixed_out:
                    add(-1, (1, 0), dims, False, v, path, mapped(self.fixed_out[pos], dims))
        if v in self.carried_out and not carried:
            # Carried units are linked to main ops only: the states one update combines
            # (parameter, moments) meet in one value, resharded once, not once per pair.
            add(self.carried_out[v], (0, 0), dims, False, v, path)
        ops = self.g.ops
        for x, i in self.index.readers.get(v, ()):
            if x == prev:
                continue
            op = ops[x]
            if op.index in self.is_main:
                add(op.index, (0, i), dims, phase != "down", v, path)
                continue
            if op.regions or hops >= HOPS:
                continue
            maps = self.dim_maps(op)
            here = path + (op.index,)
            for j, w in enumerate(op.outputs):
                fwd = maps.get((i, j), {})
                out_dims = tuple(fwd.get(d) for d in dims)
                stack.append((w, out_dims, phase, op.index, hops + self._hop(op), here))
                if phase != "down" or hops >= TURN:
                    continue
                for i2, u in enumerate(op.inputs):  # the op's other operands: co-producers
                    if i2 != i and isinstance(u, int):
                        inv = {q: p for p, q in maps.get((i2, j), {}).items()}
                        stack.append((u, tuple(inv.get(d) for d in out_dims), "down-up",
                                      op.index, hops + 1, here))

    def _hop(self, op: Op) -> int:
        """What passing through op costs a walk: nothing for an op on one array (scaling,
        casts, sqrt: an optimizer's long elementwise chains), else one hop."""
        hit = self.arrays.get(op.index)
        if hit is None:
            arrays = sum(1 for v in op.inputs if isinstance(v, int) and self.g.values[v].shape)
            hit = self.arrays[op.index] = int(arrays > 1)
        return hit


def mapped(spec: Spec, dims: tuple[int | None, ...]) -> Spec:
    """A spec of the other end, read in the owner's slot dims."""
    return Spec(tuple(spec.dims[d] if d is not None else () for d in dims))


class Units:
    """The units recursive_programming decides, and what it asks of them.

    Main ops are units by op index. Carried state (a training step's inputs that come back as
    outputs, `ties`) is grouped by update: a parameter and its optimizer moments, whose
    outputs one update makes together, are one unit numbered from len(graph.ops), with one
    spec; a tie to an input the user fixed just fixes the output (`fixed_out`).
    """

    def __init__(self, index: GraphIndex, mains: list[int], fixed_in: dict[int, Spec],
                 fixed_out: dict[int, Spec], ties: tuple[tuple[int, int], ...],
                 axis_size: int):
        self.g, self.index, self.mains = index.g, index, set(mains)
        self.fixed_out = handed_back(index.g, fixed_in, fixed_out, ties)
        self.carried = self._carried(ties)
        self.groups = self._groups()
        n = len(self.g.ops)
        self.members_in = {self.carried[k][0]: n + gi for gi, ks in enumerate(self.groups)
                           for k in ks}
        members_out = {self.carried[k][2]: n + gi for gi, ks in enumerate(self.groups)
                       for k in ks}
        self.linker = Linker(index, self.mains, fixed_in, self.fixed_out, self.members_in,
                             members_out, axis_size)
        self.infos: dict[int, OpInfo] = {}

    def _carried(self, ties) -> list[tuple[int, int, int]]:
        """(input, output position, output value) of each carried state that is a unit: an
        output some op makes, replacing a free input (those tied to a fixed one are in
        fixed_out)."""
        out, seen = [], set()
        for v, pos in ties:
            w = self.g.outputs[pos]
            if pos in self.fixed_out or not isinstance(w, int):
                continue
            if w in self.index.producer and w not in seen and w != v:
                seen.add(w)
                out.append((v, pos, w))
        return out

    def _groups(self) -> list[list[int]]:
        """Carried states updated together: each output's update, walked up through ops on
        arrays of its shape (main ops excluded), reaches the others' inputs or outputs."""
        producer, ops, values = self.index.producer, self.g.ops, self.g.values
        owner = {}
        for k, (v, _, w) in enumerate(self.carried):
            owner[v] = owner[w] = k
        parent = list(range(len(self.carried)))

        def root(k: int) -> int:
            while parent[k] != k:
                parent[k] = parent[parent[k]]
                k = parent[k]
            return k
        for k, (_, _, w) in enumerate(self.carried):
            shape, stack, seen = values[w].shape, [w], {w}
            while stack:
                u = stack.pop()
                if u in owner:
                    parent[root(owner[u])] = root(k)
                x = producer.get(u)
                if x is None or x in self.mains or ops[x].regions:
                    continue
                for a in ops[x].inputs:
                    if isinstance(a, int) and a not in seen and values[a].shape == shape:
                        seen.add(a)
                        stack.append(a)
        groups: dict[int, list[int]] = {}
        for k in range(len(self.carried)):
            groups.setdefault(root(k), []).append(k)
        return list(groups.values())

    def is_carried(self, x: int) -> bool:
        return x >= len(self.g.ops)

    def state(self, x: int) -> list[tuple[int, int, int]]:
        """Carried unit x's (input, output position, output value) triples."""
        return [self.carried[k] for k in self.groups[x - len(self.g.ops)]]

    def name(self, x: int) -> str:
        if self.is_carried(x):
            return "carried " + ", ".join(self.g.values[v].name for v, _, _ in self.state(x))
        return f"op {x} {self.g.ops[x].name}"

    def info(self, x: int) -> OpInfo:
        """A unit's OpInfo; carried state reads as a copy of its (first) input."""
        if x not in self.infos:
            if self.is_carried(x):
                info = self.g.values[self.state(x)[0][0]]
                self.infos[x] = OpInfo(lax.copy_p, {}, (info.shape,), (info.shape,),
                                       (info.dtype,), (info.dtype,))
            else:
                self.infos[x] = OpInfo.of(self.g.ops[x], self.g)
        return self.infos[x]

    def main_readers(self, v: int) -> set[int]:
        """Main ops that read value v, directly or through a few ops that are not main."""
        ops, seen, out = self.g.ops, set(), set()
        stack = [(v, 0)]
        while stack:
            u, depth = stack.pop()
            for y, _ in self.index.readers.get(u, ()):
                if y in self.mains:
                    out.add(y)
                elif depth < 4 and y not in seen and not ops[y].regions:
                    seen.add(y)
                    stack.extend((w, depth + 1) for w in ops[y].outputs)
        return out

    def update_region(self, x: int) -> list[int]:
        """The ops that make carried unit x's outputs from the gradients (walked up from
        them through ops on arrays no larger than the state, as far as the main ops making
        the gradients; not the scalars every update shares, a step count)."""
        ops, producer, size = self.g.ops, self.index.producer, self.index.nbytes
        outs = [w for _, _, w in self.state(x)]
        most = max(size(w) for w in outs)
        region, stack = set(), list(outs)
        while stack:
            y = producer.get(stack.pop())
            if y is None or y in region or ops[y].regions:
                continue
            region.add(y)
            if y in self.mains:
                continue
            stack.extend(v for v in ops[y].inputs if isinstance(v, int)
                         and self.g.values[v].shape and size(v) <= most)
        return sorted(region)
