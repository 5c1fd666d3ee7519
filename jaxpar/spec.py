"""Shardings as jaxpar reasons about them: which mesh axes cut which tensor dimension.

A `Spec` is the normalised form of a `PartitionSpec`: one tuple of mesh axis names per tensor
dimension (listed in mesh order), plus the axes over which the value is still a partial result
that needs a reduction. An `OpStrategy` is one way to run one op: the spec each input must have,
and the spec each output comes out with. `MeshInfo` is the part of a mesh the planner needs
(axis names and sizes), so plans can be made for meshes larger than the machine.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from jax.sharding import PartitionSpec as P

Axes = tuple[str, ...]


@dataclass(frozen=True)
class MeshInfo:
    """Axis names and sizes of a device mesh, outermost axis first."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @staticmethod
    def of(mesh) -> MeshInfo:
        return MeshInfo(tuple(mesh.axis_names), tuple(int(mesh.shape[n]) for n in mesh.axis_names))

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    def axis_size(self, name: str) -> int:
        return self.sizes[self.names.index(name)]

    def group_size(self, axes: Axes) -> int:
        return _group_size(self, tuple(axes))

    def order(self, axes) -> Axes:
        """`axes` sorted into mesh order (the canonical order within one dimension)."""
        return tuple(sorted(axes, key=self.names.index))

    def describe(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes, strict=True))


@functools.lru_cache(maxsize=65536)
def _group_size(mesh: MeshInfo, axes: Axes) -> int:
    return math.prod(mesh.sizes[mesh.names.index(a)] for a in axes)


@dataclass(frozen=True)
class Spec:
    """Sharding of one array: `dims[i]` are the mesh axes that cut dimension i."""

    dims: tuple[Axes, ...]
    partial: Axes = ()

    @staticmethod
    def replicated(rank: int) -> Spec:
        return Spec(((),) * rank)

    @staticmethod
    def from_pspec(pspec: P, rank: int) -> Spec:
        entries = tuple(pspec) + (None,) * (rank - len(pspec))
        return Spec(tuple(_as_axes(e) for e in entries))

    @property
    def rank(self) -> int:
        return len(self.dims)

    def axes(self) -> Axes:
        """Every mesh axis this spec uses, sharding or partial."""
        return tuple(a for d in self.dims for a in d) + self.partial

    def dim_of(self, axis: str) -> int | None:
        for i, d in enumerate(self.dims):
            if axis in d:
                return i
        return None

    def shards(self, mesh: MeshInfo) -> int:
        """Number of distinct pieces the array is cut into."""
        return math.prod(mesh.group_size(d) for d in self.dims)

    def local_shape(self, shape: tuple[int, ...], mesh: MeshInfo) -> tuple[int, ...]:
        return tuple(n // mesh.group_size(d) for n, d in zip(shape, self.dims, strict=True))

    def fits(self, shape: tuple[int, ...], mesh: MeshInfo) -> bool:
        """True when every dimension divides evenly by the axes that cut it."""
        return all(n % mesh.group_size(d) == 0 for n, d in zip(shape, self.dims, strict=True))

    def resolved(self) -> Spec:
        return Spec(self.dims)

    def to_pspec(self) -> P:
        entries = [None if not d else d[0] if len(d) == 1 else d for d in self.dims]
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    def __str__(self) -> str:
        body = ", ".join("+".join(d) if d else "-" for d in self.dims)
        tail = f" partial({'+'.join(self.partial)})" if self.partial else ""
        return f"[{body}]{tail}"

    def to_json(self) -> list:
        tail = [{"partial": list(self.partial)}] if self.partial else []
        return [list(d) for d in self.dims] + tail

    @staticmethod
    def from_json(data: list) -> Spec:
        partial: Axes = ()
        if data and isinstance(data[-1], dict):
            partial = tuple(data[-1]["partial"])
            data = data[:-1]
        return Spec(tuple(tuple(d) for d in data), partial)


def _as_axes(entry) -> Axes:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


@dataclass(frozen=True)
class OpStrategy:
    """One way to run an op: input specs it needs and output specs it produces.

    `partial[j]` lists the axes over which output j was a partial result before the op's own
    reduction (an all-reduce when the axis is absent from `outs[j]`, a reduce-scatter when
    `outs[j]` shards a dimension on it).
    """

    ins: tuple[Spec, ...]
    outs: tuple[Spec, ...]
    partial: tuple[Axes, ...] = field(default=())
    name: str = ""
    # Result dims a partial result may be reduce-scattered onto (None: any); rules only.
    scatter_dims: tuple[int, ...] | None = field(default=None, compare=False)

    def label(self) -> str:
        if self.name:
            return self.name
        outs = " ".join(str(s) for s in self.outs)
        return f"{' '.join(str(s) for s in self.ins)} -> {outs}"
