"""Links between main ops: which dimension of one main op's operand or result is which dimension
of another's, through the ops between them.

Before: an OpGraph, the set of main ops (recursive_programming decides them), the specs the
user fixed, carried-state ties. After: for a main op, its `Link`s. A walk leaves each operand
up to its producers and each result down to its consumers, through ops that are not main
(elementwise ops, reshapes, transposes, broadcasts, ...; what dimension becomes which is read
off each op's own rule on a one-axis mesh), and stops at main ops, fixed specs and after
`HOPS` ops that combine arrays (ops on one array, like an optimizer's scalings, pass free).
Early on it may turn once: to the other consumers of a free input (siblings) or to the other
operands of an op (values made by two main ops and combined). A carried output leads on to the
input it replaces (the next step reads it), and back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxpar.cost.model import _signature
from jaxpar.ir.graph import Op, OpGraph
from jaxpar.rules.registry import OpInfo, candidates
from jaxpar.spec import MeshInfo, Spec

HOPS = 8  # array-combining ops a link may pass through
TURN = 2  # ... of which at most this many before it turns (siblings, co-operands)
Slot = tuple[int, int]  # (0: operand / 1: result, position)


@dataclass(frozen=True, eq=False)
class Link:
    """A main op's operand or result joined to another main op's (or to a fixed spec)."""

    n: int                          # the link's number in its search
    owner: int                      # the main op it belongs to
    slot: Slot
    other: int                      # the other main op, -1 for a fixed spec
    other_slot: Slot
    dims: tuple[int | None, ...]    # owner's slot dims -> the other end's dims
    into: bool                      # data flows from the other end into the owner
    nbytes: int                     # bytes of the smaller of the two ends' values
    fixed: Spec | None = None       # a fixed end's spec, in the owner's slot dims
    inv: dict = field(default_factory=dict)  # the other end's dims -> owner's slot dims
    count: int = 1                  # links alike (to ops of one class) it stands for


class Linker:
    """Walks the links of main ops in one graph (caching what each op maps where)."""

    def __init__(self, graph: OpGraph, mains: set[int], fixed_in: dict[int, Spec],
                 fixed_out: dict[int, Spec], ties: list[tuple[int, int]], axis_size: int):
        self.g, self.is_main, self.fixed_in, self.fixed_out = graph, mains, fixed_in, fixed_out
        self.axis_size = axis_size
        self.producer = {v: (op, j) for op in graph.ops for j, v in enumerate(op.outputs)}
        self.users = graph.users()
        self.out_pos: dict[int, list[int]] = {}
        for pos, v in enumerate(graph.outputs):
            if isinstance(v, int):
                self.out_pos.setdefault(v, []).append(pos)
        self.tied_in: dict[int, list[int]] = {}   # carried input -> outputs that replace it
        self.tied_out: dict[int, list[int]] = {}  # and back
        for v, pos in ties:
            self.tied_in.setdefault(v, []).append(graph.outputs[pos])
            self.tied_out.setdefault(graph.outputs[pos], []).append(v)
        self.maps: dict[int, dict] = {}
        self.maps_by_sig: dict = {}
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
            mesh = MeshInfo(("_",), (self.axis_size,))
            maps = {}
            for s in candidates(info, mesh):
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

    def walk_all(self, op: Op) -> list[Link]:
        found: dict = {}
        for k, v in enumerate(op.inputs):
            if isinstance(v, int):
                self._walk(op, (0, k), v, "up", found)
        for k, v in enumerate(op.outputs):
            self._walk(op, (1, k), v, "down", found)
        return list(found.values())

    def merged(self, op: Op, found: list[Link], classes: list[int]) -> list[Link]:
        """op's links, numbered; links alike to ops of one class become one, counted."""
        merged: dict = {}
        for lk in found:
            key = (classes[lk.other] if lk.other >= 0 else -1, lk.slot, lk.other_slot,
                   lk.dims, lk.into, lk.nbytes, lk.fixed)
            merged.setdefault(key, []).append(lk)
        out = []
        for alike in merged.values():
            lk = alike[0]
            out.append(Link(self.count, op.index, lk.slot, lk.other, lk.other_slot,
                             lk.dims, lk.into, lk.nbytes, lk.fixed, lk.inv, len(alike)))
            self.count += 1
        return out

    def _walk(self, start: Op, slot: Slot, v0: int, phase0: str, links: dict) -> None:
        """Links from one slot: up to producers, down to consumers, and one early turn (to the
        other consumers of a value on the way up, or the other operands of an op on the way
        down: siblings and co-operands)."""
        stack = [(v0, tuple(range(len(self.g.values[v0].shape))), phase0, start.index, 0)]
        seen = set()
        size = self.g.values[v0].nbytes

        def add(other, other_slot, dims, into, end: int, fixed=None):
            key = (slot, other, other_slot, dims, into, fixed)
            if other != start.index and key not in links:
                inv = {d: t for t, d in enumerate(dims) if d is not None}
                links[key] = Link(-1, start.index, slot, other, other_slot, dims, into,
                                   min(size, self.g.values[end].nbytes), fixed, inv)

        while stack:
            v, dims, phase, prev, hops = stack.pop()
            if (v, dims, phase) in seen or all(d is None for d in dims):
                continue
            seen.add((v, dims, phase))
            if phase in ("up", "down-up"):
                self._step_up(v, dims, phase, prev, hops, stack, add)
            else:
                self._step_down(v, dims, phase, prev, hops, stack, add)

    def _step_up(self, v, dims, phase, prev, hops, stack, add) -> None:
        if v in self.fixed_in:
            add(-1, (0, 0), dims, True, v, mapped(self.fixed_in[v], dims))
            return
        if phase == "up" and hops <= TURN and v not in self.producer:
            # a free input's other consumers share it (siblings); a value that some op makes
            # is priced through its producer instead
            stack.append((v, dims, "up-down", prev, hops))
        if v not in self.producer:  # a carried input: up from the update that replaces it
            for w in self.tied_in.get(v, []) if hops < HOPS else []:
                stack.append((w, dims, phase, -1, hops + 1))
            return
        op, j = self.producer[v]
        if op.index in self.is_main:
            add(op.index, (1, j), dims, True, v)
        elif not op.regions and hops < HOPS:
            maps = self.dim_maps(op)
            for i, u in enumerate(op.inputs):
                if isinstance(u, int):
                    inv = {q: p for p, q in maps.get((i, j), {}).items()}
                    stack.append((u, tuple(inv.get(d) for d in dims), phase, op.index,
                                  hops + self._hop(op)))

    def _step_down(self, v, dims, phase, prev, hops, stack, add) -> None:
        if phase == "down":
            for pos in self.out_pos.get(v, []):
                if pos in self.fixed_out:
                    add(-1, (1, 0), dims, False, v, mapped(self.fixed_out[pos], dims))
            for u in self.tied_out.get(v, []) if hops < HOPS else []:  # the next step reads it
                stack.append((u, dims, phase, -1, hops + 1))
        for op, i in self.users.get(v, []):
            if op.index == prev:
                continue
            if op.index in self.is_main:
                add(op.index, (0, i), dims, phase != "down", v)
                continue
            if op.regions or hops >= HOPS:
                continue
            maps = self.dim_maps(op)
            for j, w in enumerate(op.outputs):
                fwd = maps.get((i, j), {})
                out_dims = tuple(fwd.get(d) for d in dims)
                stack.append((w, out_dims, phase, op.index, hops + self._hop(op)))
                if phase != "down" or hops >= TURN:
                    continue
                for i2, u in enumerate(op.inputs):  # the op's other operands: co-producers
                    if i2 != i and isinstance(u, int):
                        inv = {q: p for p, q in maps.get((i2, j), {}).items()}
                        stack.append((u, tuple(inv.get(d) for d in out_dims), "down-up",
                                      op.index, hops + 1))

    def _hop(self, op: Op) -> int:
        """What passing through op costs a walk: nothing for an op on one array (scaling,
        casts, sqrt: an optimizer's long elementwise chains), else one hop."""
        arrays = sum(1 for v in op.inputs if isinstance(v, int) and self.g.values[v].shape)
        return int(arrays > 1)


def mapped(spec: Spec, dims: tuple[int | None, ...]) -> Spec:
    """A spec of the other end, read in the owner's slot dims."""
    return Spec(tuple(spec.dims[d] if d is not None else () for d in dims))
