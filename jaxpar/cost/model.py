"""Per-op costs under one strategy, per-edge resharding costs, and the objective of each level.

Compute time of an op is its flop time at the profile's peak (with a profile of
`compute_time: roofline`, the larger of that and its memory time: operand and result bytes over
HBM bandwidth; see cost.hardware), divided by the number of pieces the strategy cuts its work
into.
The objective (`score`) follows MindSpore's `level`:
  0: maximise the compute/communication ratio: compute + 2 x communication (exposed
     communication is what lowers the ratio, so it weighs double);
  1: minimise memory: time plus the memory term below at weight 1;
  2: maximise speed: compute + communication.
`mem_coeff` (MindSpore's, default 0.1) adds mem_coeff x the memory term at every level. The
memory term prices the per-device bytes each op reads and writes as the time to send them once
over the mesh's slowest link: holding a replica of a weight costs about as much as moving it.
A larger mem_coeff favours plans that cut weights (model parallel), a smaller one data parallel;
0 leaves time alone.

`options(info)` lists an op's candidate strategies that fit its shapes, with their costs, once per
op signature (primitive, params, shapes, dtypes): the layers of a deep model repeat the same ops,
so a search prices each distinct op once. Ops whose rules give the same candidates on the same
shapes (an add and a mul) share the work of listing them, and their costs when their flops and
dtypes agree too; each signature still gets a candidate list of its own (callers key on it).
With `recompute_heavy=False` (the automatic searches) heavy ops (matmuls, conv) keep only
the candidates that cut their work into the most pieces the shapes allow, Alpa's rule against
computing a matmul redundantly: without it a model of toy size is cheapest fully replicated,
since its compute costs less than one collective's latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from jaxpar.cost.comm import (
    Collective,
    collective_line,
    collective_time,
    of_splat,
    reshard,
    splits_on_idle,
)
from jaxpar.cost.hardware import HardwareProfile
from jaxpar.cost.manual import body_work, misordered, on_mesh
from jaxpar.ir.graph import itemsize
from jaxpar.rules.registry import OpInfo, candidates
from jaxpar.spec import Axes, MeshInfo, OpStrategy, Spec, spec_classes

_CALLBACKS = frozenset({"pure_callback", "io_callback"})  # run on one device (_callback)
_LEVEL_COMM_WEIGHT = {0: 2.0, 1: 1.0, 2: 1.0}
_LEVEL_MEM_WEIGHT = {0: 0.0, 1: 1.0, 2: 0.0}
COMBINED_KINDS = frozenset({"all-reduce", "reduce-scatter"})  # what XLA's combiners merge
HEAVY_OPS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})
_LINE_BYTES = 2.0 ** 30  # reshard_line's slope is measured over this many bytes


@dataclass(frozen=True)
class OpCost:
    """Modeled cost of one op (or one edge) per device."""

    compute_s: float = 0.0
    comm_s: float = 0.0
    comm_bytes: float = 0.0
    memory_bytes: float = 0.0
    collectives: tuple[Collective, ...] = ()

    def __add__(self, other: OpCost) -> OpCost:
        return OpCost(self.compute_s + other.compute_s, self.comm_s + other.comm_s,
                      self.comm_bytes + other.comm_bytes, self.memory_bytes + other.memory_bytes,
                      self.collectives + other.collectives)

    def scaled(self, k: float) -> OpCost:
        return OpCost(self.compute_s * k, self.comm_s * k, self.comm_bytes * k,
                      self.memory_bytes, tuple(Collective(c.kind, c.axes, c.bytes * k, c.count * k)
                                               for c in self.collectives))


def nbytes(shape: tuple[int, ...], dtype) -> float:
    return float(math.prod(shape)) * itemsize(dtype)


def flops(info: OpInfo) -> float:
    """Flop count of one op, unsharded."""
    name = info.primitive.name
    out = float(sum(math.prod(s) for s in info.out_shapes))
    if name == "dot_general":
        (lc, _), _ = info.params["dimension_numbers"]
        return 2.0 * out * math.prod(info.in_shapes[0][d] for d in lc)
    if name == "ragged_dot_general":  # each row times its own group's matrix
        (lc, _), _ = info.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
        return 2.0 * out * math.prod(info.in_shapes[0][d] for d in lc)
    if name == "conv_general_dilated":
        rhs = info.in_shapes[1]
        spec = info.params["dimension_numbers"].rhs_spec
        kernel = math.prod(rhs[d] for d in spec[1:])  # in-features x spatial window
        return 2.0 * out * kernel
    return out


class CostModel:
    """Prices strategies and reshardings on one mesh and hardware profile."""

    def __init__(self, mesh: MeshInfo, profile: HardwareProfile, level: int = 0,
                 mem_coeff: float = 0.0, recompute_heavy: bool = True,
                 search_bodies: bool = False, lean_bodies: bool = False,
                 fp32_communication: bool = False):
        self.mesh, self.profile, self.level, self.mem_coeff = mesh, profile, level, mem_coeff
        self.recompute_heavy = recompute_heavy
        # bf16/f16 partial sums reduced in float32 (jaxpar.shard(fp32_communication=True)):
        # an op's own reductions move float32 bytes.
        self.fp32_communication = fp32_communication
        # Loop bodies also solved exactly (search.regions.region_candidates): the automatic
        # searches' models say so. lean_bodies: also solved for the least memory (lean()), for
        # a search bounding memory (dynamic_programming with a budget).
        self.search_bodies, self.lean_bodies = search_bodies, lean_bodies
        self._lean: CostModel | None = None
        self.regions_cache: dict = {}  # (id(op), operand specs) -> (op, region candidates)
        # (id(candidate list), mesh axis) -> (the list, {its strategies' use of the other
        # axes: their indices}): resolve's solves of one axis again, held plan by held plan.
        self.axis_groups: dict = {}
        # ("lockstep", id(candidate list), groups of axes) -> (the list, the indices
        # resolve.solve_grouped keeps of it): spec.derived.
        self.lockstep_cache: dict = {}
        self.links = profile.axis_links(mesh)
        # Bytes per second at which the memory term prices memory (see the module doc).
        self.memory_rate = min((link.bandwidth for link in self.links.values()),
                               default=profile.intra.bandwidth)
        self._reshard_cache: dict = {}
        # What depends on the mesh's names and sizes alone is kept in its cache, for every
        # model on it (MeshInfo.of: one per mesh shape in the process).
        self._per_byte: dict = mesh.cache.setdefault("per_byte", {})  # (src, dst) ->
                                                   # reshard()'s collectives for one byte
        self._lines: dict = {}     # (src, dst, share) -> reshard_line()
        self._comm_lines: dict = {}  # (src, dst, share) -> _comm_line(), for every level
        self._collective_lines: dict = {}  # (kind, axes, latency) -> comm.collective_line()
        self._line_lists: dict = {}  # (srcs, dsts, share) -> reshard_lines()
        self._options_cache: dict = {}
        self._costs_cache: dict = {}
        self._fitting_cache: dict = {}
        self._itemsizes: dict = {}
        self._layouts: dict = {}
        self._facts: dict = mesh.cache.setdefault("facts", {})  # (strategy, matmul) ->
                                                   # what _Layout reads of it
        self._manual_cache: dict = {}  # (id(shard_map body), specs, shapes) -> (body, cost)

    def options(self, info: OpInfo, share: float = 1.0
                ) -> tuple[list[OpStrategy], list[OpCost]]:
        """The op's candidates that fit its shapes, and the cost of each (see module doc)."""
        key = _signature(info)
        key = None if key is None else (key, share)
        hit = self._options_cache.get(key) if key is not None else None
        if hit is None:
            cands = self._fitting(info)
            # Ops alike to the cost model (same candidates, flops, shapes and dtypes: an add
            # and a mul on one shape) share their costs.
            alike = (id(cands), flops(info), info.in_shapes, info.out_shapes, info.in_dtypes,
                     info.out_dtypes, share)
            costs = self._costs_cache.get(alike)
            if costs is None:
                costs = self._costs_cache[alike] = self._costs(info, cands, share)
            hit = (list(cands), costs)  # a list of its own: callers key work on its id
            if key is not None:
                self._options_cache[key] = hit
        return hit

    def _fitting(self, info: OpInfo) -> list[OpStrategy]:
        """candidates() that fit the op's shapes (the automatic modes: heavy ops cut most)."""
        raw = candidates(info, self.mesh)
        heavy = not self.recompute_heavy and info.primitive.name in HEAVY_OPS
        key = (id(raw), info.in_shapes, info.out_shapes, heavy)
        hit = self._fitting_cache.get(key)
        if hit is None:
            hit = _that_fit(raw, info.in_shapes + info.out_shapes, self.mesh)
            if heavy:
                pieces = [self.pieces(s) for s in hit]
                most = max(pieces)
                hit = [s for s, n in zip(hit, pieces, strict=True) if n == most]
            self._fitting_cache[key] = (raw, hit)  # raw kept alive: its id stays its own
            return hit
        return hit[1]

    def pieces(self, s: OpStrategy) -> int:
        """How many pieces a strategy cuts its op's work into (axes cutting results or partial)."""
        hit = s.__dict__.get("_pieces")  # remembered on the strategy, for this mesh
        if hit is None or hit[0] is not self.mesh:
            used = {a for spec in s.outs for a in spec.axes()} | {a for p in s.partial for a in p}
            hit = s.__dict__["_pieces"] = (self.mesh, self.mesh.group_size(tuple(sorted(used))))
        return hit[1]

    def _itemsize(self, dtype) -> int:
        hit = self._itemsizes.get(dtype)
        if hit is None:
            hit = self._itemsizes[dtype] = itemsize(dtype)
        return hit

    def collectives_cost(self, cs: list[Collective], share: float = 1.0) -> OpCost:
        return OpCost(comm_s=sum(collective_time(c, self.mesh, self.links,
                                                 share if c.kind in COMBINED_KINDS else 1.0)
                                 for c in cs),
                      comm_bytes=sum(c.bytes for c in cs), collectives=tuple(cs))

    def reshard(self, src: Spec, dst: Spec, shape, dtype, share: float = 1.0,
                matmul: bool = True, splat: bool = False) -> OpCost:
        """Moving a value from `src` to `dst`. share: the fraction of a latency its reductions
        pay (OpGraph.latency_share: below 1 in a step's tail, where XLA combines them);
        matmul: whether a partial `src` is a matmul's product (comm.reshard); splat: whether
        the value is a literal scalar broadcast (OpGraph.splats; comm.of_splat)."""
        if src.placed_as(dst):
            return _FREE
        key = (src, dst, shape if type(shape) is tuple else tuple(shape), dtype, share, matmul,
               splat)
        hit = self._reshard_cache.get(key)
        if hit is None:  # the search prices the same edges many times
            size = float(math.prod(shape)) * self._itemsize(dtype)
            hit = self._reshard_cache[key] = self._moving(src, dst, size, share, matmul, splat)
        return hit

    def reshard_bytes(self, src: Spec, dst: Spec, nbytes: float) -> OpCost:
        """reshard() of an array of `nbytes`, priced from the pair's collectives for one byte
        (worked out once per pair, whatever the size)."""
        return self._moving(src, dst, nbytes, 1.0)

    def _moving(self, src: Spec, dst: Spec, nbytes: float, share: float,
                matmul: bool = True, splat: bool = False) -> OpCost:
        """reshard() of an array of `nbytes`: one_byte's collectives, scaled (none for an
        empty array: XLA moves nothing)."""
        if nbytes == 0:
            return _FREE
        moves = self.one_byte(src, dst, matmul, splat)
        if not moves:
            return _FREE
        return self.collectives_cost(
            [Collective(c.kind, c.axes, c.bytes * nbytes, c.count) for c in moves], share)

    def reshard_line(self, src: Spec, dst: Spec, share: float = 1.0, splat: bool = False
                     ) -> tuple[float, float]:
        """(per_byte, fixed): the score of reshard(src, dst, ...) for an array of n bytes is
        per_byte * n + fixed (bandwidth terms grow with the bytes, latencies do not), so the
        searches price a spec pair once for arrays of every size. Worked out from the pair's
        collectives for one byte and each collective's own line (comm.collective_line); its
        communication seconds are shared by every variant() of the model, whatever its level
        (a resharding's score is its communication time, weighed by the level). splat: as
        reshard()'s."""
        key = (src, dst, share, True) if splat else (src, dst, share)
        hit = self._lines.get(key)
        if hit is None:
            comm = self._comm_lines.get(key)
            if comm is None:
                comm = self._comm_lines[key] = (0.0, 0.0) if src.placed_as(dst) else \
                    self._comm_line(src, dst, share, splat)
            weight = _LEVEL_COMM_WEIGHT[self.level]
            hit = self._lines[key] = (weight * comm[0], weight * comm[1])
        return hit

    def one_byte(self, src: Spec, dst: Spec, matmul: bool = True, splat: bool = False
                 ) -> list[Collective]:
        """reshard()'s collectives for an array of one byte: what moves depends on the specs
        only (worked out once per pair), how much on the size. splat: as reshard()'s."""
        if splat:
            key = (src, dst, "splat", matmul or not src.partial)
            hit = self._per_byte.get(key)
            if hit is None:
                hit = self._per_byte[key] = of_splat(self.one_byte(src, dst, matmul))
            return hit
        key = (src, dst) if matmul or not src.partial else (src, dst, False)
        hit = self._per_byte.get(key)
        if hit is None:
            hit = self._per_byte[key] = reshard(src, dst, 1.0, self.mesh, matmul)
        return hit

    def _comm_line(self, src: Spec, dst: Spec, share: float, splat: bool = False
                   ) -> tuple[float, float]:
        """(seconds per byte, seconds) of reshard(src, dst) over the mesh's links."""
        slope = fixed = 0.0
        for c in self.one_byte(src, dst, splat=splat):
            latency = share if c.kind in COMBINED_KINDS else 1.0
            key = (c.kind, c.axes, latency)
            line = self._collective_lines.get(key)
            if line is None:
                line = self._collective_lines[key] = collective_line(
                    c.kind, c.axes, self.mesh, self.links, latency, _LINE_BYTES)
            slope += line[0] * c.bytes
            fixed += line[1] * c.count
        return slope, fixed

    def reshard_lines(self, srcs: tuple[Spec, ...], dsts: tuple[Spec, ...], share: float = 1.0,
                      splat: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """reshard_line of every pair: (per_byte, fixed) matrices, one row per src and one
        column per dst. Remembered by the two tuples: the exact search's tables, built again
        and again (a loop body for each set of operand specs, each mesh axis solved again),
        ask for the same spec lists each time. Do not write into the matrices. splat: as
        reshard()'s."""
        key = (srcs, dsts, share, True) if splat else (srcs, dsts, share)
        hit = self._line_lists.get(key)
        if hit is None:
            pairs = np.array([[self.reshard_line(a, b, share, splat) for b in dsts]
                              for a in srcs],
                             dtype=float).reshape(len(srcs), len(dsts), 2)
            hit = self._line_lists[key] = (pairs[..., 0], pairs[..., 1])
        return hit

    def op(self, info: OpInfo, s: OpStrategy, share: float = 1.0) -> OpCost:
        """Compute, the op's own reductions (partial results), and per-device memory."""
        return self._op(_Io(info, self._itemsize), s, share)

    def _costs(self, info: OpInfo, cands: list[OpStrategy], share: float) -> list[OpCost]:
        """op() of every candidate, from what the candidate list shares (_Layout)."""
        layout = self._layouts.get(id(cands))
        if layout is None:
            layout = self._layouts[id(cands)] = _Layout(cands, self, _matmul(info))
        io = _Io(info, self._itemsize)
        work = self.profile.compute_seconds(io.flops, io.total)
        manual = self._manual(info) or self._callback(info)
        out = []
        for n in range(len(cands)):
            memory = sum(b / k for b, k in zip(io.sizes, layout.shards[n], strict=True))
            if manual is not None:
                out.append(manual + OpCost(memory_bytes=memory))
                continue
            cost = OpCost(compute_s=work / layout.pieces[n], memory_bytes=memory)
            for k, src, dst in layout.gathers[n]:
                cost = cost + self.reshard(src, dst, info.in_shapes[k], info.in_dtypes[k], share)
            for j, raw, dst in layout.partial[n]:
                cost = cost + self.reshard(raw, dst, info.out_shapes[j],
                                           self._reduced(info.out_dtypes[j]), share,
                                           layout.matmul)
            out.append(cost)
        return out

    def _op(self, io: _Io, s: OpStrategy, share: float) -> OpCost:
        mesh = self.mesh
        compute = self.profile.compute_seconds(io.flops, io.total) / self.pieces(s)
        memory = sum(b / sp.shards(mesh) for b, sp in zip(io.sizes, s.ins + s.outs,
                                                           strict=True))
        manual = self._manual(io.info) or self._callback(io.info)
        if manual is not None:
            return manual + OpCost(memory_bytes=memory)
        cost = OpCost(compute_s=compute, memory_bytes=memory)
        matmul = _matmul(io.info)
        for k, src, dst in operand_gathers(s, mesh) if matmul else []:
            cost = cost + self.reshard(src, dst, io.info.in_shapes[k], io.info.in_dtypes[k], share)
        for j, raw, dst in reduction_steps(s, matmul, mesh):
            cost = cost + self.reshard(raw, dst, io.info.out_shapes[j],
                                       self._reduced(io.info.out_dtypes[j]), share, matmul)
        return cost

    def reductions(self, info: OpInfo, s: OpStrategy, share: float = 1.0
                   ) -> list[tuple[int, Spec, Spec, OpCost]]:
        """op()'s own reductions of strategy s, as reduction_steps has XLA run them: (result
        index, partial layout, layout after, their cost)."""
        matmul = _matmul(info)
        return [(j, raw, dst, self.reshard(raw, dst, info.out_shapes[j],
                                           self._reduced(info.out_dtypes[j]), share, matmul))
                for j, raw, dst in reduction_steps(s, matmul, self.mesh)]

    def _manual(self, info: OpInfo) -> OpCost | None:
        """A shard_map's cost, whatever its strategy: its body's work and the permutes into
        and out of its specs' axis order (cost/manual.py); None for any other op, and for a
        shard_map over another mesh (planned replicated, its collectives not priced)."""
        if info.primitive.name != "shard_map" or not on_mesh(info.params, self.mesh):
            return None
        body = info.params["jaxpr"]
        key = (id(body), info.params["in_specs"], info.params["out_specs"], info.in_shapes)
        hit = self._manual_cache.get(key)
        if hit is None or hit[0] is not body:
            work = body_work(body)
            moved = work.collectives + misordered(info.params, info.in_shapes + info.out_shapes,
                                                  info.in_dtypes + info.out_dtypes, self.mesh)
            cost = OpCost(compute_s=self.profile.compute_seconds(work.flops, work.nbytes)) + \
                self.collectives_cost(moved)
            hit = self._manual_cache[key] = (body, cost)
        return hit[1]

    def _callback(self, info: OpInfo) -> OpCost | None:
        """A host callback's cost (pure_callback, io_callback; no rule, so run replicated):
        XLA runs it on one device and all-reduces its results to the others (one all-reduce
        of them all; measured: an 8 x 8 f32 result, 256 bytes). None for any other op."""
        if info.primitive.name not in _CALLBACKS or self.mesh.size < 2:
            return None
        moved = sum(nbytes(s, d) for s, d in zip(info.out_shapes, info.out_dtypes, strict=True))
        if not moved:
            return None
        axes = tuple(n for n, k in zip(self.mesh.names, self.mesh.sizes, strict=True) if k > 1)
        return self.collectives_cost([Collective("all-reduce", axes, moved)])

    def _reduced(self, dtype):
        """The dtype an op's partial sums of `dtype` are reduced in."""
        if self.fp32_communication and np.dtype(dtype) in _LOW_FLOATS:
            return np.dtype(np.float32)
        return dtype

    def variant(self, level: int | None = None, mem_coeff: float | None = None,
                lean_bodies: bool | None = None) -> CostModel:
        """This model with another objective (None: this one's), sharing what the objective
        does not change: candidates, op costs, resharding costs and their communication
        lines; and with the same level, resharding scores too (a resharding holds no memory,
        so mem_coeff leaves its score alone). A search that plans again for another
        objective (recursive_programming under a memory budget, loop bodies solved lean) then
        prices each thing once. Loop bodies' plans are the objective's own: not shared."""
        level = self.level if level is None else level
        other = CostModel(self.mesh, self.profile, level,
                          self.mem_coeff if mem_coeff is None else mem_coeff,
                          self.recompute_heavy, self.search_bodies,
                          self.lean_bodies if lean_bodies is None else lean_bodies,
                          self.fp32_communication)
        for name in ("_reshard_cache", "_per_byte", "_options_cache", "_costs_cache",
                     "_fitting_cache", "_itemsizes", "_layouts", "_facts", "_manual_cache",
                     "_comm_lines", "_collective_lines", "axis_groups", "lockstep_cache") + \
                (("_lines", "_line_lists") if level == self.level else ()):
            setattr(other, name, getattr(self, name))
        return other

    def lean(self) -> CostModel:
        """This model with memory first: level 1 and a mem_coeff of LEAN_MEM_COEFF, time only
        telling apart plans of equal memory (one model, made once: its caches kept)."""
        if self._lean is None:
            self._lean = self.variant(1, LEAN_MEM_COEFF, lean_bodies=False)
        return self._lean

    def score(self, c: OpCost) -> float:
        mem_s = c.memory_bytes / self.memory_rate
        return (c.compute_s + _LEVEL_COMM_WEIGHT[self.level] * c.comm_s
                + (_LEVEL_MEM_WEIGHT[self.level] + self.mem_coeff) * mem_s)


_FREE = OpCost()
_LOW_FLOATS = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
LEAN_MEM_COEFF = 1e3  # CostModel.lean()'s: memory first, by far


def _that_fit(raw: list[OpStrategy], shapes: tuple, mesh: MeshInfo) -> list[OpStrategy]:
    """The strategies of `raw` whose every spec fits its array's shape (`shapes`: the
    operands', then the results'), in order. Each array's distinct specs are checked once
    (a list holds thousands of strategies on a mesh of four axes, and few specs per array;
    which strategy holds which is worked out once per list, in the mesh's cache)."""
    if not raw:
        return []
    def columns() -> list[tuple[tuple[Spec, ...], np.ndarray]]:
        rows = [s.ins + s.outs for s in raw]
        return [spec_classes(r[k] for r in rows) for k in range(len(rows[0]))]
    keep = None
    for (specs, which), shape in zip(mesh.derived("spec columns", raw, None, columns), shapes,
                                     strict=True):
        fits = np.fromiter((sp.fits(shape, mesh) for sp in specs), dtype=bool,
                           count=len(specs))
        if not fits.all():
            keep = fits[which] if keep is None else keep & fits[which]
    return list(raw) if keep is None else [raw[i] for i in np.flatnonzero(keep).tolist()]


class _Layout:
    """What a candidate list shows CostModel whatever op it belongs to: the pieces each
    strategy cuts the work into, the shards of each operand and result, the operands XLA
    gathers before a matmul (operand_gathers), and each partial result before its
    reduction. Each strategy's are worked out once per mesh shape (CostModel._facts, kept in
    the mesh's cache): ops of different shapes share most of their strategies (a GPT step's
    candidate lists price 17,172 strategies, 9,085 of them distinct)."""

    def __init__(self, cands: list[OpStrategy], model: CostModel, matmul: bool):
        self.cands = cands  # kept alive: the cache is keyed by its id
        facts, mesh = model._facts, model.mesh
        rows = []
        for s in cands:
            key = (s, matmul)
            hit = facts.get(key)
            if hit is None:
                hit = facts[key] = (model.pieces(s), [sp.shards(mesh) for sp in s.ins + s.outs],
                                    operand_gathers(s, mesh) if matmul else [],
                                    reduction_steps(s, matmul, mesh))
            rows.append(hit)
        self.pieces = [r[0] for r in rows]
        self.shards = [r[1] for r in rows]
        self.gathers = [r[2] for r in rows]
        self.partial = [r[3] for r in rows]
        self.matmul = matmul


def reduction_steps(s: OpStrategy, matmul: bool = True, mesh: MeshInfo | None = None
                    ) -> list[tuple[int, Spec, Spec]]:
    """A strategy's own reductions as the reshardings XLA runs them: (result index, the
    partial layout, the layout after). One per partial result, from its partial layout to the
    planned one, unless its partial axes cut two or more of an operand's dims (a weight
    gradient contracting batch on one axis and sequence on others, a sum over both); XLA's
    partitioner then reduces dim by dim (checked against compiled programs in
    tests/test_cost.py):
    - all-reduced, one all-reduce of the whole result per dim's axes;
    - partly reduce-scattered: a matmul (`matmul`: HEAVY_OPS) as one reshard (a
      reduce-scatter, then an all-reduce of the smaller rest); any other reduction
      all-reduces the whole result over the dims whose axes it does not scatter first.
    A matmul whose partial axes are scattered onto a dim its product already cuts is
    reduced whole along that dim (_regathered; `mesh`, where given, tells when XLA splits
    over idle axes instead)."""
    steps = []
    for j, (out, p) in enumerate(zip(s.outs, s.partial, strict=True)):
        if not p:
            continue
        dims = tuple(tuple(a for a in d if a not in p) for d in out.dims)
        groups = _partial_groups(s, p)
        scattered = [g for g in groups if set(g) & set(out.axes())]
        if len(groups) > 1 and not scattered:
            steps += [(j, Spec(out.dims, g), out) for g in groups]
        elif len(groups) > 1 and not matmul and len(scattered) > 1:
            # Several groups scattered: XLA all-reduces every group but that of the operand's
            # first dim, then reduce-scatters that one at the result's full size and slices
            # its pieces for the others' axes (a sum over (0, 1) of [d2, d0+d1] into
            # [d0+d1+d2]: an all-reduce over d0+d1 and a reduce-scatter over d2, 256 bytes
            # each; the scatter was priced after the slice, at a quarter of its bytes).
            first = min(scattered, key=lambda g: _operand_dim(s, g[0]) or (len(s.ins), 0))
            steps += [(j, Spec(dims, g), Spec(dims)) for g in groups if g != first]
            kept = tuple(tuple(a for a in d if a in first or a not in p) for d in out.dims)
            steps.append((j, Spec(dims, first), Spec(kept)))
        elif len(groups) > 1 and not matmul:
            last = scattered[-1]
            steps += [(j, Spec(dims, g), Spec(dims)) for g in groups if g != last]
            steps.append((j, Spec(dims, last), out))
        elif matmul:
            steps.append(_matmul_step(j, s, Spec(dims, p), out, mesh))
        else:
            steps.append((j, Spec(dims, p), out))
    return steps


def operand_gathers(s: OpStrategy, mesh: MeshInfo | None = None
                    ) -> list[tuple[int, Spec, Spec]]:
    """(operand index, its spec, the spec XLA gathers it to) for each operand a matmul
    strategy's partial sums make XLA gather before it multiplies: the operand cutting a
    free dim of the product that a partial axis is scattered onto ahead of the dim's own
    axes (_regathered). Empty for other strategies."""
    gone: dict[int, set[str]] = {}
    for out, p in zip(s.outs, s.partial, strict=True):
        raw = Spec(tuple(tuple(a for a in d if a not in p) for d in out.dims), p)
        batch, free = _regathered(s, raw, out, mesh)
        for axes in () if batch else free.values():
            k = next(k for k, sp in enumerate(s.ins) if sp.dim_of(axes[0]) is not None)
            gone.setdefault(k, set()).update(axes)
    return [(k, s.ins[k], Spec(tuple(tuple(a for a in d if a not in axes)
                                     for d in s.ins[k].dims)))
            for k, axes in sorted(gone.items())]


def _matmul_step(j: int, s: OpStrategy, raw: Spec, out: Spec, mesh: MeshInfo | None
                 ) -> tuple[int, Spec, Spec]:
    """A matmul's reduction of result j from its partial product `raw` into `out`, as XLA
    runs it where a partial axis lands on a dim the product already cuts (_regathered): on
    a batch dim, the product all-reduced, then gathered along that dim (and sliced to out,
    which moves nothing); on a free dim, the product of the gathered operand (whole along
    that dim) reduced into out."""
    batch, free = _regathered(s, raw, out, mesh)
    if batch:
        return (j, raw, Spec(tuple(() if d in batch else axes
                                   for d, axes in enumerate(raw.dims))))
    if free:
        return (j, Spec(tuple(() if d in free else axes for d, axes in enumerate(raw.dims)),
                        raw.partial), out)
    return (j, raw, out)


def _regathered(s: OpStrategy, raw: Spec, out: Spec, mesh: MeshInfo | None
                ) -> tuple[dict[int, Axes], dict[int, Axes]]:
    """({dim: axes} of batch dims, {dim: axes} of free dims) of a matmul's partial product
    `raw` that XLA does not reduce-scatter `out`'s partial axes onto, though the product
    already cuts them with `axes`: its pieces there are not pieces of out's. Compiled
    (tests/test_cost.py; every candidate of a matmul and a batched matmul on 2 x 2 x 2,
    4 x 2 and 2 x 4 devices), XLA
    - on a batch dim (both operands cut it), whatever the order: all-reduces the product
      and all-gathers it along that dim, then slices;
    - on a free dim (one operand cuts it) where a partial axis comes before the dim's own
      axes in out ([d1+d2, d0] @ [d0, -] -> [d0+d1+d2, -]): all-gathers that operand along
      it, multiplies, reduce-scatters the product whole along it and slices;
    and the reduce-scatter predicted (and a permute) had been up to 13x short of the bytes.
    Neither where XLA splits over idle axes instead (comm.splits_on_idle, given a mesh)."""
    batch: dict[int, Axes] = {}
    free: dict[int, Axes] = {}
    if mesh is not None and splits_on_idle(raw, out, mesh):
        return batch, free
    cuts = (lambda a: mesh.axis_size(a) > 1) if mesh is not None else (lambda a: True)
    for d, axes in enumerate(raw.dims):
        axes = tuple(a for a in axes if cuts(a))
        into = tuple(a for a in out.dims[d] if cuts(a))
        if not axes or not any(a in raw.partial for a in into):
            continue
        holders = sum(any(sp.dim_of(a) is not None for a in axes) for sp in s.ins)
        if holders > 1:
            batch[d] = axes
        elif into[:len(axes)] != axes:
            free[d] = axes
    return batch, free


def reduces_as_matmul(primitive: str) -> bool:
    """Whether an op's partial results reduce as a matmul's do (reduction_steps' `matmul`):
    the heavy ops."""
    return primitive in HEAVY_OPS


def _matmul(info: OpInfo) -> bool:
    return reduces_as_matmul(info.primitive.name)


def _partial_groups(s: OpStrategy, partial: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The partial axes grouped by the operand dim each cuts (the first operand cutting it)."""
    groups: dict[tuple[int, int] | None, list[str]] = {}
    for a in partial:
        groups.setdefault(_operand_dim(s, a), []).append(a)
    return [tuple(g) for g in groups.values()]


def _operand_dim(s: OpStrategy, axis: str) -> tuple[int, int] | None:
    """(operand, dim) of the first operand of `s` that `axis` cuts, or None."""
    return next(((k, d) for k, sp in enumerate(s.ins) if (d := sp.dim_of(axis)) is not None),
                None)


class _Io:
    """What CostModel.op reads of an op once for all its strategies: bytes of each operand and
    result, their total, and the flops."""

    def __init__(self, info: OpInfo, size_of):
        self.info = info
        self.sizes = [float(math.prod(sh)) * size_of(dt) for sh, dt in
                      zip(info.in_shapes + info.out_shapes, info.in_dtypes + info.out_dtypes,
                          strict=True)]
        self.total = sum(self.sizes)
        self.flops = flops(info)


def _signature(info: OpInfo):
    """A hashable key for everything a rule and the cost model read of an op, or None when its
    params hold something unhashable (region ops carry jaxprs; those are never cached).
    Remembered on the info (OpInfo.of keeps one per op; the searches ask per visit)."""
    memo = info.__dict__.get("_signature", _UNSET)
    if memo is not _UNSET:
        return memo
    try:
        key = (info.primitive, tuple(sorted(info.params.items())), info.in_shapes,
               info.out_shapes, info.in_dtypes, info.out_dtypes)
        hash(key)
    except TypeError:
        key = None
    object.__setattr__(info, "_signature", key)  # a frozen dataclass: not a field
    return key


_UNSET = object()
