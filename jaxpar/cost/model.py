"""Per-op costs under one strategy, per-edge resharding costs, and the objective of each level.

Compute time of an op is the larger of its flop time and its memory time (operand and result
bytes over HBM bandwidth), divided by the number of pieces the strategy cuts its work into.
The objective (`score`) follows MindSpore's `level`:
  0: maximise the compute/communication ratio: compute + 2 x communication (exposed
     communication is what lowers the ratio, so it weighs double);
  1: minimise memory: time plus per-device bytes over HBM bandwidth, weighted 10x;
  2: maximise speed: compute + communication.
`mem_coeff` adds mem_coeff x (per-device bytes / HBM bandwidth) at every level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxpar.cost.comm import Collective, collective_time, reshard
from jaxpar.cost.hardware import HardwareProfile
from jaxpar.ir.graph import itemsize
from jaxpar.rules.registry import OpInfo
from jaxpar.spec import MeshInfo, OpStrategy, Spec

_LEVEL_COMM_WEIGHT = {0: 2.0, 1: 1.0, 2: 1.0}
_LEVEL_MEM_WEIGHT = {0: 0.0, 1: 10.0, 2: 0.0}


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
    if name == "conv_general_dilated":
        rhs = info.in_shapes[1]
        spec = info.params["dimension_numbers"].rhs_spec
        kernel = math.prod(rhs[d] for d in spec[1:])  # in-features x spatial window
        return 2.0 * out * kernel
    return out


class CostModel:
    """Prices strategies and reshardings on one mesh and hardware profile."""

    def __init__(self, mesh: MeshInfo, profile: HardwareProfile, level: int = 0,
                 mem_coeff: float = 0.0):
        self.mesh, self.profile, self.level, self.mem_coeff = mesh, profile, level, mem_coeff
        self.links = profile.axis_links(mesh)
        self._reshard_cache: dict = {}

    def collectives_cost(self, cs: list[Collective]) -> OpCost:
        return OpCost(comm_s=sum(collective_time(c, self.mesh, self.links) for c in cs),
                      comm_bytes=sum(c.bytes for c in cs), collectives=tuple(cs))

    def reshard(self, src: Spec, dst: Spec, shape, dtype) -> OpCost:
        if src.resolved() == dst.resolved() and not src.partial:
            return OpCost()
        key = (src, dst, tuple(shape), dtype)
        if key not in self._reshard_cache:  # the search prices the same edges many times
            self._reshard_cache[key] = self.collectives_cost(
                reshard(src, dst, nbytes(shape, dtype), self.mesh))
        return self._reshard_cache[key]

    def op(self, info: OpInfo, s: OpStrategy) -> OpCost:
        """Compute, the op's own reductions (partial results), and per-device memory."""
        used = {a for spec in s.outs for a in spec.axes()} | {a for p in s.partial for a in p}
        pieces = self.mesh.group_size(tuple(used))
        io = [(sh, dt, sp) for sh, dt, sp in zip(info.in_shapes, info.in_dtypes, s.ins,
                                                   strict=True)]
        io += list(zip(info.out_shapes, info.out_dtypes, s.outs, strict=True))
        total = sum(nbytes(sh, dt) for sh, dt, _ in io)
        compute = max(flops(info) / self.profile.peak_flops,
                      total / self.profile.memory_bandwidth) / pieces
        memory = sum(nbytes(sh, dt) / sp.shards(self.mesh) for sh, dt, sp in io)
        cost = OpCost(compute_s=compute, memory_bytes=memory)
        for out, partial, shape, dtype in zip(s.outs, s.partial, info.out_shapes,
                                              info.out_dtypes, strict=True):
            if partial:
                raw = Spec(tuple(tuple(a for a in d if a not in partial) for d in out.dims),
                           partial)
                cost = cost + self.reshard(raw, out, shape, dtype)
        return cost

    def score(self, c: OpCost) -> float:
        mem_s = c.memory_bytes / self.profile.memory_bandwidth
        return (c.compute_s + _LEVEL_COMM_WEIGHT[self.level] * c.comm_s
                + (_LEVEL_MEM_WEIGHT[self.level] + self.mem_coeff) * mem_s)
